// plugins/cuda/attend.cu: fused decode attention over sink + packed groups + residual + new tokens.
//
// Design (FlashInfer's split-KV decode, adapted to the packed cache):
//  * grid = (splits, row chunks, B * H). A block owns one KV head of one sequence and up to ROWS
//    query rows that read it (the GQA group's heads x the nq queries), so a KV head's bytes are
//    read once for its whole query-head group. The sequence is cut into tiles in cache order
//    (sink tiles of kF16Tile tokens, one tile per quantized group, residual and new-token tiles)
//    and each split takes a contiguous run of tiles, so batch 1 still fills every SM.
//  * A group tile is staged in shared memory with 16-byte cp.async copies: the key codes, the
//    value codes and the values' step/offset. The keys' step/offset are folded into the queries
//    once per group: score = sum_c (q_c * step_c) * code_c + sum_c q_c * offset_c, so the inner
//    product is code x weight; values likewise (p * step per token, sum p * offset per row). No
//    dequantized key or value is ever written anywhere.
//  * The groups' two products run on the tensor cores (mma.m16n8k16, see below) when the shapes
//    allow, else as fp32 FMAs with format.h's read_code (PNMIX_CUDA_SIMT=1 forces the latter).
//    fp16 tiles always use fp32 FMAs.
//  * Online softmax in the log2 domain (scores are pre-scaled by log2(e) / sqrt(D)); each split
//    writes its unnormalized output, max and sum, and merge_kernel combines the splits.
// Accumulation is fp32 throughout.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdlib.h>

#include "common.cuh"
#include "kernels.cuh"

namespace pnmix {
namespace cuda {

template <typename T>
__device__ __forceinline__ float load_query(const void* q, int64_t i);
template <>
__device__ __forceinline__ float load_query<__half>(const void* q, int64_t i) {
  return __half2float(static_cast<const __half*>(q)[i]);
}
template <>
__device__ __forceinline__ float load_query<__nv_bfloat16>(const void* q, int64_t i) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(q)[i]);
}

