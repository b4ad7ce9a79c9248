/* pnmix_core.h: the C ABI of libpnmix_core (CPU).
 *
 * The cache lives in caller-owned buffers: the eleven state tensors of docs/FORMAT.md section 3
 * (pnmix_state, in STATE_NAMES order), each dense and of its capacity size
 * (pnmix_state_bytes). fp16 values are passed as their 16-bit patterns (uint16_t).
 *
 * Every function validates its pointer and size arguments and returns PNMIX_OK or an error
 * code; pnmix_last_error() then gives a one-line message (thread-local, valid until the next
 * call on the same thread).
 */
#ifndef PNMIX_CORE_H
#define PNMIX_CORE_H

#include <stdint.h>

#include "params.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PNMIX_CORE_ABI_VERSION 11 /* 3: pnmix_core_struct_offset; 4: pnmix_attend_on; 5: pnmix_set_attend_arith; \
                                    6: pnmix_paged_state, pnmix_attend_paged, pnmix_group_sections; \
                                    7: pnmix_paged_sequence, pnmix_attend_paged_batch; \
                                    8: pnmix_attend_append, PNMIX_ERR_VALUE; \
                                    9: pnmix_attend_append_on, pnmix_openmp_parallel_for; \
                                    10: pnmix_attend_paged_on, pnmix_attend_paged_batch_on; \
                                    11: q_is_fp32 == PNMIX_QUERY_FP32_AS_FP16 (2) */

#if defined(_WIN32)
#define PNMIX_API
#else
#define PNMIX_API __attribute__((visibility("default")))
#endif

enum pnmix_status {
  PNMIX_OK = 0,
  PNMIX_ERR_NULL = 1,     /* a required pointer is null */
  PNMIX_ERR_CONFIG = 2,   /* invalid config or layout */
  PNMIX_ERR_SIZE = 3,     /* a buffer size or count does not match the layout */
  PNMIX_ERR_CAPACITY = 4, /* seq_len + n would exceed max_seq_len */
  PNMIX_ERR_DUMP = 5,     /* a .pnkv blob is malformed */
  PNMIX_ERR_INTERNAL = 6,
  PNMIX_ERR_STATE = 7,    /* a state's bytes break the format (a pair mask without n_high high pairs per head) */
  PNMIX_ERR_VALUE = 8     /* new K/V hold a value that is not finite in fp16 (pnmix_attend_append) */
};

/* The eleven state buffers and their sizes in bytes (each must equal pnmix_state_bytes). */
typedef struct pnmix_state {
  void* data[PNMIX_NUM_STATE];
  int64_t nbytes[PNMIX_NUM_STATE];
} pnmix_state;

PNMIX_API int pnmix_core_abi_version(void);
PNMIX_API const char* pnmix_last_error(void);

/* One of generated.h's limits by name ("max_tokens_field", "max_int_field", "max_batch", "max_kv_heads",
 * "max_head_dim", "max_seq_len", "max_state_tensor_bytes", "dump_slack_bytes"); -1 for an unknown
 * name. Lets tests check pnmix/config.py states the same numbers. */
PNMIX_API int64_t pnmix_core_limit(const char* name);

/* The compiled layout of the ABI's structs: offsetof(type, field) for a field of "pnmix_config",
 * "pnmix_layout", "pnmix_state", "pnmix_paged_state", "pnmix_paged_sequence" or "pnmix_openmp_team", sizeof(type) when field is null or ""; -1 for an unknown name.
 * Lets a binding (pnmix/backends/native.py) check its mirror against what the compiler made. */
PNMIX_API int64_t pnmix_core_struct_offset(const char* type, const char* field);

/* Check a layout; fill nbytes[11] with the capacity size of each state buffer. */
PNMIX_API int pnmix_state_bytes(const pnmix_layout* layout, int64_t nbytes[PNMIX_NUM_STATE]);

/* Persistent bytes (FORMAT.md section 5) of a cache of this layout at seq_len tokens. */
PNMIX_API int pnmix_persistent_bytes(const pnmix_layout* layout, int64_t seq_len, int64_t* out);

