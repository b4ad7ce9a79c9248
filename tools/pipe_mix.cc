// pipe_mix.cc: which vector instructions take vpdpbusd's slots on this CPU.
//
//   g++ -O2 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi -mavx512vnni -mfma tools/pipe_mix.cc -o /tmp/pipe_mix
//   /tmp/pipe_mix [rounds]
//
// The integer path's step does 2,048 512-bit vpdpbusd a 128-token group and KV head of four query
// rows; which of its other instructions compete with them for a pipe (docs/BENCHMARKS.md section
// 2.22 counts them) depends on the core, and no manual states it for every one. So this measures
// it: a loop of 12 independent vpdpbusd runs at the products' rate; 4 and then 8 independent
// instances of one other instruction join each iteration, and the tool prints what each added
// instance costs, in product slots (the iteration's extra time over 1/12 of the
// products' time): about 0 where the instruction runs beside the products, about 1 where it takes a
// product's slot (vpdpbusd itself, as the control), between where it competes for part of one.
// Rising from the +4 to the +8 column: the instruction's own pipe fills up. Best of `rounds` runs
// (default 9) of 200,000 iterations each, in time-stamp ticks; the ratios need no clock rate.
// (tests/backends/test_pipe_mix.py builds it with the command above.)

#include <errno.h>
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <x86intrin.h>

namespace {

constexpr long kIterations = 200000;
constexpr long kMaxRounds = 1000;

// One instance of the added instruction: dst from the two sources (or dst updated, for
// instructions that read their destination). Independent of each other and of the products.
#define PNMIX_PIPE_MIX_INSTRUCTIONS(X)                      \
  X(vpdpbusd, "vpdpbusd %2, %1, %0", "+v")                  \
  X(vfmadd231ps, "vfmadd231ps %2, %1, %0", "+v")            \
  X(vmulps, "vmulps %2, %1, %0", "=v")                      \
  X(vaddps, "vaddps %2, %1, %0", "=v")                      \
  X(vcvtdq2ps, "vcvtdq2ps %1, %0", "=v")                    \
  X(vpmultishiftqb, "vpmultishiftqb %2, %1, %0", "=v")      \
  X(vpmaddubsw, "vpmaddubsw %2, %1, %0", "=v")              \
  X(vpermb, "vpermb %2, %1, %0", "=v")                      \
  X(vpermt2b, "vpermt2b %2, %1, %0", "+v")                  \
  X(vpshufb, "vpshufb %2, %1, %0", "=v")                    \
  X(vinserti64x4, "vinserti64x4 $1, %t1, %2, %0", "=v")     \
  X(vpandd, "vpandd %2, %1, %0", "=v")                      \
  X(vpternlogd, "vpternlogd $0xca, %2, %1, %0", "+v")       \
  X(vpsrlw_imm, "vpsrlw $3, %1, %0", "=v")                  \
  X(vpsrlvw, "vpsrlvw %2, %1, %0", "=v")                    \
  X(vpaddd, "vpaddd %2, %1, %0", "=v")

// 12 products, then Added instances of the instruction, per iteration; best ticks per iteration.
template <int Added, typename Add>
double ticks_per_iteration(long rounds, Add add) {
  static_assert(Added == 0 || Added == 4 || Added == 8, "0, 4 or 8 instances");
  __m512i a0 = _mm512_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
          a10 = a0, a11 = a0;
  // 1.5f and 1.0f as bit patterns: bytes for the integer instructions, and floats whose products and
  // sums stay normal (a product of tiny floats underflows, and some cores take an assist for that)
  const __m512i u = _mm512_set1_epi32(0x3FC00000), s = _mm512_set1_epi32(0x3F800000);
  // a register for each instance, read after the loop: those that only write their destination
  // write 8 registers, not one (renaming would hide that, but the loop stays what it says); those
  // that also read it form a chain of one instance an iteration each, far shorter than the loop
  __m512i p0 = u, p1 = s, p2 = u, p3 = s, p4 = u, p5 = s, p6 = u, p7 = s;
  double best = 1e300;
  for (long round = 0; round < rounds; ++round) {
    const unsigned long long t0 = __rdtsc();
    for (long i = 0; i < kIterations; ++i) {
#define PNMIX_PRODUCT(acc) asm volatile("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
      PNMIX_PRODUCT(a0) PNMIX_PRODUCT(a1) PNMIX_PRODUCT(a2) PNMIX_PRODUCT(a3) PNMIX_PRODUCT(a4) PNMIX_PRODUCT(a5)
      PNMIX_PRODUCT(a6) PNMIX_PRODUCT(a7) PNMIX_PRODUCT(a8) PNMIX_PRODUCT(a9) PNMIX_PRODUCT(a10) PNMIX_PRODUCT(a11)
#undef PNMIX_PRODUCT
      if constexpr (Added >= 4) {
        add(p0, u, s);
        add(p1, u, s);
        add(p2, u, s);
        add(p3, u, s);
      }
      if constexpr (Added >= 8) {
        add(p4, u, s);
        add(p5, u, s);
        add(p6, u, s);
        add(p7, u, s);
      }
    }
    const double t = (double)(__rdtsc() - t0) / (double)kIterations;
    best = t < best ? t : best;
  }
  asm volatile("" : : "v"(p0), "v"(p1), "v"(p2), "v"(p3), "v"(p4), "v"(p5), "v"(p6), "v"(p7));
  return best;
}

#define PNMIX_PIPE_MIX_ADDER(name, text, out)                                                          \
  struct name##_adder {                                                                                \
    void operator()(__m512i& dst, __m512i x, __m512i y) const { asm volatile(text : out(dst) : "v"(x), "v"(y)); } \
  };
PNMIX_PIPE_MIX_INSTRUCTIONS(PNMIX_PIPE_MIX_ADDER)

}  // namespace

int main(int argc, char** argv) {
  if (argc > 2) {
    fprintf(stderr, "error: one argument at most (rounds), got %d\n", argc - 1);
    return 2;
  }
  long rounds = 9;
  if (argc == 2) {
    char* end = nullptr;
    errno = 0;
    rounds = strtol(argv[1], &end, 10);
    if (end == argv[1] || *end != '\0' || errno == ERANGE || rounds < 1 || rounds > kMaxRounds) {
      fprintf(stderr, "error: rounds must be an integer from 1 to %ld, got '%s'\n", kMaxRounds, argv[1]);
      return 2;
    }
  }
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512vbmi")) {
    fprintf(stderr, "error: this CPU has no AVX-512 VNNI and VBMI, the integer kernel's instructions\n");
    return 1;
  }
  const double products = ticks_per_iteration<0>(rounds, [](__m512i&, __m512i, __m512i) {});
  const double slot = products / 12;
  printf("12 independent vpdpbusd: %.2f ticks an iteration (best of %ld runs)\n", products, rounds);
  printf("%-16s %16s %16s\n", "instruction", "+4: slots each", "+8: slots each");
#define PNMIX_PIPE_MIX_ROW(name, text, out)                                                 \
  {                                                                                         \
    const double four = ticks_per_iteration<4>(rounds, name##_adder{});                     \
    const double eight = ticks_per_iteration<8>(rounds, name##_adder{});                    \
    printf("%-16s %16.2f %16.2f\n", #name, (four - products) / (4 * slot), (eight - products) / (8 * slot)); \
  }
  PNMIX_PIPE_MIX_INSTRUCTIONS(PNMIX_PIPE_MIX_ROW)
  return 0;
}
