// libpnmix_core: pnmix_append (pnmix_core.h): the pair mask on the first append, group flushes (one
// group of one (sequence, KV head) per worker), then sink and residual. Bytes equal
// pnmix.cache.append_reference.
#include <string.h>

#include <atomic>
#include <exception>
#include <vector>

#include "core_internal.h"
#include "pnmix/format.h"
#include "pnmix/quant.h"
#include "pool.h"
#include "scratch.h"

namespace pnmix {
namespace core {
namespace {

struct AppendJob {
  const pnmix_layout* L;
  const pnmix_state* state;
  Lengths before, after;
  int64_t n, into_sink;
  const uint16_t *k, *v;
  std::atomic<bool> failed{false};
};

// Token j of the residual stream of (b, h): what the residual holds, then the new tokens past the sink.
inline const uint16_t* stream_row(const AppendJob& job, const uint16_t* residual, const uint16_t* fresh,
                                  int64_t bh, int64_t j) {
  const int64_t D = job.L->head_dim, R = job.L->config.residual_size;
  if (j < job.before.residual) return residual + (bh * R + j) * D;
  return fresh + (bh * job.n + job.into_sink + j - job.before.residual) * D;
}

// ---- a group's quantization, four lanes at a time ------------------------------------------------
//
// The bytes of quant.h's quantize_key_group / quantize_value_token (the definition, shared with
// CUDA and the reference), computed four elements at a time: keys four channels to a vector, each
// lane walking its channel's tokens in order, so every fit sees its elements in quant.h's order
// (min/max ties, float64 sums); values four channels of a token at a time, the range's minimum
// and maximum found again element by element where it is a zero (the first of -0.0 and +0.0 is
// the one quant.h keeps). rint is (x + 1.5 * 2^23) - 1.5 * 2^23: rintf for |x| < 2^22 in the
// default rounding mode, and a larger value is clamped to the same code either way.

typedef float f4 __attribute__((vector_size(16)));
typedef int32_t i4 __attribute__((vector_size(16)));
typedef double d4 __attribute__((vector_size(32)));

inline f4 load4(const float* p) {
  f4 v;
  memcpy(&v, p, sizeof v);
  return v;
}

// fp16 -> fp32 of every 16-bit pattern, half_to_float's values (NaN payloads kept); built once.
const float* half_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t h = 0; h < 65536; ++h) t[h] = half_to_float((uint16_t)h);
    return t;
  }();
  return table.data();
}

// quantize_code, lane by lane
inline i4 quantize4(f4 x, f4 step, f4 offset, f4 top) {
  const f4 magic = f4{} + 12582912.0f;
  const f4 r = ((x - offset) / step + magic) - magic;
  const i4 keep = (r > 0.0f) & (step != 0.0f);  // not NaN, above zero, a step to divide by
  const f4 code = keep ? (r >= top ? top : r) : f4{};
  return __builtin_convertvector(code, i4);
}

// codes q[0..n) of b bits each, code i at bit i * b of out (write_code's order), nbytes at most
void pack_codes(const uint8_t* q, int64_t n, int b, uint8_t* out, int64_t nbytes) {
  uint64_t acc = 0;
  int have = 0;
  int64_t o = 0;
  for (int64_t i = 0; i < n; ++i) {
    acc |= (uint64_t)q[i] << have;
    for (have += b; have >= 8; have -= 8, acc >>= 8)
      if (o < nbytes) out[o++] = (uint8_t)acc;
  }
  if (have && o < nbytes) out[o] = (uint8_t)acc;
}

