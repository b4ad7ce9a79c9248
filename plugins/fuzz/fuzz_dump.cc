// libFuzzer target: the .pnkv decoder must reject or accept any byte string cleanly (no crash,
// no out-of-bounds read). An accepted dump must round-trip through dump_write byte for byte
// (reserved header fields excepted).
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
  // byte for byte, except the two reserved header fields (a reader ignores them; a writer puts 0)
  if (size < 64) __builtin_trap();  // the header was accepted, so this cannot happen
  std::vector<uint8_t> expected(data, data + size);
  for (size_t i = 0; i < 4; ++i) expected[40 + i] = expected[60 + i] = 0;
  if (memcmp(again.data(), expected.data(), size) != 0) __builtin_trap();
  return 0;
}
