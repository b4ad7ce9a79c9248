// loop_bench.cc: the VNNI kernel's key and value product loops alone, on codes that stay in L1.
//
//   g++ -O3 -DNDEBUG -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi -mavx512vnni -mavx2 -mfma -mf16c
//       -Iplugins/src -Iplugins/include tools/loop_bench.cc -o /tmp/loop_bench
//   /tmp/loop_bench [calls]
//
// It includes the kernel's own source (attend_avx512vnni.cc), so the loops are the library's, and
// calls them for one 128-token group of the default config (head dim 128: 64 3-bit and 64 1-bit
// key channels, 2-bit values in 32-byte tokens) and four query rows, `calls` times over the same
// bytes. A decode step's group reads its codes from memory and does the rest of its work between
// the loops; the difference between these times and the same loops' share of a step is what the
// step spends waiting (docs/BENCHMARKS.md section 2.20). Prints the best of seven runs, in
// time-stamp ticks and ns per group.

#include "attend_avx512vnni.cc"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <x86intrin.h>

#include <chrono>

namespace {

using namespace pnmix;

constexpr int64_t kGroup = 128, kRows = 4, kQuads = 16;  // quads per key class
constexpr long kMaxCalls = 100000000;  // a run of about a minute
constexpr int64_t kHighBytes = kGroup * 3 / 8, kLowBytes = kGroup / 8, kValueBytes = 32;

alignas(64) uint8_t key_codes[64 * kHighBytes + 64 * kLowBytes + 64];  // + 64: the wide loads' reach
alignas(64) int64_t key_offsets[2][4 * kQuads];
alignas(64) int8_t key_weights[kRows * 2 * kQuads * 4];
alignas(64) float key_scales[kRows * 8];
alignas(64) float scores[kRows * kGroup];
alignas(64) uint8_t value_codes[kGroup * kValueBytes];
alignas(64) uint8_t value_levels[kRows][kGroup];
alignas(64) float sums[kRows][kGroup];

// Four rows' scores over a group: each 32-token chunk through both classes, as VnniKeyRows does.
__attribute__((noinline)) void key_products(int64_t quads) {
  for (int64_t chunk = 0; chunk < kGroup / 32; ++chunk) {
    __m512 out[kRows][2];
    for (int r = 0; r < kRows; ++r) out[r][0] = out[r][1] = _mm512_set1_ps(0.5f);
    for (int i = 0; i < 2; ++i) {
      const int8_t* w[kRows];
      const float* s[kRows];
      for (int r = 0; r < kRows; ++r) {
        w[r] = key_weights + 4 * key_row_slot(r, 2 * kQuads, i * kQuads);
        s[r] = key_scales + key_row_slot(r, 5, i ? 3 : 0);
      }
      vnni_key_class_chunk_bits<kRows, true>(i ? 1 : 3, key_codes, key_offsets[i], quads, chunk, w, s, out);
    }
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(scores + r * kGroup + chunk * 32, out[r][0]);
      _mm512_storeu_ps(scores + r * kGroup + chunk * 32 + 16, out[r][1]);
    }
  }
}

// Four rows' value sums over a group, both 16-byte slices of the tokens, as VnniValueRows does.
__attribute__((noinline)) void value_products(int64_t token_bytes) {
  const uint8_t* levels[kRows];
  float scale[kRows];
  float* lanes[kRows];
  for (int r = 0; r < kRows; ++r) {
    levels[r] = value_levels[r];
    scale[r] = 0.01f;
    lanes[r] = sums[r];
  }
  for (int64_t slice = 0; slice < token_bytes / 16; ++slice)
    vnni_value_slice<kRows, 2, true, true>(value_codes, token_bytes, kGroup / 4, slice, levels, scale, lanes);
}

void fill() {
  for (size_t i = 0; i < sizeof key_codes; ++i) key_codes[i] = (uint8_t)(i * 37 + 11);
  for (int64_t c = 0; c < 4 * kQuads; ++c) {  // channels in a scattered order, as magnitude order leaves them
    key_offsets[0][c] = (c * 23 % 64) * kHighBytes;
    key_offsets[1][c] = 64 * kHighBytes + (c * 23 % 64) * kLowBytes;
  }
  for (size_t i = 0; i < sizeof key_weights; ++i) key_weights[i] = (int8_t)(i * 7 - 50);
  for (int i = 0; i < kRows * 8; ++i) key_scales[i] = 0.001f * (float)(i + 1);
  for (size_t i = 0; i < sizeof value_codes; ++i) value_codes[i] = (uint8_t)(i * 29 + 3);
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < kGroup; ++t) value_levels[r][t] = (uint8_t)(t * 7 + r);
}

// Time-stamp ticks per ns, against the steady clock over 50 ms.
double ticks_per_ns() {
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t c0 = __rdtsc();
  while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(50)) {
  }
  const double ns = (double)std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  return (double)(__rdtsc() - c0) / ns;
}

template <typename F>
double best_ticks(long calls, F run) {
  double best = 1e300;
  for (int round = 0; round < 7; ++round) {
    const uint64_t c0 = __rdtsc();
    for (long i = 0; i < calls; ++i) run();
    const double t = (double)(__rdtsc() - c0) / (double)calls;
    best = t < best ? t : best;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 2) {
    fprintf(stderr, "error: one argument at most (calls), got %d\n", argc - 1);
    return 2;
  }
  long calls = 20000;
  if (argc == 2) {
    char* end = nullptr;
    errno = 0;
    calls = strtol(argv[1], &end, 10);
    if (end == argv[1] || *end != '\0' || errno == ERANGE || calls < 1 || calls > kMaxCalls) {
      fprintf(stderr, "error: calls must be an integer from 1 to %ld, got '%s'\n", kMaxCalls, argv[1]);
      return 2;
    }
  }
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512vbmi")) {
    fprintf(stderr, "error: this CPU has no AVX-512 VNNI and VBMI, the kernel these loops belong to\n");
    return 1;
  }
  fill();
  volatile int64_t quads = kQuads, token_bytes = kValueBytes;  // not constants: the kernel's are not
  const double rate = ticks_per_ns();
  const double keys = best_ticks(calls, [&] { key_products(quads); });
  const double values = best_ticks(calls, [&] { value_products(token_bytes); });
  printf("time-stamp counter: %.3f ticks per ns; %ld calls, best of 7\n", rate, calls);
  printf("key products (4 rows, 4 chunks, 16 3-bit + 16 1-bit quads): %.0f ticks, %.1f ns per group\n", keys,
         keys / rate);
  printf("value products (4 rows, 2 slices of 32 quads, 2-bit): %.0f ticks, %.1f ns per group\n", values,
         values / rate);
  printf("checksum %g\n", (double)scores[77] + (double)sums[1][7]);
  return 0;
}
