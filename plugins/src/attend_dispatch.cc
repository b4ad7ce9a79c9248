// libpnmix_core: pnmix_attend (pnmix_core.h): the checks, the choice of kernel by instruction set
// (cpuid; pnmix_set_attend_isa forces one), the work split over threads and the merge of the
// splits. The kernels themselves are attend_*.cc (attend_kernel.inc).
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <exception>
#include <string>
#include <vector>

#if defined(PNMIX_HAVE_X86_KERNELS)
#include <cpuid.h>
#endif

#include "attend.h"
#include "core_internal.h"
#include "pnmix/format.h"
#include "pnmix/half.h"
#include "pool.h"
#include "scratch.h"
#if defined(PNMIX_HAVE_X86_KERNELS)
#include "probe.h"
#endif

namespace pnmix {
namespace core {
namespace {

typedef void (*ItemFn)(const AttendJob&, int64_t);

enum class Isa { kAuto, kScalar, kAvx2, kAvx512, kAvx512Vbmi, kAvx512Vnni };
Isa forced_isa = Isa::kAuto;

// F16C from cpuid leaf 1 (not every compiler's __builtin_cpu_supports knows "f16c"); the OS's
// saving of the AVX registers is covered by the "avx2" check. Asked once: in a virtual machine
// cpuid traps to the hypervisor (11 us on this project's Firecracker VM), and every attention call
// asks which kernel to run.
bool cpu_has_f16c() {
#if defined(PNMIX_HAVE_X86_KERNELS)
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  }();
  return has;
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

bool cpu_has_avx512vnni() {
#if defined(PNMIX_HAVE_X86_KERNELS)
  return cpu_has_avx512vbmi() && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// Where the kernels' read-ahead puts the next group's lines (ReadAhead in attend_kernel.inc). AMD's
// Zen 4 takes prefetcht1 into L2 (new in Zen 4; AMD's earlier cores filled L1 for every hint, so
// there the choice should change nothing): the lines no longer hold the core's few L1 miss buffers
// while they come. On a Zen 4 EPYC the 32K int8 step was 4-10% faster, and over a paged cache the
// memory waits fell from 22-39% of the step to 12-14% (docs/BENCHMARKS.md 2.16). Intel cores keep
// prefetcht0, the hint their read-ahead was tuned with (docs/BENCHMARKS.md 2.12). Asked once.
bool cpu_reads_ahead_to_l2() {
#if defined(PNMIX_HAVE_X86_KERNELS)
  static const bool amd = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(0, &eax, &ebx, &ecx, &edx) && ebx == 0x68747541u && edx == 0x69746e65u &&
           ecx == 0x444d4163u;  // "AuthenticAMD"
  }();
  return amd;
#else
  return false;
#endif
}

// The fp32 path's kernel.
Isa best_isa() {
  if (forced_isa != Isa::kAuto) return forced_isa;
  if (cpu_has_avx512vbmi()) return Isa::kAvx512Vbmi;
  if (cpu_has_avx512()) return Isa::kAvx512;
  if (cpu_has_avx2()) return Isa::kAvx2;
  return Isa::kScalar;
}

// The arithmetic of the packed groups: exact fp32 (the default) or the integer path
// (attend_int8.inc), which the AVX-512 VNNI kernel runs where the CPU has it and the AVX2 kernel
// elsewhere. PNMIX_ATTEND_ARITH=int8 chooses it for a process
// (so it reaches every binding: Python, the ONNX Runtime op, a C++ app); pnmix_set_attend_arith
// overrides it.
// A value of the variable other than fp32 or int8 (a typo) is kInvalid: every attention then fails
// naming it, rather than running an arithmetic the user did not ask for.
enum class Arith { kUnset, kFp32, kInt8, kInvalid };
Arith forced_arith = Arith::kUnset;

Arith requested_arith() {
  if (forced_arith != Arith::kUnset) return forced_arith;
  const char* env = getenv("PNMIX_ATTEND_ARITH");
  if (!env || !*env || !strcmp(env, "fp32")) return Arith::kFp32;
  return !strcmp(env, "int8") ? Arith::kInt8 : Arith::kInvalid;
}

bool int8_requested() { return requested_arith() == Arith::kInt8 && cpu_has_avx2() && forced_isa != Isa::kScalar; }

// The halves the integer path takes for this layout ({keys, values}), none unless requested and the
// CPU has the AVX2 kernel.
struct Int8Halves {
  bool keys = false, values = false;
};
Int8Halves int8_halves(const pnmix_layout& L) {
  Int8Halves h;
  if (!int8_requested()) return h;
  h.keys = int8_keys_supported(L);
  h.values = int8_values_supported(L);
  return h;
}

const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512Vnni   ? "avx512vnni"
         : isa == Isa::kAvx512Vbmi ? "avx512vbmi"
         : isa == Isa::kAvx512     ? "avx512"
         : isa == Isa::kAvx2       ? "avx2"
                                   : "scalar";
}

bool is_avx512(Isa isa) { return isa == Isa::kAvx512 || isa == Isa::kAvx512Vbmi || isa == Isa::kAvx512Vnni; }

// The integer path's kernel: the VNNI one unless AVX2 is forced or the CPU lacks VNNI (a forced
// avx512 or avx512vbmi runs the AVX2 pair kernel, the one those CPUs have).
Isa int8_isa() {
  const bool vnni = forced_isa == Isa::kAuto || forced_isa == Isa::kAvx512Vnni;
  return vnni && cpu_has_avx512vnni() ? Isa::kAvx512Vnni : Isa::kAvx2;
}

ItemFn item_function(const pnmix_layout& L, const Int8Halves& int8) {
  Isa isa = int8.keys || int8.values ? int8_isa() : best_isa();
#if defined(PNMIX_HAVE_X86_KERNELS)
  if (is_avx512(isa) && L.config.group_size % 16) isa = Isa::kAvx2;  // 16-token chunks need gs % 16
  if (isa == Isa::kAvx512Vnni) return attend_item_avx512vnni;
  if (isa == Isa::kAvx512Vbmi) return attend_item_avx512vbmi;
  if (isa == Isa::kAvx512) return attend_item_avx512;
  if (isa == Isa::kAvx2) return attend_item_avx2;
#else
  (void)L;
  (void)isa;
#endif
  return attend_item_generic;
}

// Combine the splits of each (sequence, KV head) and query row: log-sum-exp of partial softmaxes.
void merge_splits(const AttendJob& job, float* out) {
  const int64_t D = job.L.head_dim, M = job.rows, H = job.L.kv_heads;
  for (int64_t bh = 0; bh < job.L.batch * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t r = 0; r < M; ++r) {
      const int64_t g = r / job.nq, i = r % job.nq;
      float* dst = out + ((b * job.q_heads + h * job.group_q + g) * job.nq + i) * D;
      float m = -INFINITY;
      for (int64_t s = 0; s < job.splits; ++s) {
        const float ms = partial_row(job, bh, s, r)[D];
        m = ms > m ? ms : m;
      }
      for (int64_t c = 0; c < D; ++c) dst[c] = 0.0f;
      float l = 0.0f;
      for (int64_t s = 0; s < job.splits; ++s) {
        const float* part = partial_row(job, bh, s, r);
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

}  // namespace
}  // namespace core
}  // namespace pnmix

using namespace pnmix;
using namespace pnmix::core;

extern "C" {

const char* pnmix_attend_isa(void) { return isa_name(int8_requested() ? int8_isa() : best_isa()); }

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
  } else if (!strcmp(name, "avx512vnni")) {
    if (!cpu_has_avx512vnni()) return fail(PNMIX_ERR_CONFIG, "this CPU (or build) has no AVX-512 VBMI and VNNI");
    forced_isa = Isa::kAvx512Vnni;
  } else {
    return fail(PNMIX_ERR_CONFIG, "unknown kernel '%s'; choose auto, scalar, avx2, avx512, avx512vbmi or avx512vnni",
                name);
  }
  return ok();
}

const char* pnmix_attend_arith(void) {
  const Arith a = requested_arith();
  return a == Arith::kInt8 ? "int8" : a == Arith::kInvalid ? "invalid" : "fp32";
}

int pnmix_set_attend_arith(const char* name) {
  if (!name || !strcmp(name, "auto")) {
    forced_arith = Arith::kUnset;
  } else if (!strcmp(name, "fp32")) {
    forced_arith = Arith::kFp32;
  } else if (!strcmp(name, "int8")) {
    if (!cpu_has_avx2()) return fail(PNMIX_ERR_CONFIG, "the int8 attention needs AVX2/FMA/F16C, which this CPU (or build) lacks");
    forced_arith = Arith::kInt8;
  } else {
    return fail(PNMIX_ERR_CONFIG, "unknown attention arithmetic '%s'; choose auto, fp32 or int8", name);
  }
  return ok();
}

const char* pnmix_attend_arith_for(const pnmix_layout* layout) {
  if (!layout || layout_error(*layout)) return "fp32";
  const Int8Halves h = int8_halves(*layout);
  return h.keys && h.values ? "int8" : h.keys ? "int8 keys, fp32 values" : h.values ? "fp32 keys, int8 values" : "fp32";
}

namespace {
struct ProbeRun {
  double (*loop)(int64_t iterations) = nullptr;
  int64_t iterations;
  std::atomic<double> madds{0.0};
};
void run_probe(void* ctx, int64_t) {
#if defined(PNMIX_HAVE_X86_KERNELS)
  ProbeRun& run = *static_cast<ProbeRun*>(ctx);
  const double done = run.loop(run.iterations);
  double seen = run.madds.load();
  while (!run.madds.compare_exchange_weak(seen, seen + done)) {
  }
#else
  (void)ctx;
#endif
}
}  // namespace

int pnmix_madd_rate(const char* kind, int threads, int64_t iterations, double* madds) {
  if (!kind || !madds) return fail(PNMIX_ERR_NULL, "kind or madds pointer is null");
  const bool int8 = !strcmp(kind, "int8");
  if (!int8 && strcmp(kind, "fp32")) return fail(PNMIX_ERR_CONFIG, "unknown multiply-add kind '%s'; choose fp32 or int8", kind);
  if (iterations < 1 || iterations > ((int64_t)1 << 40))
    return fail(PNMIX_ERR_SIZE, "iterations must be in 1..2^40, got %lld", (long long)iterations);
  if (!cpu_has_avx2()) return fail(PNMIX_ERR_CONFIG, "the multiply-add probe needs AVX2/FMA, which this CPU (or build) lacks");
  const int n = resolve_threads(threads);
  ProbeRun run;
#if defined(PNMIX_HAVE_X86_KERNELS)  // the instructions of the kernel the arithmetic runs on
  run.loop = int8 ? (int8_isa() == Isa::kAvx512Vnni ? int8_madds_vnni : int8_madds)
                  : (is_avx512(best_isa()) ? fp32_madds_avx512 : fp32_madds);
#endif
  run.iterations = iterations;
  parallel_for(n, n, run_probe, &run);
  *madds = run.madds.load();
  return ok();
}

namespace {

// A paged state for layout L at seq_len, checked: a one-line error, or PNMIX_OK with pages[g] the
// page of group g (its KV head 0 part) for every group the sequence has.
int check_paged(const pnmix_layout& L, const pnmix_paged_state* p, int64_t seq_len,
                std::vector<const uint8_t*>& pages) {
  if (!p) return fail(PNMIX_ERR_NULL, "paged state pointer is null");
  if (L.batch != 1)
    return fail(PNMIX_ERR_CONFIG, "a paged attention is of one sequence: layout batch must be 1, got %lld",
                (long long)L.batch);
  const int64_t gs = L.config.group_size, H = L.kv_heads;
  if (p->block_size != gs)
    return fail(PNMIX_ERR_CONFIG, "paged state block_size %lld must equal group_size %lld (a full block is one group)",
                (long long)p->block_size, (long long)gs);
  const int64_t group = group_sections(L).total;
  if (p->head_bytes < group || p->head_bytes > ((int64_t)1 << 40) || (p->head_bytes & 1))
    return fail(PNMIX_ERR_SIZE, "paged state head_bytes %lld must be even and at least a group's %lld bytes",
                (long long)p->head_bytes, (long long)group);
  if (p->page_bytes < H * p->head_bytes || p->page_bytes > ((int64_t)1 << 50) || (p->page_bytes & 1))
    return fail(PNMIX_ERR_SIZE, "paged state page_bytes %lld must be even and at least kv_heads * head_bytes = %lld",
                (long long)p->page_bytes, (long long)(H * p->head_bytes));
  if (p->num_blocks < 0 || product({p->num_blocks, p->page_bytes}) < 0)
    return fail(PNMIX_ERR_SIZE, "paged state num_blocks %lld is negative or its pages overflow", (long long)p->num_blocks);
  if (p->block_id_bytes != 4 && p->block_id_bytes != 8)
    return fail(PNMIX_ERR_CONFIG, "paged state block_id_bytes must be 4 (int32) or 8 (int64), got %lld",
                (long long)p->block_id_bytes);
  const struct {
    const char* name;
    const void* data;
    int64_t nbytes;
    int index;
  } slot[] = {{"sink_k", p->sink_k, p->sink_bytes, PNMIX_SINK_K},
              {"sink_v", p->sink_v, p->sink_bytes, PNMIX_SINK_V},
              {"residual_k", p->residual_k, p->residual_bytes, PNMIX_RESIDUAL_K},
              {"residual_v", p->residual_v, p->residual_bytes, PNMIX_RESIDUAL_V},
              {"pair_mask", p->pair_mask, p->mask_bytes, PNMIX_PAIR_MASK}};
  for (const auto& t : slot) {
    const int64_t want = state_bytes(L, t.index);
    if (t.nbytes != want)
      return fail(PNMIX_ERR_SIZE, "paged state's '%s' has %lld bytes, the layout needs %lld", t.name,
                  (long long)t.nbytes, (long long)want);
    if (want && !t.data) return fail(PNMIX_ERR_NULL, "paged state's '%s' pointer is null", t.name);
    if (state_elem_bytes(t.index) == 2 && ((uintptr_t)t.data & 1))
      return fail(PNMIX_ERR_SIZE, "paged state's '%s' is not 2-byte aligned", t.name);
  }
  const int64_t need = (seq_len + gs - 1) / gs;
  if (p->table_blocks < need || p->table_blocks > ((int64_t)1 << 40))
    return fail(PNMIX_ERR_SIZE, "the block table has %lld blocks, %lld tokens need %lld", (long long)p->table_blocks,
                (long long)seq_len, (long long)need);
  const int64_t groups = lengths(L.config, seq_len).groups;
  pages.resize(groups);
  if (!groups) return PNMIX_OK;
  if (!p->pages || !p->block_table) return fail(PNMIX_ERR_NULL, "paged state's pages or block_table pointer is null");
  if (((uintptr_t)p->pages & 1) || ((uintptr_t)p->block_table & (p->block_id_bytes - 1)))
    return fail(PNMIX_ERR_SIZE, "paged state's pages (2 bytes) or block_table (its ids) is not aligned");
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t at = page_block_of_group(L.config, g);
    const int64_t id = p->block_id_bytes == 4 ? (int64_t) static_cast<const int32_t*>(p->block_table)[at]
                                              : static_cast<const int64_t*>(p->block_table)[at];
    if (id < 0 || id >= p->num_blocks)
      return fail(PNMIX_ERR_SIZE, "block table entry %lld (group %lld) is block %lld, outside 0..%lld", (long long)at,
                  (long long)g, (long long)id, (long long)p->num_blocks - 1);
    pages[g] = p->pages + id * p->page_bytes;
  }
  return PNMIX_OK;
}

}  // namespace

