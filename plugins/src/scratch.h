// scratch.h: per-thread and per-call scratch vectors, grown when a bigger job comes, never shrunk.
#ifndef PNMIX_SRC_SCRATCH_H
#define PNMIX_SRC_SCRATCH_H

#include <stdint.h>

#include <vector>

namespace pnmix {
// A copy per translation unit: the attention kernels' files are compiled for different instruction
// sets, and no ISA's copy may stand in for another's at link time.
namespace {

// v with at least n elements (grown if smaller, contents kept); its data.
template <typename T>
inline T* ensure(std::vector<T>& v, int64_t n) {
  if ((int64_t)v.size() < n) v.resize((size_t)n);
  return v.data();
}

}  // namespace
}  // namespace pnmix

#endif  // PNMIX_SRC_SCRATCH_H
