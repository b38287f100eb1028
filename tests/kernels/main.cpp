// Runs the kernels' C++ unit tests (check.h): all, or those whose name contains argv[1].
#include "check.h"
#include "prelude.h"

int main(int argc, char** argv) {
  int ran = 0;
  for (const auto& t : check::tests()) {
    if (argc > 1 && !std::strstr(t.name, argv[1])) continue;
    check::current() = t.name;
    const int before = check::failures();
    t.fn();
    std::printf("%s %s\n", check::failures() == before ? "ok  " : "FAIL", t.name);
    ++ran;
  }
  std::printf("%s: %d tests, %d failed checks\n", ZHUZI_VARIANT, ran, check::failures());
  return check::failures() || !ran;
}