namespace {

// One sequence of a call, checked and resolved: its job and the scratch the job points into
// (kept between calls per thread, so a decode step allocates nothing once warm).
struct SeqRun {
  AttendJob job;
  std::vector<float> q32, partial;
  std::vector<const uint8_t*> pages;
  float* out = nullptr;
  bool empty = false;  // nq == 0: nothing to compute
  int64_t first_item = 0, items = 0;
};

// q_is_fp32 is one of generated.h's PNMIX_QUERY_* encodings.
int check_query_encoding(int q_is_fp32) {
  if (q_is_fp32 < 0 || q_is_fp32 >= PNMIX_NUM_QUERY_ENCODINGS)
    return fail(PNMIX_ERR_CONFIG, "q_is_fp32 %d: the query encodings are 0 (fp16), 1 (fp32) and 2 (fp32 rounded to fp16)",
                q_is_fp32);
  return PNMIX_OK;
}

// Check one sequence's arguments and resolve its job, all but the work split (split_run).
// Exactly one of state (contiguous) and paged is given.
int prepare_run(const pnmix_layout& L, const pnmix_state* state, const pnmix_paged_state* paged, int64_t seq_len,
                const void* q, int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const uint16_t* k_new,
                const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes,
                SeqRun& run) {
  if (paged) {
    if (int rc = check_seq_len(L, seq_len)) return rc;
    if (int rc = check_paged(L, paged, seq_len, run.pages)) return rc;
  } else {
    if (int rc = check_state(L, state)) return rc;
    if (int rc = check_seq_len(L, seq_len)) return rc;
  }
  const int64_t B = L.batch, H = L.kv_heads, D = L.head_dim;
  if (int rc = check_query_encoding(q_is_fp32)) return rc;
  const int q_element = q_is_fp32 == PNMIX_QUERY_FP16 ? 2 : 4;
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
  if (q_bytes != q_elems * q_element)
    return fail(PNMIX_ERR_SIZE, "q buffer has %lld bytes, [B, Hq, nq, D] %s needs %lld", (long long)q_bytes,
                q_element == 4 ? "fp32" : "fp16", (long long)(q_elems * q_element));
  if (product({B, H, n_new, D, 2}) < 0) return fail(PNMIX_ERR_SIZE, "n_new is too large: [B, H, n_new, D] overflows");
  if (new_bytes != B * H * n_new * D * 2)
    return fail(PNMIX_ERR_SIZE, "new K/V buffers have %lld bytes, [B, H, n_new, D] fp16 needs %lld",
                (long long)new_bytes, (long long)(B * H * n_new * D * 2));
  if (out_bytes != q_elems * 4)
    return fail(PNMIX_ERR_SIZE, "out buffer has %lld bytes, [B, Hq, nq, D] fp32 needs %lld", (long long)out_bytes,
                (long long)(q_elems * 4));
  run.empty = nq == 0;
  run.items = 0;
  if (run.empty) return PNMIX_OK;
  if (!q || !out) return fail(PNMIX_ERR_NULL, "q or out pointer is null");
  if (n_new && (!k_new || !v_new)) return fail(PNMIX_ERR_NULL, "k_new or v_new pointer is null");
  if (((uintptr_t)q & (q_element - 1)) || ((uintptr_t)out & 3) || (((uintptr_t)k_new | (uintptr_t)v_new) & 1))
    return fail(PNMIX_ERR_SIZE, "q, out or new K/V buffer is not aligned to its element size");
  if (seq_len > 0)
    if (int rc = check_pair_mask(L, paged ? paged->pair_mask : buffer<const uint8_t>(state, PNMIX_PAIR_MASK),
                                 PNMIX_ERR_STATE, "state's"))
      return rc;

  float* q32 = ensure(run.q32, q_elems);
  if (q_is_fp32 == PNMIX_QUERY_FP32) {
    memcpy(q32, q, q_elems * 4);
  } else if (q_is_fp32 == PNMIX_QUERY_FP32_AS_FP16) {
    const float* f = static_cast<const float*>(q);
    for (int64_t i = 0; i < q_elems; ++i) q32[i] = half_to_float(float_to_half(f[i]));
  } else
    for (int64_t i = 0; i < q_elems; ++i) q32[i] = half_to_float(static_cast<const uint16_t*>(q)[i]);

  AttendJob& job = run.job;
  job = AttendJob{};
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
  const Int8Halves int8 = int8_halves(L);
  job.int8_keys = int8.keys;
  job.int8_values = int8.values;
  job.read_ahead_to_l2 = cpu_reads_ahead_to_l2();
  job.q = run.q32.data();
  if (paged) {
    job.state = StateView<false>{};
    job.state.sink_k = paged->sink_k;
    job.state.sink_v = paged->sink_v;
    job.state.residual_k = paged->residual_k;
    job.state.residual_v = paged->residual_v;
    job.state.pair_mask = paged->pair_mask;
    job.group_pages = run.pages.data();
    job.head_bytes = paged->head_bytes;
    job.sections = group_sections(L);
  } else {
    job.state = state_view<false>(state->data);
  }
  job.k_new = k_new;
  job.v_new = v_new;
  run.out = out;
  return PNMIX_OK;
}

// What a sequence asks of the threads, in threads' worth (attend_threads' two measures; awake: for a
// caller's threads, already awake).
double run_work(const SeqRun& run, bool awake = false) {
  if (run.empty) return 0.0;
  const AttendJob& job = run.job;
  return (double)persistent_bytes(job.L, job.seq_len) / (awake ? kMinBytesPerAwakeThread : kMinBytesPerThread) +
         (double)dense_macs(job, job.L.batch) / kMinDenseMacsPerThread;
}

// split_run's floor, in groups x head_dim x query rows: 32 groups of SmolLM2's heads (head dim 64,
// 3 rows a KV head), about 25 us of a thread's work against an item's 2-3 us of its own. The bench
// shape's groups (head dim 128, 4 rows) need 12; a chunk of many queries, 1.
constexpr int64_t kMinSplitWork = 32 * 64 * 3;

// Split a sequence's work into about `wanted` items: its groups into splits (merged by
// log-sum-exp), then, for a chunk of many queries, its rows into blocks that each read every key
// (so a short cache with a long chunk still fills the threads).
void split_run(SeqRun& run, int64_t wanted) {
  AttendJob& job = run.job;
  const int64_t heads = job.L.batch * job.L.kv_heads;
  int64_t splits = (wanted + heads - 1) / heads;
  // no split of less than kMinSplitWork, but a quarter of the items wanted (two a thread)
  // whatever their size: an item's fixed cost (its rows' set-up, the integer path's channel order,
  // a partial row to merge) is that of a few groups. Where that floor decides, the items fill whole
  // rounds of the threads (SmolLM2's 3 heads on 4 threads: 12 items, not 9 with a last round of one)
  const int64_t quarter = (wanted / 4 + heads - 1) / heads;
  const int64_t group_work = job.L.head_dim * job.rows;  // rows >= 1: run_batch splits no empty run
  const int64_t by_size = job.n.groups / ((kMinSplitWork + group_work - 1) / group_work);
  const int64_t most = by_size > quarter ? by_size : quarter;
  if (splits > most) {
    splits = most;
    const int64_t threads = wanted / 8;  // run_batch's 8 items a thread (a batch's run: its share)
    if (threads > 1) splits = ((heads * most + threads - 1) / threads * threads + heads - 1) / heads;
  }
  if (splits > job.n.groups) splits = job.n.groups;
  job.splits = splits < 1 ? 1 : splits;
  int64_t row_blocks = (wanted + heads * job.splits - 1) / (heads * job.splits);
  if (row_blocks > job.rows / kMinRowsPerBlock) row_blocks = job.rows / kMinRowsPerBlock;
  job.row_blocks = row_blocks < 1 ? 1 : row_blocks;
  run.items = heads * job.splits * job.row_blocks;
  const int64_t partial_floats = heads * job.splits * job.rows * partial_stride(job);
  // rows on cache-line boundaries (partial_stride): the vector's start rounded up to a line
  float* base = ensure(run.partial, partial_floats + kFloatsPerLine);
  job.partial = base + (-(reinterpret_cast<uintptr_t>(base) / sizeof(float)) & (kFloatsPerLine - 1));
}

// The work items of several sequences in one parallel-for: item i belongs to the run whose
// [first_item, first_item + items) holds it.
struct BatchRun {
  SeqRun* runs;
  int64_t count;
  ItemFn fn;
  std::atomic<bool> failed{false};  // scratch allocation failed in some thread
};

void run_batch_item(void* ctx, int64_t item) {
  BatchRun& batch = *static_cast<BatchRun*>(ctx);
  int64_t lo = 0, hi = batch.count - 1;  // the last run whose first item is <= item
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (batch.runs[mid].first_item <= item) lo = mid; else hi = mid - 1;
  }
  const SeqRun& run = batch.runs[lo];
  try {
    batch.fn(run.job, item - run.first_item);
  } catch (const std::exception&) {  // never let an exception cross the C ABI or kill a worker
    batch.failed = true;
  }
}

