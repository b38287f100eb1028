// The memory-read ceiling, measured as STREAM does: every thread streams its own contiguous slice of one
// buffer with vector loads (several independent sums, so the loads, not the adds, set the pace), and the
// fastest of several passes counts. A decode step that reads its weights once can go no faster than this.
#include "api.h"
#include "prelude.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

static float read_slice(const float* x, int64_t n) {
  constexpr int U = 8;  // sums in flight
  vf acc[U] = {};
  int64_t i = 0;
  for (; i + U * VL <= n; i += U * VL)
    for (int u = 0; u < U; ++u) acc[u] += load_vf(x + i + u * VL);
  float tail = 0.f;
  for (; i < n; ++i) tail += x[i];
  for (int u = 1; u < U; ++u) acc[0] += acc[u];
  return hsum(acc[0]) + tail;
}

extern "C" int zhuzi_stream_read(const float* x, int64_t n, int passes, int threads, double* seconds,
                                 float* sum) {
  if (n < 1 || passes < 1) return 2;
  *seconds = INFINITY;
  for (int p = 0; p < passes; ++p) {
    float total = 0.f;
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
      // slices of whole cache lines, one a thread
      const int64_t lines = (n + 15) / 16, t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t first = std::min(n, lines * t / T * 16), last = std::min(n, lines * (t + 1) / T * 16);
      total += read_slice(x + first, last - first);
    }
    *seconds = std::min(*seconds, omp_get_wtime() - start);
    *sum = total;  // the reads' result leaves the function: they cannot be optimised away
  }
  return 0;
}