__device__ __forceinline__ float half_bits_to_float(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// ROWS consecutive floats of shared memory (16-byte aligned when ROWS >= 4) into registers.
template <int ROWS>
__device__ __forceinline__ void load_rows(const float* src, float (&dst)[ROWS]) {
  if constexpr (ROWS % 4 == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; r += 4) {
      const float4 x = *reinterpret_cast<const float4*>(src + r);
      dst[r] = x.x;
      dst[r + 1] = x.y;
      dst[r + 2] = x.z;
      dst[r + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) dst[r] = src[r];
  }
}

// Padded row of a staged fp16 tile: 16 extra bytes keep 16-byte rows and spread the banks.
__host__ __device__ inline int f16_row(int64_t head_dim) { return (int)head_dim + 8; }

// Where tile `tile` of KV head (b, h) lies: kind, first token, token count, absolute position.
struct Tile {
  enum Kind { kFp16, kGroup } kind;
  int64_t group;             // kGroup: group index
  const uint16_t *k, *v;     // kFp16: first row
  int count;
  int64_t pos0;              // position of the first token in the sequence
};

__device__ inline Tile locate_tile(const AttendParams& p, int64_t bh, int64_t tile) {
  const int64_t D = p.layout.head_dim, S = p.layout.config.sink_tokens, R = p.layout.config.residual_size;
  const int64_t gs = p.layout.config.group_size;
  Tile t;
  t.kind = Tile::kFp16;
  t.group = 0;
  if (tile < p.tiles_sink) {
    const int64_t first = tile * kF16Tile;
    t.k = p.state.sink_k + (bh * S + first) * D;
    t.v = p.state.sink_v + (bh * S + first) * D;
    t.count = (int)min((int64_t)kF16Tile, p.cache.sink - first);
    t.pos0 = first;
    return t;
  }
  tile -= p.tiles_sink;
  if (tile < p.cache.groups) {
    t.kind = Tile::kGroup;
    t.group = tile;
    t.k = t.v = nullptr;
    t.count = (int)gs;
    t.pos0 = p.cache.sink + tile * gs;
    return t;
  }
  tile -= p.cache.groups;
  if (tile < p.tiles_residual) {
    const int64_t first = tile * kF16Tile;
    t.k = p.state.residual_k + (bh * R + first) * D;
    t.v = p.state.residual_v + (bh * R + first) * D;
    t.count = (int)min((int64_t)kF16Tile, p.cache.residual - first);
    t.pos0 = p.cache.sink + p.cache.groups * gs + first;
    return t;
  }
  tile -= p.tiles_residual;
  const int64_t first = tile * kF16Tile;
  t.k = p.k_new + (bh * p.n_new + first) * D;
  t.v = p.v_new + (bh * p.n_new + first) * D;
  t.count = (int)min((int64_t)kF16Tile, p.n_new - first);
  t.pos0 = p.seq_len + first;
  return t;
}

// Stage `count` fp16 rows of D (dense) into padded shared rows.
__device__ inline void stage_f16_rows(uint16_t* dst, const uint16_t* src, int count, int D) {
  const int row = f16_row(D);
  if (D % 8 == 0 && (reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    const int per_row = D / 8;
    for (int i = threadIdx.x; i < count * per_row; i += blockDim.x) {
      const int r = i / per_row, c = i % per_row;
      async_copy16(reinterpret_cast<uint4*>(dst + r * row) + c, reinterpret_cast<const uint4*>(src + (int64_t)r * D) + c);
    }
  } else {
    for (int i = threadIdx.x; i < count * D; i += blockDim.x) dst[(i / D) * row + i % D] = __ldg(src + i);
  }
}

// ---- the tensor-core path for the groups ----------------------------------------------------------
//
// Scores of a group: S[token][row] = sum_c code[token][c] * w[c][row] (+ the offset term), an
// (gs x D) x (D x rows) product; values: O[c][row] += sum_t code[t][c] * (step[t] * p[t][row]),
// a (D x gs) x (gs x rows) product. Both run as mma.m16n8k16 (fp16 in, fp32 accumulate): the codes
// are small integers, exact in fp16, and the fp32 weights go in as two fp16 halves (hi + lo), so
// the products keep about 22 bits, as good as the fp32 reference within the test tolerance.
// The eight query rows of a block are the MMA's N = 8 columns. A fragment's token (or channel)
// order is free, so each thread takes a few CONSECUTIVE tokens (channels) of a stream and reads
// them with one 32-bit window: one load for several codes.

// D += A * B (m16n8k16, row.col, f16 x f16 -> f32).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t half2_bits(__half2 x) {
  union {
    __half2 h;
    uint32_t u;
  } v;
  v.h = x;
  return v.u;
}

// The next code of a 32-bit window, as the bits of the half 1024 + code (0x6400 | code, code <
// 1024), and the window moved on to the code after it.
__device__ __forceinline__ uint32_t next_biased_code(uint32_t& window, int bits, uint32_t mask) {
  const uint32_t x = (window & mask) | 0x6400u;
  window >>= bits;
  return x;
}

// Two biased codes as an exact fp16 pair (lo, hi): one byte permute, one subtraction of 1024.
__device__ __forceinline__ uint32_t code_pair(uint32_t lo_biased, uint32_t hi_biased) {
  union {
    uint32_t u;
    __half2 h;
  } v;
  v.u = __byte_perm(lo_biased, hi_biased, 0x5410);
  const __half k1024 = __ushort_as_half(0x6400);
  return half2_bits(__hsub2(v.h, __halves2half2(k1024, k1024)));
}

// fp32 pair -> (hi, lo) fp16 pairs with hi + lo = x to about 22 bits.
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t* hi, uint32_t* lo) {
  const __half h0 = __float2half_rn(x0), h1 = __float2half_rn(x1);
  const __half l0 = __float2half_rn(x0 - __half2float(h0)), l1 = __float2half_rn(x1 - __half2float(h1));
  *hi = half2_bits(__halves2half2(h0, h1));
  *lo = half2_bits(__halves2half2(l0, l1));
}

// 32 stream bits from absolute bit `bit` of a staged stream: format.h's read_code for several
// consecutive codes at once (LSB-first bits, little-endian words). Buffers are padded by 8 bytes.
__device__ __forceinline__ uint32_t stream_window(const uint8_t* buf, uint32_t bit) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(buf);
  return __funnelshift_r(words[bit >> 5], words[(bit >> 5) + 1], bit & 31);
}

