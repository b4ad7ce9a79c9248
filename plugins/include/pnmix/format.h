// pnmix/format.h: docs/FORMAT.md in C++ (host and device). pnmix/format.py is the Python twin.
//
// Sizes (section 1), the closed-form schedule (section 2), state tensor shapes (section 3),
// LSB-first bit streams (3.1), the pair mask and per-channel key bits (3.2, 3.3), and the
// config checks a reader must make (section 1.1). The facts Python owns (field names, limits,
// state tensors, the .pnkv header) come from generated.h. Everything is inline and
// allocation-free.
#ifndef PNMIX_FORMAT_H
#define PNMIX_FORMAT_H

#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "params.h"

namespace pnmix {

// ---- section 1: derived sizes ------------------------------------------------------------

PNMIX_HD inline int64_t pairs(const pnmix_layout& L) { return L.head_dim / 2; }

// vg = min(value_group_size, D)
PNMIX_HD inline int64_t value_block(const pnmix_layout& L) {
  return L.config.value_group_size < L.head_dim ? (int64_t)L.config.value_group_size : L.head_dim;
}
// NVB = D / vg
PNMIX_HD inline int64_t value_blocks(const pnmix_layout& L) { return L.head_dim / value_block(L); }

// n_high = floor(high_ratio * P + 0.5)
PNMIX_HD inline int64_t high_pairs(const pnmix_layout& L) {
  return (int64_t)floor(L.config.high_ratio * (double)pairs(L) + 0.5);
}

// KB: key bytes of one group and head
PNMIX_HD inline int64_t key_group_bytes(const pnmix_layout& L) {
  const int64_t c_hi = 2 * high_pairs(L), c_lo = L.head_dim - c_hi;
  return (int64_t)L.config.group_size * (c_hi * L.config.key_high_bits + c_lo * L.config.key_low_bits) / 8;
}
// VB: value bytes of one token and head
PNMIX_HD inline int64_t value_token_bytes(const pnmix_layout& L) {
  return L.head_dim * L.config.value_bits / 8;
}
// MB: mask bytes per sequence
PNMIX_HD inline int64_t mask_bytes(const pnmix_layout& L) { return (L.kv_heads * pairs(L) + 7) / 8; }

// ---- section 2: where tokens are -----------------------------------------------------------

struct Lengths {
  int64_t sink, groups, residual;
};

PNMIX_HD inline Lengths lengths(const pnmix_config& c, int64_t seq_len) {
  Lengths n;
  n.sink = seq_len < c.sink_tokens ? seq_len : (int64_t)c.sink_tokens;
  const int64_t rest = seq_len - n.sink;
  n.groups = rest < c.residual_size ? 0 : (rest - c.residual_size) / c.group_size + 1;
  n.residual = rest - n.groups * c.group_size;
  return n;
}

// G: group slots of the capacity
PNMIX_HD inline int64_t max_groups(const pnmix_layout& L) {
  return lengths(L.config, L.max_seq_len).groups;
}

// ---- section 3: the state tensors ------------------------------------------------------------

// Name of state tensor i, as pnmix/format.py STATE_NAMES (ONNX input names; messages).
inline const char* state_name(int i) {
  static const char* const kNames[PNMIX_NUM_STATE] = {
#define PNMIX_X(index, NAME, name, elem_bytes, type) #name,
      PNMIX_STATE_TENSORS(PNMIX_X)
#undef PNMIX_X
  };
  return (i >= 0 && i < PNMIX_NUM_STATE) ? kNames[i] : "?";
}

// The eleven state buffers, typed (section 3): what the CPU and CUDA kernels read (Writable =
// false) or write. state_view builds one from the C ABI's pointers in STATE_NAMES order.
template <bool Writable>
struct StateView {
  template <class T>
  using Ptr = typename std::conditional<Writable, T*, const T*>::type;
  Ptr<uint16_t> sink_k, sink_v, residual_k, residual_v;
  Ptr<uint8_t> key_codes;
  Ptr<uint16_t> key_step, key_offset;
  Ptr<uint8_t> value_codes;
  Ptr<uint16_t> value_step, value_offset;
  Ptr<uint8_t> pair_mask;
};

template <bool Writable>
inline StateView<Writable> state_view(void* const* data) {
  using View = StateView<Writable>;
  using Half = typename View::template Ptr<uint16_t>;
  using Byte = typename View::template Ptr<uint8_t>;
  View v;
  v.sink_k = static_cast<Half>(data[PNMIX_SINK_K]);
  v.sink_v = static_cast<Half>(data[PNMIX_SINK_V]);
  v.residual_k = static_cast<Half>(data[PNMIX_RESIDUAL_K]);
  v.residual_v = static_cast<Half>(data[PNMIX_RESIDUAL_V]);
  v.key_codes = static_cast<Byte>(data[PNMIX_KEY_CODES]);
  v.key_step = static_cast<Half>(data[PNMIX_KEY_STEP]);
  v.key_offset = static_cast<Half>(data[PNMIX_KEY_OFFSET]);
  v.value_codes = static_cast<Byte>(data[PNMIX_VALUE_CODES]);
  v.value_step = static_cast<Half>(data[PNMIX_VALUE_STEP]);
  v.value_offset = static_cast<Half>(data[PNMIX_VALUE_OFFSET]);
  v.pair_mask = static_cast<Byte>(data[PNMIX_PAIR_MASK]);
  return v;
}

// Element size in bytes of state tensor i (fp16 = 2, codes and mask = 1; format.STATE_DTYPES).
PNMIX_HD inline int64_t state_elem_bytes(int i) {
  switch (i) {
#define PNMIX_X(index, NAME, name, elem_bytes, type) \
  case index: return elem_bytes;
    PNMIX_STATE_TENSORS(PNMIX_X)
#undef PNMIX_X
    default: return 0;
  }
}

// Shape of state tensor i with `groups` group slots, and the leading dims per sequence/head:
// every tensor but pair_mask is [B, H, rows, row_elems]; pair_mask is [B, MB] (rows = 1, H = 1).
struct TensorShape {
  int64_t heads;      // H, or 1 for pair_mask
  int64_t rows;       // S, R or G (slots along the token/group axis)
  int64_t row_elems;  // elements per row (per token or per group)
};

// rows_used: the slot count of the axis (S, R or G), as a capacity or as the used part.
PNMIX_HD inline TensorShape state_shape(const pnmix_layout& L, int i, int64_t sink_rows,
                                        int64_t residual_rows, int64_t group_rows) {
  const int64_t H = L.kv_heads, D = L.head_dim, gs = L.config.group_size;
  switch (i) {
    case PNMIX_SINK_K:
    case PNMIX_SINK_V: return TensorShape{H, sink_rows, D};
    case PNMIX_RESIDUAL_K:
    case PNMIX_RESIDUAL_V: return TensorShape{H, residual_rows, D};
    case PNMIX_KEY_CODES: return TensorShape{H, group_rows, key_group_bytes(L)};
    case PNMIX_KEY_STEP:
    case PNMIX_KEY_OFFSET: return TensorShape{H, group_rows, D};
    case PNMIX_VALUE_CODES: return TensorShape{H, group_rows, gs * value_token_bytes(L)};
    case PNMIX_VALUE_STEP:
    case PNMIX_VALUE_OFFSET: return TensorShape{H, group_rows, gs * value_blocks(L)};
    default: return TensorShape{1, 1, mask_bytes(L)};
  }
}

// Full (capacity) shape of state tensor i: FORMAT.md section 3's table.
PNMIX_HD inline TensorShape capacity_shape(const pnmix_layout& L, int i) {
  return state_shape(L, i, L.config.sink_tokens, L.config.residual_size, max_groups(L));
}

// Used shape at seq_len tokens (section 5); the mask is used once seq_len > 0.
PNMIX_HD inline TensorShape used_shape(const pnmix_layout& L, int i, int64_t seq_len) {
  const Lengths n = lengths(L.config, seq_len);
  TensorShape s = state_shape(L, i, n.sink, n.residual, n.groups);
  if (i == PNMIX_PAIR_MASK && seq_len == 0) s.rows = 0;
  return s;
}

PNMIX_HD inline int64_t shape_bytes(const pnmix_layout& L, int i, const TensorShape& s) {
  return L.batch * s.heads * s.rows * s.row_elems * state_elem_bytes(i);
}

// Bytes of the whole capacity buffer of state tensor i.
PNMIX_HD inline int64_t state_bytes(const pnmix_layout& L, int i) {
  return shape_bytes(L, i, capacity_shape(L, i));
}

// Persistent bytes at seq_len (section 5): the used parts of all eleven tensors.
PNMIX_HD inline int64_t persistent_bytes(const pnmix_layout& L, int64_t seq_len) {
  int64_t total = 0;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) total += shape_bytes(L, i, used_shape(L, i, seq_len));
  return total;
}

