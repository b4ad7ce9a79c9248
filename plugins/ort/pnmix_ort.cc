// plugins/ort/pnmix_ort.cc: libpnmix_ort, the two pn-mix ops (docs/OPS.md sections 3 and 4) as
// ONNX Runtime custom ops on the CPU execution provider, over libpnmix_core.
//
// ONNX Runtime loads the library (SessionOptions.register_custom_ops_library, or the C API's
// RegisterCustomOpsLibrary_V2) and calls RegisterCustomOps, which adds domain `pnmix` with
// PnMixAppend and PnMixAttention. Kernel creation reads the node's attributes into a pnmix_config
// (plugin_fields.h's parser, the one the TensorRT plugins use); compute derives the layout from the
// state tensors' shapes, checks every input, and calls pnmix_append / pnmix_attend: the format has
// no second implementation here. Every failure is an OrtStatus with ONE line
// "pnmix <OpName>: <reason>"; nothing throws or aborts across the C boundary.
//
// Threads: the attention's work items run on ONNX Runtime's own intra-op pool
// (KernelContext_ParallelFor, ONNX Runtime 1.17 and newer; pnmix_attend_on), whose threads are
// awake between the graph's kernels, so a second pool never competes with them for the cores;
// older runtimes get the core's own pool. The split is made for the session config entry
// `pnmix.threads` (read through KernelInfo_GetConfigEntries, ONNX Runtime 1.24 and newer), else
// the environment variable PNMIX_ORT_THREADS; 0 or unset: all cores.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <new>

#include "ort_c_api.h"
#include "pnmix/plugin_fields.h"
#include "pnmix/pnmix_core.h"

#if defined(_WIN32)
#define PNMIX_ORT_EXPORT __declspec(dllexport)
#else
#define PNMIX_ORT_EXPORT __attribute__((visibility("default")))
#endif

