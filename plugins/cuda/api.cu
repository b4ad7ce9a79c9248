// plugins/cuda/api.cu: the extern "C" entry points of libpnmix_cuda (pnmix/pnmix_cuda.h).
//
// Every entry point checks its arguments on the host first (layout and state buffers through
// pnmix/abi_check.h, as libpnmix_core does; every byte count; that pointers are device memory)
// and only then enqueues kernels. Errors are a status code plus a one-line, thread-local message
// (abi_check.h's slot). The pair mask's contents are not checked (pnmix_cuda.h says why).
#include <cuda_runtime.h>
#include <stdio.h>

#include "kernels.cuh"
#include "pnmix/abi_check.h"
#include "pnmix/format.h"
#include "pnmix/pnmix_cuda.h"

PNMIX_DEFINE_ERROR_SLOT()

namespace {

using namespace pnmix;
using namespace pnmix::cuda;

using abi::check_layout;
using abi::check_state;
using abi::fail;
using abi::ok;

// Device (or managed) memory? Host pointers would fault inside a kernel, so refuse them here.
int check_device_pointer(const void* ptr, const char* what) {
  cudaPointerAttributes attr;
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();  // a non-sticky error: clear it so the next launch check is not blamed
    return fail(PNMIX_ERR_CUDA, "cannot inspect %s: %s", what, cudaGetErrorString(err));
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return fail(PNMIX_ERR_NULL, "%s is not device memory (pass CUDA tensors)", what);
  return PNMIX_OK;
}

int check_state_pointers(const pnmix_layout& L, const pnmix_state* state) {
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    if (!state_bytes(L, i)) continue;
    char what[64];
    snprintf(what, sizeof what, "state tensor '%s'", state_name(i));
    if (const int err = check_device_pointer(state->data[i], what)) return err;
  }
  return PNMIX_OK;
}

int check_workspace(const void* workspace, int64_t given, int64_t needed) {
  if (given < needed)
    return fail(PNMIX_ERR_SIZE, "workspace has %lld bytes, this call needs %lld", (long long)given,
                (long long)needed);
  if (needed && !workspace) return fail(PNMIX_ERR_NULL, "workspace is null");
  if (needed) return check_device_pointer(workspace, "workspace");
  return PNMIX_OK;
}

// A launch is checked with cudaGetLastError(); clear an error left from before this call (say, a
// failed graph capture) so it is not blamed on this launch. Sticky errors come back anyway.
void clear_stale_error() { (void)cudaGetLastError(); }

int cuda_status(cudaError_t err, const char* what) {
  if (err != cudaSuccess) return fail(PNMIX_ERR_CUDA, "%s failed: %s", what, cudaGetErrorString(err));
  return ok();
}

int sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 1;
  return count;
}

int64_t bytes_of(const pnmix_layout& L, int64_t heads, int64_t tokens, int64_t elem) {
  return L.batch * heads * tokens * L.head_dim * elem;
}

// Shape checks of an attention call shared by the workspace query and the call itself.
int check_attend_shape(const pnmix_layout& L, int64_t seq_len, int64_t q_heads, int64_t nq, int64_t n_new) {
  if (seq_len < 0 || n_new < 0) return fail(PNMIX_ERR_SIZE, "seq_len and n_new must be >= 0");
  if (seq_len > L.max_seq_len)
    return fail(PNMIX_ERR_CAPACITY, "seq_len %lld exceeds max_seq_len %lld", (long long)seq_len,
                (long long)L.max_seq_len);
  if (n_new > ((int64_t)1 << 30)) return fail(PNMIX_ERR_SIZE, "n_new %lld is too large", (long long)n_new);
  if (q_heads < 1 || q_heads % L.kv_heads)
    return fail(PNMIX_ERR_SIZE, "q_heads %lld must be a positive multiple of kv_heads %lld", (long long)q_heads,
                (long long)L.kv_heads);
  if (q_heads > 65536) return fail(PNMIX_ERR_SIZE, "q_heads %lld is too large", (long long)q_heads);
  if (nq < 1 || nq > seq_len + n_new)
    return fail(PNMIX_ERR_SIZE, "nq must be in 1..seq_len + n_new (%lld), got %lld", (long long)(seq_len + n_new),
                (long long)nq);
  return PNMIX_OK;
}

}  // namespace

