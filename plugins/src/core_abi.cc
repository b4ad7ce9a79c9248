// libpnmix_core: the C ABI (pnmix_core.h) over the header-only core. Every argument is
// validated here; the kernels below assume valid input.
#include "pnmix/pnmix_core.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <atomic>
#include <exception>
#include <initializer_list>
#include <string>
#include <vector>

#if defined(PNMIX_HAVE_X86_KERNELS)
#include <cpuid.h>
#endif

#include "attend.h"
#include "pnmix/format.h"
#include "pnmix/half.h"
#include "pnmix/quant.h"
#include "pool.h"

namespace pnmix {
namespace {

thread_local std::string tls_error;

int fail(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
int fail(int code, const char* fmt, ...) {
  char buffer[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buffer, sizeof buffer, fmt, args);
  va_end(args);
  tls_error = buffer;
  return code;
}

int ok() {
  tls_error.clear();
  return PNMIX_OK;
}

// a * b * ... as int64, or -1 when the product overflows (a caller's sizes must never wrap around)
int64_t product(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors)
    if (f < 0 || __builtin_mul_overflow(out, f, &out)) return -1;
  return out;
}

int check_layout(const pnmix_layout* L) {
  if (!L) return fail(PNMIX_ERR_NULL, "layout pointer is null");
  if (const char* bad = layout_error(*L)) return fail(PNMIX_ERR_CONFIG, "%s", bad);
  return PNMIX_OK;
}

int check_state(const pnmix_layout& L, const pnmix_state* state) {
  char msg[192];
  if (const int err = state_problem(L, state, msg, sizeof msg)) return fail(err, "%s", msg);
  return PNMIX_OK;
}

// FORMAT.md 3.2's rule for the B masks at `mask` (once seq_len > 0): exactly n_high high pairs
// per KV head, nothing past H * P. The kernels take key offsets from the mask, so a wrong count
// would make them read past a group's KB bytes.
int check_pair_mask(const pnmix_layout& L, const uint8_t* mask, int code, const char* what) {
  const int64_t want = high_pairs(L), MB = mask_bytes(L);
  for (int64_t b = 0; b < L.batch; ++b) {
    if (mask_has_trailing_bits(L, mask + b * MB))
      return fail(code, "%s pair_mask of sequence %lld has set bits past the last pair (must be 0)", what,
                  (long long)b);
    for (int64_t h = 0; h < L.kv_heads; ++h) {
      const int64_t high = high_pairs_in_head(L, mask + b * MB, h);
      if (high != want)
        return fail(code, "%s pair_mask marks %lld high pairs in KV head %lld of sequence %lld, the config "
                    "(high_ratio %g) gives %lld", what, (long long)high, (long long)h, (long long)b,
                    L.config.high_ratio, (long long)want);
    }
  }
  return PNMIX_OK;
}

int check_seq_len(const pnmix_layout& L, int64_t seq_len) {
  if (seq_len < 0 || seq_len > L.max_seq_len)
    return fail(PNMIX_ERR_SIZE, "seq_len %lld outside 0..max_seq_len %lld", (long long)seq_len,
                (long long)L.max_seq_len);
  return PNMIX_OK;
}

template <typename T>
T* buffer(const pnmix_state* state, int i) {
  return static_cast<T*>(state->data[i]);
}

// ---- append -------------------------------------------------------------------------------

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

void append_head_impl(const AppendJob& job, int64_t bh);

void append_head(void* ctx, int64_t bh) {
  AppendJob& job = *static_cast<AppendJob*>(ctx);
  try {
    append_head_impl(job, bh);
  } catch (const std::exception&) {  // never let an exception cross the C ABI or kill a worker
    job.failed = true;
  }
}

void append_head_impl(const AppendJob& job, int64_t bh) {
  const pnmix_layout& L = *job.L;
  const pnmix_state* st = job.state;
  const int64_t H = L.kv_heads, D = L.head_dim, S = L.config.sink_tokens, R = L.config.residual_size;
  const int64_t gs = L.config.group_size, G = max_groups(L), b = bh / H, h = bh % H;
  const int64_t row = D * 2;  // bytes of one fp16 token row

  uint16_t* sink_k = buffer<uint16_t>(st, PNMIX_SINK_K);
  uint16_t* sink_v = buffer<uint16_t>(st, PNMIX_SINK_V);
  uint16_t* res_k = buffer<uint16_t>(st, PNMIX_RESIDUAL_K);
  uint16_t* res_v = buffer<uint16_t>(st, PNMIX_RESIDUAL_V);
  for (int64_t t = 0; t < job.into_sink; ++t) {
    memcpy(sink_k + (bh * S + job.before.sink + t) * D, job.k + (bh * job.n + t) * D, row);
    memcpy(sink_v + (bh * S + job.before.sink + t) * D, job.v + (bh * job.n + t) * D, row);
  }

  const int64_t new_groups = job.after.groups - job.before.groups;
  if (new_groups) {
    thread_local std::vector<uint16_t> rows;
    thread_local std::vector<int> bits;
    thread_local std::vector<int64_t> offsets;
    if ((int64_t)rows.size() < 2 * gs * D) rows.resize(2 * gs * D);
    if ((int64_t)bits.size() < D) bits.resize(D), offsets.resize(D);
    const uint8_t* mask = buffer<uint8_t>(st, PNMIX_PAIR_MASK) + b * mask_bytes(L);
    key_channel_layout(L, mask, h, bits.data(), offsets.data());
    const int64_t KB = key_group_bytes(L), VB = value_token_bytes(L), NVB = value_blocks(L);
    for (int64_t i = 0; i < new_groups; ++i) {
      uint16_t* keys = rows.data();
      uint16_t* values = rows.data() + gs * D;
      for (int64_t t = 0; t < gs; ++t) {
        memcpy(keys + t * D, stream_row(job, res_k, job.k, bh, i * gs + t), row);
        memcpy(values + t * D, stream_row(job, res_v, job.v, bh, i * gs + t), row);
      }
      const int64_t slot = bh * G + job.before.groups + i;
      quantize_key_group(L, keys, D, bits.data(), offsets.data(), buffer<uint8_t>(st, PNMIX_KEY_CODES) + slot * KB,
                         buffer<uint16_t>(st, PNMIX_KEY_STEP) + slot * D,
                         buffer<uint16_t>(st, PNMIX_KEY_OFFSET) + slot * D);
      for (int64_t t = 0; t < gs; ++t)
        quantize_value_token(L, values + t * D, buffer<uint8_t>(st, PNMIX_VALUE_CODES) + (slot * gs + t) * VB,
                             buffer<uint16_t>(st, PNMIX_VALUE_STEP) + (slot * gs + t) * NVB,
                             buffer<uint16_t>(st, PNMIX_VALUE_OFFSET) + (slot * gs + t) * NVB);
    }
  }
  // the stream's tail becomes the residual; rows only move towards the front, so a forward copy is safe
  const int64_t skip = new_groups * gs;
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

// ---- attention ------------------------------------------------------------------------------

typedef void (*ItemFn)(const AttendJob&, int64_t);

enum class Isa { kAuto, kScalar, kAvx2, kAvx512, kAvx512Vbmi };
Isa forced_isa = Isa::kAuto;

// F16C from cpuid leaf 1 (not every compiler's __builtin_cpu_supports knows "f16c"); the OS's
// saving of the AVX registers is covered by the "avx2" check.
bool cpu_has_f16c() {
#if defined(PNMIX_HAVE_X86_KERNELS)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
#else
  return false;
#endif
}

bool cpu_has_avx2() {
#if defined(PNMIX_HAVE_X86_KERNELS)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(PNMIX_HAVE_X86_KERNELS)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool cpu_has_avx512vbmi() {
#if defined(PNMIX_HAVE_X86_KERNELS)
  return cpu_has_avx512() && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

Isa best_isa() {
  if (forced_isa != Isa::kAuto) return forced_isa;
  if (cpu_has_avx512vbmi()) return Isa::kAvx512Vbmi;
  if (cpu_has_avx512()) return Isa::kAvx512;
  if (cpu_has_avx2()) return Isa::kAvx2;
  return Isa::kScalar;
}

const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512Vbmi ? "avx512vbmi" : isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "scalar";
}

ItemFn item_function(const pnmix_layout& L) {
  Isa isa = best_isa();
#if defined(PNMIX_HAVE_X86_KERNELS)
  const bool wide = isa == Isa::kAvx512 || isa == Isa::kAvx512Vbmi;
  if (wide && L.config.group_size % 16) isa = Isa::kAvx2;  // 16-token chunks need gs % 16
  if (isa == Isa::kAvx512Vbmi) return attend_item_avx512vbmi;
  if (isa == Isa::kAvx512) return attend_item_avx512;
  if (isa == Isa::kAvx2) return attend_item_avx2;
#else
  (void)L;
  (void)isa;
#endif
  return attend_item_generic;
}

struct AttendRun {
  const AttendJob* job;
  ItemFn fn;
  std::atomic<bool> failed{false};  // scratch allocation failed in some thread
};

void run_item(void* ctx, int64_t item) {
  AttendRun& run = *static_cast<AttendRun*>(ctx);
  try {
    run.fn(*run.job, item);
  } catch (const std::exception&) {  // never let an exception cross the C ABI or kill a worker
    run.failed = true;
  }
}

// Combine the splits of each (sequence, KV head) and query row: log-sum-exp of partial softmaxes.
void merge_splits(const AttendJob& job, float* out) {
  const int64_t D = job.L.head_dim, M = job.rows, ps = partial_stride(job), H = job.L.kv_heads;
  for (int64_t bh = 0; bh < job.L.batch * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t r = 0; r < M; ++r) {
      const int64_t g = r / job.nq, i = r % job.nq;
      float* dst = out + ((b * job.q_heads + h * job.group_q + g) * job.nq + i) * D;
      float m = -INFINITY;
      for (int64_t s = 0; s < job.splits; ++s) {
        const float ms = job.partial[((bh * job.splits + s) * M + r) * ps + D];
        m = ms > m ? ms : m;
      }
      for (int64_t c = 0; c < D; ++c) dst[c] = 0.0f;
      float l = 0.0f;
      for (int64_t s = 0; s < job.splits; ++s) {
        const float* part = job.partial + ((bh * job.splits + s) * M + r) * ps;
        if (part[D] == -INFINITY) continue;
        const float weight = expf(part[D] - m);
        l += weight * part[D + 1];
        for (int64_t c = 0; c < D; ++c) dst[c] += weight * part[c];
      }
      const float inv = 1.0f / l;
      for (int64_t c = 0; c < D; ++c) dst[c] *= inv;
    }
  }
}

// ---- dump --------------------------------------------------------------------------------

constexpr int64_t kDumpHeader = 64;

void put_u16(uint8_t* p, uint16_t x) { p[0] = (uint8_t)x, p[1] = (uint8_t)(x >> 8); }
void put_u32(uint8_t* p, uint32_t x) {
  for (int i = 0; i < 4; ++i) p[i] = (uint8_t)(x >> (8 * i));
}
void put_u64(uint8_t* p, uint64_t x) {
  for (int i = 0; i < 8; ++i) p[i] = (uint8_t)(x >> (8 * i));
}
uint16_t get_u16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }
uint32_t get_u32(const uint8_t* p) {
  uint32_t x = 0;
  for (int i = 3; i >= 0; --i) x = (x << 8) | p[i];
  return x;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t x = 0;
  for (int i = 7; i >= 0; --i) x = (x << 8) | p[i];
  return x;
}

// Copy the used part of tensor i between a capacity buffer and a dense section, either way.
// Used shape [B, heads, rows_used, row_elems] inside capacity [B, heads, rows_cap, row_elems].
void copy_used(const pnmix_layout& L, int i, int64_t seq_len, uint8_t* buffer_bytes, uint8_t* section,
               bool to_section) {
  const TensorShape cap = capacity_shape(L, i), used = used_shape(L, i, seq_len);
  const int64_t row_bytes = used.row_elems * state_elem_bytes(i);
  const int64_t chunk = used.rows * row_bytes;
  if (!chunk) return;
  for (int64_t bh = 0; bh < L.batch * cap.heads; ++bh) {
    uint8_t* a = buffer_bytes + bh * cap.rows * row_bytes;
    uint8_t* s = section + bh * chunk;
    if (to_section)
      memcpy(s, a, chunk);
    else
      memcpy(a, s, chunk);
  }
}

}  // namespace
}  // namespace pnmix