// ---- one group's tensors side by side: a paged cache's page (docs/VLLM.md section 2) ----------

// The six per-group tensors of section 3 (key_codes, key_step, key_offset, value_codes,
// value_step, value_offset: state indices PNMIX_KEY_CODES .. PNMIX_VALUE_OFFSET) of one
// (sequence, KV head, group), one after another: where each starts and how many bytes it has.
// A page of a paged cache holds them so for each KV head (pnmix/vllm/paged.py's PageLayout;
// tests/vllm/test_paged.py checks its offsets against these, pnmix_group_sections).
constexpr int kGroupTensors = PNMIX_VALUE_OFFSET - PNMIX_KEY_CODES + 1;
struct GroupSections {
  int64_t first_byte[kGroupTensors];
  int64_t bytes[kGroupTensors];
  int64_t total;  // one group and head: KB + 4D + gs*(VB + 4*NVB)
};

PNMIX_HD inline GroupSections group_sections(const pnmix_layout& L) {
  GroupSections s;
  int64_t at = 0;
  for (int j = 0; j < kGroupTensors; ++j) {
    const int i = PNMIX_KEY_CODES + j;
    s.first_byte[j] = at;
    s.bytes[j] = capacity_shape(L, i).row_elems * state_elem_bytes(i);
    at += s.bytes[j];
  }
  s.total = at;
  return s;
}

