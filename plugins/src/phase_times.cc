// phase_times.cc: the process's totals of a PNMIX_PHASE_TIMES build (phase_times.h), printed to
// stderr at exit in the form tools/phase_times.py reads:
//   pnmix phase times: GROUPS groups, TICKS_PER_NS ticks per ns
//   pnmix phase NAME TICKS
#include "phase_times.h"

#include <stdio.h>

#include <atomic>
#include <chrono>

namespace pnmix {
namespace {

const char* const kPhaseNames[kPhases] = {"setup",         "key_weights", "key_scores", "softmax",
                                          "value_weights", "values",      "tail"};

uint64_t now_ns() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct PhaseTotals {
  std::atomic<uint64_t> ticks[kPhases] = {};
  std::atomic<uint64_t> groups{0};
  // the clock's rate: its reading and the steady clock's at the first group and at exit
  std::atomic<bool> started{false};
  uint64_t first_tick = 0, first_ns = 0;

  ~PhaseTotals() {
    const uint64_t n = groups.load();
    if (!n) return;
    const double rate = (double)(phase_clock_now() - first_tick) / (double)(now_ns() - first_ns);
    fprintf(stderr, "pnmix phase times: %llu groups, %.4f ticks per ns\n", (unsigned long long)n, rate);
    for (int i = 0; i < kPhases; ++i)
      fprintf(stderr, "pnmix phase %s %llu\n", kPhaseNames[i], (unsigned long long)ticks[i].load());
  }
};

PhaseTotals totals;

}  // namespace

void add_phase_ticks(const uint64_t (&ticks)[kPhases]) {
  bool expected = false;
  if (totals.started.compare_exchange_strong(expected, true)) {
    totals.first_tick = phase_clock_now();
    totals.first_ns = now_ns();
  }
  for (int i = 0; i < kPhases; ++i) totals.ticks[i].fetch_add(ticks[i], std::memory_order_relaxed);
  totals.groups.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace pnmix