using namespace pnmix;

extern "C" {

int pnmix_core_abi_version(void) { return PNMIX_CORE_ABI_VERSION; }

int64_t pnmix_core_limit(const char* name) {
  static const struct {
    const char* name;
    int64_t value;
  } kLimits[] = {{"max_tokens_field", PNMIX_MAX_TOKENS_FIELD}, {"max_int_field", PNMIX_MAX_INT_FIELD},
                 {"max_batch", PNMIX_MAX_BATCH},   {"max_kv_heads", PNMIX_MAX_KV_HEADS},
                 {"max_head_dim", PNMIX_MAX_HEAD_DIM}, {"max_seq_len", PNMIX_MAX_SEQ_LEN},
                 {"max_state_tensor_bytes", PNMIX_MAX_STATE_TENSOR_BYTES},
                 {"dump_slack_bytes", PNMIX_DUMP_SLACK_BYTES}};
  if (name)
    for (const auto& limit : kLimits)
      if (!strcmp(limit.name, name)) return limit.value;
  return -1;
}

const char* pnmix_last_error(void) { return tls_error.c_str(); }

int pnmix_state_bytes(const pnmix_layout* layout, int64_t nbytes[PNMIX_NUM_STATE]) {
  if (int rc = check_layout(layout)) return rc;
  if (!nbytes) return fail(PNMIX_ERR_NULL, "nbytes pointer is null");
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) nbytes[i] = state_bytes(*layout, i);
  return ok();
}