/* Append n tokens of fp16 K/V [B, H, n, D] (kv_bytes = bytes of each of k and v) to a cache holding
 * seq_len tokens: pair mask first when seq_len == 0, sink, residual, and every group flush.
 * Bytes are identical to pnmix.cache.append_reference. When seq_len > 0 the state's pair mask
 * must follow FORMAT.md 3.2 (append and attend check it: PNMIX_ERR_STATE). */
PNMIX_API int pnmix_append(const pnmix_layout* layout, pnmix_state* state, int64_t seq_len, const uint16_t* k,
                 const uint16_t* v, int64_t n, int64_t kv_bytes);

/* A decode step in one call: pnmix_attend of q over the cache and the n_new >= 1 new tokens, then
 * pnmix_append of them (state ends holding seq_len + n_new tokens). k_new/v_new [B, H, n_new, D]
 * are fp16 bits, or fp32 when new_is_fp32 (rounded to fp16 as pnmix_float_to_half(..., 0) does);
 * new_bytes is the bytes of each. A new key or value that is not finite in fp16 (NaN, Inf, or an
 * fp32 of magnitude 65520 or more, which rounds to Inf) fails the call with PNMIX_ERR_VALUE, and
 * every argument the append checks (capacity included) is checked, before anything is written; a
 * failing call leaves the state as it was. The attention's output and work split are pnmix_attend's;
 * `threads` serves the append's group flushes too. out must not overlap k_new or v_new (the
 * attention writes it before the append reads them). */
PNMIX_API int pnmix_attend_append(const pnmix_layout* layout, pnmix_state* state, int64_t seq_len, const void* q,
                                  int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const void* k_new,
                                  const void* v_new, int new_is_fp32, int64_t n_new, int64_t new_bytes, float* out,
                                  int64_t out_bytes, int threads);

/* Attention of q [B, Hq, nq, D] over the cache of seq_len
 * tokens followed by n_new fp16 tokens k_new/v_new [B, H, n_new, D] (may be null when n_new == 0).
 * The queries are the last nq of the seq_len + n_new positions (causal); GQA head h reads KV
 * head h / (Hq / H); scale 1/sqrt(D); out fp32 [B, Hq, nq, D]. threads <= 0: every core the
 * calling thread may run on (its affinity mask: a pinned engine worker gets its own cores).
 * q_is_fp32, in every attention call, says how q is read (generated.h): PNMIX_QUERY_FP16 (0) fp16
 * bits, PNMIX_QUERY_FP32 (1) fp32 as it is, PNMIX_QUERY_FP32_AS_FP16 (2) fp32 rounded to fp16
 * first, as a cast to fp16 rounds it (bit for bit the fp16 call on the cast's result); any other
 * value is PNMIX_ERR_CONFIG. */
PNMIX_API int pnmix_attend(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len, const void* q,
                 int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const uint16_t* k_new,
                 const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes,
                 int threads);

/* A paged cache (docs/VLLM.md section 2): an engine's memory in blocks of block_size == group_size
 * tokens. The page of a block holds, for each KV head, the six group tensors of one group
 * (pnmix_group_sections: key_codes, key_step, key_offset, value_codes, value_step, value_offset, one
 * after another); group g of a sequence is in the page of block_table[(S + (g + 1) * gs - 1) / gs],
 * the block of its last token. The fp16 sink and residual and the pair mask are the sequence's slot,
 * shaped as pnmix_state's tensors of batch 1. Nothing is copied: the kernel reads the pages in place. */
typedef struct pnmix_paged_state {
  const uint8_t* pages;    /* the layer's pages: num_blocks of them, page_bytes apart */
  int64_t num_blocks;      /* block ids are 0..num_blocks-1 */
  int64_t page_bytes;      /* from one block's page to the next (the block stride; even) */
  int64_t head_bytes;      /* from one KV head's part of a page to the next (even; >= a group's bytes) */
  int64_t block_size;      /* tokens per block: must equal group_size */
  const void* block_table; /* the sequence's block ids, in token order */
  int64_t table_blocks;    /* its entries: at least ceil(seq_len / block_size) (only groups' are read) */
  int64_t block_id_bytes;  /* 4 (int32 ids) or 8 (int64 ids) */
  const uint16_t* sink_k;  /* fp16 [H, S, D], sink_bytes bytes each */
  const uint16_t* sink_v;
  const uint16_t* residual_k; /* fp16 [H, R, D], residual_bytes bytes each */
  const uint16_t* residual_v;
  const uint8_t* pair_mask;   /* [MB], mask_bytes bytes */
  int64_t sink_bytes, residual_bytes, mask_bytes;
} pnmix_paged_state;