namespace {

constexpr const char* kDomain = PNMIX_OP_DOMAIN;  // generated.h, from export/ops.py
constexpr const char* kThreadsKey = "pnmix.threads";
constexpr const char* kThreadsEnv = "PNMIX_ORT_THREADS";
constexpr const char* kOwnPoolEnv = "PNMIX_ORT_OWN_POOL";  // set: the core's own pool, for comparison
constexpr int kMaxRank = 8;

// Whether the runtime has KernelInfo_GetConfigEntries, and its API table with
// KernelContext_ParallelFor or null (decided once, at registration).
bool g_has_config_entries = false;
const OrtApi* g_parallel_api = nullptr;

enum class OpKind { kAppend, kAttention };

const char* op_name(OpKind kind) { return kind == OpKind::kAppend ? PNMIX_APPEND_PLUGIN_NAME : PNMIX_ATTENTION_PLUGIN_NAME; }

// Inputs before the eleven state tensors (docs/OPS.md: append k_new v_new seq_len new_len;
// attention q k_new v_new seq_len new_len).
// Input positions come from generated.h (export/ops.py's tables); read_lengths takes new_len right after seq_len.
static_assert(PNMIX_APPEND_IN_NEW_LEN == PNMIX_APPEND_IN_SEQ_LEN + 1, "new_len follows seq_len");
static_assert(PNMIX_ATTENTION_IN_NEW_LEN == PNMIX_ATTENTION_IN_SEQ_LEN + 1, "new_len follows seq_len");
size_t leading_inputs(OpKind kind) {
  return kind == OpKind::kAppend ? PNMIX_APPEND_IN_FIRST_STATE : PNMIX_ATTENTION_IN_FIRST_STATE;
}

ONNXTensorElementDataType state_type(int i) {
  switch (i) {
#define PNMIX_X(index, NAME, name, elem_bytes, type) \
  case index: return ONNX_TENSOR_ELEMENT_DATA_TYPE_##type;
    PNMIX_STATE_TENSORS(PNMIX_X)
#undef PNMIX_X
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
}

// "pnmix <Op>: <reason>" as one line (any newline in a reason becomes a space).
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
OrtStatus* fail(const OrtApi* api, OpKind kind, const char* fmt, ...) {
  char reason[768];
  va_list args;
  va_start(args, fmt);
  vsnprintf(reason, sizeof reason, fmt, args);
  va_end(args);
  char line[900];
  snprintf(line, sizeof line, "pnmix %s: %s", op_name(kind), reason);
  for (char* c = line; *c; ++c)
    if (*c == '\n' || *c == '\r') *c = ' ';
  return api->CreateStatus(ORT_INVALID_ARGUMENT, line);
}

// An ONNX Runtime error from a call we made, re-worded as our one line.
OrtStatus* relay(const OrtApi* api, OpKind kind, const char* what, OrtStatus* status) {
  OrtStatus* ours = fail(api, kind, "%s: %s", what, api->GetErrorMessage(status));
  api->ReleaseStatus(status);
  return ours;
}

#define PNMIX_ORT_TRY(api, kind, what, call)                   \
  do {                                                         \
    OrtStatus* status_ = (call);                               \
    if (status_) return relay((api), (kind), (what), status_); \
  } while (0)

// ---- kernel creation: attributes -> pnmix_config -----------------------------------------------

struct Kernel {
  const OrtApi* api;
  OpKind kind;
  pnmix_config config;
  int threads;
};

// Read one attribute as the field plugin_fields.h's parser expects (FLOAT -> float32, INT ->
// int64, STRING -> chars with their NUL). Storage outlives the parse.
struct AttributeStorage {
  float ratio;
  int64_t ints[PNMIX_NUM_CONFIG_FIELDS];
  char layout[pnmix::kMaxFieldChars + 1];
};

OrtStatus* read_attribute(const OrtApi* api, OpKind kind, const OrtKernelInfo* info, int i, AttributeStorage* s,
                          pnmix_field* field) {
  const pnmix::FieldSpec& spec = pnmix::kConfigFields[i];
  field->name = spec.name;
  field->length = 1;
  OrtStatus* status = nullptr;
  switch (spec.kind) {
    case pnmix::FieldKind::kRatio:
      status = api->KernelInfoGetAttribute_float(info, spec.name, &s->ratio);
      field->data = &s->ratio;
      field->type = PNMIX_FIELD_FLOAT32;
      break;
    case pnmix::FieldKind::kInt:
      status = api->KernelInfoGetAttribute_int64(info, spec.name, &s->ints[i]);
      field->data = &s->ints[i];
      field->type = PNMIX_FIELD_INT64;
      break;
    case pnmix::FieldKind::kLayout: {
      size_t size = 0;
      status = api->KernelInfoGetAttribute_string(info, spec.name, nullptr, &size);
      if (!status && (size == 0 || size > sizeof s->layout))
        return fail(api, kind, "attribute '%s' must be one of: %s", spec.name, PNMIX_PAIR_LAYOUT_LIST);
      if (!status) status = api->KernelInfoGetAttribute_string(info, spec.name, s->layout, &size);
      field->data = s->layout;
      field->type = PNMIX_FIELD_CHAR;
      field->length = (int32_t)size;
      break;
    }
  }
  if (status) {
    char what[96];
    snprintf(what, sizeof what, "attribute '%s'", spec.name);
    return relay(api, kind, what, status);
  }
  return nullptr;
}

OrtStatus* read_config(const OrtApi* api, OpKind kind, const OrtKernelInfo* info, pnmix_config* config) {
  AttributeStorage storage;
  pnmix_field fields[PNMIX_NUM_CONFIG_FIELDS];
  for (int i = 0; i < PNMIX_NUM_CONFIG_FIELDS; ++i)
    if (OrtStatus* status = read_attribute(api, kind, info, i, &storage, &fields[i])) return status;
  char err[512];
  if (!pnmix::parse_config_fields(fields, PNMIX_NUM_CONFIG_FIELDS, config, err, sizeof err))
    return fail(api, kind, "%s", err);
  return nullptr;
}

// `pnmix.threads` from the session config (when the runtime can say), else PNMIX_ORT_THREADS.
OrtStatus* read_threads(const OrtApi* api, OpKind kind, const OrtKernelInfo* info, int* threads) {
  *threads = 0;
  const char* text = nullptr;
  const char* source = kThreadsEnv;
  OrtKeyValuePairs* entries = nullptr;
#if ORT_API_VERSION >= PNMIX_ORT_API_CONFIG_ENTRIES
  if (g_has_config_entries) {
    PNMIX_ORT_TRY(api, kind, "reading the session config", api->KernelInfo_GetConfigEntries(info, &entries));
    text = api->GetKeyValue(entries, kThreadsKey);
    source = kThreadsKey;
  }
#else
  (void)info;
#endif
  if (!text) {
    text = getenv(kThreadsEnv);
    source = kThreadsEnv;
  }
  OrtStatus* status = nullptr;
  if (text && *text) {
    char* end = nullptr;
    const long value = strtol(text, &end, 10);
    if (*end || value < 0 || value > 4096)
      status = fail(api, kind, "%s must be an integer in [0, 4096] (0: all cores), got '%s'", source, text);
    else
      *threads = (int)value;
  }
#if ORT_API_VERSION >= PNMIX_ORT_API_CONFIG_ENTRIES
  if (entries) api->ReleaseKeyValuePairs(entries);
#endif
  return status;
}

// ---- compute: the tensors ----------------------------------------------------------------------

struct Tensor {
  ONNXTensorElementDataType type;
  size_t rank;
  int64_t dims[kMaxRank];
  int64_t count;
  void* data;
  int64_t bytes() const { return count * (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT ? 4 : type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 ? 8 : type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? 2 : 1); }
};

OrtStatus* describe(const OrtApi* api, OpKind kind, const OrtValue* value, const char* name, Tensor* t) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  PNMIX_ORT_TRY(api, kind, name, api->GetTensorTypeAndShape(value, &info));
  OrtStatus* status = api->GetTensorElementType(info, &t->type);
  if (!status) status = api->GetDimensionsCount(info, &t->rank);
  if (!status && t->rank > (size_t)kMaxRank) {
    api->ReleaseTensorTypeAndShapeInfo(info);
    return fail(api, kind, "input '%s' has rank %zu", name, t->rank);
  }
  if (!status) status = api->GetDimensions(info, t->dims, t->rank);
  size_t count = 0;
  if (!status) status = api->GetTensorShapeElementCount(info, &count);
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (status) return relay(api, kind, name, status);
  t->count = (int64_t)count;
  // Inputs are read-only here; the C API hands their data out through the mutable getter.
  PNMIX_ORT_TRY(api, kind, name, api->GetTensorMutableData(const_cast<OrtValue*>(value), &t->data));
  return nullptr;
}

const char* type_name(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    default: return "another type";
  }
}

