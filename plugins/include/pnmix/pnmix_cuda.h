/* pnmix_cuda.h: the C ABI of libpnmix_cuda (CUDA kernels over the packed cache).
 *
 * Same conventions as pnmix_core.h: the cache is the eleven state tensors of docs/FORMAT.md
 * section 3 (pnmix_state, STATE_NAMES order, each dense and of its capacity size), here in
 * DEVICE memory; fp16 values are 16-bit patterns. Every function validates its pointer and size
 * arguments before touching the device and returns PNMIX_OK or a pnmix_status code;
 * pnmix_cuda_last_error() then gives a one-line message (thread-local).
 *
 * Work is enqueued on `stream` (a cudaStream_t; NULL = the legacy default stream) and not
 * waited for. Scratch memory is caller-owned: ask for its size with the *_workspace_bytes
 * functions (same arguments) and pass a device buffer at least that large.
 *
 * Not checked here: the state's CONTENTS. Once seq_len > 0 its pair mask must follow
 * docs/FORMAT.md 3.2 (exactly n_high high pairs per KV head, nothing past H * P), or the key
 * offsets run past a group's bytes. The mask lives in device memory and the entry points only
 * enqueue work, so checking it would cost a copy and a sync per call; libpnmix_core checks it
 * (PNMIX_ERR_STATE), and a state from append or from a checked .pnkv decoder always obeys it.
 */
#ifndef PNMIX_CUDA_H
#define PNMIX_CUDA_H

#include <stdint.h>

#include "params.h"
#include "pnmix_core.h" /* pnmix_state, pnmix_status */

#ifdef __cplusplus
extern "C" {
#endif

#define PNMIX_CUDA_ABI_VERSION 1

/* Extra status code: a CUDA runtime call or a kernel launch failed (the message says which). */
#define PNMIX_ERR_CUDA 100

/* Query dtypes of pnmix_cuda_attend (keys and values are always fp16). */
#define PNMIX_DTYPE_FP16 0
#define PNMIX_DTYPE_BF16 1

/* The largest head_dim the attention kernel takes (a thread owns at most two output channels). */
#define PNMIX_CUDA_MAX_HEAD_DIM 256

int pnmix_cuda_abi_version(void);
const char* pnmix_cuda_last_error(void);

/* Append n fp16 tokens k, v [B, H, n, D] (device, kv_bytes bytes each) to a cache holding seq_len
 * tokens: pair mask from these keys when seq_len == 0, sink, residual, every group flush, all in
 * place. Bytes identical to pnmix.cache.append_reference. */
int pnmix_cuda_append_workspace_bytes(const pnmix_layout* layout, int64_t seq_len, int64_t n,
                                      int64_t* out);
int pnmix_cuda_append(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len,
                      const uint16_t* k, const uint16_t* v, int64_t n, int64_t kv_bytes,
                      void* workspace, int64_t workspace_bytes, void* stream);

/* Attention of q [B, Hq, nq, D] (q_dtype PNMIX_DTYPE_FP16 or _BF16) over the cache of seq_len tokens
 * followed by n_new fp16 tokens k_new/v_new [B, H, n_new, D] (may be NULL when n_new == 0). The
 * queries are the last nq of the seq_len + n_new positions (causal); GQA: query head h reads KV
 * head h / (Hq / H); scale 1/sqrt(D); out fp32 [B, Hq, nq, D]. Split along the sequence; the
 * split count is chosen from the device's SM count (num_splits reports it, may be NULL). */
int pnmix_cuda_attend_workspace_bytes(const pnmix_layout* layout, int64_t seq_len, int64_t q_heads,
                                      int64_t nq, int64_t n_new, int64_t* out, int64_t* num_splits);
int pnmix_cuda_attend(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len,
                      const void* q, int q_dtype, int64_t q_heads, int64_t nq, int64_t q_bytes,
                      const uint16_t* k_new, const uint16_t* v_new, int64_t n_new, int64_t new_bytes,
                      float* out, int64_t out_bytes, void* workspace, int64_t workspace_bytes,
                      void* stream);

/* Bytes one attention call reads from the cache and the new tokens (the used parts of the state,
 * the queries and k_new/v_new): the figure a bandwidth number is computed from. */
int pnmix_cuda_attend_bytes_read(const pnmix_layout* layout, int64_t seq_len, int64_t q_heads,
                                 int64_t nq, int64_t n_new, int q_dtype, int64_t* out);

#ifdef __cplusplus
}
#endif

#endif /* PNMIX_CUDA_H */
