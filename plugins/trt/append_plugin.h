// plugins/trt/append_plugin.h: PnMixAppend, quantize/append the new tokens into the packed cache in
// place (a thin wrapper of pnmix_cuda_append: pair mask, sink, residual and group flush kernels).
#ifndef PNMIX_TRT_APPEND_PLUGIN_H
#define PNMIX_TRT_APPEND_PLUGIN_H

#include "pnmix_plugin.h"

namespace pnmix {
namespace trt {

class PnMixAppendPlugin final : public PnMixPluginBase {
 public:
  static constexpr const char* kName = kAppendPluginName;

  PnMixAppendPlugin(const pnmix_config& config, const char* layer) : PnMixPluginBase(config, layer, kAppendIo) {}

  nvinfer1::IPluginV3* clone() noexcept override;
  const char* getPluginName() const noexcept override { return kName; }

  int32_t getNbOutputs() const noexcept override { return PNMIX_NUM_STATE; }
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, const nvinfer1::DataType* inputTypes,
                             int32_t nbInputs) const noexcept override;
  bool supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc* outputDesc,
                  const void* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;

 protected:
  // Scratch of the CUDA kernels for the profile's largest call (PnMixPluginBase::getWorkspaceSize).
  int64_t workspace_bound(const Shapes& s, const nvinfer1::DynamicPluginTensorDesc* inputs) const noexcept override;
  bool output_dims(const nvinfer1::DimsExprs* inputs, int32_t nb_inputs, nvinfer1::DimsExprs* outputs,
                   int32_t nb_outputs) const noexcept override;
};

}  // namespace trt
}  // namespace pnmix

#endif  // PNMIX_TRT_APPEND_PLUGIN_H