OrtStatus* expect_type(const OrtApi* api, OpKind kind, const char* name, const Tensor& t, ONNXTensorElementDataType want) {
  if (t.type != want) return fail(api, kind, "input '%s' is %s, expected %s", name, type_name(t.type), type_name(want));
  return nullptr;
}

OrtStatus* read_scalar(const OrtApi* api, OpKind kind, const OrtValue* value, const char* name, int64_t* out) {
  Tensor t;
  if (OrtStatus* status = describe(api, kind, value, name, &t)) return status;
  if (OrtStatus* status = expect_type(api, kind, name, t, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64)) return status;
  if (t.rank != 0 || t.count != 1) return fail(api, kind, "input '%s' must be an int64 scalar (shape [])", name);
  *out = *static_cast<const int64_t*>(t.data);
  return nullptr;
}

// Fp16 K/V-like input [B, heads, n, D] (heads < 0: any).
OrtStatus* read_tokens(const OrtApi* api, OpKind kind, const OrtValue* value, const char* name, const pnmix_layout& L,
                       int64_t heads, Tensor* t) {
  if (OrtStatus* status = describe(api, kind, value, name, t)) return status;
  if (OrtStatus* status = expect_type(api, kind, name, *t, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16)) return status;
  if (t->rank != 4 || t->dims[0] != L.batch || (heads >= 0 && t->dims[1] != heads) || t->dims[3] != L.head_dim)
    return fail(api, kind, "input '%s' must be fp16 [B=%lld, %s, n, D=%lld] like the state", name, (long long)L.batch,
                heads >= 0 ? "H" : "heads", (long long)L.head_dim);
  return nullptr;
}