/* Where each group tensor sits in one KV head's part of a page: first_byte[6] and nbytes[6] in the
 * order above (state indices PNMIX_KEY_CODES .. PNMIX_VALUE_OFFSET); their sum is a group's bytes. */
PNMIX_API int pnmix_group_sections(const pnmix_layout* layout, int64_t first_byte[6], int64_t nbytes[6]);

/* pnmix_attend of one sequence (layout batch 1, max_seq_len >= seq_len) whose groups are in pages:
 * the same kernel, work split and results, bit for bit, as pnmix_attend over a contiguous state
 * holding the same bytes. Every block id a group reads is checked against num_blocks. */
PNMIX_API int pnmix_attend_paged(const pnmix_layout* layout, const pnmix_paged_state* paged, int64_t seq_len,
                       const void* q, int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes,
                       const uint16_t* k_new, const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out,
                       int64_t out_bytes, int threads);

/* One sequence of pnmix_attend_paged_batch: what pnmix_attend_paged takes for it (its paged state,
 * length, queries [1, Hq, nq, D], new tokens [1, H, n_new, D] and output [1, Hq, nq, D], with their
 * byte counts). The batch shares the layout, q_is_fp32 and q_heads. */
typedef struct pnmix_paged_sequence {
  pnmix_paged_state paged;
  int64_t seq_len;
  const void* q;
  int64_t nq, q_bytes;
  const uint16_t* k_new;
  const uint16_t* v_new;
  int64_t n_new, new_bytes;
  float* out;
  int64_t out_bytes;
} pnmix_paged_sequence;

/* pnmix_attend_paged of `count` sequences at once (an engine's step: every sequence of a layer in
 * one call), their work items in one parallel-for. Every sequence is checked before any runs (a
 * failing one is named by its index; no output is written then). The work is split over the
 * sequences in proportion to their work; each sequence's result equals pnmix_attend_paged's up to
 * the order of its splits' merge (bit for bit when count == 1 and the thread counts agree). */
PNMIX_API int pnmix_attend_paged_batch(const pnmix_layout* layout, const pnmix_paged_sequence* seqs, int64_t count,
                                       int q_is_fp32, int64_t q_heads, int threads);

/* A caller's parallel-for, for pnmix_attend_on: run task(task_ctx, i) exactly once for every i in
 * [0, items), on any threads, concurrently or not, and return 0 when all have run (non-zero: it
 * could not run them; the attention then fails with PNMIX_ERR_INTERNAL). */
typedef void (*pnmix_task)(void* task_ctx, int64_t item);
typedef int (*pnmix_parallel_for)(void* runner_ctx, pnmix_task task, void* task_ctx, int64_t items);

/* pnmix_attend on the caller's threads: the work items run through runner(runner_ctx, ...) instead
 * of the core's own pool (an engine's intra-op pool: ONNX Runtime's KernelContext_ParallelFor).
 * threads: how many threads the runner has (<= 0: all cores); the work is split for that many, and
 * a thread is worth a smaller share of the cache than the core's own pool needs, since the
 * runner's threads are already awake. runner == null is pnmix_attend. The results are pnmix_attend's
 * bit for bit when both split the work alike (the split follows the thread count, in both). */
PNMIX_API int pnmix_attend_on(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len, const void* q,
                    int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const uint16_t* k_new,
                    const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes,
                    int threads, pnmix_parallel_for runner, void* runner_ctx);

/* pnmix_attend_append with the attention's work items on the caller's threads (runner, as in
 * pnmix_attend_on; null: pnmix_attend_append). The append's group flushes run on the core's pool. */
PNMIX_API int pnmix_attend_append_on(const pnmix_layout* layout, pnmix_state* state, int64_t seq_len, const void* q,
                                     int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes, const void* k_new,
                                     const void* v_new, int new_is_fp32, int64_t n_new, int64_t new_bytes, float* out,
                                     int64_t out_bytes, int threads, pnmix_parallel_for runner, void* runner_ctx);

