// scratch.h: per-thread and per-call scratch vectors, grown when a bigger job comes, never shrunk.
#ifndef PNMIX_SRC_SCRATCH_H
#define PNMIX_SRC_SCRATCH_H

#include <stdint.h>

#include <cstddef>
#include <new>
#include <vector>

namespace pnmix {
// A copy per translation unit: the attention kernels' files are compiled for different instruction
// sets, and no ISA's copy may stand in for another's at link time.
namespace {

// Storage that starts on a cache line. The kernels' 512-bit loads and stores of their scratch
// (scores, probabilities, weights) are then whole lines; from malloc's 16-byte alignment most of
// them straddled two lines, and a split access costs the core two.
template <typename T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kLine{64};
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kLine)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kLine); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};

template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

// v with at least n elements (grown if smaller, contents kept); its data.
template <typename T, typename A>
inline T* ensure(std::vector<T, A>& v, int64_t n) {
  if ((int64_t)v.size() < n) v.resize((size_t)n);
  return v.data();
}

}  // namespace
}  // namespace pnmix

#endif  // PNMIX_SRC_SCRATCH_H