int pnmix_persistent_bytes(const pnmix_layout* layout, int64_t seq_len, int64_t* out) {
  if (int rc = check_layout(layout)) return rc;
  if (!out) return fail(PNMIX_ERR_NULL, "output pointer is null");
  if (int rc = check_seq_len(*layout, seq_len)) return rc;
  *out = persistent_bytes(*layout, seq_len);
  return ok();
}

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
  const int64_t heads = L.batch * L.kv_heads;
  const bool big = (job.after.groups - job.before.groups) > 0 && heads > 1;
  parallel_for(big ? resolve_threads(0) : 1, heads, append_head, &job);
  if (job.failed) return fail(PNMIX_ERR_INTERNAL, "out of memory for the append scratch");
  return ok();
}

const char* pnmix_attend_isa(void) { return isa_name(best_isa()); }

int pnmix_set_attend_isa(const char* name) {
  if (!name || !strcmp(name, "auto")) {
    forced_isa = Isa::kAuto;
  } else if (!strcmp(name, "scalar")) {
    forced_isa = Isa::kScalar;
  } else if (!strcmp(name, "avx2")) {
    if (!cpu_has_avx2()) return fail(PNMIX_ERR_CONFIG, "this CPU (or build) has no AVX2/FMA/F16C");
    forced_isa = Isa::kAvx2;
  } else if (!strcmp(name, "avx512")) {
    if (!cpu_has_avx512()) return fail(PNMIX_ERR_CONFIG, "this CPU (or build) has no AVX-512F/BW/VL/DQ");
    forced_isa = Isa::kAvx512;
  } else if (!strcmp(name, "avx512vbmi")) {
    if (!cpu_has_avx512vbmi()) return fail(PNMIX_ERR_CONFIG, "this CPU (or build) has no AVX-512 VBMI");
    forced_isa = Isa::kAvx512Vbmi;
  } else {
    return fail(PNMIX_ERR_CONFIG, "unknown kernel '%s'; choose auto, scalar, avx2, avx512 or avx512vbmi", name);
  }
  return ok();
}