/* pnmix_attend_paged and pnmix_attend_paged_batch with the work items on the caller's threads
 * (runner, as in pnmix_attend_on: the work split for `threads`, a thread worth the smaller share of
 * an awake pool; null: the core's pool, as the calls without _on). A batch's thread count follows
 * the work of all its sequences. */
PNMIX_API int pnmix_attend_paged_on(const pnmix_layout* layout, const pnmix_paged_state* paged, int64_t seq_len,
                                    const void* q, int q_is_fp32, int64_t q_heads, int64_t nq, int64_t q_bytes,
                                    const uint16_t* k_new, const uint16_t* v_new, int64_t n_new, int64_t new_bytes,
                                    float* out, int64_t out_bytes, int threads, pnmix_parallel_for runner,
                                    void* runner_ctx);
PNMIX_API int pnmix_attend_paged_batch_on(const pnmix_layout* layout, const pnmix_paged_sequence* seqs,
                                          int64_t count, int q_is_fp32, int64_t q_heads, int threads,
                                          pnmix_parallel_for runner, void* runner_ctx);

/* An OpenMP runtime's thread team, for pnmix_openmp_parallel_for: gomp_parallel is the address of
 * that runtime's GOMP_parallel (GCC libgomp's entry point, which LLVM's libomp and Intel's libiomp5
 * provide too: void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads,
 * unsigned flags)); threads the team's size (<= 0: the runtime's default for the calling thread,
 * omp_get_max_threads). */
typedef struct pnmix_openmp_team {
  void* gomp_parallel;
  int32_t threads;
} pnmix_openmp_team;

/* A pnmix_parallel_for on an OpenMP team: runner_ctx is a pnmix_openmp_team. Its threads take the
 * items one at a time, so a team of any size runs them all. A framework whose intra-op threads are
 * that team (PyTorch's CPU builds) keeps them spinning for a while after each of its own kernels: a
 * decode step's attention, called between two of them, starts on every thread at once, where the
 * core's own pool would wake a sleeping helper (tens of microseconds in a virtual machine) to share
 * a core with the framework's spinning one. Called inside an active parallel region the team is
 * the calling thread alone (OpenMP's nesting default), and from another host thread that thread's
 * own team: the items still all run. Returns -1 when team, its gomp_parallel or task is null, or
 * when a task threw (the other items still ran); 0 otherwise. */
PNMIX_API int pnmix_openmp_parallel_for(void* team, pnmix_task task, void* task_ctx, int64_t items);

/* The attention kernel in use: "avx512vbmi", "avx512", "avx2" or "scalar" (chosen at run time from
 * cpuid; groups whose size is not a multiple of 16 use "avx2" in place of the AVX-512 kernels). With
 * the integer arithmetic requested (pnmix_attend_arith), the kernel of the integer path: "avx512vnni"
 * where the CPU has AVX-512 VBMI and VNNI, else "avx2". */
PNMIX_API const char* pnmix_attend_isa(void);
/* Force a kernel ("avx512vnni", "avx512vbmi", "avx512", "avx2", "scalar" or "auto" / null); for tests
 * and benchmarks. The integer path runs on "avx512vnni" (auto or forced) or "avx2" (any other). */
PNMIX_API int pnmix_set_attend_isa(const char* name);

/* The arithmetic of the packed groups in pnmix_attend: "fp32" (exact: the default, what verify's
 * byte-exactness reports use) or "int8": key weights (scale * q * key step) and value weights (softmax
 * probability * value step) rounded to int8 per row and group and multiplied with the codes as
 * bytes (AVX-512 VNNI vpdpbusd, or AVX2 vpmaddubsw), 2-3x fewer instructions; the rounding adds an error of about 1/254 of a
 * row's largest weight per group. The environment variable PNMIX_ATTEND_ARITH=int8 chooses it for
 * a process (any other value but fp32 makes every pnmix_attend fail with PNMIX_ERR_CONFIG, and
 * pnmix_attend_arith say "invalid"); pnmix_set_attend_arith("fp32" | "int8" | "auto": back to the
 * environment) overrides it. A layout the integer path does not take (key bits > 4, group_size not a multiple of 32;
 * values: more than one value block per token, value bits other than 1, 2, 4) runs that half in
 * fp32: pnmix_attend_arith_for says what a call with this layout runs ("int8", "int8 keys, fp32
 * values", "fp32 keys, int8 values" or "fp32"). */
