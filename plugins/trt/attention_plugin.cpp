// plugins/trt/attention_plugin.cpp: PnMixAttention.
#include "attention_plugin.h"

#include <new>

#include "pnmix/format.h"
#include "pnmix/pnmix_cuda.h"

namespace pnmix {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::ILogger;

nvinfer1::IPluginV3* PnMixAttentionPlugin::clone() noexcept {
  try {
    return new PnMixAttentionPlugin(*this);
  } catch (...) {
    return nullptr;
  }
}

int32_t PnMixAttentionPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, const DataType*,
                                                 int32_t) const noexcept {
  if (outputTypes == nullptr || nbOutputs != 1) return -1;
  outputTypes[0] = DataType::kFLOAT;  // the attention is fp32 arithmetic and output (docs/METHOD.md section 2.4)
  return 0;
}

bool PnMixAttentionPlugin::supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut,
                                                     int32_t nbInputs, int32_t nbOutputs) noexcept {
  if (inOut == nullptr || nbInputs != kAttentionIo.max_inputs || nbOutputs != 1 || pos < 0 || pos > nbInputs)
    return false;
  const nvinfer1::PluginTensorDesc& desc = inOut[pos].desc;
  if (pos < nbInputs) return supports_input(mIo, pos, desc);
  return desc.type == DataType::kFLOAT && desc.format == nvinfer1::TensorFormat::kLINEAR;
}

bool PnMixAttentionPlugin::output_dims(const nvinfer1::DimsExprs* inputs, int32_t, nvinfer1::DimsExprs* outputs,
                                       int32_t nb_outputs) const noexcept {
  if (nb_outputs != 1 || inputs[mIo.q].nbDims != 4) return false;
  outputs[0] = inputs[mIo.q];  // [B, Hq, n, D]: one output row per query
  return true;
}

int64_t PnMixAttentionPlugin::workspace_bound(const Shapes& s, const nvinfer1::DynamicPluginTensorDesc* inputs) const noexcept {
  return attention_workspace_bound(s, inputs[mIo.q].max.d[2]);
}

int32_t PnMixAttentionPlugin::enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc*,
                                      const void* const* inputs, void* const* outputs, void* workspace,
                                      cudaStream_t stream) noexcept {
  int64_t seq_len = 0, new_len = 0;
  if (!begin_enqueue(inputDesc, inputs, outputs, stream, &seq_len, &new_len)) return -1;

  const pnmix_layout& L = mShapes.layout;
  pnmix_state state;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    state.data[i] = const_cast<void*>(inputs[mIo.state + i]);  // read only; the C ABI's struct is shared
    state.nbytes[i] = state_bytes(L, i);
  }
  const int64_t n = mShapes.tokens;
  const int64_t q_heads = mShapes.q_heads;
  const int q_dtype = inputDesc[mIo.q].type == DataType::kBF16 ? PNMIX_DTYPE_BF16 : PNMIX_DTYPE_FP16;
  const int64_t q_bytes = L.batch * q_heads * n * L.head_dim * 2;
  const int64_t new_bytes = L.batch * L.kv_heads * new_len * L.head_dim * 2;
  const int64_t out_bytes = L.batch * q_heads * n * L.head_dim * 4;
  // TensorRT reserved attention_workspace_bound() for this profile: at least what this call needs.
  int64_t needed = 0;
  int status = pnmix_cuda_attend_workspace_bytes(&L, seq_len, q_heads, n, new_len, &needed, nullptr);
  if (status == PNMIX_OK) {
    const auto* k_new = new_len ? static_cast<const uint16_t*>(inputs[mIo.k_new]) : nullptr;
    const auto* v_new = new_len ? static_cast<const uint16_t*>(inputs[mIo.v_new]) : nullptr;
    status = pnmix_cuda_attend(&L, &state, seq_len, inputs[mIo.q], q_dtype, q_heads, n, q_bytes, k_new, v_new,
                               new_len, new_bytes, static_cast<float*>(outputs[0]), out_bytes, workspace, needed,
                               stream);
  }
  if (status != PNMIX_OK) {
    log(ILogger::Severity::kERROR, PNMIX_ATTENTION_PLUGIN_NAME " '%s': %s", mLayer.c_str(), pnmix_cuda_last_error());
    return -1;
  }
  return 0;
}

}  // namespace trt
}  // namespace pnmix