// The largest capacity whose buffers have G group slots (docs/FORMAT.md section 2: G = groups at
// the capacity); every capacity with the same G has the same state sizes.
int64_t capacity_for_groups(const pnmix_config& c, int64_t groups) {
  return (int64_t)c.sink_tokens + c.residual_size - 1 + groups * c.group_size;
}

struct Inputs {
  pnmix_layout layout;
  pnmix_state state;
  Tensor states[PNMIX_NUM_STATE];
  int64_t seq_len, new_len;
};

// The eleven state tensors from input `first` on: dtypes, the layout their shapes give, their sizes.
OrtStatus* read_state(const Kernel& k, OrtKernelContext* ctx, size_t first, Inputs* in) {
  const OrtApi* api = k.api;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    const OrtValue* value = nullptr;
    PNMIX_ORT_TRY(api, k.kind, pnmix::state_name(i), api->KernelContext_GetInput(ctx, first + i, &value));
    if (!value) return fail(api, k.kind, "input '%s' is missing", pnmix::state_name(i));
    Tensor& t = in->states[i];
    if (OrtStatus* status = describe(api, k.kind, value, pnmix::state_name(i), &t)) return status;
    if (OrtStatus* status = expect_type(api, k.kind, pnmix::state_name(i), t, state_type(i))) return status;
  }
  const Tensor& sink = in->states[PNMIX_SINK_K];
  const Tensor& codes = in->states[PNMIX_KEY_CODES];
  if (sink.rank != 4 || codes.rank != 4)
    return fail(api, k.kind, "state tensors 'sink_k' and 'key_codes' must have rank 4 ([B, H, rows, row])");
  pnmix_layout& L = in->layout;
  L.config = k.config;
  L.batch = sink.dims[0];
  L.kv_heads = sink.dims[1];
  L.head_dim = sink.dims[3];
  L.max_seq_len = capacity_for_groups(k.config, codes.dims[2]);
  int64_t want[PNMIX_NUM_STATE];
  if (pnmix_state_bytes(&L, want) != PNMIX_OK) return fail(api, k.kind, "state shapes: %s", pnmix_last_error());
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    const int64_t have = in->states[i].bytes();
    if (have != want[i])
      return fail(api, k.kind, "state tensor '%s' has %lld bytes, the layout of its attributes and the state's shapes "
                  "(B=%lld, H=%lld, D=%lld, %lld group slots) needs %lld", pnmix::state_name(i), (long long)have,
                  (long long)L.batch, (long long)L.kv_heads, (long long)L.head_dim, (long long)codes.dims[2],
                  (long long)want[i]);
    in->state.data[i] = in->states[i].data;
    in->state.nbytes[i] = have;
  }
  return nullptr;
}

OrtStatus* read_lengths(const Kernel& k, OrtKernelContext* ctx, size_t at, int64_t n, Inputs* in) {
  const OrtApi* api = k.api;
  const OrtValue* seq = nullptr;
  const OrtValue* fresh = nullptr;
  PNMIX_ORT_TRY(api, k.kind, "seq_len", api->KernelContext_GetInput(ctx, at, &seq));
  PNMIX_ORT_TRY(api, k.kind, "new_len", api->KernelContext_GetInput(ctx, at + 1, &fresh));
  if (OrtStatus* status = read_scalar(api, k.kind, seq, "seq_len", &in->seq_len)) return status;
  if (OrtStatus* status = read_scalar(api, k.kind, fresh, "new_len", &in->new_len)) return status;
  if (in->new_len != 0 && in->new_len != n)
    return fail(api, k.kind, "new_len must be 0 or n = %lld, got %lld", (long long)n, (long long)in->new_len);
  if (in->seq_len < 0 || in->seq_len + in->new_len > in->layout.max_seq_len)
    return fail(api, k.kind, "seq_len %lld + new_len %lld exceeds the state's capacity of %lld tokens",
                (long long)in->seq_len, (long long)in->new_len, (long long)in->layout.max_seq_len);
  return nullptr;
}

