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
  if ((int64_t)rows.size() < 2 * gs * D) rows.resize(2 * gs * D);
  if ((int64_t)bits.size() < D) bits.resize(D), offsets.resize(D);
  const uint8_t* mask = buffer<uint8_t>(st, PNMIX_PAIR_MASK) + b * mask_bytes(L);
  key_channel_layout(L, mask, h, bits.data(), offsets.data());
  const int64_t KB = key_group_bytes(L), VB = value_token_bytes(L), NVB = value_blocks(L);
  uint16_t* keys = rows.data();
  uint16_t* values = rows.data() + gs * D;
  for (int64_t t = 0; t < gs; ++t) {
    memcpy(keys + t * D, stream_row(job, res_k, job.k, bh, i * gs + t), row);
    memcpy(values + t * D, stream_row(job, res_v, job.v, bh, i * gs + t), row);
  }
  const int64_t slot = bh * G + job.before.groups + i;
  quantize_key_group(L, keys, D, bits.data(), offsets.data(), buffer<uint8_t>(st, PNMIX_KEY_CODES) + slot * KB,
                     buffer<uint16_t>(st, PNMIX_KEY_STEP) + slot * D, buffer<uint16_t>(st, PNMIX_KEY_OFFSET) + slot * D);
  for (int64_t t = 0; t < gs; ++t)
    quantize_value_token(L, values + t * D, buffer<uint8_t>(st, PNMIX_VALUE_CODES) + (slot * gs + t) * VB,
                         buffer<uint16_t>(st, PNMIX_VALUE_STEP) + (slot * gs + t) * NVB,
                         buffer<uint16_t>(st, PNMIX_VALUE_OFFSET) + (slot * gs + t) * NVB);
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
  // rows only move towards the front, so a forward copy is safe
  const int64_t skip = (job.after.groups - job.before.groups) * gs;
  for (int64_t j = 0; j < job.after.residual; ++j) {
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
}  // namespace core
}  // namespace pnmix

using namespace pnmix;
using namespace pnmix::core;

extern "C" {

static int append_impl(const pnmix_layout* layout, pnmix_state* state, int64_t seq_len, const uint16_t* k,
                       const uint16_t* v, int64_t n, int64_t kv_bytes) {
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
  if (groups) parallel_for(groups > 1 ? resolve_threads(0) : 1, groups, quantize_group_item, &job);
  if (job.failed) return fail(PNMIX_ERR_INTERNAL, "out of memory for the append scratch");
  for (int64_t bh = 0; bh < heads; ++bh) move_sink_and_residual(job, bh);
  return ok();
}

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
