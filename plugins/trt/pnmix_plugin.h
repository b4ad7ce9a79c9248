// plugins/trt/pnmix_plugin.h: what the two pn-mix TensorRT plugins share.
//
// Both plugins are thin: they check shapes and types, read the two lengths, and call the CUDA
// kernels' C ABI (pnmix/pnmix_cuda.h). Their fields are the config (pnmix/plugin_fields.h).
//
//   PnMixAttention (q, k_new, v_new, seq_len, new_len, 11 state) -> attention
//   PnMixAppend    (k_new, v_new, seq_len, new_len, 11 state [, after]) -> 11 present state
//
// q [B, Hq, n, D] fp16/bf16; k_new, v_new [B, H, n, D] fp16; seq_len, new_len int64 (or int32)
// scalars on the device; the state tensors at their capacity shapes (docs/FORMAT.md section 3),
// codes and mask INT8. The queries are the last n of the seq_len + new_len positions; new_len is
// n (prefill / decode: attend to and append these tokens) or 0 (evaluation: attention only).
// The optional 16th input of PnMixAppend only orders it after the attention (pnmix/backends/tensorrt/engine.py adds
// it); its data is never read.
//
// The cache is updated in place: bind present_<name> to the same device address as <name>
// (TensorRT-Edge-LLM binds past and present KV the same way). The append then writes into that
// one buffer; if the addresses differ it first copies each state tensor to its output.
#ifndef PNMIX_TRT_PLUGIN_H
#define PNMIX_TRT_PLUGIN_H

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "pnmix/params.h"
#include "pnmix/plugin_fields.h"

namespace pnmix {
namespace trt {

// pnmix_field mirrors nvinfer1::PluginField and uses PluginFieldType's codes.
static_assert(static_cast<int32_t>(nvinfer1::PluginFieldType::kFLOAT32) == PNMIX_FIELD_FLOAT32, "field type");
static_assert(static_cast<int32_t>(nvinfer1::PluginFieldType::kFLOAT64) == PNMIX_FIELD_FLOAT64, "field type");
static_assert(static_cast<int32_t>(nvinfer1::PluginFieldType::kINT32) == PNMIX_FIELD_INT32, "field type");
static_assert(static_cast<int32_t>(nvinfer1::PluginFieldType::kCHAR) == PNMIX_FIELD_CHAR, "field type");
static_assert(static_cast<int32_t>(nvinfer1::PluginFieldType::kINT64) == PNMIX_FIELD_INT64, "field type");

// ---- logging: through the logger TensorRT hands over with setLoggerFinder ---------------------

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept;
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void log(nvinfer1::ILogger::Severity severity, const char* fmt, ...) noexcept;

// Parse a creator's field collection (TensorRT's or an engine's) into a config; logs why not.
bool parse_fields(const nvinfer1::PluginFieldCollection* fc, const char* plugin, const char* layer,
                  pnmix_config* out) noexcept;

// ---- where each tensor is -----------------------------------------------------------------------

struct IoMap {
  int q;         // -1: none
  int k_new, v_new, seq_len, new_len;
  int state;     // first of the 11 state tensors
  int min_inputs, max_inputs;
};

// Input positions from generated.h (export/ops.py's ATTENTION_INPUTS / APPEND_INPUTS).
constexpr IoMap kAttentionIo{PNMIX_ATTENTION_IN_Q,       PNMIX_ATTENTION_IN_K_NEW,   PNMIX_ATTENTION_IN_V_NEW,
                             PNMIX_ATTENTION_IN_SEQ_LEN, PNMIX_ATTENTION_IN_NEW_LEN, PNMIX_ATTENTION_IN_FIRST_STATE,
                             PNMIX_ATTENTION_NUM_INPUTS, PNMIX_ATTENTION_NUM_INPUTS};
constexpr IoMap kAppendIo{PNMIX_APPEND_IN_Q,       PNMIX_APPEND_IN_K_NEW,   PNMIX_APPEND_IN_V_NEW,
                          PNMIX_APPEND_IN_SEQ_LEN, PNMIX_APPEND_IN_NEW_LEN, PNMIX_APPEND_IN_FIRST_STATE,
                          PNMIX_APPEND_NUM_INPUTS, PNMIX_APPEND_MAX_INPUTS};
constexpr int kMaxInputs = PNMIX_APPEND_MAX_INPUTS > PNMIX_ATTENTION_NUM_INPUTS ? PNMIX_APPEND_MAX_INPUTS
                                                                               : PNMIX_ATTENTION_NUM_INPUTS;

// The shapes a call runs with, from its tensors' dims (-1 for a dimension only known at run time).
struct Shapes {
  pnmix_layout layout;  // max_seq_len: the most tokens the state's group slots can hold
  int64_t q_heads = 0;  // Hq (attention) or 0
  int64_t tokens = 0;   // n (-1 while building)
};

// Check the inputs' dims against each other and the config; fills *out or logs why not.
bool check_shapes(const IoMap& io, const pnmix_config& config, const nvinfer1::Dims* dims, int32_t nb_inputs,
                  const char* layer, Shapes* out) noexcept;

// True for a state tensor whose elements are codes or mask bytes (INT8), else fp16.
bool is_byte_state(int state_index) noexcept;

// Is inOut[pos] a type and format this plugin takes (per position, see the table above)?
bool supports_input(const IoMap& io, int32_t pos, const nvinfer1::PluginTensorDesc& desc) noexcept;

// Read seq_len and new_len (device scalars) to the host: one copy each, then a stream sync,
// because the kernels plan their launch on the host from these lengths.
bool read_lengths(const IoMap& io, const nvinfer1::PluginTensorDesc* in, const void* const* inputs,
                  cudaStream_t stream, const char* layer, int64_t* seq_len, int64_t* new_len) noexcept;

// Check the two lengths against the call's shapes (new_len is 0 or n, the capacity holds them).
bool check_lengths(const Shapes& s, int64_t seq_len, int64_t new_len, const char* layer) noexcept;

// The largest workspace the CUDA kernels need for any length of a profile (n <= max_tokens).
int64_t attention_workspace_bound(const Shapes& s, int64_t max_tokens) noexcept;
int64_t append_workspace_bound(const Shapes& s, int64_t max_tokens) noexcept;

// ---- the part of both plugins that does not depend on the op -----------------------------------

class PnMixPluginBase : public nvinfer1::IPluginV3,
                        public nvinfer1::IPluginV3OneCore,
                        public nvinfer1::IPluginV3OneBuild,
                        public nvinfer1::IPluginV3OneRuntime {
 public:
  PnMixPluginBase(const pnmix_config& config, const char* layer, const IoMap& io);
  PnMixPluginBase(const PnMixPluginBase& other);
  PnMixPluginBase& operator=(const PnMixPluginBase&) = delete;
  ~PnMixPluginBase() override = default;

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;

  // IPluginV3OneCore
  const char* getPluginVersion() const noexcept override { return kPluginVersion; }
  const char* getPluginNamespace() const noexcept override { return kPluginNamespace; }

  // IPluginV3OneBuild
  int32_t configurePlugin(const nvinfer1::DynamicPluginTensorDesc* in, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc* out, int32_t nbOutputs) noexcept override;
  int32_t getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nbInputs, const nvinfer1::DimsExprs* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  size_t getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* inputs, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc* outputs, int32_t nbOutputs) const noexcept override;
  const char* getTimingCacheID() noexcept override { return mMetadata.c_str(); }
  const char* getMetadataString() noexcept override { return mMetadata.c_str(); }