template <int ROWS>
__device__ __forceinline__ void mma_group_scores(const AttendParams& p, const Tile& t, const uint8_t* key_codes,
                                        const int* bits_s, const int* offset_s, const uint32_t* key_b,
                                        const float (&qoff)[ROWS], const int64_t (&limit)[ROWS], float* score_s) {
  const int D = (int)p.layout.head_dim, gs = p.layout.config.group_size;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tq = lane & 3;
  const int tiles = gs / 64;                       // M tiles (16 tokens) per warp
  const int t0 = warp * (gs / 4) + g * 2 * tiles;  // this thread's first token; it owns 2 * tiles
  const uint32_t* hi = key_b;
  const uint32_t* lo = key_b + D / 2 * 8;
  float d[4][4] = {};
  for (int ks = 0; ks < D / 16; ++ks) {
    const int c0 = ks * 16 + 2 * tq;
    uint32_t window[4], mask[4];
    int bits[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // channels c0, c0 + 1, c0 + 8, c0 + 9
      const int c = c0 + (q & 1) + (q >> 1) * 8;
      bits[q] = bits_s[c];
      mask[q] = (1u << bits[q]) - 1u;
      window[q] = stream_window(key_codes, (uint32_t)offset_s[c] * 8u + (uint32_t)(t0 * bits[q]));
    }
    const int b0 = (8 * ks + tq) * 8 + g, b1 = (8 * ks + tq + 4) * 8 + g;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      if (m >= tiles) break;
      uint32_t x[4][2];  // channel q's codes of tokens t0 + 2m (row g) and t0 + 2m + 1 (row g + 8)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        x[q][0] = next_biased_code(window[q], bits[q], mask[q]);
        x[q][1] = next_biased_code(window[q], bits[q], mask[q]);
      }
      const uint32_t a[4] = {code_pair(x[0][0], x[1][0]), code_pair(x[0][1], x[1][1]), code_pair(x[2][0], x[3][0]),
                             code_pair(x[2][1], x[3][1])};
      mma_16816(d[m], a, hi[b0], hi[b1]);
      mma_16816(d[m], a, lo[b0], lo[b1]);
    }
  }
  // this thread's two query rows (2 tq, 2 tq + 1), picked with constant indices (no local memory)
  int64_t my_limit[2] = {-1, -1};
  float my_qoff[2] = {0.0f, 0.0f};
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (r == 2 * tq) my_limit[0] = limit[r], my_qoff[0] = qoff[r];
    if (r == 2 * tq + 1) my_limit[1] = limit[r], my_qoff[1] = qoff[r];
  }
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    if (m >= tiles) break;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int token = t0 + 2 * m + (e >> 1), r = 2 * tq + (e & 1);
      if (r < ROWS)
        score_s[token * ROWS + r] = t.pos0 + token > my_limit[e & 1] ? -INFINITY : d[m][e] + my_qoff[e & 1];
    }
  }
}

// B operands of the values (step * p, hi/lo) and the offset sums sum_t offset[t] * p[t][row].
template <int ROWS>
__device__ __forceinline__ void mma_value_operands(const AttendParams& p, const float2* value_params, const float* score_s,
                                          uint32_t* value_b, float* value_offset) {
  const int gs = p.layout.config.group_size, NVB = (int)p.value_blocks;
  const int pairs = gs / 2 * 8;  // per block: token pairs x 8 rows
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int i = threadIdx.x; i < NVB * pairs; i += blockDim.x) {
    const int blk = i / pairs, pr = (i % pairs) / 8, n = i % 8;
    float x0 = 0.0f, x1 = 0.0f;
    if (n < ROWS) {
      x0 = value_params[(2 * pr) * NVB + blk].x * score_s[(2 * pr) * ROWS + n];
      x1 = value_params[(2 * pr + 1) * NVB + blk].x * score_s[(2 * pr + 1) * ROWS + n];
    }
    split_pair(x0, x1, value_b + i, value_b + NVB * pairs + i);
  }
  for (int i = warp; i < ROWS * NVB; i += kThreads / 32) {
    const int n = i / NVB, blk = i % NVB;
    float s = 0.0f;
    for (int t = lane; t < gs; t += 32) s = fmaf(value_params[t * NVB + blk].y, score_s[t * ROWS + n], s);
    s = warp_sum(s);
    if (lane == 0) value_offset[i] = s;
  }
}

