// plugins/cuda/kernels.cuh: the params structs of the CUDA kernels and their launchers.
//
// Like FlashInfer's decode_params.cuh: one small struct per op carries the shapes (derived once
// on the host from pnmix_layout through format.h) and the device pointers; the kernels read
// nothing else. api.cu validates the C ABI's arguments and fills these structs.
#ifndef PNMIX_CUDA_KERNELS_CUH
#define PNMIX_CUDA_KERNELS_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "pnmix/format.h"
#include "pnmix/params.h"
#include "pnmix/pnmix_cuda.h"

namespace pnmix {
namespace cuda {

constexpr int kThreads = 128;  // every kernel's block size
constexpr int kF16Tile = 16;   // tokens per fp16 tile (sink, residual, new tokens)

// ---- append -------------------------------------------------------------------------------------

struct AppendParams {
  pnmix_layout layout;
  int64_t seq_len, n;   // tokens held before, tokens appended
  Lengths before, after;
  int64_t into_sink;    // new tokens that go to the sink
  int64_t new_groups;   // groups this append flushes, into slots before.groups ..
  int64_t mixed_groups; // the first of them that hold residual rows (gathered first)
  int64_t group_slots;  // G
  int64_t key_group_bytes, value_token_bytes, value_blocks, pairs, mask_bytes, high_bytes;
  // the state (device)
  StateView<true> state;
  const uint16_t *k, *v;  // new tokens [B, H, n, D]
  // workspace
  double* energy;         // [B, H, P]            (seq_len == 0 only)
  uint8_t* high;          // [B, H, ceil(P / 8)]  per-head high pairs (seq_len == 0 only)
  uint16_t *gather_k, *gather_v;  // [mixed_groups, B, H, gs, D]
  int group_smem;         // dynamic shared bytes of the group kernel
};

// Workspace pieces of an append, 256-byte aligned, in AppendParams order; returns the total.
int64_t append_workspace(const pnmix_layout& L, int64_t seq_len, int64_t n, int64_t offsets[4]);
// Fill the shape fields of p (not the pointers).
void plan_append(const pnmix_layout& L, int64_t seq_len, int64_t n, AppendParams* p);
cudaError_t launch_append(const AppendParams& p, cudaStream_t stream);

// ---- attention ------------------------------------------------------------------------------------

struct AttendParams {
  pnmix_layout layout;
  int64_t seq_len, n_new, q_heads, nq;
  Lengths cache;              // the schedule at seq_len
  int64_t group_slots;        // G
  int64_t key_group_bytes, value_token_bytes, value_blocks, value_block, mask_bytes;
  int64_t rows_per_head;      // (Hq / H) * nq query rows that read one KV head
  int64_t out_rows;           // B * Hq * nq
  int rows;                   // query rows per block: the kernel's ROWS (1, 2, 4 or 8)
  int row_chunks;             // ceil(rows_per_head / rows)
  // tiles in cache order: sink (kF16Tile tokens), one per group, residual, new (kF16Tile)
  int64_t tiles_sink, tiles_residual, tiles_new, n_tiles, tiles_per_split;
  int num_splits;
  float scale_log2;           // log2(e) / sqrt(D): scores live in the log2 domain (exp2f)
  int q_dtype;
  // shared memory carve-up (byte offsets)
  int smem_q, smem_w, smem_chan, smem_scores, smem_rowstate, smem_buf, smem_bytes;
  int buf_value_codes, buf_value_params;  // offsets inside the buffer for a group tile
  // Tensor-core path for the groups (see attend.cu): taken when the shapes allow it.
  int use_mma;
  int smem_key_b, smem_value_b, smem_value_offset;  // B operands (fp16 hi/lo pairs), offset sums
  // pointers (device)
  const void* q;
  StateView<false> state;
  const uint16_t *k_new, *v_new;
  float* out;                 // [B, Hq, nq, D]
  float* part_o;              // [splits, out_rows, D]   unnormalized partial outputs
  float* part_m;              // [splits, out_rows]      running max (log2 domain)
  float* part_l;              // [splits, out_rows]      running sum of exp2
  int64_t workspace_m, workspace_l;  // byte offsets of part_m and part_l in the workspace
};

// Split count and shared memory for this call on a device with sm_count SMs. Returns the
// workspace bytes (0 on a shape the kernel cannot take; *why then says which).
int64_t plan_attend(const pnmix_layout& L, int64_t seq_len, int64_t q_heads, int64_t nq, int64_t n_new,
                    int sm_count, AttendParams* p, const char** why);
// Largest dynamic shared memory a block may use on the current device.
int max_dynamic_smem();
cudaError_t launch_attend(const AttendParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace pnmix

#endif  // PNMIX_CUDA_KERNELS_CUH
