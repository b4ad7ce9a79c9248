// probe_avx2.cc: the machine's multiply-add rates with the data in registers (pnmix_madd_rate), so
// `pnmix bench decode` can say how far each attention path is from the arithmetic it needs: fp32
// FMAs (8 multiply-adds an instruction) and the integer path's vpmaddubsw + vpaddw (32 multiply-adds
// of an 8-bit code and an 8-bit weight into 16-bit sums). Compiled with AVX2 + FMA, called only
// where cpuid reports them.
#include <immintrin.h>
#include <stdint.h>

#include "probe.h"

namespace pnmix {

// Eight independent accumulators hide the latency; the asm barrier keeps the compiler from
// folding the loop (the operands are opaque to it). Each accumulator multiplies its own pair of
// operands: with one pair for all, the compiler computes the product once per round (an earlier
// version did, and reported 2-4x the real rate).
double int8_madds(int64_t iterations) {
  __m256i acc[8], codes[4], weights[2];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_epi16((short)i);
  for (int i = 0; i < 4; ++i) codes[i] = _mm256_set1_epi8((char)(1 + i));
  for (int i = 0; i < 2; ++i) weights[i] = _mm256_set1_epi8((char)(3 + i));
  for (int64_t n = 0; n < iterations; ++n) {
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(codes[i % 4], weights[i / 4]));
    __asm__ volatile("" : "+x"(codes[0]), "+x"(codes[1]), "+x"(codes[2]), "+x"(codes[3]), "+x"(weights[0]),
                     "+x"(weights[1]));
  }
  __m256i sum = acc[0];
  for (int i = 1; i < 8; ++i) sum = _mm256_add_epi16(sum, acc[i]);
  volatile int sink = _mm256_extract_epi16(sum, 0);
  (void)sink;
  return (double)iterations * 8 * 32;
}

double fp32_madds(int64_t iterations) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_set1_ps((float)i);
  __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-7f);
  for (int64_t n = 0; n < iterations; ++n) {
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  __m256 sum = acc[0];
  for (int i = 1; i < 8; ++i) sum = _mm256_add_ps(sum, acc[i]);
  volatile float sink = _mm256_cvtss_f32(sum);
  (void)sink;
  return (double)iterations * 8 * 8;
}

}  // namespace pnmix