template <int ROWS>
__device__ __forceinline__ void mma_group_values(const AttendParams& p, const uint8_t* value_codes, const uint32_t* value_b,
                                        const float* value_offset, float (&o)[4][4]) {
  const int D = (int)p.layout.head_dim, gs = p.layout.config.group_size, NVB = (int)p.value_blocks;
  const int bv = p.layout.config.value_bits, VB = (int)p.value_token_bytes;
  const uint32_t mask = (1u << bv) - 1u;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, tq = lane & 3;
  const int per_warp = D / 4, tiles = per_warp / 16;    // channels and M tiles per warp
  const int c0 = warp * per_warp + g * 2 * tiles;       // this thread's first channel; it owns 2 * tiles
  const int blk = warp * per_warp / (int)p.value_block;  // a warp's channels share one value block
  const int pairs = gs / 2 * 8;
  const uint32_t* hi = value_b + blk * pairs;
  const uint32_t* lo = value_b + NVB * pairs + blk * pairs;
  for (int ks = 0; ks < gs / 16; ++ks) {
    uint32_t window[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // tokens 2tq, 2tq + 1, 2tq + 8, 2tq + 9 of this k step
      const int token = ks * 16 + 2 * tq + (q & 1) + (q >> 1) * 8;
      window[q] = stream_window(value_codes, (uint32_t)(token * VB * 8 + c0 * bv));
    }
    const int b0 = (8 * ks + tq) * 8 + g, b1 = (8 * ks + tq + 4) * 8 + g;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      if (m >= tiles) break;
      uint32_t x[4][2];  // token q's codes of channels c0 + 2m (row g) and c0 + 2m + 1 (row g + 8)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        x[q][0] = next_biased_code(window[q], bv, mask);
        x[q][1] = next_biased_code(window[q], bv, mask);
      }
      const uint32_t a[4] = {code_pair(x[0][0], x[1][0]), code_pair(x[0][1], x[1][1]), code_pair(x[2][0], x[3][0]),
                             code_pair(x[2][1], x[3][1])};
      mma_16816(o[m], a, hi[b0], hi[b1]);
      mma_16816(o[m], a, lo[b0], lo[b1]);
    }
  }
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    if (m >= tiles) break;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 2 * tq + (e & 1);
      if (r < ROWS) o[m][e] += value_offset[r * NVB + blk];
    }
  }
}