extern "C" {

int pnmix_cuda_abi_version(void) { return PNMIX_CUDA_ABI_VERSION; }

const char* pnmix_cuda_last_error(void) { return abi::last_error(); }

int pnmix_cuda_append_workspace_bytes(const pnmix_layout* layout, int64_t seq_len, int64_t n, int64_t* out) {
  if (const int err = check_layout(layout)) return err;
  if (!out) return fail(PNMIX_ERR_NULL, "out is null");
  if (seq_len < 0 || n < 0) return fail(PNMIX_ERR_SIZE, "seq_len and n must be >= 0");
  if (seq_len + n > layout->max_seq_len)
    return fail(PNMIX_ERR_CAPACITY, "cache capacity exceeded: %lld + %lld tokens > max_seq_len %lld",
                (long long)seq_len, (long long)n, (long long)layout->max_seq_len);
  int64_t offsets[4];
  *out = append_workspace(*layout, seq_len, n, offsets);
  return ok();
}

int pnmix_cuda_append(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len, const uint16_t* k,
                      const uint16_t* v, int64_t n, int64_t kv_bytes, void* workspace, int64_t workspace_bytes,
                      void* stream) {
  int64_t needed = 0;
  if (const int err = pnmix_cuda_append_workspace_bytes(layout, seq_len, n, &needed)) return err;
  const pnmix_layout& L = *layout;
  if (const int err = check_state(L, state)) return err;
  if (kv_bytes != bytes_of(L, L.kv_heads, n, 2))
    return fail(PNMIX_ERR_SIZE, "new keys/values have %lld bytes, [B, H, n=%lld, D] fp16 needs %lld",
                (long long)kv_bytes, (long long)n, (long long)bytes_of(L, L.kv_heads, n, 2));
  if (n == 0) return ok();
  if (!k || !v) return fail(PNMIX_ERR_NULL, "new keys or values are null");
  AppendParams p;
  plan_append(L, seq_len, n, &p);
  if (p.new_groups && p.group_smem > max_dynamic_smem())
    return fail(PNMIX_ERR_CONFIG, "group too large for the CUDA append kernel: %d bytes of shared memory",
                p.group_smem);
  if (L.batch * L.kv_heads > 65535) return fail(PNMIX_ERR_CONFIG, "batch * kv_heads must be <= 65535");
  if (const int err = check_state_pointers(L, state)) return err;
  if (const int err = check_device_pointer(k, "new keys")) return err;
  if (const int err = check_device_pointer(v, "new values")) return err;
  if (const int err = check_workspace(workspace, workspace_bytes, needed)) return err;

  p.state = state_view<true>(state->data);
  p.k = k;
  p.v = v;
  int64_t offsets[4];
  append_workspace(L, seq_len, n, offsets);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  p.energy = reinterpret_cast<double*>(ws + offsets[0]);
  p.high = ws + offsets[1];
  p.gather_k = reinterpret_cast<uint16_t*>(ws + offsets[2]);
  p.gather_v = reinterpret_cast<uint16_t*>(ws + offsets[3]);
  clear_stale_error();
  return cuda_status(launch_append(p, static_cast<cudaStream_t>(stream)), "append kernel launch");
}

int pnmix_cuda_attend_workspace_bytes(const pnmix_layout* layout, int64_t seq_len, int64_t q_heads, int64_t nq,
                                      int64_t n_new, int64_t* out, int64_t* num_splits) {
  if (const int err = check_layout(layout)) return err;
  if (!out) return fail(PNMIX_ERR_NULL, "out is null");
  if (const int err = check_attend_shape(*layout, seq_len, q_heads, nq, n_new)) return err;
  AttendParams p;
  const char* why = nullptr;
  *out = plan_attend(*layout, seq_len, q_heads, nq, n_new, sm_count(), &p, &why);
  if (why) return fail(PNMIX_ERR_CONFIG, "%s", why);
  if (num_splits) *num_splits = p.num_splits;
  return ok();
}

int pnmix_cuda_attend(const pnmix_layout* layout, const pnmix_state* state, int64_t seq_len, const void* q,
                      int q_dtype, int64_t q_heads, int64_t nq, int64_t q_bytes, const uint16_t* k_new,
                      const uint16_t* v_new, int64_t n_new, int64_t new_bytes, float* out, int64_t out_bytes,
                      void* workspace, int64_t workspace_bytes, void* stream) {
  if (const int err = check_layout(layout)) return err;
  const pnmix_layout& L = *layout;
  if (const int err = check_state(L, state)) return err;
  if (const int err = check_attend_shape(L, seq_len, q_heads, nq, n_new)) return err;
  if (q_dtype != PNMIX_DTYPE_FP16 && q_dtype != PNMIX_DTYPE_BF16)
    return fail(PNMIX_ERR_CONFIG, "q_dtype must be %d (fp16) or %d (bf16), got %d", PNMIX_DTYPE_FP16,
                PNMIX_DTYPE_BF16, q_dtype);
  if (q_bytes != bytes_of(L, q_heads, nq, 2))
    return fail(PNMIX_ERR_SIZE, "queries have %lld bytes, [B, Hq, nq, D] needs %lld", (long long)q_bytes,
                (long long)bytes_of(L, q_heads, nq, 2));
  if (new_bytes != bytes_of(L, L.kv_heads, n_new, 2))
    return fail(PNMIX_ERR_SIZE, "new keys/values have %lld bytes, [B, H, n_new, D] fp16 needs %lld",
                (long long)new_bytes, (long long)bytes_of(L, L.kv_heads, n_new, 2));
  if (out_bytes != bytes_of(L, q_heads, nq, 4))
    return fail(PNMIX_ERR_SIZE, "output has %lld bytes, [B, Hq, nq, D] fp32 needs %lld", (long long)out_bytes,
                (long long)bytes_of(L, q_heads, nq, 4));
  if (!q || !out) return fail(PNMIX_ERR_NULL, "queries or output are null");
  if (n_new && (!k_new || !v_new)) return fail(PNMIX_ERR_NULL, "new keys or values are null");
  AttendParams p;
  const char* why = nullptr;
  const int64_t needed = plan_attend(L, seq_len, q_heads, nq, n_new, sm_count(), &p, &why);
  if (why) return fail(PNMIX_ERR_CONFIG, "%s", why);
  if (const int err = check_state_pointers(L, state)) return err;
  if (const int err = check_device_pointer(q, "queries")) return err;
  if (const int err = check_device_pointer(out, "output")) return err;
  if (n_new) {
    if (const int err = check_device_pointer(k_new, "new keys")) return err;
    if (const int err = check_device_pointer(v_new, "new values")) return err;
  }
  if (const int err = check_workspace(workspace, workspace_bytes, needed)) return err;

  p.q_dtype = q_dtype;
  p.q = q;
  p.state = state_view<false>(state->data);
  p.k_new = k_new;
  p.v_new = v_new;
  p.out = out;
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  p.part_o = reinterpret_cast<float*>(ws);
  p.part_m = reinterpret_cast<float*>(ws + p.workspace_m);
  p.part_l = reinterpret_cast<float*>(ws + p.workspace_l);
  clear_stale_error();
  return cuda_status(launch_attend(p, static_cast<cudaStream_t>(stream)), "attention kernel launch");
}

int pnmix_cuda_attend_bytes_read(const pnmix_layout* layout, int64_t seq_len, int64_t q_heads, int64_t nq,
                                 int64_t n_new, int q_dtype, int64_t* out) {
  if (const int err = check_layout(layout)) return err;
  if (!out) return fail(PNMIX_ERR_NULL, "out is null");
  if (const int err = check_attend_shape(*layout, seq_len, q_heads, nq, n_new)) return err;
  (void)q_dtype;  // fp16 and bf16 are both two bytes
  *out = persistent_bytes(*layout, seq_len) + bytes_of(*layout, q_heads, nq, 2) +
         2 * bytes_of(*layout, layout->kv_heads, n_new, 2);
  return ok();
}

}  // extern "C"
