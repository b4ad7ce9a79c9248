// plugins/cuda/append.cu: append new fp16 tokens to the packed cache, flushing in place.
//
// The schedule is docs/FORMAT.md section 2; the arithmetic is format.h / quant.h (fit_affine,
// quantize_code, write_code, quantize_value_token, choose_high_pairs), so the bytes are those of
// pnmix.cache.append_reference. The launches, in stream order:
//   1. seq_len == 0: pair energies (one block per sequence and head), then the mask;
//   2. new tokens that still fit in the sink;
//   3. groups that hold old residual rows are gathered into the workspace (the residual is
//      about to be overwritten), then every new group is quantized, one block per group and head;
//   4. the residual tail moves to the front of the residual, followed by the new tokens.
#include <math.h>

#include "common.cuh"
#include "kernels.cuh"
#include "pnmix/half.h"
#include "pnmix/quant.h"

namespace pnmix {
namespace cuda {

// ---- 1. saliency ---------------------------------------------------------------------------------

// Per-channel float64 sums of squares over the n new keys (one thread per channel, tokens in
// order), then each pair's energy exactly as pnmix::pair_energy forms it (NaN ranks lowest).
__global__ void __launch_bounds__(kThreads) pair_energy_kernel(const AppendParams p) {
  extern __shared__ double channel_sum[];  // [D]
  const pnmix_layout& L = p.layout;
  const int64_t bh = blockIdx.x, D = L.head_dim;
  const uint16_t* keys = p.k + bh * p.n * D;
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    double s = 0.0;
    for (int64_t t = 0; t < p.n; ++t) {
      const double x = half_to_float(keys[t * D + c]);
      s += x * x;  // exact: the square of an fp16 value fits in a double's mantissa
    }
    channel_sum[c] = s;
  }
  __syncthreads();
  for (int64_t pair = threadIdx.x; pair < p.pairs; pair += blockDim.x) {
    int64_t a, b;
    pair_channels(pair, D, L.config.pair_layout, &a, &b);
    const double e = 0.0 + channel_sum[a] + channel_sum[b];
    p.energy[bh * p.pairs + pair] = e != e ? -INFINITY : e;
  }
}

// One block per sequence: each head picks its high pairs into its own scratch bits (heads may
// share a mask byte), then one thread packs them into the sequence's mask.
__global__ void __launch_bounds__(kThreads) pair_mask_kernel(const AppendParams p) {
  const pnmix_layout& L = p.layout;
  const int64_t b = blockIdx.x, H = L.kv_heads;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    uint8_t* high = p.high + (b * H + h) * p.high_bytes;
    for (int64_t i = 0; i < p.high_bytes; ++i) high[i] = 0;
    choose_high_pairs(L, p.energy + (b * H + h) * p.pairs, 0, high);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint8_t* mask = p.state.pair_mask + b * p.mask_bytes;
    for (int64_t i = 0; i < p.mask_bytes; ++i) mask[i] = 0;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t pair = 0; pair < p.pairs; ++pair)
        if (pair_is_high(p.high + (b * H + h) * p.high_bytes, p.pairs, 0, pair)) set_pair_high(mask, p.pairs, h, pair);
  }
}

// ---- 2. the sink ------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) sink_kernel(const AppendParams p) {
  const int64_t bh = blockIdx.x, D = p.layout.head_dim, S = p.layout.config.sink_tokens;
  const int64_t bytes = p.into_sink * D * 2;
  const int64_t dst = (bh * S + p.before.sink) * D, src = bh * p.n * D;
  block_copy_bytes(reinterpret_cast<uint8_t*>(p.state.sink_k + dst), reinterpret_cast<const uint8_t*>(p.k + src), bytes);
  block_copy_bytes(reinterpret_cast<uint8_t*>(p.state.sink_v + dst), reinterpret_cast<const uint8_t*>(p.v + src), bytes);
}

// ---- 3. groups ------------------------------------------------------------------------------------

// Row s of the residual stream (the residual's rows, then the new tokens past the sink).
__device__ inline const uint16_t* stream_row(const AppendParams& p, const uint16_t* residual, const uint16_t* fresh,
                                             int64_t bh, int64_t s) {
  const int64_t D = p.layout.head_dim, R = p.layout.config.residual_size;
  if (s < p.before.residual) return residual + (bh * R + s) * D;
  return fresh + (bh * p.n + p.into_sink + s - p.before.residual) * D;
}