template <typename QT, int ROWS, bool MMA>
__global__ void __launch_bounds__(kThreads) attend_split_kernel(const AttendParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const pnmix_layout& L = p.layout;
  const int D = (int)L.head_dim;
  const int64_t gs = L.config.group_size, H = L.kv_heads, G = p.group_slots;
  const int64_t bh = blockIdx.z, b = bh / H, h = bh % H;
  const int64_t gq = p.q_heads / H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  float* q_s = reinterpret_cast<float*>(smem + p.smem_q);        // [D][ROWS], pre-scaled
  float* w_s = reinterpret_cast<float*>(smem + p.smem_w);        // [D][ROWS], q * key step
  int* bits_s = reinterpret_cast<int*>(smem + p.smem_chan);      // [D]
  int* offset_s = bits_s + D;                                    // [D] channel stream byte offset
  float* score_s = reinterpret_cast<float*>(smem + p.smem_scores);  // [tokens][ROWS]
  float* m_s = reinterpret_cast<float*>(smem + p.smem_rowstate);    // [ROWS] running max
  float* l_s = m_s + ROWS;                                          // [ROWS] running sum
  float* alpha_s = l_s + ROWS;                                      // [ROWS] rescale of this tile
  float* qoff_s = alpha_s + ROWS;                                   // [kThreads / 32][ROWS]
  uint8_t* buf = smem + p.smem_buf;
  uint32_t* key_b = reinterpret_cast<uint32_t*>(smem + p.smem_key_b);      // MMA: [2][D/2][8]
  uint32_t* value_b = reinterpret_cast<uint32_t*>(smem + p.smem_value_b);  // MMA: [2][NVB][gs/2][8]
  float* value_offset = reinterpret_cast<float*>(smem + p.smem_value_offset);  // MMA: [ROWS][NVB]

  // The block's query rows: row r -> query head h * gq + r' / nq, query r' % nq, r' = chunk row.
  int64_t limit[ROWS];  // last visible position, -1 for padding rows
  int64_t max_limit = -1;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int64_t row = (int64_t)blockIdx.y * ROWS + r;
    limit[r] = row < p.rows_per_head ? p.seq_len + p.n_new - p.nq + row % p.nq : -1;
    max_limit = limit[r] > max_limit ? limit[r] : max_limit;
  }
  for (int i = threadIdx.x; i < D * ROWS; i += blockDim.x) {
    const int c = i / ROWS, r = i % ROWS;
    const int64_t row = (int64_t)blockIdx.y * ROWS + r;
    float x = 0.0f;
    if (row < p.rows_per_head) {
      const int64_t qh = h * gq + row / p.nq, qi = row % p.nq;
      x = load_query<QT>(p.q, ((b * p.q_heads + qh) * p.nq + qi) * D + c) * p.scale_log2;
    }
    q_s[c * ROWS + r] = x;
  }
  if (threadIdx.x < ROWS) {
    m_s[threadIdx.x] = -INFINITY;
    l_s[threadIdx.x] = 0.0f;
  }
  if (p.cache.groups) block_key_channel_layout(L, p.state.pair_mask + b * p.mask_bytes, h, bits_s, offset_s);

  float acc[ROWS][2];  // SIMT accumulators: output channels tid and tid + kThreads
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = 0.0f;
  float o_mma[4][4] = {};  // MMA accumulators of the groups' values (C fragments)

  const int64_t tile_begin = (int64_t)blockIdx.x * p.tiles_per_split;
  const int64_t tile_end = min(p.n_tiles, tile_begin + p.tiles_per_split);
  const int64_t KB = p.key_group_bytes, VB = p.value_token_bytes, NVB = p.value_blocks, vg = p.value_block;
  const int bv = L.config.value_bits;

  for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
    const Tile t = locate_tile(p, bh, tile);
    if (t.pos0 > max_limit) break;  // causal: this and every later tile is masked for all rows
    __syncthreads();                // the previous tile's buffers and scores are free

    // ---- stage ------------------------------------------------------------------------------
    uint8_t* key_codes = buf;
    uint8_t* value_codes = buf + p.buf_value_codes;
    float2* value_params = reinterpret_cast<float2*>(buf + p.buf_value_params);  // (step, offset)
    uint16_t* k_rows = reinterpret_cast<uint16_t*>(buf);
    uint16_t* v_rows = k_rows + kF16Tile * f16_row(D);
    if (t.kind == Tile::kGroup) {
      const int64_t row = bh * G + t.group;
      block_stage_bytes(key_codes, p.state.key_codes + row * KB, KB);
      block_stage_bytes(value_codes, p.state.value_codes + row * gs * VB, gs * VB);
      for (int64_t i = threadIdx.x; i < gs * NVB; i += blockDim.x)
        value_params[i] = make_float2(half_bits_to_float(p.state.value_step[row * gs * NVB + i]),
                                      half_bits_to_float(p.state.value_offset[row * gs * NVB + i]));
      float qoff[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) qoff[r] = 0.0f;
      for (int c = threadIdx.x; c < D; c += blockDim.x) {
        const float step = half_bits_to_float(p.state.key_step[row * D + c]);
        const float offset = half_bits_to_float(p.state.key_offset[row * D + c]);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          if constexpr (!MMA) w_s[c * ROWS + r] = q_s[c * ROWS + r] * step;
          qoff[r] = fmaf(q_s[c * ROWS + r], offset, qoff[r]);
        }
      }
      if constexpr (MMA) {
        for (int i = threadIdx.x; i < D / 2 * 8; i += blockDim.x) {
          const int pr = i / 8, n = i % 8;
          float w0 = 0.0f, w1 = 0.0f;
          if (n < ROWS) {
            w0 = q_s[(2 * pr) * ROWS + n] * half_bits_to_float(p.state.key_step[row * D + 2 * pr]);
            w1 = q_s[(2 * pr + 1) * ROWS + n] * half_bits_to_float(p.state.key_step[row * D + 2 * pr + 1]);
          }
          split_pair(w0, w1, key_b + i, key_b + D / 2 * 8 + i);
        }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const float s = warp_sum(qoff[r]);
        if (lane == 0) qoff_s[warp * ROWS + r] = s;
      }
    } else {
      stage_f16_rows(k_rows, t.k, t.count, D);
      stage_f16_rows(v_rows, t.v, t.count, D);
    }
    async_copy_wait();
    __syncthreads();

    // ---- scores ---------------------------------------------------------------------------------
    if (t.kind == Tile::kGroup) {
      float qoff[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        qoff[r] = 0.0f;
        for (int w = 0; w < kThreads / 32; ++w) qoff[r] += qoff_s[w * ROWS + r];
      }
      if constexpr (MMA) {
        mma_group_scores<ROWS>(p, t, key_codes, bits_s, offset_s, key_b, qoff, limit, score_s);
      } else {
        for (int i = threadIdx.x; i < t.count; i += blockDim.x) {
          float s[ROWS];
#pragma unroll
          for (int r = 0; r < ROWS; ++r) s[r] = qoff[r];
          for (int c = 0; c < D; ++c) {
            const int bits = bits_s[c];
            const float code = code_to_float(read_code(key_codes + offset_s[c], gs * bits / 8, i, bits));
            float w[ROWS];
            load_rows<ROWS>(w_s + c * ROWS, w);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) s[r] = fmaf(w[r], code, s[r]);
          }
#pragma unroll
          for (int r = 0; r < ROWS; ++r) score_s[i * ROWS + r] = t.pos0 + i > limit[r] ? -INFINITY : s[r];
        }
      }
    } else {
      // eight threads per token, each over every eighth channel pair, then a shuffle sum
      const int i = threadIdx.x / 8, part = threadIdx.x % 8;
      float s[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) s[r] = 0.0f;
      if (i < t.count) {
        const uint16_t* krow = k_rows + i * f16_row(D);
        for (int c = 2 * part; c < D; c += 16) {
          const float2 k2 = __half22float2(*reinterpret_cast<const __half2*>(krow + c));
#pragma unroll
          for (int r = 0; r < ROWS; ++r) s[r] = fmaf(q_s[(c + 1) * ROWS + r], k2.y, fmaf(q_s[c * ROWS + r], k2.x, s[r]));
        }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        for (int d = 4; d > 0; d >>= 1) s[r] += __shfl_xor_sync(0xffffffffu, s[r], d);
      if (i < t.count && part == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) score_s[i * ROWS + r] = t.pos0 + i > limit[r] ? -INFINITY : s[r];
      }
    }
    __syncthreads();

    // ---- online softmax: one warp per row -----------------------------------------------------------
    for (int r = warp; r < ROWS; r += kThreads / 32) {
      float mx = -INFINITY;
      for (int i = lane; i < t.count; i += 32) mx = fmaxf(mx, score_s[i * ROWS + r]);
      mx = warp_max(mx);
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, mx);
      const bool empty = m_new == -INFINITY;  // nothing visible yet: keep exp2 away from inf - inf
      float sum = 0.0f;
      for (int i = lane; i < t.count; i += 32) {
        const float e = empty ? 0.0f : exp2f(score_s[i * ROWS + r] - m_new);
        score_s[i * ROWS + r] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float alpha = empty ? 1.0f : exp2f(m_old - m_new);
        alpha_s[r] = alpha;
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();

    // ---- values ---------------------------------------------------------------------------------------
    if constexpr (MMA) {
      const int tq = lane & 3;
#pragma unroll
      for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 2 * tq + (e & 1);
          o_mma[m][e] *= r < ROWS ? alpha_s[r] : 0.0f;
        }
      if (t.kind == Tile::kGroup) {
        mma_value_operands<ROWS>(p, value_params, score_s, value_b, value_offset);
        __syncthreads();
        mma_group_values<ROWS>(p, value_codes, value_b, value_offset, o_mma);
      }
    }
    // SIMT: one thread per output channel
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = threadIdx.x + j * kThreads;
      if (c >= D) break;
      float o[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) o[r] = acc[r][j] * alpha_s[r];
      if (t.kind == Tile::kGroup) {
        if constexpr (!MMA) {
          const int64_t blk = c / vg;
          for (int i = 0; i < t.count; ++i) {
            const float2 sp = value_params[i * NVB + blk];
            const float v = fmaf(sp.x, code_to_float(read_code(value_codes + i * VB, VB, c, bv)), sp.y);
            float pr[ROWS];
            load_rows<ROWS>(score_s + i * ROWS, pr);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) o[r] = fmaf(pr[r], v, o[r]);
          }
        }
      } else {
        for (int i = 0; i < t.count; ++i) {
          const float v = half_bits_to_float(v_rows[i * f16_row(D) + c]);
          float pr[ROWS];
          load_rows<ROWS>(score_s + i * ROWS, pr);
#pragma unroll
          for (int r = 0; r < ROWS; ++r) o[r] = fmaf(pr[r], v, o[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[r][j] = o[r];
    }
  }
  __syncthreads();

  // ---- this split's partial state ------------------------------------------------------------------
  float* mma_out = w_s;  // [D][ROWS]: the MMA accumulators, gathered by channel
  if constexpr (MMA) {
    const int g = lane >> 2, tq = lane & 3, per_warp = D / 4, tiles = per_warp / 16;
    const int c0 = warp * per_warp + g * 2 * tiles;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      if (m >= tiles) break;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = c0 + 2 * m + (e >> 1), r = 2 * tq + (e & 1);
        if (r < ROWS) mma_out[c * ROWS + r] = o_mma[m][e];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int64_t row = (int64_t)blockIdx.y * ROWS + r;
    if (row >= p.rows_per_head) break;
    const int64_t qh = h * gq + row / p.nq, qi = row % p.nq;
    const int64_t out_row = (b * p.q_heads + qh) * p.nq + qi;
    const int64_t part = (int64_t)blockIdx.x * p.out_rows + out_row;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = threadIdx.x + j * kThreads;
      if (c < D) p.part_o[part * D + c] = acc[r][j] + (MMA ? mma_out[c * ROWS + r] : 0.0f);
    }
    if (threadIdx.x == 0) {
      p.part_m[part] = m_s[r];
      p.part_l[part] = l_s[r];
    }
  }
}