// The block (index into a sequence's block table, blocks of group_size tokens) whose page holds
// group g: the block of the group's last token, S + (g + 1) * gs - 1.
PNMIX_HD inline int64_t page_block_of_group(const pnmix_config& c, int64_t g) {
  return ((int64_t)c.sink_tokens + (g + 1) * (int64_t)c.group_size - 1) / c.group_size;
}

// ---- config checks (docs/FORMAT.md 1.1; messages name the field like pnmix/config.py) -------

// v > limit for any integer v (a function, so a bound equal to the type's own limit is no
// "always false" comparison for the compiler to warn about).
PNMIX_HD inline bool exceeds(int64_t v, int64_t limit) { return v > limit; }

// nullptr when valid, else a static one-line reason. The integer ranges are generated.h's
// (config.INT_FIELD_RANGES); the rules between fields follow them.
PNMIX_HD inline const char* config_error(const pnmix_config& c) {
  if (!(c.high_ratio >= 0.0 && c.high_ratio <= 1.0)) return "config field 'high_ratio' must be in [0, 1]";
#define PNMIX_X(name, lo, hi)                                                      \
  if (exceeds(lo, c.name)) return "config field '" #name "' must be >= " #lo; \
  if (exceeds(c.name, hi)) return "config field '" #name "' must be <= " #hi;
  PNMIX_CONFIG_INT_RANGES(PNMIX_X)
#undef PNMIX_X
  if (c.group_size % 8) return "config field 'group_size' must be a positive multiple of 8";
  if (c.residual_size < c.group_size) return "config field 'residual_size' must be >= group_size";
  if (c.pair_layout < 0 || c.pair_layout >= PNMIX_NUM_PAIR_LAYOUTS)
    return "config field 'pair_layout' must be 0 (adjacent) or 1 (half)";
  return nullptr;
}