static int attend_impl(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len, const void* q,
                       int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const uint16_t* k_new,
                       const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes,
                       int threads) {
  if (int rc = check_layout(layout)) return rc;
  const pnmix_layout& L = *layout;
  if (int rc = check_state(L, state)) return rc;
  if (int rc = check_seq_len(L, seq_len)) return rc;
  const int64_t B = L.batch, H = L.kv_heads, D = L.head_dim;
  if (q_heads < 1 || q_heads > 65536 || q_heads % H)
    return fail(PNMIX_ERR_SIZE, "q_heads %lld must be a positive multiple of kv_heads %lld", (long long)q_heads,
                (long long)H);
  if (n_new < 0 || n_new > ((int64_t)1 << 40))
    return fail(PNMIX_ERR_SIZE, "n_new must be in 0..2^40, got %lld", (long long)n_new);
  const int64_t total = seq_len + n_new;
  if (nq < 0 || nq > total)
    return fail(PNMIX_ERR_SIZE, "nq %lld outside 0..%lld (the queries are the last positions)", (long long)nq,
                (long long)total);
  const int64_t q_elems = product({B, q_heads, nq, D, 4}) < 0 ? -1 : B * q_heads * nq * D;
  if (q_elems < 0) return fail(PNMIX_ERR_SIZE, "q is too large: [B, Hq, nq, D] overflows");
  if (q_bytes != q_elems * (q_is_fp32 ? 4 : 2))
    return fail(PNMIX_ERR_SIZE, "q buffer has %lld bytes, [B, Hq, nq, D] %s needs %lld", (long long)q_bytes,
                q_is_fp32 ? "fp32" : "fp16", (long long)(q_elems * (q_is_fp32 ? 4 : 2)));
  if (product({B, H, n_new, D, 2}) < 0) return fail(PNMIX_ERR_SIZE, "n_new is too large: [B, H, n_new, D] overflows");
  if (new_bytes != B * H * n_new * D * 2)
    return fail(PNMIX_ERR_SIZE, "new K/V buffers have %lld bytes, [B, H, n_new, D] fp16 needs %lld",
                (long long)new_bytes, (long long)(B * H * n_new * D * 2));
  if (out_bytes != q_elems * 4)
    return fail(PNMIX_ERR_SIZE, "out buffer has %lld bytes, [B, Hq, nq, D] fp32 needs %lld", (long long)out_bytes,
                (long long)(q_elems * 4));
  if (nq == 0) return ok();
  if (!q || !out) return fail(PNMIX_ERR_NULL, "q or out pointer is null");
  if (n_new && (!k_new || !v_new)) return fail(PNMIX_ERR_NULL, "k_new or v_new pointer is null");
  if (((uintptr_t)q & (q_is_fp32 ? 3 : 1)) || ((uintptr_t)out & 3) || (((uintptr_t)k_new | (uintptr_t)v_new) & 1))
    return fail(PNMIX_ERR_SIZE, "q, out or new K/V buffer is not aligned to its element size");
  if (seq_len > 0)
    if (int rc = check_pair_mask(L, buffer<const uint8_t>(state, PNMIX_PAIR_MASK), PNMIX_ERR_STATE, "state's"))
      return rc;

  thread_local std::vector<float> q32, partial;
  if ((int64_t)q32.size() < q_elems) q32.resize(q_elems);
  if (q_is_fp32)
    memcpy(q32.data(), q, q_elems * 4);
  else
    for (int64_t i = 0; i < q_elems; ++i) q32[i] = half_to_float(static_cast<const uint16_t*>(q)[i]);

  AttendJob job;
  job.L = L;
  job.n = lengths(L.config, seq_len);
  job.seq_len = seq_len;
  job.n_new = n_new;
  job.total = total;
  job.q_heads = q_heads;
  job.nq = nq;
  job.group_q = q_heads / H;
  job.rows = job.group_q * nq;
  job.scale = (float)(1.0 / sqrt((double)D));
  const int nthreads = attend_threads(L, seq_len, resolve_threads(threads));
  const int64_t heads = B * H;
  int64_t splits = (8 * nthreads + heads - 1) / heads;  // enough items for dynamic balance across threads
  if (splits > job.n.groups) splits = job.n.groups;
  job.splits = splits < 1 ? 1 : splits;
  job.q = q32.data();
  job.state = state_view<false>(state->data);
  job.k_new = k_new;
  job.v_new = v_new;
  const int64_t items = heads * job.splits;
  const int64_t partial_floats = items * job.rows * partial_stride(job);
  if ((int64_t)partial.size() < partial_floats) partial.resize(partial_floats);
  job.partial = partial.data();

  AttendRun run;
  run.job = &job;
  run.fn = item_function(L);
  parallel_for(nthreads, items, run_item, &run);
  if (run.failed) return fail(PNMIX_ERR_INTERNAL, "out of memory for the attention scratch");
  merge_splits(job, out);
  return ok();
}

