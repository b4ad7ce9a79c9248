// libpnmix_core: the .pnkv dump (docs/FORMAT.md section 6; pnmix_core.h): size, write, header
// checks and read. The header's magic, version and field offsets are generated.h's
// (format.DUMP_HEADER_FIELDS).
#include <string.h>

#include "core_internal.h"
#include "pnmix/format.h"

namespace pnmix {
namespace core {
namespace {

constexpr int64_t kDumpHeader = PNMIX_DUMP_HEADER_BYTES;
constexpr size_t kMagicBytes = sizeof(PNMIX_DUMP_MAGIC) - 1;

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
}  // namespace core
}  // namespace pnmix

using namespace pnmix;
using namespace pnmix::core;

extern "C" {

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
  memcpy(out + PNMIX_DUMP_AT_MAGIC, PNMIX_DUMP_MAGIC, kMagicBytes);
  put_u16(out + PNMIX_DUMP_AT_VERSION, PNMIX_DUMP_VERSION);
  put_u16(out + PNMIX_DUMP_AT_HEADER_BYTES, (uint16_t)kDumpHeader);
  put_u32(out + PNMIX_DUMP_AT_GROUP_SIZE, (uint32_t)c.group_size);
  put_u32(out + PNMIX_DUMP_AT_RESIDUAL_SIZE, (uint32_t)c.residual_size);
  put_u32(out + PNMIX_DUMP_AT_SINK_TOKENS, (uint32_t)c.sink_tokens);
  put_u32(out + PNMIX_DUMP_AT_VALUE_GROUP_SIZE, (uint32_t)c.value_group_size);
  out[PNMIX_DUMP_AT_VALUE_BITS] = (uint8_t)c.value_bits;
  out[PNMIX_DUMP_AT_KEY_HIGH_BITS] = (uint8_t)c.key_high_bits;
  out[PNMIX_DUMP_AT_KEY_LOW_BITS] = (uint8_t)c.key_low_bits;
  out[PNMIX_DUMP_AT_PAIR_LAYOUT] = (uint8_t)c.pair_layout;
  put_u32(out + PNMIX_DUMP_AT_BATCH, (uint32_t)L.batch);
  put_u32(out + PNMIX_DUMP_AT_KV_HEADS, (uint32_t)L.kv_heads);
  put_u32(out + PNMIX_DUMP_AT_HEAD_DIM, (uint32_t)L.head_dim);
  uint64_t ratio_bits;
  memcpy(&ratio_bits, &c.high_ratio, 8);
  put_u64(out + PNMIX_DUMP_AT_HIGH_RATIO, ratio_bits);
  put_u64(out + PNMIX_DUMP_AT_SEQ_LEN, (uint64_t)seq_len);
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
  if (memcmp(blob + PNMIX_DUMP_AT_MAGIC, PNMIX_DUMP_MAGIC, kMagicBytes)) return fail(PNMIX_ERR_DUMP, "not a pnkv dump: bad magic");
  const uint16_t version = get_u16(blob + PNMIX_DUMP_AT_VERSION);
  const uint16_t header_bytes = get_u16(blob + PNMIX_DUMP_AT_HEADER_BYTES);
  if (version != PNMIX_DUMP_VERSION || header_bytes != kDumpHeader)
    return fail(PNMIX_ERR_DUMP, "unsupported pnkv dump version %u (header %u bytes)", version, header_bytes);
  const uint32_t reserved0 = get_u32(blob + PNMIX_DUMP_AT_RESERVED0);
  const uint32_t reserved1 = get_u32(blob + PNMIX_DUMP_AT_RESERVED1);
  if (reserved0 || reserved1)
    return fail(PNMIX_ERR_DUMP, "pnkv dump has non-zero reserved header fields (%u, %u)", reserved0, reserved1);
  // u32 config fields must survive the cast to int32 (pnmix/config.py's rule); their other limits
  // are config_error's, below
  const uint32_t fields[] = {get_u32(blob + PNMIX_DUMP_AT_GROUP_SIZE), get_u32(blob + PNMIX_DUMP_AT_RESIDUAL_SIZE),
                            get_u32(blob + PNMIX_DUMP_AT_SINK_TOKENS), get_u32(blob + PNMIX_DUMP_AT_VALUE_GROUP_SIZE)};
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
  L.config.value_bits = blob[PNMIX_DUMP_AT_VALUE_BITS];
  L.config.key_high_bits = blob[PNMIX_DUMP_AT_KEY_HIGH_BITS];
  L.config.key_low_bits = blob[PNMIX_DUMP_AT_KEY_LOW_BITS];
  const uint8_t pair_layout = blob[PNMIX_DUMP_AT_PAIR_LAYOUT];
  L.config.pair_layout = pair_layout;
  if (pair_layout >= PNMIX_NUM_PAIR_LAYOUTS)
    return fail(PNMIX_ERR_DUMP, "pnkv dump has an unknown pair_layout code %u", pair_layout);
  L.batch = get_u32(blob + PNMIX_DUMP_AT_BATCH);
  L.kv_heads = get_u32(blob + PNMIX_DUMP_AT_KV_HEADS);
  L.head_dim = get_u32(blob + PNMIX_DUMP_AT_HEAD_DIM);
  const uint64_t ratio_bits = get_u64(blob + PNMIX_DUMP_AT_HIGH_RATIO);
  memcpy(&L.config.high_ratio, &ratio_bits, 8);
  const uint64_t n = get_u64(blob + PNMIX_DUMP_AT_SEQ_LEN);
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
