// pnmix/abi_check.h: the error reporting and argument checks both C ABIs share (libpnmix_core,
// plugins/src; libpnmix_cuda, plugins/cuda/api.cu). Host code only.
//
// An entry point returns PNMIX_OK or an error code, and leaves a one-line message in a
// thread-local slot that the library's *_last_error() returns. Each library owns one slot:
// exactly one of its files says PNMIX_DEFINE_ERROR_SLOT(); the slot's symbol is hidden, so two
// pnmix libraries in one process never share (or overwrite) each other's message.
#ifndef PNMIX_ABI_CHECK_H
#define PNMIX_ABI_CHECK_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <initializer_list>

#include "format.h"
#include "pnmix_core.h"

#if defined(__GNUC__)
#define PNMIX_HIDDEN __attribute__((visibility("hidden")))
#define PNMIX_PRINTF(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define PNMIX_HIDDEN
#define PNMIX_PRINTF(fmt, args)
#endif

namespace pnmix {
namespace abi {

constexpr size_t kErrorBytes = 512;

// This thread's message slot of the library (kErrorBytes long); see PNMIX_DEFINE_ERROR_SLOT.
PNMIX_HIDDEN char* error_slot();

#define PNMIX_DEFINE_ERROR_SLOT()                    \
  char* pnmix::abi::error_slot() {                   \
    thread_local char slot[pnmix::abi::kErrorBytes]; \
    return slot;                                     \
  }

// Record a one-line message and return code.
inline int fail(int code, const char* fmt, ...) PNMIX_PRINTF(2, 3);
inline int fail(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(error_slot(), kErrorBytes, fmt, args);
  va_end(args);
  return code;
}

// Success: the previous message no longer applies.
inline int ok() {
  error_slot()[0] = '\0';
  return PNMIX_OK;
}

inline const char* last_error() { return error_slot(); }

// a * b * ... as int64, or -1 when the product overflows (a caller's sizes must never wrap around)
inline int64_t product(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors)
    if (f < 0 || __builtin_mul_overflow(out, f, &out)) return -1;
  return out;
}

// The layout: present and valid (format.h's layout_error, docs/FORMAT.md 1.1).
inline int check_layout(const pnmix_layout* layout) {
  if (!layout) return fail(PNMIX_ERR_NULL, "layout is null");
  if (const char* bad = layout_error(*layout)) return fail(PNMIX_ERR_CONFIG, "%s", bad);
  return PNMIX_OK;
}

// The caller's eleven buffers fit layout L (pnmix_core.h's state_problem).
inline int check_state(const pnmix_layout& L, const pnmix_state* state) {
  char msg[192];
  if (const int err = state_problem(L, state, msg, sizeof msg)) return fail(err, "%s", msg);
  return PNMIX_OK;
}

}  // namespace abi
}  // namespace pnmix

#endif  // PNMIX_ABI_CHECK_H
