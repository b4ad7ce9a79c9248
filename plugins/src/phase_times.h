// phase_times.h: where a profiling build of libpnmix_core spends a packed group's time
// (cmake -DPNMIX_PHASE_TIMES=ON; tools/phase_times.py reads what it prints). Each thread's clock
// reads the time-stamp counter at the end of each phase of attend_group and adds the differences to
// the process's totals once per group; at exit the library prints those totals to stderr. In a
// normal build the clock is an empty struct and every mark compiles to nothing.
#ifndef PNMIX_SRC_PHASE_TIMES_H
#define PNMIX_SRC_PHASE_TIMES_H

#include <stdint.h>

#if PNMIX_PHASE_TIMES
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#else
#include <chrono>
#endif
#endif

namespace pnmix {

// attend_group's phases, in the order it runs them (names: phase_times.cc)
enum Phase : int {
  kPhaseSetup,       // the group's tensors, the read-ahead, the key steps and each row's offset constant
  kPhaseKeyWeights,  // the integer path's key weights, rounded per block (0 in fp32)
  kPhaseKeyScores,   // the key codes' decode and products
  kPhaseSoftmax,     // the value steps, the causal mask, the online softmax, folding p into the value steps
                     // and the rows' running sums of the value offsets
  kPhaseValueWeights,  // the VNNI kernel's value weights, rounded per row (0 elsewhere: the AVX2 pair
                       // kernel rounds a row's beside its products, in values)
  kPhaseValues,      // the value weights' rounding (AVX2 integer path), the value codes' decode and products
  kPhaseTail,        // the read-ahead's rest
  kPhases
};

#if PNMIX_PHASE_TIMES
inline uint64_t phase_clock_now() {
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#else
  return (uint64_t)std::chrono::steady_clock::now().time_since_epoch().count();
#endif
}

void add_phase_ticks(const uint64_t (&ticks)[kPhases]);  // to the process's totals (phase_times.cc)

struct PhaseClock {
  uint64_t last = 0, ticks[kPhases] = {};
  void start() { last = phase_clock_now(); }
  void mark(Phase phase) {
    const uint64_t now = phase_clock_now();
    ticks[phase] += now - last;
    last = now;
  }
  void end_group() {
    mark(kPhaseTail);
    add_phase_ticks(ticks);
    for (uint64_t& t : ticks) t = 0;
  }
};
#else
struct PhaseClock {
  void start() {}
  void mark(Phase) {}
  void end_group() {}
};
#endif

}  // namespace pnmix

#endif  // PNMIX_SRC_PHASE_TIMES_H
