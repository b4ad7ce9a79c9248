// plugins/trt/pnmix_plugin.cpp: logging, field parsing, shape/type checks, lengths and workspace
// bounds shared by the two pn-mix plugins, and their common IPluginV3 base.
#include "pnmix_plugin.h"

#include <stdarg.h>
#include <stdio.h>

#include <algorithm>
#include <mutex>
#include <new>

#include "pnmix/format.h"
#include "pnmix/pnmix_cuda.h"

namespace pnmix {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::ILogger;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;

namespace {

std::mutex g_logger_mutex;
nvinfer1::ILoggerFinder* g_logger_finder = nullptr;

bool is_scalar(const Dims& d) { return d.nbDims == 0 || (d.nbDims == 1 && d.d[0] == 1); }

// Two extents agree when equal or when either is only known at run time (-1).
bool same_extent(int64_t a, int64_t b) { return a == b || a < 0 || b < 0; }

}  // namespace

// ---- logging ---------------------------------------------------------------------------------------

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept {
  std::lock_guard<std::mutex> lock(g_logger_mutex);
  if (g_logger_finder == nullptr && finder != nullptr) g_logger_finder = finder;
}

void log(ILogger::Severity severity, const char* fmt, ...) noexcept {
  char message[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(message, sizeof message, fmt, args);
  va_end(args);
  ILogger* logger = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_logger_mutex);
    if (g_logger_finder != nullptr) logger = g_logger_finder->findLogger();
  }
  if (logger != nullptr)
    logger->log(severity, message);
  else if (severity <= ILogger::Severity::kWARNING)
    fprintf(stderr, "[pnmix] %s\n", message);
}

// ---- fields --------------------------------------------------------------------------------------------

bool parse_fields(const PluginFieldCollection* fc, const char* plugin, const char* layer, pnmix_config* out) noexcept {
  char why[256] = "";
  bool ok = false;
  constexpr int32_t kMaxFields = 4 * PNMIX_NUM_CONFIG_FIELDS;  // parse_config_fields' own limit
  if (fc == nullptr) {
    snprintf(why, sizeof why, "no plugin field collection");
  } else if (fc->nbFields < 0 || fc->nbFields > kMaxFields || fc->fields == nullptr) {
    ok = parse_config_fields(nullptr, fc->nbFields, out, why, sizeof why);  // says which
  } else {
    pnmix_field copy[kMaxFields];
    for (int32_t i = 0; i < fc->nbFields; ++i) {
      const PluginField& f = fc->fields[i];
      copy[i] = pnmix_field{f.name, f.data, static_cast<int32_t>(f.type), f.length};
    }
    ok = parse_config_fields(copy, fc->nbFields, out, why, sizeof why);
  }
  if (!ok) log(ILogger::Severity::kERROR, "%s '%s': %s", plugin, layer ? layer : "", why);
  return ok;
}

// ---- shapes and types -----------------------------------------------------------------------------------

bool is_byte_state(int i) noexcept {
  switch (i) {  // generated.h: the codes and the mask travel as INT8, the rest as FLOAT16
#define PNMIX_X(index, NAME, name, elem_bytes, type) \
  case index: return PNMIX_TYPE_IS_INT8_##type;
#define PNMIX_TYPE_IS_INT8_INT8 true
#define PNMIX_TYPE_IS_INT8_FLOAT16 false
    PNMIX_STATE_TENSORS(PNMIX_X)
#undef PNMIX_TYPE_IS_INT8_INT8
#undef PNMIX_TYPE_IS_INT8_FLOAT16
#undef PNMIX_X
    default: return false;
  }
}