// Split the prepared runs for `nthreads` threads (8 items per thread, shared in proportion to each
// run's work; fewer where split_run's floor of groups a split stops it), run every item, merge each
// run's splits into its output.
int run_batch(const pnmix_layout& L, SeqRun* runs, int64_t count, int nthreads, pnmix_parallel_for runner,
              void* runner_ctx) {
  const bool awake = runner != nullptr;  // the measure the thread count came from
  double total_work = 0.0;
  int64_t live = 0;
  for (int64_t i = 0; i < count; ++i) total_work += run_work(runs[i], awake), live += !runs[i].empty;
  if (!live) return ok();
  // enough items for dynamic balance across threads; one thread gains nothing from splits, and each
  // costs its partial rows' set-up and merge (a chunk's thousands of rows: megabytes)
  const int64_t wanted = nthreads > 1 ? 8 * (int64_t)nthreads : 1;
  int64_t items = 0;
  for (int64_t i = 0; i < count; ++i) {
    SeqRun& run = runs[i];
    run.first_item = items;
    if (run.empty) continue;
    const double share = total_work > 0.0 ? run_work(run, awake) / total_work : 1.0 / (double)live;
    const double mine = ceil((double)wanted * share);
    split_run(run, mine < 1.0 ? 1 : mine > (double)wanted ? wanted : (int64_t)mine);
    items += run.items;
  }
  BatchRun batch;
  batch.runs = runs;
  batch.count = count;
  batch.fn = item_function(L, int8_halves(L));
  if (runner && nthreads > 1) {
    if (runner(runner_ctx, run_batch_item, &batch, items) != 0)
      return fail(PNMIX_ERR_INTERNAL, "the caller's parallel-for did not run the attention's work items");
  } else {
    parallel_for(nthreads, items, run_batch_item, &batch);
  }
  if (batch.failed) return fail(PNMIX_ERR_INTERNAL, "out of memory for the attention scratch");
  for (int64_t i = 0; i < count; ++i)
    if (!runs[i].empty) merge_splits(runs[i].job, runs[i].out);
  return ok();
}

