// pnmix/quant.h: FORMAT.md section 4 in C++ (host and device): affine fit, quantize, dequantize,
// the saliency energy and high-pair choice, and whole key/value groups packed into the layout.
// pnmix/quant.py and pnmix/reference.py are the Python twins; results are bit-exact with them.
//
// Arithmetic rules that make the bytes identical on every backend:
//  * no fast-math: (x - offset) / step is an fp32 subtraction then a correctly rounded division
//    (nvcc's default -prec-div=true; host compilers without -ffast-math);
//  * rounding is rintf (half to even in the default rounding mode);
//  * b == 1 sums are float64.
#ifndef PNMIX_QUANT_H
#define PNMIX_QUANT_H

#include <math.h>
#include <stdint.h>

#include "format.h"
#include "half.h"

namespace pnmix {

struct QParams {
  uint16_t step;    // fp16 bits
  uint16_t offset;  // fp16 bits
};

// The fit of b >= 2 bits from a block's range: lo and hi its first minimum and maximum (the
// earliest of equal values, which tells -0.0 from +0.0), nan whether any element is NaN.
PNMIX_HD inline QParams affine_from_range(float lo, float hi, bool nan, int bits) {
  if (nan) lo = hi = NAN;  // torch.amin/amax propagate NaN
  const float levels = (float)((1 << bits) - 1);
  QParams qp;
  qp.step = float_to_half_saturating((hi - lo) / levels);
  qp.offset = float_to_half_saturating(lo);
  return qp;
}

// The 1-bit fit from a block's mean mu and spread = the float64 sum, in element order, of
// |x - mu| (fp32 differences), over n elements.
PNMIX_HD inline QParams affine_from_mean(float mu, double spread, int64_t n) {
  const float a = (float)(spread / (double)n);
  QParams qp;
  qp.step = float_to_half_saturating(2.0f * a);
  qp.offset = float_to_half_saturating(mu - a);
  return qp;
}

// Fit (step, offset) over n fp16 elements x[0], x[stride], ... with b bits.
PNMIX_HD inline QParams fit_affine(const uint16_t* x, int64_t n, int64_t stride, int bits) {
  if (bits >= 2) {
    float lo = half_to_float(x[0]), hi = lo;
    bool nan = lo != lo;
    for (int64_t i = 1; i < n; ++i) {
      const float v = half_to_float(x[i * stride]);
      nan |= v != v;
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    return affine_from_range(lo, hi, nan, bits);
  }
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += (double)half_to_float(x[i * stride]);
  const float mu = (float)(sum / (double)n);
  double spread = 0.0;
  for (int64_t i = 0; i < n; ++i) spread += (double)fabsf(half_to_float(x[i * stride]) - mu);
  return affine_from_mean(mu, spread, n);
}

// q = clamp(rint(fp32(x - offset) / step), 0, 2^b - 1); 0 where step == 0 (or the result is NaN).
PNMIX_HD inline uint32_t quantize_code(float x, float step, float offset, int bits) {
  if (step == 0.0f) return 0u;
  const float q = rintf((x - offset) / step);
  const float top = (float)((1 << bits) - 1);
  if (!(q > 0.0f)) return 0u;  // also NaN
  return q >= top ? (uint32_t)top : (uint32_t)q;
}

// x = fp32(offset) + fp32(step) * q, the product rounded on its own (no fused multiply-add),
// exactly as the reference computes it.
PNMIX_HD inline float dequantize_code(uint32_t code, float step, float offset) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(offset, __fmul_rn(step, (float)code));
#else
  return offset + step * (float)code;  // the core builds with -ffp-contract=off
#endif
}

// ---- saliency (FORMAT.md section 4, last paragraph) -------------------------------------------

// x * x rounded on its own (never fused into the following add), as torch squares then sums.
PNMIX_HD inline double square_rn(double x) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(x, x);
#else
  return x * x;  // host builds of the core use -ffp-contract=off
#endif
}

// Energy of each pair of KV head h over n tokens: keys fp16 [n, D] rows `row_stride` apart.
// energy[p] = sum_t k[a_p]^2 + sum_t k[b_p]^2, float64, per-channel sums first (as the reference).
// NaN energy is returned as -inf so it ranks lowest.
PNMIX_HD inline void pair_energy(const pnmix_layout& L, const uint16_t* keys, int64_t n, int64_t row_stride,
                                 double* energy) {
  const int64_t P = pairs(L);
  for (int64_t p = 0; p < P; ++p) {
    int64_t a, b;
    pair_channels(p, L.head_dim, L.config.pair_layout, &a, &b);
    double sa = 0.0, sb = 0.0;
    for (int64_t t = 0; t < n; ++t) {
      const double ka = half_to_float(keys[t * row_stride + a]);
      const double kb = half_to_float(keys[t * row_stride + b]);
      sa += square_rn(ka);
      sb += square_rn(kb);
    }
    const double e = 0.0 + sa + sb;
    energy[p] = e != e ? -INFINITY : e;
  }
}