bool check_shapes(const IoMap& io, const pnmix_config& config, const Dims* dims, int32_t nb_inputs, const char* layer,
                  Shapes* out) noexcept {
  auto bad = [&](const char* what) {
    log(ILogger::Severity::kERROR, "pn-mix plugin '%s': %s", layer, what);
    return false;
  };
  if (dims == nullptr || nb_inputs < io.min_inputs || nb_inputs > io.max_inputs)
    return bad("wrong number of inputs (see plugins/trt/README.md)");
  const Dims& k = dims[io.k_new];
  const Dims& v = dims[io.v_new];
  if (k.nbDims != 4 || v.nbDims != 4) return bad("k_new and v_new must be [B, H, n, D]");
  for (int i = 0; i < 4; ++i)
    if (!same_extent(k.d[i], v.d[i])) return bad("k_new and v_new must have the same shape");
  if (k.d[0] < 1 || k.d[1] < 1 || k.d[3] < 1) return bad("k_new's batch, heads and head_dim must be static");
  if (!is_scalar(dims[io.seq_len]) || !is_scalar(dims[io.new_len])) return bad("seq_len and new_len must be scalars");

  Shapes s;
  pnmix_layout& L = s.layout;
  L.config = config;
  L.batch = k.d[0];
  L.kv_heads = k.d[1];
  L.head_dim = k.d[3];
  s.tokens = k.d[2];
  // The capacity is what the group slots hold: sink, G groups and a residual one short of a flush.
  const Dims& key_codes = dims[io.state + PNMIX_KEY_CODES];
  if (key_codes.nbDims != 4 || key_codes.d[2] < 0) return bad("key_codes must be [B, H, G, KB] with static G");
  L.max_seq_len = (int64_t)config.sink_tokens + key_codes.d[2] * config.group_size + config.residual_size - 1;
  if (const char* why = layout_error(L)) return bad(why);

  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    const Dims& d = dims[io.state + i];
    const TensorShape want = capacity_shape(L, i);
    const bool per_token_groups = i == PNMIX_VALUE_CODES || i == PNMIX_VALUE_STEP || i == PNMIX_VALUE_OFFSET;
    const int rank = i == PNMIX_PAIR_MASK ? 2 : per_token_groups ? 5 : 4;
    bool fits = d.nbDims == rank && d.d[0] == L.batch;
    if (fits && i == PNMIX_PAIR_MASK) {
      fits = d.d[1] == want.row_elems;
    } else if (fits) {
      fits = d.d[1] == want.heads && d.d[2] == want.rows;
      int64_t elems = 1;
      for (int j = 3; j < rank; ++j) elems *= d.d[j];
      fits = fits && elems == want.row_elems && (!per_token_groups || d.d[3] == config.group_size);
    }
    if (!fits) {
      char why[160];
      snprintf(why, sizeof why, "state tensor '%s' does not have the capacity shape of docs/FORMAT.md section 3",
               pnmix::state_name(i));
      return bad(why);
    }
  }
  if (io.q >= 0) {
    const Dims& q = dims[io.q];
    if (q.nbDims != 4 || q.d[0] != L.batch || q.d[3] != L.head_dim || !same_extent(q.d[2], s.tokens))
      return bad("q must be [B, Hq, n, D] with k_new's B, n and D");
    if (q.d[1] < 1 || q.d[1] % L.kv_heads) return bad("q's heads must be a positive multiple of k_new's heads");
    s.q_heads = q.d[1];
  }
  *out = s;
  return true;
}

bool supports_input(const IoMap& io, int32_t pos, const PluginTensorDesc& desc) noexcept {
  if (desc.format != TensorFormat::kLINEAR) return false;
  const DataType t = desc.type;
  if (pos == io.q) return t == DataType::kHALF || t == DataType::kBF16;
  if (pos == io.k_new || pos == io.v_new) return t == DataType::kHALF;
  if (pos == io.seq_len || pos == io.new_len) return t == DataType::kINT64 || t == DataType::kINT32;
  if (pos >= io.state && pos < io.state + PNMIX_NUM_STATE)
    return t == (is_byte_state(pos - io.state) ? DataType::kINT8 : DataType::kHALF);
  return true;  // PnMixAppend's ordering input: any type, never read
}

