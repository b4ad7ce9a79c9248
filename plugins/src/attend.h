// attend.h: the packed decode-attention job shared by the per-ISA kernels (attend_kernel.inc).
#ifndef PNMIX_SRC_ATTEND_H
#define PNMIX_SRC_ATTEND_H

#include <stdint.h>

#include "pnmix/format.h"

#ifndef PNMIX_MIN_KB_PER_AWAKE_THREAD
#define PNMIX_MIN_KB_PER_AWAKE_THREAD 128
#endif

namespace pnmix {

// One call of pnmix_attend, resolved: pointers into the state, lengths, and the work split.
// Work item = (split s, sequence b, KV head h); split s covers groups [split_first_group(s),
// split_first_group(s + 1)), split 0 also the sink, the last split also the residual and the new
// tokens.
struct AttendJob {
  pnmix_layout L;
  Lengths n;
  int64_t seq_len, n_new, total;  // total = seq_len + n_new key positions
  int64_t q_heads, nq, group_q;   // group_q = Hq / H query heads per KV head
  int64_t rows;                   // group_q * nq query rows per KV head
  int64_t splits;      // of the groups, merged by log-sum-exp
  int64_t row_blocks = 1;  // of the rows (a chunk of many queries): each covers every key
  float scale;
  bool int8_keys = false, int8_values = false;  // the integer path (attend_int8.inc) for each half
  bool read_ahead_to_l2 = false;  // the next group's lines by prefetcht1, not prefetcht0 (cpu_reads_ahead_to_l2)
  const float* q;  // fp32 [B, Hq, nq, D]
  StateView<false> state;  // paged: the slot's sink, residual and mask; the group tensors null
  // A paged cache (pnmix_attend_paged, batch 1): KV head 0's part of group g's page at
  // group_pages[g], head h's head_bytes further, the group tensors at sections; null: the
  // contiguous state's group tensors. Read only through group_tensors.
  const uint8_t* const* group_pages = nullptr;
  int64_t head_bytes = 0;
  GroupSections sections;
  const uint16_t *k_new, *v_new;
  // per item and row: D accumulators, then the running max m and sum l
  float* partial;
};

// The first group of split s of a sequence's n groups cut into S splits. The splits shrink from
// first to last (split s starts after n * (1 - (1 - s/S)^2) groups) and the items run split by
// split, every KV head's first split first: the items claimed last are the smallest, so the
// threads finish close together (with equal splits, the two threads of a 32K step finished
// 144 us apart on average, half an item).
inline int64_t split_first_group(int64_t s, int64_t S, int64_t n) {
  const int64_t rest = S - s;
  return n - n * rest * rest / (S * S);
}

// Floats per row of `partial`: D + 2, rounded up to whole 64-byte cache lines. Each group writes its
// rows (the softmax's rescale, the offsets' sums), and work items on different threads must not
// share a line: a line written by both cores goes back and forth between them at every group.
constexpr int64_t kFloatsPerLine = 16;
inline int64_t partial_stride(const AttendJob& job) {
  return (job.L.head_dim + 2 + kFloatsPerLine - 1) / kFloatsPerLine * kFloatsPerLine;
}

// Row `row` of split `split` of sequence and KV head bh in `partial` (what the items write and
// merge_splits reads).
inline float* partial_row(const AttendJob& job, int64_t bh, int64_t split, int64_t row) {
  return job.partial + ((bh * job.splits + split) * job.rows + row) * partial_stride(job);
}

// Threads worth waking for a call: one per kMinBytesPerThread of packed bytes to read, or per
// kMinDenseMacsPerThread multiply-adds of the queries against the fp16 tokens (a long chunk over
// a short cache: its own keys), whichever asks for more (at least one, at most `available`).
// Below that, waking a helper (and, inside a model, contending with the framework's own threads
// for the cores) costs more than the split saves.
// On a caller's pool whose threads are already awake (pnmix_attend_on: an engine's intra-op pool
// between its own kernels), a thread pays for itself on far less.
constexpr int64_t kMinBytesPerThread = (int64_t)2 << 20;
constexpr int64_t kMinBytesPerAwakeThread = (int64_t)PNMIX_MIN_KB_PER_AWAKE_THREAD << 10;
constexpr int64_t kMinDenseMacsPerThread = (int64_t)4 << 20;  // about 0.1 ms of one core's FMAs
constexpr int64_t kMinRowsPerBlock = 32;  // a row block's rows: the group decoding each block repeats pays off

inline int attend_threads(const pnmix_layout& L, int64_t seq_len, int available, bool awake = false,
                          int64_t dense_macs = 0) {
  int64_t useful = persistent_bytes(L, seq_len) / (awake ? kMinBytesPerAwakeThread : kMinBytesPerThread);
  if (dense_macs / kMinDenseMacsPerThread > useful) useful = dense_macs / kMinDenseMacsPerThread;
  return useful < 1 ? 1 : useful < available ? (int)useful : available;
}

// Multiply-adds of a call's queries against its fp16 tokens (sink, residual, new; causal), both
// products (scores and values).
// In double, clamped: absurd shapes must not overflow (they only ask for every thread).
inline int64_t dense_macs(const AttendJob& job, int64_t batch) {
  const double dense = (double)(job.n.sink + job.n.residual + job.n_new);
  const double seen = dense < job.nq ? dense : (double)job.nq;  // the chunk's own keys are causal: about half
  const double macs = 2.0 * batch * job.L.kv_heads * job.group_q * job.nq * (dense - seen / 2) * job.L.head_dim;
  return macs < 4e18 ? (int64_t)macs : (int64_t)4e18;
}

// What the integer path (attend_int8.inc) takes. Keys: codes of at most 4 bits (two products of a
// code and an int8 weight stay inside vpmaddubsw's 16-bit sum) in chunks of 32 tokens. Values: one
// value block per token (the weights are per token), codes that tile a byte (1, 2 or 4 bits), and a
// token's codes 16 bytes or a multiple of 32.
inline bool int8_keys_supported(const pnmix_layout& L) {
  return L.config.key_high_bits <= 4 && L.config.key_low_bits <= 4 && L.config.group_size % 32 == 0;
}
inline bool int8_values_supported(const pnmix_layout& L) {
  const int64_t B = L.config.value_bits, VB = value_token_bytes(L);
  return value_blocks(L) == 1 && (B == 1 || B == 2 || B == 4) && (VB == 16 || (VB >= 32 && VB % 32 == 0)) &&
         L.config.group_size % 4 == 0;
}

// The kernels: one per instruction set, same arithmetic.
void attend_item_generic(const AttendJob& job, int64_t item);
void attend_item_avx2(const AttendJob& job, int64_t item);
void attend_item_avx512(const AttendJob& job, int64_t item);
void attend_item_avx512vbmi(const AttendJob& job, int64_t item);
void attend_item_avx512vnni(const AttendJob& job, int64_t item);

}  // namespace pnmix

#endif  // PNMIX_SRC_ATTEND_H