// quantize_key_group of keys x fp32 [gs][D] (keys16: the same as fp16, for a channel tail past
// the last whole vector); q: scratch of D * gs codes.
void quantize_keys4(const pnmix_layout& L, const float* x, const uint16_t* keys16, const int* bits,
                    const int64_t* offsets, uint8_t* codes, uint16_t* step, uint16_t* offset, uint8_t* q) {
  const int64_t gs = L.config.group_size, D = L.head_dim;
  int64_t c = 0;
  for (; c + 4 <= D; c += 4) {
    f4 lo = load4(x + c), hi = lo;
    i4 nan = lo != lo;
    d4 sum = d4{} + __builtin_convertvector(lo, d4);
    for (int64_t t = 1; t < gs; ++t) {
      const f4 v = load4(x + t * D + c);
      nan |= v != v;
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
      sum += __builtin_convertvector(v, d4);
    }
    const f4 mu = __builtin_convertvector(sum / (double)gs, f4);
    d4 spread = d4{};
    if (bits[c] == 1 || bits[c + 1] == 1 || bits[c + 2] == 1 || bits[c + 3] == 1)
      for (int64_t t = 0; t < gs; ++t) {
        const i4 diff = (i4)(load4(x + t * D + c) - mu) & 0x7fffffff;  // fabsf
        spread += __builtin_convertvector((f4)diff, d4);
      }
    f4 s4, o4, top;
    for (int l = 0; l < 4; ++l) {
      const int b = bits[c + l];
      const QParams qp = b >= 2 ? affine_from_range(lo[l], hi[l], nan[l] != 0, b) : affine_from_mean(mu[l], spread[l], gs);
      step[c + l] = qp.step;
      offset[c + l] = qp.offset;
      s4[l] = half_to_float(qp.step);
      o4[l] = half_to_float(qp.offset);
      top[l] = (float)((1 << b) - 1);
    }
    for (int64_t t = 0; t < gs; ++t) {
      const i4 code = quantize4(load4(x + t * D + c), s4, o4, top);
      for (int l = 0; l < 4; ++l) q[(c + l) * gs + t] = (uint8_t)code[l];
    }
  }
  for (; c < D; ++c) {  // quant.h's loop for the channels past the last vector
    const QParams qp = fit_affine(keys16 + c, gs, D, bits[c]);
    step[c] = qp.step;
    offset[c] = qp.offset;
    const float s = half_to_float(qp.step), o = half_to_float(qp.offset);
    for (int64_t t = 0; t < gs; ++t) q[c * gs + t] = (uint8_t)quantize_code(x[t * D + c], s, o, bits[c]);
  }
  for (c = 0; c < D; ++c) pack_codes(q + c * gs, gs, bits[c], codes + offsets[c], gs * bits[c] / 8);
}

// The first minimum (or maximum) of x[0..n) as quant.h's scan keeps it, given the value m of it:
// only a zero has two encodings that compare equal.
float first_extreme(const float* x, int64_t n, float m, bool lowest) {
  if (m != 0.0f) return m;
  float e = x[0];
  for (int64_t i = 1; i < n; ++i) e = lowest ? (x[i] < e ? x[i] : e) : (x[i] > e ? x[i] : e);
  return e;
}