int pnmix_half_to_float(const uint16_t* src, float* dst, int64_t n) {
  if (n < 0) return fail(PNMIX_ERR_SIZE, "n must be >= 0");
  if (n && (!src || !dst)) return fail(PNMIX_ERR_NULL, "src or dst pointer is null");
  for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
  return ok();
}

int pnmix_float_to_half(const float* src, uint16_t* dst, int64_t n, int saturating) {
  if (n < 0) return fail(PNMIX_ERR_SIZE, "n must be >= 0");
  if (n && (!src || !dst)) return fail(PNMIX_ERR_NULL, "src or dst pointer is null");
  for (int64_t i = 0; i < n; ++i) dst[i] = saturating ? float_to_half_saturating(src[i]) : float_to_half(src[i]);
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

int pnmix_attend(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len, const void* q,
                 int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const uint16_t* k_new,
                 const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes,
                 int threads) {
  try {
    return attend_impl(layout, state, seq_len, q, q_is_fp32, q_heads, nq, q_bytes, k_new, v_new, n_new,
                       new_bytes, out, out_bytes, threads);
  } catch (const std::exception& e) {
    return fail(PNMIX_ERR_INTERNAL, "attention failed: %s", e.what());
  }
}

int pnmix_dump_size(const pnmix_layout* layout, int64_t seq_len, int64_t* out) {
  if (int rc = check_layout(layout)) return rc;
  if (!out) return fail(PNMIX_ERR_NULL, "output pointer is null");
  if (int rc = check_seq_len(*layout, seq_len)) return rc;
  *out = kDumpHeader + persistent_bytes(*layout, seq_len);
  return ok();
}

int pnmix_dump_write(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len, uint8_t* out,
                     int64_t out_bytes, int64_t* written) {
  if (int rc = check_layout(layout)) return rc;
  const pnmix_layout& L = *layout;
  if (int rc = check_state(L, state)) return rc;
  if (int rc = check_seq_len(L, seq_len)) return rc;
  if (!out) return fail(PNMIX_ERR_NULL, "output pointer is null");
  const int64_t size = kDumpHeader + persistent_bytes(L, seq_len);
  if (out_bytes < size)
    return fail(PNMIX_ERR_SIZE, "dump needs %lld bytes, the output buffer has %lld", (long long)size,
                (long long)out_bytes);
  const pnmix_config& c = L.config;
  memset(out, 0, kDumpHeader);
  memcpy(out, "PNKV", 4);
  put_u16(out + 4, 1);
  put_u16(out + 6, (uint16_t)kDumpHeader);
  put_u32(out + 8, (uint32_t)c.group_size);
  put_u32(out + 12, (uint32_t)c.residual_size);
  put_u32(out + 16, (uint32_t)c.sink_tokens);
  put_u32(out + 20, (uint32_t)c.value_group_size);
  out[24] = (uint8_t)c.value_bits;
  out[25] = (uint8_t)c.key_high_bits;
  out[26] = (uint8_t)c.key_low_bits;
  out[27] = (uint8_t)c.pair_layout;
  put_u32(out + 28, (uint32_t)L.batch);
  put_u32(out + 32, (uint32_t)L.kv_heads);
  put_u32(out + 36, (uint32_t)L.head_dim);
  uint64_t ratio_bits;
  memcpy(&ratio_bits, &c.high_ratio, 8);
  put_u64(out + 44, ratio_bits);
  put_u64(out + 52, (uint64_t)seq_len);
  int64_t cursor = kDumpHeader;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    copy_used(L, i, seq_len, static_cast<uint8_t*>(state->data[i]), out + cursor, true);
    cursor += shape_bytes(L, i, used_shape(L, i, seq_len));
  }
  if (written) *written = cursor;
  return ok();
}