OrtStatus* input(const Kernel& k, OrtKernelContext* ctx, size_t index, const char* name, const OrtValue** out) {
  PNMIX_ORT_TRY(k.api, k.kind, name, k.api->KernelContext_GetInput(ctx, index, out));
  if (!*out) return fail(k.api, k.kind, "input '%s' is missing", name);
  return nullptr;
}

OrtStatus* compute_append(const Kernel& k, OrtKernelContext* ctx) {
  const OrtApi* api = k.api;
  Inputs in;
  if (OrtStatus* status = read_state(k, ctx, leading_inputs(k.kind), &in)) return status;
  const OrtValue* kv[2];
  Tensor key, value;
  if (OrtStatus* status = input(k, ctx, PNMIX_APPEND_IN_K_NEW, "k_new", &kv[0])) return status;
  if (OrtStatus* status = input(k, ctx, PNMIX_APPEND_IN_V_NEW, "v_new", &kv[1])) return status;
  if (OrtStatus* status = read_tokens(api, k.kind, kv[0], "k_new", in.layout, in.layout.kv_heads, &key)) return status;
  if (OrtStatus* status = read_tokens(api, k.kind, kv[1], "v_new", in.layout, in.layout.kv_heads, &value)) return status;
  if (value.dims[2] != key.dims[2]) return fail(api, k.kind, "inputs 'k_new' and 'v_new' differ in shape");
  if (OrtStatus* status = read_lengths(k, ctx, PNMIX_APPEND_IN_SEQ_LEN, key.dims[2], &in)) return status;

  // Outputs have the inputs' shapes; the append happens in the output (in place when ONNX
  // Runtime bound an output onto its input's buffer).
  pnmix_state present;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    const Tensor& t = in.states[i];
    OrtValue* out = nullptr;
    char what[64];
    snprintf(what, sizeof what, "output 'present_%s'", pnmix::state_name(i));
    PNMIX_ORT_TRY(api, k.kind, what, api->KernelContext_GetOutput(ctx, i, t.dims, t.rank, &out));
    void* data = nullptr;
    PNMIX_ORT_TRY(api, k.kind, what, api->GetTensorMutableData(out, &data));
    if (t.count && data != t.data) memcpy(data, t.data, (size_t)t.bytes());
    present.data[i] = data;
    present.nbytes[i] = t.bytes();
  }
  if (in.new_len == 0) return nullptr;
  if (pnmix_append(&in.layout, &present, in.seq_len, static_cast<const uint16_t*>(key.data),
                   static_cast<const uint16_t*>(value.data), in.new_len, key.bytes()) != PNMIX_OK)
    return fail(api, k.kind, "%s", pnmix_last_error());
  return nullptr;
}

// pnmix_attend_on's runner over ONNX Runtime's intra-op pool: every work item its own task, so
// the pool balances them (the split at the sink and the residual costs more).
struct PoolRun {
  OrtKernelContext* ctx;
  pnmix_task task;
  void* task_ctx;
};

void pool_item(void* run, size_t item) {
  const PoolRun& r = *static_cast<const PoolRun*>(run);
  r.task(r.task_ctx, (int64_t)item);
}