// out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s over the splits; one block per output row.
__global__ void __launch_bounds__(kThreads) merge_kernel(const AttendParams p) {
  const int64_t row = blockIdx.x, D = p.layout.head_dim;
  float M = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) M = fmaxf(M, p.part_m[(int64_t)s * p.out_rows + row]);
  float total = 0.0f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float m = p.part_m[(int64_t)s * p.out_rows + row];
    if (m != -INFINITY) total += exp2f(m - M) * p.part_l[(int64_t)s * p.out_rows + row];
  }
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) {
      const int64_t part = (int64_t)s * p.out_rows + row;
      const float m = p.part_m[part];
      if (m != -INFINITY) o = fmaf(exp2f(m - M), p.part_o[part * D + c], o);
    }
    p.out[row * D + c] = o / total;
  }
}

// ---- host side --------------------------------------------------------------------------------------

int max_dynamic_smem() {
  int device = 0, bytes = 48 * 1024;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  return bytes;
}

int64_t plan_attend(const pnmix_layout& L, int64_t seq_len, int64_t q_heads, int64_t nq, int64_t n_new,
                    int sm_count, AttendParams* p, const char** why) {
  const pnmix_config& cfg = L.config;
  const int64_t D = L.head_dim, gs = cfg.group_size;
  p->layout = L;
  p->seq_len = seq_len;
  p->n_new = n_new;
  p->q_heads = q_heads;
  p->nq = nq;
  p->cache = lengths(cfg, seq_len);
  p->group_slots = max_groups(L);
  p->key_group_bytes = key_group_bytes(L);
  p->value_token_bytes = value_token_bytes(L);
  p->value_blocks = value_blocks(L);
  p->value_block = value_block(L);
  p->mask_bytes = mask_bytes(L);
  p->rows_per_head = q_heads / L.kv_heads * nq;
  p->out_rows = L.batch * q_heads * nq;
  p->rows = p->rows_per_head <= 1 ? 1 : p->rows_per_head <= 2 ? 2 : p->rows_per_head <= 4 ? 4 : 8;
  p->row_chunks = (int)ceil_div(p->rows_per_head, p->rows);
  p->scale_log2 = (float)(1.4426950408889634 / sqrt((double)D));

  p->tiles_sink = ceil_div(p->cache.sink, kF16Tile);
  p->tiles_residual = ceil_div(p->cache.residual, kF16Tile);
  p->tiles_new = ceil_div(n_new, kF16Tile);
  p->n_tiles = p->tiles_sink + p->cache.groups + p->tiles_residual + p->tiles_new;
  // Enough blocks for a few per SM, whatever the batch: split the tiles evenly.
  const int64_t blocks = L.batch * L.kv_heads * p->row_chunks;
  const int64_t target = 4 * (int64_t)(sm_count > 0 ? sm_count : 1);
  int64_t splits = ceil_div(target, blocks);
  if (splits > p->n_tiles) splits = p->n_tiles;
  if (splits < 1) splits = 1;
  p->tiles_per_split = ceil_div(p->n_tiles, splits);
  p->num_splits = (int)ceil_div(p->n_tiles, p->tiles_per_split);

  // The tensor-core path needs whole MMA tiles and 32-bit code windows: a warp's quarter of the
  // group (gs / 4 tokens) and of the channels (D / 4) in 16s, at most four tiles each, codes of
  // at most 4 bits, and a warp's channels inside one value block. PNMIX_CUDA_SIMT=1 turns it off.
  const char* simt = getenv("PNMIX_CUDA_SIMT");
  p->use_mma = gs % 64 == 0 && gs <= 256 && D % 64 == 0 && D <= 256 && p->value_block % (D / 4) == 0 &&
               cfg.key_high_bits <= 4 && cfg.key_low_bits <= 4 && cfg.value_bits <= 4 &&
               !(simt && simt[0] && simt[0] != '0');

  // shared memory: q, w, channel layout, scores, row state, then one tile's buffer
  const int R = p->rows;
  const int64_t tokens = gs > kF16Tile ? gs : kF16Tile;
  const int64_t group_buf_codes = align_up(p->key_group_bytes + 8, 16);  // +8: code windows peek
  const int64_t group_buf_params = group_buf_codes + align_up(gs * p->value_token_bytes + 8, 16);
  const int64_t group_buf = group_buf_params + gs * p->value_blocks * 8;
  const int64_t f16_buf = 2 * kF16Tile * f16_row(D) * 2;
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t here = at;
    at += align_up(bytes, 16);
    return (int)here;
  };
  p->smem_q = take(D * R * 4);
  p->smem_w = take(D * R * 4);
  p->smem_chan = take(D * 8);
  p->smem_scores = take(tokens * R * 4);
  p->smem_rowstate = take((3 + kThreads / 32) * R * 4);
  p->smem_buf = take(group_buf > f16_buf ? group_buf : f16_buf);
  p->smem_key_b = take(p->use_mma ? 2 * (D / 2) * 8 * 4 : 0);
  p->smem_value_b = take(p->use_mma ? 2 * p->value_blocks * (gs / 2) * 8 * 4 : 0);
  p->smem_value_offset = take(p->use_mma ? R * p->value_blocks * 4 : 0);
  p->buf_value_codes = (int)group_buf_codes;
  p->buf_value_params = (int)group_buf_params;
  p->smem_bytes = (int)at;
  p->q_dtype = PNMIX_DTYPE_FP16;
  *why = nullptr;
  if (D > PNMIX_CUDA_MAX_HEAD_DIM) *why = "head_dim must be <= 256 for the CUDA attention kernel";
  else if (at > max_dynamic_smem())
    *why = "group_size too large for the CUDA attention kernel: one group does not fit in shared memory";
  else if (L.batch * L.kv_heads > 65535) *why = "batch * kv_heads must be <= 65535 for the CUDA kernels";
  else if (p->row_chunks > 65535) *why = "too many query rows per KV head for the CUDA attention kernel";
  if (*why) return 0;
  const int64_t parts = (int64_t)p->num_splits * p->out_rows;
  p->workspace_m = align_up(parts * D * 4, 256);
  p->workspace_l = p->workspace_m + align_up(parts * 4, 256);
  return p->workspace_l + align_up(parts * 4, 256);
}

