// pnmix/half.h: bit-exact fp16 <-> fp32 on host and device, without cuda_fp16.h.
//
// fp16 values travel as uint16_t bit patterns everywhere in the core (the state tensors, the C
// ABI), so host and device code agree to the bit and nothing depends on a compiler's half type.
#ifndef PNMIX_HALF_H
#define PNMIX_HALF_H

#include <stdint.h>
#include <string.h>

#include "params.h"

namespace pnmix {

PNMIX_HD inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

PNMIX_HD inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// fp16 bits -> fp32, exact (every fp16 value is an fp32 value; NaN payloads are kept).
PNMIX_HD inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);
  // subnormal: shift the leading one up to the implicit bit
  uint32_t e = 113u;
  while (!(mantissa & 0x400u)) {
    mantissa <<= 1;
    --e;
  }
  return bits_float(sign | (e << 23) | ((mantissa & 0x3ffu) << 13));
}

// Round-to-nearest-even right shift of a mantissa by s (1 <= s <= 31).
PNMIX_HD inline uint32_t shift_round_even(uint32_t mantissa, uint32_t s) {
  const uint32_t kept = mantissa >> s;
  const uint32_t rest = mantissa & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1u);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

// fp32 -> fp16 bits, IEEE round to nearest even (overflow gives infinity; NaN stays NaN).
PNMIX_HD inline uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN, quiet
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // >= 65520 rounds to infinity
  if (ax >= 0x38800000u) {  // normal fp16 (>= 2^-14): rebias, round off 13 bits (carry may bump e)
    const uint32_t biased = ax - 0x38000000u;  // exponent - 112
    return (uint16_t)(sign | shift_round_even(biased, 13));
  }
  if (ax < 0x33000000u) return sign;  // below 2^-25: rounds to zero (2^-25 itself ties to 0)
  // subnormal fp16: value = mantissa * 2^(e - 150), in units of 2^-24 that is >> (126 - e)
  const uint32_t e = ax >> 23;
  const uint32_t mantissa = (ax & 0x7fffffu) | 0x800000u;
  return (uint16_t)(sign | shift_round_even(mantissa, 126u - e));
}

// FORMAT.md section 4's fp16(.): round to nearest even, saturating at +-65504; NaN stays NaN.
PNMIX_HD inline uint16_t float_to_half_saturating(float f) {
  const float kMax = 65504.0f;
  if (f > kMax) f = kMax;
  if (f < -kMax) f = -kMax;
  return float_to_half(f);
}

// Whether fp16 bits hold a finite value (the exponent field is not all ones: Inf and NaN).
PNMIX_HD inline bool half_is_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

}  // namespace pnmix

#endif  // PNMIX_HALF_H
