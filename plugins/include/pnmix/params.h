// pnmix/params.h: the method's configuration and a cache's shape, as plain C structs.
//
// The field names are pnmix/config.py's CONFIG_FIELDS, in the same order (one place names them;
// tests/test_core.py checks this struct against it). The structs are plain C so the C ABI
// (pnmix_core.h), the CUDA kernels and the TensorRT plugins all pass the same thing.
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

/* Limits every reader applies (docs/FORMAT.md 1.1); pnmix/config.py states the same numbers and
 * tests/test_core.py checks them against pnmix_core_limit(). Plain literals so messages can
 * quote them (PNMIX_STR). */
#define PNMIX_MAX_TOKENS_FIELD 1048576 /* group_size, residual_size, sink_tokens: 2^20 */
#define PNMIX_MAX_INT_FIELD 2147483647 /* every other integer config field (value_group_size): int32 */
#define PNMIX_MAX_BATCH 1048576        /* B: 2^20 */
#define PNMIX_MAX_KV_HEADS 4096        /* H */
#define PNMIX_MAX_HEAD_DIM 4096        /* D */
#define PNMIX_MAX_SEQ_LEN 1099511627776LL             /* max_seq_len and a dump's N: 2^40 */
#define PNMIX_MAX_STATE_TENSOR_BYTES 1125899906842624LL /* any one state tensor at capacity: 2^50 */
#define PNMIX_DUMP_SLACK_BYTES 1073741824LL /* a dump's state at capacity may exceed the file by this: 2^30 */
#define PNMIX_XSTR(x) #x
#define PNMIX_STR(x) PNMIX_XSTR(x)

/* pair_layout codes (docs/FORMAT.md 3.2 and the .pnkv header) */
#define PNMIX_PAIR_ADJACENT 0
#define PNMIX_PAIR_HALF 1

/* The 11 state tensors, in docs/FORMAT.md section 3's order (format.STATE_NAMES). */
#define PNMIX_NUM_STATE 11
enum pnmix_state_index {
  PNMIX_SINK_K = 0,
  PNMIX_SINK_V = 1,
  PNMIX_RESIDUAL_K = 2,
  PNMIX_RESIDUAL_V = 3,
  PNMIX_KEY_CODES = 4,
  PNMIX_KEY_STEP = 5,
  PNMIX_KEY_OFFSET = 6,
  PNMIX_VALUE_CODES = 7,
  PNMIX_VALUE_STEP = 8,
  PNMIX_VALUE_OFFSET = 9,
  PNMIX_PAIR_MASK = 10
};

/* PnMixConfig (pnmix/config.py), field for field. */
typedef struct pnmix_config {
  double high_ratio;
  int32_t group_size;
  int32_t residual_size;
  int32_t sink_tokens;
  int32_t value_bits;
  int32_t value_group_size;
  int32_t pair_layout; /* PNMIX_PAIR_ADJACENT or PNMIX_PAIR_HALF */
  int32_t key_high_bits;
  int32_t key_low_bits;
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