// Config plus the shape checks (params.h's limits). They keep every byte count far inside int64.
PNMIX_HD inline const char* layout_error(const pnmix_layout& L) {
  const char* bad = config_error(L.config);
  if (bad) return bad;
  if (L.batch < 1 || L.batch > PNMIX_MAX_BATCH) return "batch must be in 1.." PNMIX_STR(PNMIX_MAX_BATCH);
  if (L.kv_heads < 1 || L.kv_heads > PNMIX_MAX_KV_HEADS) return "kv_heads must be in 1.." PNMIX_STR(PNMIX_MAX_KV_HEADS);
  if (L.head_dim < 2 || L.head_dim % 2 || L.head_dim > PNMIX_MAX_HEAD_DIM)
    return "head_dim must be a positive even number <= " PNMIX_STR(PNMIX_MAX_HEAD_DIM);
  if (L.max_seq_len < 1 || L.max_seq_len > PNMIX_MAX_SEQ_LEN) return "max_seq_len must be in 1..2^40";
  if (L.head_dim % value_block(L))
    return "config field 'value_group_size' gives a value block that does not divide head_dim";
  if ((L.head_dim * L.config.value_bits) % 8) return "config field 'value_bits' times head_dim must be a multiple of 8";
  // the largest tensor must fit comfortably in int64 (and in memory). The double product is exact
  // up to 2^53, so the comparison with 2^50 is exact (pnmix/format.py makes the same one).
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    const TensorShape s = capacity_shape(L, i);
    const double bytes = (double)L.batch * (double)s.heads * (double)s.rows * (double)s.row_elems *
                         (double)state_elem_bytes(i);
    if (bytes > (double)PNMIX_MAX_STATE_TENSOR_BYTES) return "cache too large: a state tensor would exceed 2^50 bytes";
  }
  return nullptr;
}

// ---- section 3.1: LSB-first bit streams ---------------------------------------------------------

// Code i of a b-bit stream of nbytes bytes (reads the second byte only if it exists).
PNMIX_HD inline uint32_t read_code(const uint8_t* stream, int64_t nbytes, int64_t i, int b) {
  const int64_t bit = i * b;
  const int64_t byte = bit >> 3;
  uint32_t word = stream[byte];
  if (byte + 1 < nbytes) word |= (uint32_t)stream[byte + 1] << 8;
  return (word >> (bit & 7)) & ((1u << b) - 1u);
}

// Write code i (masked to b bits) into a stream, leaving every other bit as it was.
PNMIX_HD inline void write_code(uint8_t* stream, int64_t nbytes, int64_t i, int b, uint32_t code) {
  const int64_t bit = i * b;
  const int64_t byte = bit >> 3;
  const uint32_t shift = (uint32_t)(bit & 7);
  const uint32_t mask = ((1u << b) - 1u) << shift;
  const uint32_t value = (code << shift) & mask;
  stream[byte] = (uint8_t)((stream[byte] & ~mask) | value);
  if ((mask >> 8) && byte + 1 < nbytes)
    stream[byte + 1] = (uint8_t)((stream[byte + 1] & ~(mask >> 8)) | (value >> 8));
}

// ---- sections 3.2 and 3.3: the pair mask and per-channel key bits ------------------------------