// quantize_value_token of one token's values x fp32 [D] (values16: the same as fp16, for the
// layouts the vectors do not take: 1-bit values, blocks narrower than a vector); q: D codes.
void quantize_values4(const pnmix_layout& L, const float* x, const uint16_t* values16, uint8_t* codes,
                      uint16_t* step, uint16_t* offset, uint8_t* q) {
  const int64_t vg = value_block(L), nvb = value_blocks(L), vb = value_token_bytes(L), D = L.head_dim;
  const int b = L.config.value_bits;
  if (b < 2 || vg % 4) return quantize_value_token(L, values16, codes, step, offset);
  const f4 top = f4{} + (float)((1 << b) - 1);
  for (int64_t j = 0; j < nvb; ++j) {
    const float* xb = x + j * vg;
    f4 lo = load4(xb), hi = lo;
    i4 nan = lo != lo;
    for (int64_t c = 4; c < vg; c += 4) {
      const f4 v = load4(xb + c);
      nan |= v != v;
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    float l = lo[0], h = hi[0];
    bool any_nan = nan[0] != 0;
    for (int k = 1; k < 4; ++k) {
      l = lo[k] < l ? lo[k] : l;
      h = hi[k] > h ? hi[k] : h;
      any_nan |= nan[k] != 0;
    }
    const QParams qp = any_nan ? affine_from_range(0.0f, 0.0f, true, b)
                               : affine_from_range(first_extreme(xb, vg, l, true), first_extreme(xb, vg, h, false),
                                                   false, b);
    step[j] = qp.step;
    offset[j] = qp.offset;
    const f4 s4 = f4{} + half_to_float(qp.step), o4 = f4{} + half_to_float(qp.offset);
    for (int64_t c = 0; c < vg; c += 4) {
      const i4 code = quantize4(load4(xb + c), s4, o4, top);
      for (int k = 0; k < 4; ++k) q[j * vg + c + k] = (uint8_t)code[k];
    }
  }
  pack_codes(q, D, b, codes, vb);
}

void quantize_group(const AppendJob& job, int64_t item);

// Work item (sequence and KV head bh, new group i) = bh * new_groups + i: every group of every head
// is quantized on its own, so a long append keeps every thread busy however few the KV heads.
void quantize_group_item(void* ctx, int64_t item) {
  AppendJob& job = *static_cast<AppendJob*>(ctx);
  try {
    quantize_group(job, item);
  } catch (const std::exception&) {  // never let an exception cross the C ABI or kill a worker
    job.failed = true;
  }
}

void quantize_group(const AppendJob& job, int64_t item) {
  const pnmix_layout& L = *job.L;
  const pnmix_state* st = job.state;
  const int64_t new_groups = job.after.groups - job.before.groups, bh = item / new_groups, i = item % new_groups;
  const int64_t H = L.kv_heads, D = L.head_dim, gs = L.config.group_size, G = max_groups(L), b = bh / H, h = bh % H;
  const int64_t row = D * 2;  // bytes of one fp16 token row
  const uint16_t* res_k = buffer<uint16_t>(st, PNMIX_RESIDUAL_K);
  const uint16_t* res_v = buffer<uint16_t>(st, PNMIX_RESIDUAL_V);
  thread_local std::vector<uint16_t> rows;
  thread_local std::vector<int> bits;
  thread_local std::vector<int64_t> offsets;
  uint16_t* keys = ensure(rows, 2 * gs * D);
  uint16_t* values = keys + gs * D;
  const uint8_t* mask = buffer<uint8_t>(st, PNMIX_PAIR_MASK) + b * mask_bytes(L);
  key_channel_layout(L, mask, h, ensure(bits, D), ensure(offsets, D));
  const int64_t KB = key_group_bytes(L), VB = value_token_bytes(L), NVB = value_blocks(L);
  for (int64_t t = 0; t < gs; ++t) {
    memcpy(keys + t * D, stream_row(job, res_k, job.k, bh, i * gs + t), row);
    memcpy(values + t * D, stream_row(job, res_v, job.v, bh, i * gs + t), row);
  }
  thread_local std::vector<float> as_float;
  thread_local std::vector<uint8_t> scratch_codes;
  float* xf = ensure(as_float, 2 * gs * D);
  uint8_t* q = ensure(scratch_codes, gs * D);
  const float* table = half_table();
  for (int64_t e = 0; e < 2 * gs * D; ++e) xf[e] = table[rows[e]];  // keys, then values
  const int64_t slot = bh * G + job.before.groups + i;
  quantize_keys4(L, xf, keys, bits.data(), offsets.data(), buffer<uint8_t>(st, PNMIX_KEY_CODES) + slot * KB,
                 buffer<uint16_t>(st, PNMIX_KEY_STEP) + slot * D, buffer<uint16_t>(st, PNMIX_KEY_OFFSET) + slot * D, q);
  for (int64_t t = 0; t < gs; ++t)
    quantize_values4(L, xf + (gs + t) * D, values + t * D, buffer<uint8_t>(st, PNMIX_VALUE_CODES) + (slot * gs + t) * VB,
                     buffer<uint16_t>(st, PNMIX_VALUE_STEP) + (slot * gs + t) * NVB,
                     buffer<uint16_t>(st, PNMIX_VALUE_OFFSET) + (slot * gs + t) * NVB, q);
}

// After every group of (b, h) is quantized (they read the residual): the sink's new tokens, and
// the stream's tail becomes the residual.
void move_sink_and_residual(const AppendJob& job, int64_t bh) {
  const pnmix_layout& L = *job.L;
  const pnmix_state* st = job.state;
  const int64_t D = L.head_dim, S = L.config.sink_tokens, R = L.config.residual_size, gs = L.config.group_size;
  const int64_t row = D * 2;
  uint16_t* sink_k = buffer<uint16_t>(st, PNMIX_SINK_K);
  uint16_t* sink_v = buffer<uint16_t>(st, PNMIX_SINK_V);
  uint16_t* res_k = buffer<uint16_t>(st, PNMIX_RESIDUAL_K);
  uint16_t* res_v = buffer<uint16_t>(st, PNMIX_RESIDUAL_V);
  for (int64_t t = 0; t < job.into_sink; ++t) {
    memcpy(sink_k + (bh * S + job.before.sink + t) * D, job.k + (bh * job.n + t) * D, row);
    memcpy(sink_v + (bh * S + job.before.sink + t) * D, job.v + (bh * job.n + t) * D, row);
  }
  // rows only move towards the front, so a forward copy is safe; with no group flushed the rows
  // held stay where they are (a decode step copied its whole residual onto itself: K and V, up to
  // residual_size - 1 rows a head, 9 us of SmolLM2's 8K call)
  const int64_t skip = (job.after.groups - job.before.groups) * gs;
  for (int64_t j = skip ? 0 : job.before.residual; j < job.after.residual; ++j) {
    memmove(res_k + (bh * R + j) * D, stream_row(job, res_k, job.k, bh, skip + j), row);
    memmove(res_v + (bh * R + j) * D, stream_row(job, res_v, job.v, bh, skip + j), row);
  }
}

void compute_pair_mask(const pnmix_layout& L, const pnmix_state* st, const uint16_t* k, int64_t n) {
  const int64_t B = L.batch, H = L.kv_heads, D = L.head_dim, MB = mask_bytes(L);
  uint8_t* mask = buffer<uint8_t>(st, PNMIX_PAIR_MASK);
  std::vector<double> energy(pairs(L));
  memset(mask, 0, B * MB);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      pair_energy(L, k + (b * H + h) * n * D, n, D, energy.data());
      choose_high_pairs(L, energy.data(), h, mask + b * MB);
    }
}

}  // namespace