// New K/V as the append takes them, fp16 bits: fp32 ones rounded into `scratch` (pnmix_float_to_half's
// rounding), fp16 ones as given. PNMIX_ERR_VALUE when one is not finite in fp16: an infinity would
// saturate a group's step and quantize silently, and a NaN's codes depend on the conversion.
int fp16_new_kv(const void* src, bool is_fp32, int64_t count, std::vector<uint16_t>& scratch, const char* what,
                const uint16_t** out) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  if (is_fp32) {
    uint16_t* rounded = ensure(scratch, count);
    const float* f = static_cast<const float*>(src);
    for (int64_t i = 0; i < count; ++i) rounded[i] = float_to_half(f[i]);
    h = rounded;
  }
  bool finite = true;
  for (int64_t i = 0; i < count; ++i) finite &= half_is_finite(h[i]);
  if (!finite)
    return fail(PNMIX_ERR_VALUE, "new %s hold a value that is not finite in fp16 (NaN, Inf, or a magnitude of 65520 or more)",
                what);
  *out = h;
  return PNMIX_OK;
}

int check_arith() {
  if (requested_arith() == Arith::kInvalid)
    return fail(PNMIX_ERR_CONFIG, "PNMIX_ATTEND_ARITH is '%s'; set it to fp32 or int8 (or unset it)",
                getenv("PNMIX_ATTEND_ARITH"));
  return PNMIX_OK;
}

}  // namespace

