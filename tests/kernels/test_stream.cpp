// stream.cpp, the bandwidth ceiling's read: every element is read once a pass, whatever the threads' split
// (a buffer of ones sums to its length), and a pass takes time.
#include "check.h"

TEST(stream_read_reads_every_element_once_a_pass) {
  for (int64_t n : {int64_t(1), int64_t(17), int64_t(1000003)})
    for (int threads : {1, 2, 3}) {
      std::vector<float> x(n, 1.f);
      double seconds = 0;
      float sum = 0;
      CHECK(zhuzi_stream_read(x.data(), n, 2, threads, &seconds, &sum) == 0, "n %ld", (long)n);
      CHECK(sum == float(n) && seconds > 0, "n %ld threads %d: sum %g in %g s", (long)n, threads, sum, seconds);
    }
  double seconds;
  float sum;
  CHECK(zhuzi_stream_read(nullptr, 0, 1, 1, &seconds, &sum) == 2, "an empty buffer");
}