// ---- lengths --------------------------------------------------------------------------------------------

bool read_lengths(const IoMap& io, const PluginTensorDesc* in, const void* const* inputs, cudaStream_t stream,
                  const char* layer, int64_t* seq_len, int64_t* new_len) noexcept {
  const int index[2] = {io.seq_len, io.new_len};
  int64_t wide[2] = {0, 0};
  int32_t narrow[2] = {0, 0};
  for (int j = 0; j < 2; ++j) {
    const bool is64 = in[index[j]].type == DataType::kINT64;
    void* host = is64 ? static_cast<void*>(&wide[j]) : static_cast<void*>(&narrow[j]);
    const cudaError_t err =
        cudaMemcpyAsync(host, inputs[index[j]], is64 ? 8 : 4, cudaMemcpyDeviceToHost, stream);
    if (err != cudaSuccess) {
      log(ILogger::Severity::kERROR, "pn-mix plugin '%s': reading the lengths failed: %s", layer,
          cudaGetErrorString(err));
      return false;
    }
  }
  const cudaError_t err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    log(ILogger::Severity::kERROR, "pn-mix plugin '%s': reading the lengths failed: %s", layer,
        cudaGetErrorString(err));
    return false;
  }
  *seq_len = in[io.seq_len].type == DataType::kINT64 ? wide[0] : narrow[0];
  *new_len = in[io.new_len].type == DataType::kINT64 ? wide[1] : narrow[1];
  return true;
}

bool check_lengths(const Shapes& s, int64_t seq_len, int64_t new_len, const char* layer) noexcept {
  const char* why = nullptr;
  if (seq_len < 0 || new_len < 0)
    why = "seq_len and new_len must be >= 0";
  else if (new_len != 0 && new_len != s.tokens)
    why = "new_len must be 0 (evaluation) or the number of new tokens n (prefill, decode)";
  else if (seq_len + new_len > s.layout.max_seq_len)
    why = "cache capacity exceeded: seq_len + new_len is more than the state's group slots hold";
  if (why == nullptr) return true;
  log(ILogger::Severity::kERROR, "pn-mix plugin '%s': %s (seq_len %lld, new_len %lld, n %lld, capacity %lld)", layer,
      why, (long long)seq_len, (long long)new_len, (long long)s.tokens, (long long)s.layout.max_seq_len);
  return false;
}

// ---- workspace bounds -------------------------------------------------------------------------------------
//
// TensorRT reserves getWorkspaceSize() for the profile's largest shapes, but the kernels' scratch
// also depends on seq_len (the schedule) and, for the attention, on the split count. The bounds
// ask the kernels' own sizing functions over the lengths that matter: every phase of the
// schedule near the capacity (most groups) and near the start (the pair mask's scratch).

namespace {

// 1, 2, 4, ... up to max_tokens, and max_tokens itself.
std::vector<int64_t> token_samples(int64_t max_tokens) {
  std::vector<int64_t> samples;
  for (int64_t n = 1; n < max_tokens; n *= 2) samples.push_back(n);
  samples.push_back(max_tokens);
  return samples;
}

// seq_len values from lo to hi, at most ~4096 of them, hi included.
template <typename Fn>
void sweep(int64_t lo, int64_t hi, Fn fn) {
  if (hi < lo) return;
  const int64_t stride = std::max<int64_t>(1, (hi - lo) / 4096);
  for (int64_t s = lo; s < hi; s += stride) fn(s);
  fn(hi);
}

}  // namespace