// Exactly one of state (contiguous) and paged is given.
static int attend_impl(const pnmix_layout* layout, const pnmix_state* state, const pnmix_paged_state* paged,
                       int64_t seq_len, const void* q, int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes,
                       const uint16_t* k_new, const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out,
                       int64_t out_bytes, int threads, pnmix_parallel_for runner, void* runner_ctx) {
  if (int rc = check_layout(layout)) return rc;
  if (int rc = check_arith()) return rc;
  const pnmix_layout& L = *layout;
  thread_local SeqRun run;
  if (int rc = prepare_run(L, state, paged, seq_len, q, q_is_fp32, q_heads, nq, q_bytes, k_new, v_new, n_new,
                           new_bytes, out, out_bytes, run))
    return rc;
  if (run.empty) return ok();
  const int nthreads =
      attend_threads(L, seq_len, resolve_threads(threads), runner != nullptr, dense_macs(run.job, L.batch));
  return run_batch(L, &run, 1, nthreads, runner, runner_ctx);
}

int pnmix_attend(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len, const void* q,
                 int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const uint16_t* k_new,
                 const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes,
                 int threads) {
  return pnmix_attend_on(layout, state, seq_len, q, q_is_fp32, q_heads, nq, q_bytes, k_new, v_new, n_new, new_bytes,
                         out, out_bytes, threads, nullptr, nullptr);
}