PNMIX_API const char* pnmix_attend_arith(void);
PNMIX_API int pnmix_set_attend_arith(const char* name);
PNMIX_API const char* pnmix_attend_arith_for(const pnmix_layout* layout);

/* The machine's multiply-add rate with the data in registers, for benchmarks: `threads` threads
 * (<= 0: all cores) each run `iterations` rounds of 8 independent instructions of the kernel that
 * arithmetic runs on (pnmix_attend_isa): "fp32": FMAs of 8 lanes (AVX2) or 16 (AVX-512 kernels);
 * "int8": vpmaddubsw + vpaddw pairs (AVX2: 32 multiply-adds of a byte code and an int8 weight) or
 * vpdpbusd (avx512vnni: 64); *madds gets the multiply-adds done (time the call). AVX2 and newer
 * only (PNMIX_ERR_CONFIG elsewhere). */
PNMIX_API int pnmix_madd_rate(const char* kind, int threads, int64_t iterations, double* madds);

/* The header's fp16 conversions, exposed so tests can check them exhaustively:
 * half bits -> fp32, and fp32 -> half bits (saturating != 0: FORMAT.md's saturating fp16(.)). */
PNMIX_API int pnmix_half_to_float(const uint16_t* src, float* dst, int64_t n);
PNMIX_API int pnmix_float_to_half(const float* src, uint16_t* dst, int64_t n, int saturating);

/* .pnkv dump (FORMAT.md section 6). */
/* Bytes a dump of this layout at seq_len takes (64 + persistent bytes). */
PNMIX_API int pnmix_dump_size(const pnmix_layout* layout, int64_t seq_len, int64_t* out);
/* Write the dump into out (out_bytes must be at least pnmix_dump_size). */
PNMIX_API int pnmix_dump_write(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len, uint8_t* out,
                     int64_t out_bytes, int64_t* written);
/* Decode and check a dump (FORMAT.md 6's reader rules: header, limits, size, pair mask):
 * layout (capacity = max(seq_len, 1)) and seq_len. */
PNMIX_API int pnmix_dump_header(const uint8_t* blob, int64_t size, pnmix_layout* layout, int64_t* seq_len);
/* Load a dump into state buffers of `layout` (same config/B/H/D, capacity >= the dump's seq_len);
 * unused parts of the buffers are zeroed. */
PNMIX_API int pnmix_dump_read(const uint8_t* blob, int64_t size, const pnmix_layout* layout, pnmix_state* state,
                    int64_t* seq_len);

#ifdef __cplusplus
}

#include <stdio.h>

#include "format.h"

namespace pnmix {

// Why a caller's eleven buffers do not fit layout L (each exactly its capacity size, non-null
// when non-empty, fp16 ones 2-byte aligned): a one-line message in msg and the error code, or
// PNMIX_OK. The CPU and CUDA C ABIs both check their state with it.
inline int state_problem(const pnmix_layout& L, const pnmix_state* state, char* msg, size_t n) {
  if (!state) return snprintf(msg, n, "state pointer is null"), PNMIX_ERR_NULL;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    const int64_t want = state_bytes(L, i);
    if (state->nbytes[i] != want)
      return snprintf(msg, n, "state tensor '%s' has %lld bytes, the layout needs %lld", state_name(i),
                      (long long)state->nbytes[i], (long long)want),
             PNMIX_ERR_SIZE;
    if (want && !state->data[i]) return snprintf(msg, n, "state tensor '%s' pointer is null", state_name(i)), PNMIX_ERR_NULL;
    if (state_elem_bytes(i) == 2 && ((uintptr_t)state->data[i] & 1))
      return snprintf(msg, n, "state tensor '%s' is not 2-byte aligned", state_name(i)), PNMIX_ERR_SIZE;
  }
  return PNMIX_OK;
}

}  // namespace pnmix
#endif

#endif /* PNMIX_CORE_H */