template <typename QT, int ROWS>
static cudaError_t launch_split(const AttendParams& p, cudaStream_t stream) {
  auto kernel = p.use_mma ? attend_split_kernel<QT, ROWS, true> : attend_split_kernel<QT, ROWS, false>;
  if (p.smem_bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.smem_bytes);
    if (err != cudaSuccess) return err;
  }
  const dim3 grid((unsigned)p.num_splits, (unsigned)p.row_chunks, (unsigned)(p.layout.batch * p.layout.kv_heads));
  kernel<<<grid, kThreads, p.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename QT>
static cudaError_t launch_rows(const AttendParams& p, cudaStream_t stream) {
  switch (p.rows) {
    case 1: return launch_split<QT, 1>(p, stream);
    case 2: return launch_split<QT, 2>(p, stream);
    case 4: return launch_split<QT, 4>(p, stream);
    default: return launch_split<QT, 8>(p, stream);
  }
}

cudaError_t launch_attend(const AttendParams& p, cudaStream_t stream) {
  const cudaError_t err = p.q_dtype == PNMIX_DTYPE_BF16 ? launch_rows<__nv_bfloat16>(p, stream)
                                                       : launch_rows<__half>(p, stream);
  if (err != cudaSuccess) return err;
  merge_kernel<<<(unsigned)p.out_rows, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace pnmix
