// plugins/trt/plugin_library.cpp: the creators and the two entry points TensorRT looks for in a
// plugin library (trtexec --dynamicPlugins, IPluginRegistry::loadLibrary): getCreators and
// setLoggerFinder. Nothing here calls into libnvinfer, so the library links without it.
#include <new>

#include "append_plugin.h"
#include "attention_plugin.h"

#if defined(__GNUC__)
#define PNMIX_TRT_EXPORT __attribute__((visibility("default")))
#else
#define PNMIX_TRT_EXPORT
#endif

namespace pnmix {
namespace trt {
namespace {

template <typename Plugin>
class PnMixCreator final : public PnMixCreatorBase {
 public:
  const char* getPluginName() const noexcept override { return Plugin::kName; }

  // Build phase: the ONNX node's attributes. Runtime phase: getFieldsToSerialize's fields.
  nvinfer1::IPluginV3* createPlugin(const char* name, const nvinfer1::PluginFieldCollection* fc,
                                    nvinfer1::TensorRTPhase) noexcept override {
    pnmix_config config;
    if (!parse_fields(fc, Plugin::kName, name, &config)) return nullptr;
    try {
      return new Plugin(config, name);
    } catch (...) {
      return nullptr;
    }
  }
};

}  // namespace
}  // namespace trt
}  // namespace pnmix

extern "C" {

PNMIX_TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static pnmix::trt::PnMixCreator<pnmix::trt::PnMixAttentionPlugin> attention;
  static pnmix::trt::PnMixCreator<pnmix::trt::PnMixAppendPlugin> append;
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&attention, &append};
  nbCreators = 2;
  return creators;
}

PNMIX_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) { pnmix::trt::set_logger_finder(finder); }

}  // extern "C"
