// libpnmix_core: the C ABI (pnmix_core.h) over the header-only core. Every argument is
// validated at the entry points; the kernels assume valid input. This file: the ABI's version,
// limits and struct layout, the last error, byte accounting and the fp16 conversions; append.cc,
// attend_dispatch.cc and dump.cc hold the other entry points.
#include "pnmix/pnmix_core.h"

#include <stddef.h>
#include <string.h>

#include "core_internal.h"
#include "pnmix/format.h"
#include "pnmix/half.h"

PNMIX_DEFINE_ERROR_SLOT()

using namespace pnmix;
using namespace pnmix::core;

extern "C" {

int pnmix_core_abi_version(void) { return PNMIX_CORE_ABI_VERSION; }

int64_t pnmix_core_limit(const char* name) {
  static const struct {
    const char* name;
    int64_t value;
  } kLimits[] = {
#define PNMIX_X(limit, macro) {#limit, (int64_t)(macro)},
      PNMIX_LIMITS(PNMIX_X)
#undef PNMIX_X
  };
  if (name)
    for (const auto& limit : kLimits)
      if (!strcmp(limit.name, name)) return limit.value;
  return -1;
}

int64_t pnmix_core_struct_offset(const char* type, const char* field) {
  if (!type) return -1;
  const bool whole = field == nullptr || field[0] == '\0';
#define PNMIX_FIELD(strukt, member) \
  if (!whole && !strcmp(field, #member)) return (int64_t)offsetof(strukt, member);
  if (!strcmp(type, "pnmix_config")) {
    if (whole) return (int64_t)sizeof(pnmix_config);
#define PNMIX_X(name, kind) PNMIX_FIELD(pnmix_config, name)
    PNMIX_CONFIG_FIELDS(PNMIX_X)
#undef PNMIX_X
  } else if (!strcmp(type, "pnmix_layout")) {
    if (whole) return (int64_t)sizeof(pnmix_layout);
    PNMIX_FIELD(pnmix_layout, config)
    PNMIX_FIELD(pnmix_layout, batch)
    PNMIX_FIELD(pnmix_layout, kv_heads)
    PNMIX_FIELD(pnmix_layout, head_dim)
    PNMIX_FIELD(pnmix_layout, max_seq_len)
  } else if (!strcmp(type, "pnmix_state")) {
    if (whole) return (int64_t)sizeof(pnmix_state);
    PNMIX_FIELD(pnmix_state, data)
    PNMIX_FIELD(pnmix_state, nbytes)
  } else if (!strcmp(type, "pnmix_paged_state")) {
    if (whole) return (int64_t)sizeof(pnmix_paged_state);
    PNMIX_FIELD(pnmix_paged_state, pages)
    PNMIX_FIELD(pnmix_paged_state, num_blocks)
    PNMIX_FIELD(pnmix_paged_state, page_bytes)
    PNMIX_FIELD(pnmix_paged_state, head_bytes)
    PNMIX_FIELD(pnmix_paged_state, block_size)
    PNMIX_FIELD(pnmix_paged_state, block_table)
    PNMIX_FIELD(pnmix_paged_state, table_blocks)
    PNMIX_FIELD(pnmix_paged_state, block_id_bytes)
    PNMIX_FIELD(pnmix_paged_state, sink_k)
    PNMIX_FIELD(pnmix_paged_state, sink_v)
    PNMIX_FIELD(pnmix_paged_state, residual_k)
    PNMIX_FIELD(pnmix_paged_state, residual_v)
    PNMIX_FIELD(pnmix_paged_state, pair_mask)
    PNMIX_FIELD(pnmix_paged_state, sink_bytes)
    PNMIX_FIELD(pnmix_paged_state, residual_bytes)
    PNMIX_FIELD(pnmix_paged_state, mask_bytes)
  } else if (!strcmp(type, "pnmix_paged_sequence")) {
    if (whole) return (int64_t)sizeof(pnmix_paged_sequence);
    PNMIX_FIELD(pnmix_paged_sequence, paged)
    PNMIX_FIELD(pnmix_paged_sequence, seq_len)
    PNMIX_FIELD(pnmix_paged_sequence, q)
    PNMIX_FIELD(pnmix_paged_sequence, nq)
    PNMIX_FIELD(pnmix_paged_sequence, q_bytes)
    PNMIX_FIELD(pnmix_paged_sequence, k_new)
    PNMIX_FIELD(pnmix_paged_sequence, v_new)
    PNMIX_FIELD(pnmix_paged_sequence, n_new)
    PNMIX_FIELD(pnmix_paged_sequence, new_bytes)
    PNMIX_FIELD(pnmix_paged_sequence, out)
    PNMIX_FIELD(pnmix_paged_sequence, out_bytes)
  } else if (!strcmp(type, "pnmix_openmp_team")) {
    if (whole) return (int64_t)sizeof(pnmix_openmp_team);
    PNMIX_FIELD(pnmix_openmp_team, gomp_parallel)
    PNMIX_FIELD(pnmix_openmp_team, threads)
  }
#undef PNMIX_FIELD
  return -1;
}

const char* pnmix_last_error(void) { return abi::last_error(); }

int pnmix_state_bytes(const pnmix_layout* layout, int64_t nbytes[PNMIX_NUM_STATE]) {
  if (int rc = check_layout(layout)) return rc;
  if (!nbytes) return fail(PNMIX_ERR_NULL, "nbytes pointer is null");
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) nbytes[i] = state_bytes(*layout, i);
  return ok();
}

int pnmix_group_sections(const pnmix_layout* layout, int64_t first_byte[6], int64_t nbytes[6]) {
  if (int rc = check_layout(layout)) return rc;
  if (!first_byte || !nbytes) return fail(PNMIX_ERR_NULL, "first_byte or nbytes pointer is null");
  const GroupSections s = group_sections(*layout);
  for (int j = 0; j < kGroupTensors; ++j) {
    first_byte[j] = s.first_byte[j];
    nbytes[j] = s.bytes[j];
  }
  return ok();
}

int pnmix_persistent_bytes(const pnmix_layout* layout, int64_t seq_len, int64_t* out) {
  if (int rc = check_layout(layout)) return rc;
  if (!out) return fail(PNMIX_ERR_NULL, "output pointer is null");
  if (int rc = check_seq_len(*layout, seq_len)) return rc;
  *out = persistent_bytes(*layout, seq_len);
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

}  // extern "C"