int64_t attention_workspace_bound(const Shapes& s, int64_t max_tokens) noexcept {
  const pnmix_layout& L = s.layout;
  const int64_t window = (int64_t)L.config.group_size + L.config.residual_size + 16;
  int64_t best = 0;
  try {
    for (int64_t nq : token_samples(std::max<int64_t>(1, max_tokens))) {
      for (int64_t n_new : {(int64_t)0, nq}) {
        const int64_t hi = L.max_seq_len - n_new;
        sweep(std::max<int64_t>(0, hi - window), hi, [&](int64_t seq_len) {
          int64_t bytes = 0;
          if (seq_len + n_new >= nq &&
              pnmix_cuda_attend_workspace_bytes(&L, seq_len, s.q_heads, nq, n_new, &bytes, nullptr) == PNMIX_OK)
            best = std::max(best, bytes);
        });
      }
    }
  } catch (...) {
    return -1;
  }
  // One more split of the largest call: split counts round up, and n between two samples may
  // round differently.
  const int64_t rows = L.batch * s.q_heads * std::max<int64_t>(1, max_tokens);
  return best + rows * (L.head_dim + 2) * 4 + 1024;
}

int64_t append_workspace_bound(const Shapes& s, int64_t max_tokens) noexcept {
  const pnmix_layout& L = s.layout;
  const int64_t phases = (int64_t)L.config.sink_tokens + L.config.residual_size + L.config.group_size;
  int64_t best = 0;
  try {
    for (int64_t n : token_samples(std::max<int64_t>(1, max_tokens))) {
      const int64_t hi = std::min(L.max_seq_len - n, phases);
      sweep(0, hi, [&](int64_t seq_len) {
        int64_t bytes = 0;
        if (pnmix_cuda_append_workspace_bytes(&L, seq_len, n, &bytes) == PNMIX_OK) best = std::max(best, bytes);
      });
    }
  } catch (...) {
    return -1;
  }
  // One more gathered group pair (k and v), for lengths between the samples.
  return best + 2 * L.batch * L.kv_heads * L.config.group_size * L.head_dim * 2 + 1024;
}

// ---- the shared plugin base --------------------------------------------------------------------------------

PnMixPluginBase::PnMixPluginBase(const pnmix_config& config, const char* layer, const IoMap& io)
    : mConfig(config), mLayer(layer ? layer : ""), mIo(io) {
  // "pn-mix high_ratio=... group_size=... ...": every config field, in CONFIG_FIELDS order.
  mMetadata = "pn-mix";
  for (const FieldSpec& field : kConfigFields) {
    char value[40];
    if (field.kind == FieldKind::kRatio)
      snprintf(value, sizeof value, "%.17g", config.high_ratio);
    else if (field.kind == FieldKind::kLayout)
      snprintf(value, sizeof value, "%s", pair_layout_name(config.*field.member));
    else
      snprintf(value, sizeof value, "%d", (int)(config.*field.member));
    mMetadata += std::string(" ") + field.name + "=" + value;
  }
}

PnMixPluginBase::PnMixPluginBase(const PnMixPluginBase& other)
    : nvinfer1::IPluginV3(other),
      nvinfer1::IPluginV3OneCore(other),
      nvinfer1::IPluginV3OneBuild(other),
      nvinfer1::IPluginV3OneRuntime(other),
      mConfig(other.mConfig),
      mLayer(other.mLayer),
      mIo(other.mIo),
      mShapes(other.mShapes),
      mShapesKnown(other.mShapesKnown),
      mMetadata(other.mMetadata) {}  // serialized fields are rebuilt on demand (they point into *this)