int append_impl(const pnmix_layout* layout, pnmix_state* state, int64_t seq_len, const uint16_t* k, const uint16_t* v,
                int64_t n, int64_t kv_bytes, bool check_only, int threads) {
  if (int rc = check_layout(layout)) return rc;
  const pnmix_layout& L = *layout;
  if (int rc = check_state(L, state)) return rc;
  if (int rc = check_seq_len(L, seq_len)) return rc;
  if (n < 0) return fail(PNMIX_ERR_SIZE, "token count n must be >= 0, got %lld", (long long)n);
  if (n > L.max_seq_len - seq_len)
    return fail(PNMIX_ERR_CAPACITY, "cache capacity exceeded: %lld + %lld tokens > max_seq_len %lld",
                (long long)seq_len, (long long)n, (long long)L.max_seq_len);
  const int64_t want = product({L.batch, L.kv_heads, n, L.head_dim, 2});
  if (want < 0 || kv_bytes != want)
    return fail(PNMIX_ERR_SIZE, "new K/V buffers have %lld bytes, [B, H, n, D] fp16 needs %lld",
                (long long)kv_bytes, (long long)want);
  if (n == 0) return ok();
  if (!k || !v) return fail(PNMIX_ERR_NULL, "new keys or values pointer is null");
  if (((uintptr_t)k | (uintptr_t)v) & 1) return fail(PNMIX_ERR_SIZE, "new K/V buffers are not 2-byte aligned");
  if (seq_len > 0)
    if (int rc = check_pair_mask(L, buffer<const uint8_t>(state, PNMIX_PAIR_MASK), PNMIX_ERR_STATE, "state's"))
      return rc;
  if (check_only) return ok();

  if (seq_len == 0) compute_pair_mask(L, state, k, n);
  AppendJob job;
  job.L = layout;
  job.state = state;
  job.before = lengths(L.config, seq_len);
  job.after = lengths(L.config, seq_len + n);
  job.n = n;
  job.into_sink = job.after.sink - job.before.sink;
  job.k = k;
  job.v = v;
  const int64_t heads = L.batch * L.kv_heads, groups = heads * (job.after.groups - job.before.groups);
  if (groups) parallel_for(groups > 1 ? resolve_threads(threads) : 1, groups, quantize_group_item, &job);
  if (job.failed) return fail(PNMIX_ERR_INTERNAL, "out of memory for the append scratch");
  for (int64_t bh = 0; bh < heads; ++bh) move_sink_and_residual(job, bh);
  return ok();
}

}  // namespace core
}  // namespace pnmix

using namespace pnmix;
using namespace pnmix::core;

extern "C" {

// The two entry points that allocate (scratch, threads): no exception crosses the C ABI.
int pnmix_append(const pnmix_layout* layout, pnmix_state* state, int64_t seq_len, const uint16_t* k,
                 const uint16_t* v, int64_t n, int64_t kv_bytes) {
  try {
    return append_impl(layout, state, seq_len, k, v, n, kv_bytes);
  } catch (const std::exception& e) {
    return fail(PNMIX_ERR_INTERNAL, "append failed: %s", e.what());
  }
}

}  // extern "C"
