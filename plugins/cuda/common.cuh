// plugins/cuda/common.cuh: small device helpers shared by the append and attention kernels.
#ifndef PNMIX_CUDA_COMMON_CUH
#define PNMIX_CUDA_COMMON_CUH

#include <stdint.h>

#include "kernels.cuh"
#include "pnmix/format.h"

namespace pnmix {
namespace cuda {

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ inline int64_t align_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// A code (< 2^23) as fp32 without the quarter-rate int->float conversion: the code becomes the
// mantissa of 2^23 + code, exactly, and the subtraction is exact too.
__device__ __forceinline__ float code_to_float(uint32_t code) {
  return __uint_as_float(0x4B000000u | code) - 8388608.0f;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int d = 16; d > 0; d >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, d));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}

// Copy n bytes global -> any (shared or global) with the whole block, 16 bytes at a time where
// both addresses allow it. Streaming data: read once, through the non-coherent path.
__device__ inline void block_copy_bytes(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, int64_t n) {
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const int64_t n16 = n >> 4;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = threadIdx.x; i < n16; i += blockDim.x) d[i] = __ldg(s + i);
    done = n16 << 4;
  } else if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 3) == 0) {
    const int64_t n4 = n >> 2;
    const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) d[i] = __ldg(s + i);
    done = n4 << 2;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = __ldg(src + i);
}

// ---- global -> shared staging with cp.async (sm_80+) ------------------------------------------
// Every 16-byte piece is its own asynchronous copy, so a block keeps all of a tile's loads in
// flight at once instead of one load-store round trip per piece. Call async_copy_wait() before
// the __syncthreads() that publishes the tile.
__device__ __forceinline__ void async_copy16(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}

__device__ __forceinline__ void async_copy_wait() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// n bytes global -> shared with the whole block: cp.async where both ends are 16-byte aligned.
__device__ inline void block_stage_bytes(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, int64_t n) {
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const int64_t n16 = n >> 4;
    for (int64_t i = threadIdx.x; i < n16; i += blockDim.x) async_copy16(dst + 16 * i, src + 16 * i);
    done = n16 << 4;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = __ldg(src + i);
}

// The byte offset of each key channel's stream in a group of KV head h (format.h's
// key_channel_layout, computed by the block: bits per thread, then one warp's prefix sum).
// bits_s and offset_s are shared arrays of D entries. Ends with __syncthreads().
__device__ inline void block_key_channel_layout(const pnmix_layout& L, const uint8_t* mask, int64_t h,
                                                int* bits_s, int* offset_s) {
  const int D = (int)L.head_dim;
  for (int c = threadIdx.x; c < D; c += blockDim.x) bits_s[c] = channel_bits(L, mask, h, c);
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int per_lane = (D + 31) / 32;
    const int first = lane * per_lane;
    int sum = 0;
    for (int c = first; c < first + per_lane && c < D; ++c) sum += bits_s[c];
    int before = sum;  // inclusive scan over lanes, then exclude this lane's own sum
    for (int d = 1; d < 32; d <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, before, d);
      if (lane >= d) before += up;
    }
    before -= sum;
    const int bytes_per_bit = L.config.group_size / 8;  // key_channel_offset(c) = gs/8 * sum bits
    for (int c = first; c < first + per_lane && c < D; ++c) {
      offset_s[c] = before * bytes_per_bit;
      before += bits_s[c];
    }
  }
  __syncthreads();
}

}  // namespace cuda
}  // namespace pnmix

#endif  // PNMIX_CUDA_COMMON_CUH
