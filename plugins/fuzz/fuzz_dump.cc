// libFuzzer target: the .pnkv decoder must reject or accept any byte string cleanly (no crash,
// no out-of-bounds read). An accepted dump must round-trip through dump_write byte for byte, and
// attention over its state must run (it reads every group at the offsets the pair mask gives).
#include <stdint.h>
#include <string.h>

#include <vector>

#include "pnmix/pnmix_core.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pnmix_layout layout;
  int64_t seq_len = 0;
  if (pnmix_dump_header(data, (int64_t)size, &layout, &seq_len) != PNMIX_OK) return 0;
  int64_t nbytes[PNMIX_NUM_STATE];
  if (pnmix_state_bytes(&layout, nbytes) != PNMIX_OK) __builtin_trap();  // header accepted it
  int64_t total = 0;
  for (int64_t n : nbytes) total += n;
  if (total > (int64_t)64 << 20) return 0;  // a valid but huge capacity: not worth allocating here
  std::vector<std::vector<uint8_t>> buffers(PNMIX_NUM_STATE);
  pnmix_state state;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    buffers[i].assign((size_t)nbytes[i] + 2, 0);  // +2 keeps data() non-null and 2-byte aligned
    state.data[i] = buffers[i].data();
    state.nbytes[i] = nbytes[i];
  }
  if (pnmix_dump_read(data, (int64_t)size, &layout, &state, &seq_len) != PNMIX_OK) __builtin_trap();
  std::vector<uint8_t> again(size);
  int64_t written = 0;
  if (pnmix_dump_write(&layout, &state, seq_len, again.data(), (int64_t)size, &written) != PNMIX_OK ||
      written != (int64_t)size)
    __builtin_trap();
  // byte for byte: the reader refuses non-zero reserved fields, and a writer puts 0
  if (memcmp(again.data(), data, size) != 0) __builtin_trap();
  if (seq_len == 0) return 0;
  const int64_t q_elems = layout.batch * layout.kv_heads * layout.head_dim;  // one query per KV head
  std::vector<float> q((size_t)q_elems, 0.5f), out((size_t)q_elems);
  if (pnmix_attend(&layout, &state, seq_len, q.data(), 1, layout.kv_heads, 1, q_elems * 4, nullptr, nullptr, 0, 0,
                   out.data(), q_elems * 4, 1) != PNMIX_OK)
    __builtin_trap();
  return 0;
}
