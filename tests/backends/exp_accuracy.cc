// exp_accuracy.cc: the kernels' two exponentials (vexp, the fp32 path's; vexp_coarse, the integer
// path's) against libm's double exp, built from one kernel file (-DKERNEL='"attend_avx2.cc"' and
// that file's flags; tests/backends/test_exp_accuracy.py builds and runs it).
//
// Prints, for each: the largest relative error over x in [-16, 0] (every probability a softmax row
// can still see at 8-bit levels: e^-16 is 1e-7 of its largest) and over [-87, 0], on 2^22 points
// each plus the edges; then whether the edges hold (exactly 0 below -87 and for -inf, NaN for NaN).

#include KERNEL

#include <math.h>
#include <stdio.h>

namespace {

using namespace pnmix;

template <vf (*Exp)(vf)>
double worst_relative_error(double lo, double hi) {
  constexpr long kPoints = 1L << 22;
  double worst = 0.0;
  float x[W], y[W];
  for (long i = 0; i < kPoints; i += W) {
    for (int j = 0; j < W; ++j) x[j] = (float)(lo + (hi - lo) * (double)(i + j) / (double)(kPoints - 1));
    store(y, Exp(load(x)));
    for (int j = 0; j < W; ++j) {
      const double exact = exp((double)x[j]);
      const double err = fabs((double)y[j] - exact) / exact;
      worst = err > worst ? err : worst;
    }
  }
  return worst;
}

template <vf (*Exp)(vf)>
bool edges_hold() {
  float x[W], y[W];
  const float cases[] = {-87.5f, -88.0f, -1000.0f, -INFINITY, NAN};
  for (float c : cases) {
    for (int j = 0; j < W; ++j) x[j] = c;
    store(y, Exp(load(x)));
    for (int j = 0; j < W; ++j)
      if (isnan(c) ? !isnan(y[j]) : y[j] != 0.0f) return false;
  }
  return true;
}

template <vf (*Exp)(vf)>
void report(const char* name) {
  printf("%s near %.3e all %.3e edges %s\n", name, worst_relative_error<Exp>(-16.0, 0.0),
         worst_relative_error<Exp>(-87.0, 0.0), edges_hold<Exp>() ? "ok" : "wrong");
}

}  // namespace

int main() {
  report<vexp>("vexp");
  report<vexp_coarse>("vexp_coarse");
  return 0;
}