int pnmix_attend_on(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len, const void* q,
                    int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const uint16_t* k_new,
                    const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes,
                    int threads, pnmix_parallel_for runner, void* runner_ctx) {
  try {
    return attend_impl(layout, state, nullptr, seq_len, q, q_is_fp32, q_heads, nq, q_bytes, k_new, v_new, n_new,
                       new_bytes, out, out_bytes, threads, runner, runner_ctx);
  } catch (const std::exception& e) {
    return fail(PNMIX_ERR_INTERNAL, "attention failed: %s", e.what());
  }
}

int pnmix_attend_append(const pnmix_layout* layout, pnmix_state* state, int64_t seq_len, const void* q, int q_is_fp32,
                        int64_t q_heads, int64_t nq, int64_t q_bytes, const void* k_new, const void* v_new,
                        int new_is_fp32, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes, int threads) {
  return pnmix_attend_append_on(layout, state, seq_len, q, q_is_fp32, q_heads, nq, q_bytes, k_new, v_new, new_is_fp32,
                                n_new, new_bytes, out, out_bytes, threads, nullptr, nullptr);
}

int pnmix_attend_append_on(const pnmix_layout* layout, pnmix_state* state, int64_t seq_len, const void* q,
                           int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const void* k_new,
                           const void* v_new, int new_is_fp32, int64_t n_new, int64_t new_bytes, float* out,
                           int64_t out_bytes, int threads, pnmix_parallel_for runner, void* runner_ctx) {
  try {
    if (int rc = check_layout(layout)) return rc;
    const pnmix_layout& L = *layout;
    if (n_new < 1 || n_new > ((int64_t)1 << 40))
      return fail(PNMIX_ERR_SIZE, "n_new must be in 1..2^40, got %lld", (long long)n_new);
    const int element = new_is_fp32 ? 4 : 2;
    const int64_t want = product({L.batch, L.kv_heads, n_new, L.head_dim, element});
    if (want < 0 || new_bytes != want)
      return fail(PNMIX_ERR_SIZE, "new K/V buffers have %lld bytes, [B, H, n_new, D] %s needs %lld",
                  (long long)new_bytes, new_is_fp32 ? "fp32" : "fp16", (long long)want);
    if (!k_new || !v_new) return fail(PNMIX_ERR_NULL, "k_new or v_new pointer is null");
    if (((uintptr_t)k_new | (uintptr_t)v_new) & (element - 1))
      return fail(PNMIX_ERR_SIZE, "new K/V buffers are not aligned to their element size");
    // the rounded K/V: kept per thread, so a decode step allocates nothing once warm
    thread_local std::vector<uint16_t> k_rounded, v_rounded;
    const int64_t count = want / element, fp16_bytes = count * 2;
    const uint16_t *k16 = nullptr, *v16 = nullptr;
    if (int rc = fp16_new_kv(k_new, new_is_fp32, count, k_rounded, "keys", &k16)) return rc;
    if (int rc = fp16_new_kv(v_new, new_is_fp32, count, v_rounded, "values", &v16)) return rc;
    if (int rc = append_impl(layout, state, seq_len, k16, v16, n_new, fp16_bytes, /*check_only=*/true)) return rc;
    if (int rc = attend_impl(layout, state, nullptr, seq_len, q, q_is_fp32, q_heads, nq, q_bytes, k16, v16, n_new,
                             fp16_bytes, out, out_bytes, threads, runner, runner_ctx))
      return rc;
    return append_impl(layout, state, seq_len, k16, v16, n_new, fp16_bytes, /*check_only=*/false, threads);
  } catch (const std::exception& e) {
    return fail(PNMIX_ERR_INTERNAL, "attention and append failed: %s", e.what());
  }
}

