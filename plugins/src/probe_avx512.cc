// probe_avx512.cc: the AVX-512 kernels' multiply-add rates with the data in registers (see
// probe_avx2.cc): fp32 FMAs on 16 lanes, and the VNNI integer path's vpdpbusd (64 multiply-adds of
// an 8-bit code and an 8-bit weight into 32-bit sums). Compiled with AVX-512F + VNNI, called only
// where cpuid reports them.
#include <immintrin.h>
#include <stdint.h>

#include "probe.h"

namespace pnmix {

double int8_madds_vnni(int64_t iterations) {
  __m512i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i codes = _mm512_set1_epi8(1), weights = _mm512_set1_epi8(3);
  for (int64_t n = 0; n < iterations; ++n) {
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], codes, weights);
    __asm__ volatile("" : "+v"(codes), "+v"(weights));
  }
  __m512i sum = acc[0];
  for (int i = 1; i < 8; ++i) sum = _mm512_add_epi32(sum, acc[i]);
  volatile int sink = _mm512_cvtsi512_si32(sum);
  (void)sink;
  return (double)iterations * 8 * 64;
}

double fp32_madds_avx512(int64_t iterations) {
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_set1_ps((float)i);
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-7f);
  for (int64_t n = 0; n < iterations; ++n) {
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  __m512 sum = acc[0];
  for (int i = 1; i < 8; ++i) sum = _mm512_add_ps(sum, acc[i]);
  volatile float sink = _mm512_cvtss_f32(sum);
  (void)sink;
  return (double)iterations * 8 * 16;
}

}  // namespace pnmix
