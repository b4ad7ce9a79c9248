// loop_bench.cc: the VNNI kernel's key and value product loops alone, on codes that stay in L1.
//
//   g++ -O3 -DNDEBUG -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vbmi -mavx512vnni -mavx2 -mfma -mf16c
//       -Iplugins/src -Iplugins/include tools/loop_bench.cc -o /tmp/loop_bench
//   /tmp/loop_bench [calls]
//
// It includes the kernel's own source (attend_avx512vnni.cc) and calls its two row functions,
// VnniKeyRows<4>::run and VnniValueRows<4>::run, for one 128-token group of a head of dim 128
// with the default config's widths (64 3-bit and 64 1-bit key channels, 2-bit values) and four
// query rows, `calls` times over the same bytes. A decode step's group reads its codes from
// memory and does the rest of its work between the loops; the difference between these times
// and the same loops' share of a step is what the step spends waiting (docs/BENCHMARKS.md
// section 2.20). Prints the best of seven runs, in time-stamp ticks and ns per group.
// (tests/backends/test_loop_bench.py builds it with the command above.)

#include "attend_avx512vnni.cc"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <x86intrin.h>

#include <chrono>

namespace {

using namespace pnmix;

constexpr long kMaxCalls = 100000000;  // a run of about a minute
constexpr int64_t kRows = 4;
const int64_t kAllRows[kRows] = {0, 1, 2, 3};

// One group of one KV head, as a work item's set-up leaves the scratch for the kernel's rows.
struct Group {
  pnmix_layout L{};
  AttendJob job{};
  Scratch& sc = thread_scratch();
  KeyQuads keys;
  Int8Values values;
  LineVector<uint8_t> key_codes, value_codes;  // on cache lines, as the state's tensors are

  Group() {
    L.config.group_size = 128;
    L.config.high_ratio = 0.5;  // half the channels at the high width, as the classes below
    L.config.key_high_bits = 3;
    L.config.key_low_bits = 1;
    L.config.value_bits = 2;
    L.config.value_group_size = 128;
    L.batch = L.kv_heads = 1;
    L.head_dim = 128;
    job.L = L;
    job.rows = kRows;
    const int64_t D = L.head_dim, gs = L.config.group_size;
    // the classes in a scattered channel order, as the magnitude order leaves them; each channel's
    // codes where the group's key codes hold them (channel-major, in channel order)
    int64_t* offsets = ensure(sc.offsets, D);
    int64_t group_bytes = 0;
    for (int64_t c = 0; c < D; ++c) {
      offsets[c] = group_bytes;
      group_bytes += gs / 8 * (c % 4 < 2 ? L.config.key_high_bits : L.config.key_low_bits);
    }
    if (group_bytes != key_group_bytes(L)) {  // the codes must be where the format puts a group's
      fprintf(stderr, "error: the bench's channel classes hold %lld bytes, the format's group %lld\n",
              (long long)group_bytes, (long long)key_group_bytes(L));
      exit(1);
    }
    sc.high.clear();
    sc.low.clear();
    for (int64_t i = 0; i < D; ++i) {
      const int32_t c = (int32_t)(i * 23 % D);
      (c % 4 < 2 ? sc.high : sc.low).push_back(c);
    }
    keys = key_quads(job, sc);
    key_codes.resize((size_t)key_group_bytes(L) + 64);  // + 64: the wide loads' reach past a chunk
    for (size_t i = 0; i < key_codes.size(); ++i) key_codes[i] = (uint8_t)(i * 37 + 11);
    int8_t* weights = (int8_t*)ensure(sc.key_quad_weights, key_set_rows(kRows) * keys.total_quads);
    for (int64_t i = 0; i < 4 * key_set_rows(kRows) * keys.total_quads; ++i) weights[i] = (int8_t)(i * 7 - 50);
    float* scales = ensure(sc.key_scales, key_set_rows(kRows) * keys.total_blocks);
    for (int64_t i = 0; i < key_set_rows(kRows) * keys.total_blocks; ++i) scales[i] = 0.001f * (float)(i + 1);
    float* cst = ensure(sc.cst, kRows);
    for (int64_t r = 0; r < kRows; ++r) cst[r] = 0.5f;
    ensure(sc.s, kRows * gs);

    values = int8_values_plan(L);
    value_codes.resize((size_t)(gs * value_token_bytes(L)));
    for (size_t i = 0; i < value_codes.size(); ++i) value_codes[i] = (uint8_t)(i * 29 + 3);
    uint8_t* levels = ensure(sc.value_levels, kRows * gs);
    for (int64_t i = 0; i < kRows * gs; ++i) levels[i] = (uint8_t)(i * 7);
    float* value_scale = ensure(sc.value_scale, kRows);
    for (int64_t r = 0; r < kRows; ++r) value_scale[r] = 0.01f;  // > 0: unsigned weights
    float* lanes = ensure(sc.lanes, kRows * values.floats());
    for (int64_t i = 0; i < kRows * values.floats(); ++i) lanes[i] = 0.0f;
  }

  // Four rows' scores over the group (the kernel's wide loads: the buffer has the bytes past it).
  __attribute__((noinline)) void key_products() {
    VnniKeyRows<kRows>::run(kAllRows, job, sc, key_codes.data(), keys, (const int8_t*)sc.key_quad_weights.data(),
                            sc.key_scales.data(), true);
  }
  // Four rows' value sums over the group.
  __attribute__((noinline)) void value_products() {
    VnniValueRows<kRows>::run(kAllRows, job, sc, values, value_codes.data());
  }
  double checksum() const { return (double)sc.s[77] + (double)sc.lanes[135]; }
};

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
  Group group;
  const double rate = ticks_per_ns();
  const double keys = best_ticks(calls, [&] { group.key_products(); });
  const double values = best_ticks(calls, [&] { group.value_products(); });
  printf("time-stamp counter: %.3f ticks per ns; %ld calls, best of 7\n", rate, calls);
  printf("key products (4 rows, 4 chunks, 16 3-bit + 16 1-bit quads): %.0f ticks, %.1f ns per group\n", keys,
         keys / rate);
  printf("value products (4 rows, 2 slices of 32 quads, 2-bit): %.0f ticks, %.1f ns per group\n", values,
         values / rate);
  printf("checksum %g\n", group.checksum());
  return 0;
}