nvinfer1::IPluginCapability* PnMixPluginBase::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept {
  switch (type) {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

bool PnMixPluginBase::shapes_of(const Dims* dims, int32_t nb_inputs, Shapes* out) const noexcept {
  return check_shapes(mIo, mConfig, dims, nb_inputs, mLayer.c_str(), out);
}

size_t PnMixPluginBase::getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* inputs, int32_t nbInputs,
                                         const nvinfer1::DynamicPluginTensorDesc*, int32_t) const noexcept {
  if (inputs == nullptr || nbInputs < mIo.min_inputs || nbInputs > mIo.max_inputs) return 0;
  Dims dims[kMaxInputs];
  for (int32_t i = 0; i < nbInputs; ++i) dims[i] = inputs[i].desc.dims;
  Shapes s;
  if (!shapes_of(dims, nbInputs, &s)) return 0;
  const int64_t bound = workspace_bound(s, inputs);
  return bound > 0 ? static_cast<size_t>(bound) : 0;
}

bool PnMixPluginBase::begin_enqueue(const PluginTensorDesc* in, const void* const* inputs, void* const* outputs,
                                    cudaStream_t stream, int64_t* seq_len, int64_t* new_len) noexcept {
  if (in == nullptr || inputs == nullptr || outputs == nullptr) return false;
  if (!mShapesKnown) {
    log(ILogger::Severity::kERROR, "%s '%s': enqueue before a valid onShapeChange", getPluginName(), mLayer.c_str());
    return false;
  }
  if (!read_lengths(mIo, in, inputs, stream, mLayer.c_str(), seq_len, new_len)) return false;
  return check_lengths(mShapes, *seq_len, *new_len, mLayer.c_str());
}

int32_t PnMixPluginBase::configurePlugin(const nvinfer1::DynamicPluginTensorDesc* in, int32_t nbInputs,
                                         const nvinfer1::DynamicPluginTensorDesc*, int32_t) noexcept {
  if (in == nullptr || nbInputs < mIo.min_inputs || nbInputs > mIo.max_inputs) return -1;
  Dims dims[kMaxInputs];
  for (int32_t i = 0; i < nbInputs; ++i) dims[i] = in[i].desc.dims;
  Shapes s;
  return shapes_of(dims, nbInputs, &s) ? 0 : -1;
}

int32_t PnMixPluginBase::getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nbInputs,
                                         const nvinfer1::DimsExprs*, int32_t, nvinfer1::DimsExprs* outputs,
                                         int32_t nbOutputs, nvinfer1::IExprBuilder&) noexcept {
  if (inputs == nullptr || outputs == nullptr || nbInputs < mIo.min_inputs || nbInputs > mIo.max_inputs) return -1;
  return output_dims(inputs, nbInputs, outputs, nbOutputs) ? 0 : -1;
}

int32_t PnMixPluginBase::onShapeChange(const PluginTensorDesc* in, int32_t nbInputs, const PluginTensorDesc*,
                                       int32_t) noexcept {
  if (in == nullptr || nbInputs < mIo.min_inputs || nbInputs > mIo.max_inputs) return -1;
  Dims dims[kMaxInputs];
  for (int32_t i = 0; i < nbInputs; ++i) dims[i] = in[i].dims;
  mShapesKnown = shapes_of(dims, nbInputs, &mShapes);
  return mShapesKnown ? 0 : -1;
}

nvinfer1::IPluginV3* PnMixPluginBase::attachToContext(nvinfer1::IPluginResourceContext*) noexcept {
  return clone();
}

const PluginFieldCollection* PnMixPluginBase::getFieldsToSerialize() noexcept {
  try {
    serialize_config_fields(mConfig, &mStorage);
    mSerialFields.clear();
    for (const pnmix_field& f : mStorage.fields)
      mSerialFields.emplace_back(f.name, f.data, static_cast<PluginFieldType>(f.type), f.length);
    mSerialCollection.nbFields = static_cast<int32_t>(mSerialFields.size());
    mSerialCollection.fields = mSerialFields.data();
    return &mSerialCollection;
  } catch (...) {
    return nullptr;
  }
}

// ---- creators -----------------------------------------------------------------------------------------------

PnMixCreatorBase::PnMixCreatorBase() {
  for (int i = 0; i < PNMIX_NUM_CONFIG_FIELDS; ++i)
    mFields.emplace_back(kConfigFields[i].name, nullptr, static_cast<PluginFieldType>(advertised_type(i)), 1);
  mFieldNames.nbFields = static_cast<int32_t>(mFields.size());
  mFieldNames.fields = mFields.data();
}

}  // namespace trt
}  // namespace pnmix