int pnmix_dump_header(const uint8_t* blob, int64_t size, pnmix_layout* layout, int64_t* seq_len) {
  if (!blob || !layout || !seq_len) return fail(PNMIX_ERR_NULL, "blob, layout or seq_len pointer is null");
  if (size < kDumpHeader)
    return fail(PNMIX_ERR_DUMP, "pnkv dump too short: %lld bytes, header needs %lld", (long long)size,
                (long long)kDumpHeader);
  if (memcmp(blob, "PNKV", 4)) return fail(PNMIX_ERR_DUMP, "not a pnkv dump: bad magic");
  if (get_u16(blob + 4) != 1 || get_u16(blob + 6) != kDumpHeader)
    return fail(PNMIX_ERR_DUMP, "unsupported pnkv dump version %u (header %u bytes)", get_u16(blob + 4),
                get_u16(blob + 6));
  if (get_u32(blob + 40) || get_u32(blob + 60))
    return fail(PNMIX_ERR_DUMP, "pnkv dump has non-zero reserved header fields (%u, %u)", get_u32(blob + 40),
                get_u32(blob + 60));
  // u32 config fields must survive the cast to int32 (pnmix/config.py's rule); their other limits
  // are config_error's, below
  const uint32_t fields[] = {get_u32(blob + 8), get_u32(blob + 12), get_u32(blob + 16), get_u32(blob + 20)};
  const char* const names[] = {"group_size", "residual_size", "sink_tokens", "value_group_size"};
  for (int i = 0; i < 4; ++i)
    if (fields[i] > (uint32_t)PNMIX_MAX_INT_FIELD)
      return fail(PNMIX_ERR_DUMP, "pnkv dump header: config field '%s' = %u does not fit in int32", names[i],
                  fields[i]);
  pnmix_layout L;
  L.config.group_size = (int32_t)fields[0];
  L.config.residual_size = (int32_t)fields[1];
  L.config.sink_tokens = (int32_t)fields[2];
  L.config.value_group_size = (int32_t)fields[3];
  L.config.value_bits = blob[24];
  L.config.key_high_bits = blob[25];
  L.config.key_low_bits = blob[26];
  L.config.pair_layout = blob[27];
  if (blob[27] > 1) return fail(PNMIX_ERR_DUMP, "pnkv dump has an unknown pair_layout code %u", blob[27]);
  L.batch = get_u32(blob + 28);
  L.kv_heads = get_u32(blob + 32);
  L.head_dim = get_u32(blob + 36);
  const uint64_t ratio_bits = get_u64(blob + 44);
  memcpy(&L.config.high_ratio, &ratio_bits, 8);
  const uint64_t n = get_u64(blob + 52);
  if (n > (uint64_t)PNMIX_MAX_SEQ_LEN)
    return fail(PNMIX_ERR_DUMP, "pnkv dump claims an implausible seq_len %llu", (unsigned long long)n);
  L.max_seq_len = n > 0 ? (int64_t)n : 1;
  if (const char* bad = layout_error(L)) return fail(PNMIX_ERR_DUMP, "pnkv dump header: %s", bad);
  // A reader allocates the state at capacity; a 64-byte header must not make it allocate far more
  // than the file holds (full sink and residual rows may exceed the file by the slack).
  int64_t capacity = 0;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) capacity += state_bytes(L, i);
  if (capacity - PNMIX_DUMP_SLACK_BYTES > size)
    return fail(PNMIX_ERR_DUMP, "pnkv dump header describes a %lld-byte state for a %lld-byte blob: implausible",
                (long long)capacity, (long long)size);
  const int64_t expected = kDumpHeader + persistent_bytes(L, (int64_t)n);
  if (size != expected)
    return fail(PNMIX_ERR_DUMP, "pnkv dump size mismatch: header describes %lld bytes, blob has %lld",
                (long long)expected, (long long)size);
  // the pair mask is the last section (B * MB bytes, present once N > 0)
  if (n > 0)
    if (int rc = check_pair_mask(L, blob + size - L.batch * mask_bytes(L), PNMIX_ERR_DUMP, "pnkv dump's"))
      return rc;
  *layout = L;
  *seq_len = (int64_t)n;
  return ok();
}