// Set the mask bits of KV head h: the n_high pairs of largest energy, ties to the lower index.
PNMIX_HD inline void choose_high_pairs(const pnmix_layout& L, const double* energy, int64_t h, uint8_t* mask) {
  const int64_t P = pairs(L), n_high = high_pairs(L);
  for (int64_t p = 0; p < P; ++p) {
    int64_t rank = 0;  // pairs ahead of p in a stable descending sort
    for (int64_t o = 0; o < P; ++o)
      rank += (energy[o] > energy[p] || (energy[o] == energy[p] && o < p)) ? 1 : 0;
    if (rank < n_high) set_pair_high(mask, P, h, p);
  }
}

// ---- whole groups, packed into the layout --------------------------------------------------------

// Quantize one key group of one KV head: keys fp16 [gs, D] rows `row_stride` apart (oldest first).
// Writes KB code bytes, D steps and D offsets. `bits`/`offsets` come from key_channel_layout.
PNMIX_HD inline void quantize_key_group(const pnmix_layout& L, const uint16_t* keys, int64_t row_stride,
                                        const int* bits, const int64_t* offsets, uint8_t* codes,
                                        uint16_t* step, uint16_t* offset) {
  const int64_t gs = L.config.group_size;
  for (int64_t c = 0; c < L.head_dim; ++c) {
    const int b = bits[c];
    const QParams qp = fit_affine(keys + c, gs, row_stride, b);
    step[c] = qp.step;
    offset[c] = qp.offset;
    const float s = half_to_float(qp.step), o = half_to_float(qp.offset);
    uint8_t* stream = codes + offsets[c];
    const int64_t nbytes = gs * b / 8;
    for (int64_t i = 0; i < nbytes; ++i) stream[i] = 0;
    for (int64_t t = 0; t < gs; ++t)
      write_code(stream, nbytes, t, b, quantize_code(half_to_float(keys[t * row_stride + c]), s, o, b));
  }
}

// Quantize one token's values of one KV head: fp16 [D] -> VB code bytes, NVB steps and offsets.
PNMIX_HD inline void quantize_value_token(const pnmix_layout& L, const uint16_t* values, uint8_t* codes,
                                          uint16_t* step, uint16_t* offset) {
  const int64_t vg = value_block(L), nvb = value_blocks(L), vb = value_token_bytes(L);
  const int b = L.config.value_bits;
  for (int64_t i = 0; i < vb; ++i) codes[i] = 0;
  for (int64_t j = 0; j < nvb; ++j) {
    const QParams qp = fit_affine(values + j * vg, vg, 1, b);
    step[j] = qp.step;
    offset[j] = qp.offset;
    const float s = half_to_float(qp.step), o = half_to_float(qp.offset);
    for (int64_t c = j * vg; c < (j + 1) * vg; ++c)
      write_code(codes, vb, c, b, quantize_code(half_to_float(values[c]), s, o, b));
  }
}

// Dequantize key channel c of a group at token t (fp32).
PNMIX_HD inline float dequantize_key(const uint8_t* codes, const int* bits, const int64_t* offsets,
                                     int64_t gs, const uint16_t* step, const uint16_t* offset, int64_t c,
                                     int64_t t) {
  const int b = bits[c];
  const uint32_t q = read_code(codes + offsets[c], gs * b / 8, t, b);
  return dequantize_code(q, half_to_float(step[c]), half_to_float(offset[c]));
}

// Dequantize value channel c of one token (fp32): codes VB bytes, step/offset NVB entries.
PNMIX_HD inline float dequantize_value_channel(const pnmix_layout& L, const uint8_t* codes, const uint16_t* step,
                                               const uint16_t* offset, int64_t c) {
  const int b = L.config.value_bits;
  const int64_t j = c / value_block(L);
  return dequantize_code(read_code(codes, value_token_bytes(L), c, b), half_to_float(step[j]),
                          half_to_float(offset[j]));
}

}  // namespace pnmix

#endif  // PNMIX_QUANT_H