int run_on_pool(void* run, pnmix_task task, void* task_ctx, int64_t items) {
  PoolRun& r = *static_cast<PoolRun*>(run);
  r.task = task;
  r.task_ctx = task_ctx;
  OrtStatus* status = g_parallel_api->KernelContext_ParallelFor(r.ctx, pool_item, (size_t)items, (size_t)items, &r);
  if (!status) return 0;
  g_parallel_api->ReleaseStatus(status);
  return 1;
}

OrtStatus* compute_attention(const Kernel& k, OrtKernelContext* ctx) {
  const OrtApi* api = k.api;
  Inputs in;
  if (OrtStatus* status = read_state(k, ctx, leading_inputs(k.kind), &in)) return status;
  const OrtValue* values[3];
  Tensor q, key, value;
  if (OrtStatus* status = input(k, ctx, PNMIX_ATTENTION_IN_Q, "q", &values[0])) return status;
  if (OrtStatus* status = input(k, ctx, PNMIX_ATTENTION_IN_K_NEW, "k_new", &values[1])) return status;
  if (OrtStatus* status = input(k, ctx, PNMIX_ATTENTION_IN_V_NEW, "v_new", &values[2])) return status;
  if (OrtStatus* status = read_tokens(api, k.kind, values[0], "q", in.layout, -1, &q)) return status;
  if (OrtStatus* status = read_tokens(api, k.kind, values[1], "k_new", in.layout, in.layout.kv_heads, &key)) return status;
  if (OrtStatus* status = read_tokens(api, k.kind, values[2], "v_new", in.layout, in.layout.kv_heads, &value)) return status;
  if (value.dims[2] != key.dims[2] || key.dims[2] != q.dims[2])
    return fail(api, k.kind, "inputs 'q', 'k_new' and 'v_new' must have the same n");
  if (OrtStatus* status = read_lengths(k, ctx, PNMIX_ATTENTION_IN_SEQ_LEN, key.dims[2], &in)) return status;

  OrtValue* out = nullptr;
  PNMIX_ORT_TRY(api, k.kind, "output 'attention'", api->KernelContext_GetOutput(ctx, 0, q.dims, q.rank, &out));
  void* data = nullptr;
  PNMIX_ORT_TRY(api, k.kind, "output 'attention'", api->GetTensorMutableData(out, &data));
  const bool fresh = in.new_len > 0;
  PoolRun pool{ctx, nullptr, nullptr};
  if (pnmix_attend_on(&in.layout, &in.state, in.seq_len, q.data, 0, q.dims[1], q.dims[2], q.bytes(),
                      fresh ? static_cast<const uint16_t*>(key.data) : nullptr,
                      fresh ? static_cast<const uint16_t*>(value.data) : nullptr, in.new_len, fresh ? key.bytes() : 0,
                      static_cast<float*>(data), q.count * 4, k.threads, g_parallel_api ? run_on_pool : nullptr,
                      &pool) != PNMIX_OK)
    return fail(api, k.kind, "%s", pnmix_last_error());
  return nullptr;
}

// ---- the OrtCustomOp tables ---------------------------------------------------------------------

struct PnMixOp : OrtCustomOp {
  OpKind kind;
};

OpKind kind_of(const OrtCustomOp* op) { return static_cast<const PnMixOp*>(op)->kind; }

OrtStatusPtr ORT_API_CALL create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                        void** kernel) noexcept {
  *kernel = nullptr;
  const OpKind kind = kind_of(op);
  Kernel k{api, kind, {}, 0};
  if (OrtStatus* status = read_config(api, kind, info, &k.config)) return status;
  if (OrtStatus* status = read_threads(api, kind, info, &k.threads)) return status;
  Kernel* made = new (std::nothrow) Kernel(k);
  if (!made) return fail(api, kind, "out of memory");
  *kernel = made;
  return nullptr;
}

OrtStatusPtr ORT_API_CALL compute(void* kernel, OrtKernelContext* ctx) noexcept {
  const Kernel& k = *static_cast<const Kernel*>(kernel);
  return k.kind == OpKind::kAppend ? compute_append(k, ctx) : compute_attention(k, ctx);
}

