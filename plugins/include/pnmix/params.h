// pnmix/params.h: the method's configuration and a cache's shape, as plain C structs.
//
// The config struct is built from generated.h's field table (pnmix/config.py's CONFIG_FIELDS, in
// the same order); tests/backends/test_core.py compares its compiled layout (pnmix_core_struct_offset) with
// the ctypes mirror. The structs are plain C so the C ABI (pnmix_core.h), the CUDA kernels and the
// TensorRT plugins all pass the same thing.
#ifndef PNMIX_PARAMS_H
#define PNMIX_PARAMS_H

#include <stdint.h>

#if defined(__CUDACC__)
#define PNMIX_HD __host__ __device__
#else
#define PNMIX_HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The config fields, the limits (docs/FORMAT.md 1.1), the pair layouts and the state tensors
 * come from generated.h, which pnmix/codegen.py writes from pnmix/config.py and pnmix/format.py. */
#include "generated.h"

#define PNMIX_XSTR(x) #x
#define PNMIX_STR(x) PNMIX_XSTR(x)

/* The state tensors' indices (PNMIX_SINK_K = 0 ... PNMIX_PAIR_MASK = 10), in STATE_NAMES order. */
enum pnmix_state_index {
#define PNMIX_X(index, NAME, name, elem_bytes, type) PNMIX_##NAME = index,
  PNMIX_STATE_TENSORS(PNMIX_X)
#undef PNMIX_X
};

/* PnMixConfig (pnmix/config.py), field for field, in CONFIG_FIELDS order. pair_layout holds
 * PNMIX_PAIR_ADJACENT or PNMIX_PAIR_HALF. */
#define PNMIX_CTYPE_RATIO double
#define PNMIX_CTYPE_INT int32_t
#define PNMIX_CTYPE_LAYOUT int32_t
typedef struct pnmix_config {
#define PNMIX_X(name, kind) PNMIX_CTYPE_##kind name;
  PNMIX_CONFIG_FIELDS(PNMIX_X)
#undef PNMIX_X
} pnmix_config;

/* A cache: config, batch B, KV heads H, head dim D, capacity in tokens (CacheLayout). */
typedef struct pnmix_layout {
  pnmix_config config;
  int64_t batch;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t max_seq_len;
} pnmix_layout;

#ifdef __cplusplus
}
#endif

#endif /* PNMIX_PARAMS_H */