int pnmix_dump_read(const uint8_t* blob, int64_t size, const pnmix_layout* layout, pnmix_state* state,
                    int64_t* seq_len) {
  pnmix_layout dumped;
  int64_t n = 0;
  if (int rc = pnmix_dump_header(blob, size, &dumped, &n)) return rc;
  if (int rc = check_layout(layout)) return rc;
  const pnmix_layout& L = *layout;
  if (int rc = check_state(L, state)) return rc;
  if (memcmp(&dumped.config, &L.config, sizeof L.config) || dumped.batch != L.batch ||
      dumped.kv_heads != L.kv_heads || dumped.head_dim != L.head_dim)
    return fail(PNMIX_ERR_DUMP, "pnkv dump's config or shape differs from the target layout");
  if (n > L.max_seq_len)
    return fail(PNMIX_ERR_CAPACITY, "pnkv dump holds %lld tokens, the target capacity is %lld", (long long)n,
                (long long)L.max_seq_len);
  int64_t cursor = kDumpHeader;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    if (state->nbytes[i]) memset(state->data[i], 0, state->nbytes[i]);
    copy_used(L, i, n, static_cast<uint8_t*>(state->data[i]), const_cast<uint8_t*>(blob) + cursor, false);
    cursor += shape_bytes(L, i, used_shape(L, i, n));
  }
  if (seq_len) *seq_len = n;
  return ok();
}

}  // extern "C"