// Groups that start inside the old residual: copy their rows out before the tail overwrites it.
__global__ void __launch_bounds__(kThreads) gather_kernel(const AppendParams p) {
  const int64_t j = blockIdx.x, bh = blockIdx.y, BH = p.layout.batch * p.layout.kv_heads;
  const int64_t gs = p.layout.config.group_size, D = p.layout.head_dim;
  const int64_t out = ((j * BH) + bh) * gs * D;
  for (int64_t t = 0; t < gs; ++t) {
    const int64_t s = j * gs + t;
    block_copy_bytes(reinterpret_cast<uint8_t*>(p.gather_k + out + t * D),
                     reinterpret_cast<const uint8_t*>(stream_row(p, p.state.residual_k, p.k, bh, s)), D * 2);
    block_copy_bytes(reinterpret_cast<uint8_t*>(p.gather_v + out + t * D),
                     reinterpret_cast<const uint8_t*>(stream_row(p, p.state.residual_v, p.v, bh, s)), D * 2);
  }
}

// One block per (new group, sequence x head). Keys: one thread per channel (fit over the group's
// tokens, quantize, pack into the channel's own bytes); values: one thread per token. Codes are
// packed in shared memory (write_code is a read-modify-write of bytes), then stored whole.
__global__ void __launch_bounds__(kThreads) group_kernel(const AppendParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const pnmix_layout& L = p.layout;
  const int64_t j = blockIdx.x, bh = blockIdx.y, h = bh % L.kv_heads, b = bh / L.kv_heads;
  const int64_t gs = L.config.group_size, D = L.head_dim, G = p.group_slots;
  const int64_t KB = p.key_group_bytes, VB = p.value_token_bytes, NVB = p.value_blocks;
  const int64_t slot = p.before.groups + j;

  int* bits_s = reinterpret_cast<int*>(smem);
  int* offset_s = bits_s + D;
  uint8_t* key_s = smem + align_up(8 * D, 16);
  uint8_t* value_s = key_s + align_up(KB, 16);

  const uint16_t *keys, *values;  // the group's gs rows, D apart
  if (j < p.mixed_groups) {
    const int64_t at = ((j * L.batch * L.kv_heads) + bh) * gs * D;
    keys = p.gather_k + at;
    values = p.gather_v + at;
  } else {
    const int64_t at = (bh * p.n + p.into_sink + j * gs - p.before.residual) * D;
    keys = p.k + at;
    values = p.v + at;
  }

  block_key_channel_layout(L, p.state.pair_mask + b * p.mask_bytes, h, bits_s, offset_s);
  for (int64_t i = threadIdx.x; i < KB; i += blockDim.x) key_s[i] = 0;
  __syncthreads();

  const int64_t row = bh * G + slot;
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    const int bits = bits_s[c];
    const QParams qp = fit_affine(keys + c, gs, D, bits);
    p.state.key_step[row * D + c] = qp.step;
    p.state.key_offset[row * D + c] = qp.offset;
    const float s = half_to_float(qp.step), o = half_to_float(qp.offset);
    uint8_t* stream = key_s + offset_s[c];
    const int64_t nbytes = gs * bits / 8;
    for (int64_t t = 0; t < gs; ++t)
      write_code(stream, nbytes, t, bits, quantize_code(half_to_float(keys[t * D + c]), s, o, bits));
  }
  for (int64_t t = threadIdx.x; t < gs; t += blockDim.x) {
    const int64_t token = row * gs + t;
    quantize_value_token(L, values + t * D, value_s + t * VB, p.state.value_step + token * NVB, p.state.value_offset + token * NVB);
  }
  __syncthreads();
  block_copy_bytes(p.state.key_codes + row * KB, key_s, KB);
  block_copy_bytes(p.state.value_codes + row * gs * VB, value_s, gs * VB);
}

// ---- 4. the residual ---------------------------------------------------------------------------------

// Residual row d takes stream row d + shift (shift = flushed tokens). Rows move down, so one
// thread owns a column and walks rows upwards: a row is read (as a source) before it is
// overwritten (as a destination). Eight rows are loaded before any is stored, which is safe
// because shift is 0 (only new rows are read) or a multiple of group_size >= 8.
template <typename Vec>
__device__ inline void move_rows(const AppendParams& p, uint16_t* residual, const uint16_t* fresh, int64_t bh,
                                 int64_t first, int64_t end, int64_t shift) {
  const int64_t D = p.layout.head_dim, R = p.layout.config.residual_size;
  const int64_t per_row = D * 2 / (int64_t)sizeof(Vec);
  for (int64_t col = threadIdx.x; col < per_row; col += blockDim.x) {
    for (int64_t d0 = first; d0 < end; d0 += 8) {
      Vec held[8];
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (d0 + u < end)
          held[u] = reinterpret_cast<const Vec*>(stream_row(p, residual, fresh, bh, d0 + u + shift))[col];
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (d0 + u < end) reinterpret_cast<Vec*>(residual + (bh * R + d0 + u) * D)[col] = held[u];
    }
  }
}