// Pair of channel c: adjacent (2p, 2p+1) -> c / 2; half (p, p + P) -> c % P.
PNMIX_HD inline int64_t pair_of_channel(int64_t c, int64_t head_dim, int32_t pair_layout) {
  return pair_layout == PNMIX_PAIR_HALF ? c % (head_dim / 2) : c / 2;
}

// The two channels (a_p, b_p) of pair p.
PNMIX_HD inline void pair_channels(int64_t p, int64_t head_dim, int32_t pair_layout, int64_t* a, int64_t* b) {
  if (pair_layout == PNMIX_PAIR_HALF) {
    *a = p;
    *b = p + head_dim / 2;
  } else {
    *a = 2 * p;
    *b = 2 * p + 1;
  }
}

// Is pair p of KV head h high in one sequence's mask bytes?
PNMIX_HD inline bool pair_is_high(const uint8_t* mask, int64_t pairs_per_head, int64_t h, int64_t p) {
  const int64_t bit = h * pairs_per_head + p;
  return (mask[bit >> 3] >> (bit & 7)) & 1u;
}

PNMIX_HD inline void set_pair_high(uint8_t* mask, int64_t pairs_per_head, int64_t h, int64_t p) {
  const int64_t bit = h * pairs_per_head + p;
  mask[bit >> 3] = (uint8_t)(mask[bit >> 3] | (1u << (bit & 7)));
}

// Set bits in stream bits [first, end): bit by bit at the ragged ends, a byte at a time between.
PNMIX_HD inline int64_t count_set_bits(const uint8_t* stream, int64_t first, int64_t end) {
  int64_t count = 0, bit = first;
  for (; bit < end && (bit & 7); ++bit) count += (stream[bit >> 3] >> (bit & 7)) & 1u;
  for (; bit + 8 <= end; bit += 8) {
    uint32_t x = stream[bit >> 3];
    x = x - ((x >> 1) & 0x55u);
    x = (x & 0x33u) + ((x >> 2) & 0x33u);
    count += (x + (x >> 4)) & 0x0Fu;
  }
  for (; bit < end; ++bit) count += (stream[bit >> 3] >> (bit & 7)) & 1u;
  return count;
}

// High pairs of KV head h in one sequence's mask bytes. Section 3.2's reader rule: exactly
// high_pairs(L) in every head, else key_channel_layout's offsets run past a group's KB bytes.
PNMIX_HD inline int64_t high_pairs_in_head(const pnmix_layout& L, const uint8_t* mask, int64_t h) {
  return count_set_bits(mask, h * pairs(L), (h + 1) * pairs(L));
}

// Does one sequence's mask set any of the trailing bits past H * P? (They must be 0.)
PNMIX_HD inline bool mask_has_trailing_bits(const pnmix_layout& L, const uint8_t* mask) {
  return count_set_bits(mask, L.kv_heads * pairs(L), mask_bytes(L) * 8) != 0;
}

// bits(c) for channel c of KV head h, from one sequence's mask bytes.
PNMIX_HD inline int channel_bits(const pnmix_layout& L, const uint8_t* mask, int64_t h, int64_t c) {
  const int64_t p = pair_of_channel(c, L.head_dim, L.config.pair_layout);
  return pair_is_high(mask, pairs(L), h, p) ? L.config.key_high_bits : L.config.key_low_bits;
}

// Fill bits[D] and byte offsets[D] (key_channel_offset) of KV head h's key group.
PNMIX_HD inline void key_channel_layout(const pnmix_layout& L, const uint8_t* mask, int64_t h,
                                        int* bits, int64_t* offsets) {
  const int64_t bytes_per_bit = L.config.group_size / 8;
  int64_t at = 0;
  for (int64_t c = 0; c < L.head_dim; ++c) {
    bits[c] = channel_bits(L, mask, h, c);
    offsets[c] = at;
    at += bytes_per_bit * bits[c];
  }
}

}  // namespace pnmix

#endif  // PNMIX_FORMAT_H