  // IPluginV3OneRuntime
  int32_t onShapeChange(const nvinfer1::PluginTensorDesc* in, int32_t nbInputs, const nvinfer1::PluginTensorDesc* out,
                        int32_t nbOutputs) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  const nvinfer1::PluginFieldCollection* getFieldsToSerialize() noexcept override;

 protected:
  // The shapes of the inputs' dims; logs and returns false when they do not fit together.
  bool shapes_of(const nvinfer1::Dims* dims, int32_t nb_inputs, Shapes* out) const noexcept;
  // The op's scratch bytes for shapes s at the profile maxima of `inputs`.
  virtual int64_t workspace_bound(const Shapes& s, const nvinfer1::DynamicPluginTensorDesc* inputs) const noexcept = 0;
  // What every enqueue starts with: shapes known from onShapeChange, both lengths read and valid.
  bool begin_enqueue(const nvinfer1::PluginTensorDesc* in, const void* const* inputs, void* const* outputs,
                     cudaStream_t stream, int64_t* seq_len, int64_t* new_len) noexcept;
  // Output i's dims from the inputs' (getOutputShapes); the op decides.
  virtual bool output_dims(const nvinfer1::DimsExprs* inputs, int32_t nb_inputs, nvinfer1::DimsExprs* outputs,
                           int32_t nb_outputs) const noexcept = 0;

  const pnmix_config mConfig;
  const std::string mLayer;
  const IoMap mIo;
  Shapes mShapes{};  // from the last onShapeChange
  bool mShapesKnown = false;

 private:
  std::string mMetadata;
  pnmix_field_storage mStorage{};
  std::vector<nvinfer1::PluginField> mSerialFields;
  nvinfer1::PluginFieldCollection mSerialCollection{};
};

// ---- one creator template for both ops ---------------------------------------------------------

class PnMixCreatorBase : public nvinfer1::IPluginCreatorV3One {
 public:
  PnMixCreatorBase();
  const nvinfer1::PluginFieldCollection* getFieldNames() noexcept override { return &mFieldNames; }
  const char* getPluginVersion() const noexcept override { return kPluginVersion; }
  const char* getPluginNamespace() const noexcept override { return kPluginNamespace; }

 private:
  std::vector<nvinfer1::PluginField> mFields;
  nvinfer1::PluginFieldCollection mFieldNames{};
};

}  // namespace trt
}  // namespace pnmix

#endif  // PNMIX_TRT_PLUGIN_H
