// A standalone driver for fuzz_dump.cc that needs no libFuzzer: runs every file given on the
// command line (a corpus), then N random and mutated inputs (valid headers with corrupted sizes,
// truncations, flipped bytes). Prints how many cases ran. Usage: driver [-n N] [-seed S] [files...]
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <random>
#include <string>
#include <vector>

#include "pnmix/pnmix_core.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::vector<uint8_t> read_file(const char* path) {
  std::vector<uint8_t> bytes;
  FILE* f = fopen(path, "rb");
  if (!f) return bytes;
  uint8_t chunk[4096];
  size_t got;
  while ((got = fread(chunk, 1, sizeof chunk, f)) > 0) bytes.insert(bytes.end(), chunk, chunk + got);
  fclose(f);
  return bytes;
}

// A small valid dump built with the library, as the seed of the mutations.
std::vector<uint8_t> seed_dump(std::mt19937_64& rng) {
  pnmix_layout L;
  L.config = pnmix_config{0.5, 8, 16, 4, 2, 8, PNMIX_PAIR_ADJACENT, 3, 1};
  L.batch = 1 + rng() % 2;
  L.kv_heads = 1 + rng() % 2;
  L.head_dim = 8;
  L.max_seq_len = 64;
  int64_t nbytes[PNMIX_NUM_STATE];
  pnmix_state_bytes(&L, nbytes);
  std::vector<std::vector<uint8_t>> buffers(PNMIX_NUM_STATE);
  pnmix_state state;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    buffers[i].assign(nbytes[i] + 2, 0);
    state.data[i] = buffers[i].data();
    state.nbytes[i] = nbytes[i];
  }
  const int64_t n = rng() % 60;
  std::vector<uint16_t> kv(L.batch * L.kv_heads * n * L.head_dim);
  for (auto& x : kv) x = (uint16_t)(0x3000 + rng() % 0x1000);  // finite fp16 values
  pnmix_append(&L, &state, 0, kv.data(), kv.data(), n, (int64_t)kv.size() * 2);
  int64_t size = 0;
  pnmix_dump_size(&L, n, &size);
  std::vector<uint8_t> out(size);
  pnmix_dump_write(&L, &state, n, out.data(), size, nullptr);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  long random_cases = 20000;
  unsigned long long seed = 1;
  std::vector<const char*> files;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "-n") && i + 1 < argc) {
      random_cases = atol(argv[++i]);
    } else if (!strcmp(argv[i], "-seed") && i + 1 < argc) {
      seed = strtoull(argv[++i], nullptr, 10);
    } else {
      files.push_back(argv[i]);
    }
  }
  long ran = 0, accepted = 0;
  for (const char* path : files) {
    const std::vector<uint8_t> bytes = read_file(path);
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
    ++ran;
  }
  std::mt19937_64 rng(seed);
  for (long i = 0; i < random_cases; ++i) {
    std::vector<uint8_t> input = seed_dump(rng);
    switch (i % 5) {
      case 0: break;  // valid as built
      case 1: input.resize(rng() % (input.size() + 1)); break;  // truncated
      case 2: input.push_back((uint8_t)rng()); break;           // one byte too many
      case 3: {  // flip a few header bytes (sizes, config, seq_len)
        for (int k = 0; k < 1 + (int)(rng() % 3); ++k) input[rng() % 64] ^= (uint8_t)(1u << (rng() % 8));
        break;
      }
      default: {  // random bytes behind a valid magic
        input.assign(rng() % 256, 0);
        for (auto& b : input) b = (uint8_t)rng();
        if (input.size() >= 8) memcpy(input.data(), "PNKV\x01\x00\x40\x00", 8);
      }
    }
    pnmix_layout L;
    int64_t n;
    accepted += pnmix_dump_header(input.data(), (int64_t)input.size(), &L, &n) == PNMIX_OK;
    LLVMFuzzerTestOneInput(input.data(), input.size());
    ++ran;
  }
  printf("fuzz_dump driver: %ld cases ran (%zu corpus files), %ld accepted as valid dumps, no crash\n", ran,
         files.size(), accepted);
  return 0;
}