int pnmix_attend_paged(const pnmix_layout* layout, const pnmix_paged_state* paged, int64_t seq_len, const void* q,
                       int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const uint16_t* k_new,
                       const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes,
                       int threads) {
  return pnmix_attend_paged_on(layout, paged, seq_len, q, q_is_fp32, q_heads, nq, q_bytes, k_new, v_new, n_new,
                               new_bytes, out, out_bytes, threads, nullptr, nullptr);
}

int pnmix_attend_paged_on(const pnmix_layout* layout, const pnmix_paged_state* paged, int64_t seq_len, const void* q,
                          int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const uint16_t* k_new,
                          const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes,
                          int threads, pnmix_parallel_for runner, void* runner_ctx) {
  try {
    if (!paged) return fail(PNMIX_ERR_NULL, "paged state pointer is null");
    return attend_impl(layout, nullptr, paged, seq_len, q, q_is_fp32, q_heads, nq, q_bytes, k_new, v_new, n_new,
                       new_bytes, out, out_bytes, threads, runner, runner_ctx);
  } catch (const std::exception& e) {
    return fail(PNMIX_ERR_INTERNAL, "attention failed: %s", e.what());
  }
}

int pnmix_attend_paged_batch(const pnmix_layout* layout, const pnmix_paged_sequence* seqs, int64_t count,
                             int q_is_fp32, int64_t q_heads, int threads) {
  return pnmix_attend_paged_batch_on(layout, seqs, count, q_is_fp32, q_heads, threads, nullptr, nullptr);
}

