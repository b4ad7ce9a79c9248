// core_internal.h: what the files of libpnmix_core share besides the header-only core: the error
// slot and argument checks (pnmix/abi_check.h) and the checks of a state's contents.
#ifndef PNMIX_SRC_CORE_INTERNAL_H
#define PNMIX_SRC_CORE_INTERNAL_H

#include <stdint.h>

#include "pnmix/abi_check.h"
#include "pnmix/format.h"
#include "pnmix/pnmix_core.h"

namespace pnmix {
namespace core {

using abi::check_layout;
using abi::check_state;
using abi::fail;
using abi::ok;
using abi::product;

// FORMAT.md 3.2's rule for the B masks at `mask` (once seq_len > 0): exactly n_high high pairs
// per KV head, nothing past H * P. The kernels take key offsets from the mask, so a wrong count
// would make them read past a group's KB bytes.
inline int check_pair_mask(const pnmix_layout& L, const uint8_t* mask, int code, const char* what) {
  const int64_t want = high_pairs(L), MB = mask_bytes(L);
  for (int64_t b = 0; b < L.batch; ++b) {
    if (mask_has_trailing_bits(L, mask + b * MB))
      return fail(code, "%s pair_mask of sequence %lld has set bits past the last pair (must be 0)", what,
                  (long long)b);
    for (int64_t h = 0; h < L.kv_heads; ++h) {
      const int64_t high = high_pairs_in_head(L, mask + b * MB, h);
      if (high != want)
        return fail(code, "%s pair_mask marks %lld high pairs in KV head %lld of sequence %lld, the config "
                    "(high_ratio %g) gives %lld", what, (long long)high, (long long)h, (long long)b,
                    L.config.high_ratio, (long long)want);
    }
  }
  return PNMIX_OK;
}

inline int check_seq_len(const pnmix_layout& L, int64_t seq_len) {
  if (seq_len < 0 || seq_len > L.max_seq_len)
    return fail(PNMIX_ERR_SIZE, "seq_len %lld outside 0..max_seq_len %lld", (long long)seq_len,
                (long long)L.max_seq_len);
  return PNMIX_OK;
}

// pnmix_append (append.cc): every check comes before the first write; check_only stops after them.
// threads: the group flushes' threads, as pnmix_attend's argument (<= 0: the caller's cores).
int append_impl(const pnmix_layout* layout, pnmix_state* state, int64_t seq_len, const uint16_t* k, const uint16_t* v,
                int64_t n, int64_t kv_bytes, bool check_only = false, int threads = 0);

template <typename T>
inline T* buffer(const pnmix_state* state, int i) {
  return static_cast<T*>(state->data[i]);
}

}  // namespace core
}  // namespace pnmix

#endif  // PNMIX_SRC_CORE_INTERNAL_H