__global__ void __launch_bounds__(kThreads) residual_kernel(const AppendParams p, int vector16) {
  const int64_t bh = blockIdx.x;
  const int64_t shift = p.new_groups * p.layout.config.group_size;
  const int64_t first = shift == 0 ? p.before.residual : 0;  // unchanged rows stay
  const int64_t end = p.after.residual;
  if (vector16) {
    move_rows<uint4>(p, p.state.residual_k, p.k, bh, first, end, shift);
    move_rows<uint4>(p, p.state.residual_v, p.v, bh, first, end, shift);
  } else {
    move_rows<uint16_t>(p, p.state.residual_k, p.k, bh, first, end, shift);
    move_rows<uint16_t>(p, p.state.residual_v, p.v, bh, first, end, shift);
  }
}

// ---- host side -------------------------------------------------------------------------------------

void plan_append(const pnmix_layout& L, int64_t seq_len, int64_t n, AppendParams* p) {
  const pnmix_config& c = L.config;
  p->layout = L;
  p->seq_len = seq_len;
  p->n = n;
  p->before = lengths(c, seq_len);
  p->after = lengths(c, seq_len + n);
  p->into_sink = p->after.sink - p->before.sink;
  p->new_groups = p->after.groups - p->before.groups;
  const int64_t mixed = ceil_div(p->before.residual, c.group_size);
  p->mixed_groups = p->new_groups < mixed ? p->new_groups : mixed;
  p->group_slots = max_groups(L);
  p->key_group_bytes = key_group_bytes(L);
  p->value_token_bytes = value_token_bytes(L);
  p->value_blocks = value_blocks(L);
  p->pairs = pairs(L);
  p->mask_bytes = mask_bytes(L);
  p->high_bytes = ceil_div(p->pairs, 8);
  p->group_smem = (int)(align_up(8 * L.head_dim, 16) + align_up(p->key_group_bytes, 16) +
                        c.group_size * p->value_token_bytes);
}

int64_t append_workspace(const pnmix_layout& L, int64_t seq_len, int64_t n, int64_t offsets[4]) {
  AppendParams p;
  plan_append(L, seq_len, n, &p);
  const int64_t BH = L.batch * L.kv_heads;
  const bool saliency = seq_len == 0 && n > 0;
  const int64_t sizes[4] = {
      saliency ? BH * p.pairs * 8 : 0,
      saliency ? BH * p.high_bytes : 0,
      p.mixed_groups * BH * L.config.group_size * L.head_dim * 2,
      p.mixed_groups * BH * L.config.group_size * L.head_dim * 2,
  };
  int64_t total = 0;
  for (int i = 0; i < 4; ++i) {
    offsets[i] = total;
    total += align_up(sizes[i], 256);
  }
  return total;
}

cudaError_t launch_append(const AppendParams& p, cudaStream_t stream) {
  const pnmix_layout& L = p.layout;
  const int64_t BH = L.batch * L.kv_heads;
  if (p.n == 0) return cudaSuccess;
  if (p.seq_len == 0) {
    pair_energy_kernel<<<(unsigned)BH, kThreads, L.head_dim * sizeof(double), stream>>>(p);
    pair_mask_kernel<<<(unsigned)L.batch, kThreads, 0, stream>>>(p);
  }
  if (p.into_sink) sink_kernel<<<(unsigned)BH, kThreads, 0, stream>>>(p);
  if (p.new_groups) {
    if (p.mixed_groups) gather_kernel<<<dim3((unsigned)p.mixed_groups, (unsigned)BH), kThreads, 0, stream>>>(p);
    if (p.group_smem > 48 * 1024) {
      const cudaError_t err =
          cudaFuncSetAttribute(group_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p.group_smem);
      if (err != cudaSuccess) return err;
    }
    group_kernel<<<dim3((unsigned)p.new_groups, (unsigned)BH), kThreads, p.group_smem, stream>>>(p);
  }
  const uintptr_t any = reinterpret_cast<uintptr_t>(p.state.residual_k) | reinterpret_cast<uintptr_t>(p.state.residual_v) |
                        reinterpret_cast<uintptr_t>(p.k) | reinterpret_cast<uintptr_t>(p.v);
  const int vector16 = (L.head_dim % 8 == 0) && (any & 15) == 0;
  if (p.after.residual > (p.new_groups ? 0 : p.before.residual))
    residual_kernel<<<(unsigned)BH, kThreads, 0, stream>>>(p, vector16);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace pnmix