int pnmix_attend_paged_batch_on(const pnmix_layout* layout, const pnmix_paged_sequence* seqs, int64_t count,
                                int q_is_fp32, int64_t q_heads, int threads, pnmix_parallel_for runner,
                                void* runner_ctx) {
  try {
    if (int rc = check_layout(layout)) return rc;
    if (int rc = check_arith()) return rc;
    if (int rc = check_query_encoding(q_is_fp32)) return rc;  // once, not as sequence 0's (an empty batch too)
    if (count < 0 || count > ((int64_t)1 << 20))
      return fail(PNMIX_ERR_SIZE, "sequence count must be in 0..2^20, got %lld", (long long)count);
    if (count && !seqs) return fail(PNMIX_ERR_NULL, "sequences pointer is null");
    const pnmix_layout& L = *layout;
    thread_local std::vector<SeqRun> runs;
    ensure(runs, count);
    double work = 0.0;
    for (int64_t i = 0; i < count; ++i) {
      const pnmix_paged_sequence& s = seqs[i];
      if (int rc = prepare_run(L, nullptr, &s.paged, s.seq_len, s.q, q_is_fp32, q_heads, s.nq, s.q_bytes, s.k_new,
                               s.v_new, s.n_new, s.new_bytes, s.out, s.out_bytes, runs[i])) {
        const std::string why = abi::last_error();  // the sequence's own message, named by its index
        return fail(rc, "sequence %lld: %s", (long long)i, why.c_str());
      }
      work += run_work(runs[i], runner != nullptr);
    }
    // attend_threads' measure summed over the batch: one thread per that much work
    const int available = resolve_threads(threads);
    const int nthreads = work < 1.0 ? 1 : work < (double)available ? (int)work : available;
    return run_batch(L, runs.data(), count, nthreads, runner, runner_ctx);
  } catch (const std::exception& e) {
    return fail(PNMIX_ERR_INTERNAL, "attention failed: %s", e.what());
  }
}

}  // extern "C"