void ORT_API_CALL destroy_kernel(void* kernel) noexcept { delete static_cast<Kernel*>(kernel); }

const char* ORT_API_CALL get_name(const OrtCustomOp* op) noexcept { return op_name(kind_of(op)); }
const char* ORT_API_CALL get_provider(const OrtCustomOp*) noexcept { return "CPUExecutionProvider"; }

size_t ORT_API_CALL input_count(const OrtCustomOp* op) noexcept { return leading_inputs(kind_of(op)) + PNMIX_NUM_STATE; }

ONNXTensorElementDataType ORT_API_CALL input_type(const OrtCustomOp* op, size_t index) noexcept {
  const size_t lead = leading_inputs(kind_of(op));
  if (index >= lead) return state_type((int)(index - lead));
  return index + 2 >= lead ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
}

size_t ORT_API_CALL output_count(const OrtCustomOp* op) noexcept { return kind_of(op) == OpKind::kAppend ? PNMIX_NUM_STATE : 1; }

ONNXTensorElementDataType ORT_API_CALL output_type(const OrtCustomOp* op, size_t index) noexcept {
  return kind_of(op) == OpKind::kAppend ? state_type((int)index) : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}

OrtCustomOpInputOutputCharacteristic ORT_API_CALL required(const OrtCustomOp*, size_t) noexcept { return INPUT_OUTPUT_REQUIRED; }
OrtMemType ORT_API_CALL input_memory(const OrtCustomOp*, size_t) noexcept { return OrtMemTypeDefault; }
int ORT_API_CALL one(const OrtCustomOp*) noexcept { return 1; }

PnMixOp make_op(OpKind kind) {
  PnMixOp op;
  memset(static_cast<OrtCustomOp*>(&op), 0, sizeof(OrtCustomOp));
  // The fields through KernelComputeV2; the runtime reads none past what this version names.
  op.version = PNMIX_ORT_API_MIN;
  op.GetName = get_name;
  op.GetExecutionProviderType = get_provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = output_count;
  op.KernelDestroy = destroy_kernel;
  op.GetInputCharacteristic = required;
  op.GetOutputCharacteristic = required;
  op.GetInputMemoryType = input_memory;
  op.GetVariadicInputMinArity = one;
  op.GetVariadicInputHomogeneity = one;
  op.GetVariadicOutputMinArity = one;
  op.GetVariadicOutputHomogeneity = one;
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  op.kind = kind;
  return op;
}

PnMixOp g_append = make_op(OpKind::kAppend);
PnMixOp g_attention = make_op(OpKind::kAttention);

}  // namespace

extern "C" PNMIX_ORT_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                                      const OrtApiBase* base) noexcept {
  const OrtApi* api = base->GetApi(PNMIX_ORT_API_MIN);
  if (!api) {
    const OrtApi* v1 = base->GetApi(1);
    char line[256];
    snprintf(line, sizeof line, "libpnmix_ort needs ONNX Runtime API %d (%s) or newer, this runtime is %s",
             PNMIX_ORT_API_MIN, PNMIX_ORT_API_MIN_RELEASE, base->GetVersionString());
    return v1 ? v1->CreateStatus(ORT_FAIL, line) : nullptr;
  }
  g_has_config_entries = base->GetApi(PNMIX_ORT_API_CONFIG_ENTRIES) != nullptr;
  g_parallel_api = getenv(kOwnPoolEnv) ? nullptr : base->GetApi(PNMIX_ORT_API_PARALLEL_FOR);
  // The domain must outlive every session made from these options; ONNX Runtime never frees it,
  // and releasing it at unload could run after the runtime is gone, so it is left to the process.
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* status = api->CreateCustomOpDomain(kDomain, &domain)) return status;
  if (OrtStatus* status = api->CustomOpDomain_Add(domain, &g_append)) return status;
  if (OrtStatus* status = api->CustomOpDomain_Add(domain, &g_attention)) return status;
  return api->AddCustomOpDomain(options, domain);
}
