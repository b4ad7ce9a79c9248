// plugins/trt/append_plugin.cpp: PnMixAppend.
#include "append_plugin.h"

#include <new>

#include "pnmix/format.h"
#include "pnmix/pnmix_cuda.h"

namespace pnmix {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::ILogger;

nvinfer1::IPluginV3* PnMixAppendPlugin::clone() noexcept {
  try {
    return new PnMixAppendPlugin(*this);
  } catch (...) {
    return nullptr;
  }
}

int32_t PnMixAppendPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, const DataType* inputTypes,
                                              int32_t nbInputs) const noexcept {
  if (outputTypes == nullptr || inputTypes == nullptr || nbOutputs != PNMIX_NUM_STATE ||
      nbInputs < mIo.min_inputs || nbInputs > mIo.max_inputs)
    return -1;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) outputTypes[i] = inputTypes[mIo.state + i];  // present_<name> = <name>
  return 0;
}

bool PnMixAppendPlugin::supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut,
                                                  int32_t nbInputs, int32_t nbOutputs) noexcept {
  if (inOut == nullptr || nbInputs < mIo.min_inputs || nbInputs > mIo.max_inputs || nbOutputs != PNMIX_NUM_STATE ||
      pos < 0 || pos >= nbInputs + nbOutputs)
    return false;
  const nvinfer1::PluginTensorDesc& desc = inOut[pos].desc;
  if (pos < nbInputs) return supports_input(mIo, pos, desc);
  const nvinfer1::PluginTensorDesc& state = inOut[mIo.state + (pos - nbInputs)].desc;
  return desc.type == state.type && desc.format == nvinfer1::TensorFormat::kLINEAR;
}

bool PnMixAppendPlugin::output_dims(const nvinfer1::DimsExprs* inputs, int32_t, nvinfer1::DimsExprs* outputs,
                                    int32_t nb_outputs) const noexcept {
  if (nb_outputs != PNMIX_NUM_STATE) return false;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) outputs[i] = inputs[mIo.state + i];  // fixed capacity
  return true;
}

int64_t PnMixAppendPlugin::workspace_bound(const Shapes& s, const nvinfer1::DynamicPluginTensorDesc* inputs) const noexcept {
  return append_workspace_bound(s, inputs[mIo.k_new].max.d[2]);
}

int32_t PnMixAppendPlugin::enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc*,
                                   const void* const* inputs, void* const* outputs, void* workspace,
                                   cudaStream_t stream) noexcept {
  int64_t seq_len = 0, new_len = 0;
  if (!begin_enqueue(inputDesc, inputs, outputs, stream, &seq_len, &new_len)) return -1;

  const pnmix_layout& L = mShapes.layout;
  pnmix_state state;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    state.data[i] = outputs[i];
    state.nbytes[i] = state_bytes(L, i);
    // In place when present_<name> is bound to <name>'s address (the intended binding); else
    // the output starts as a copy of the input.
    if (outputs[i] != inputs[mIo.state + i] && state.nbytes[i] > 0) {
      const cudaError_t err = cudaMemcpyAsync(outputs[i], inputs[mIo.state + i], static_cast<size_t>(state.nbytes[i]),
                                              cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) {
        log(ILogger::Severity::kERROR, PNMIX_APPEND_PLUGIN_NAME " '%s': copying the state failed: %s", mLayer.c_str(),
            cudaGetErrorString(err));
        return -1;
      }
    }
  }
  if (new_len == 0) return 0;  // evaluation: the cache does not change

  const int64_t kv_bytes = L.batch * L.kv_heads * new_len * L.head_dim * 2;
  int64_t needed = 0;
  int status = pnmix_cuda_append_workspace_bytes(&L, seq_len, new_len, &needed);
  if (status == PNMIX_OK)
    status = pnmix_cuda_append(&L, &state, seq_len, static_cast<const uint16_t*>(inputs[mIo.k_new]),
                               static_cast<const uint16_t*>(inputs[mIo.v_new]), new_len, kv_bytes, workspace, needed,
                               stream);
  if (status != PNMIX_OK) {
    log(ILogger::Severity::kERROR, PNMIX_APPEND_PLUGIN_NAME " '%s': %s", mLayer.c_str(), pnmix_cuda_last_error());
    return -1;
  }
  return 0;
}

}  // namespace trt
}  // namespace pnmix
