// plugins/trt/plugin_probe.cpp: drive libpnmix_trt_plugins the way TensorRT does, without TensorRT
// and without a GPU (tests/backends/test_trt_plugin_host.py runs it).
//
//   pnmix_trt_probe path/to/libpnmix_trt_plugins.so
//
// dlopen + getCreators + setLoggerFinder; each creator's identity and advertised fields; plugins
// from the fields TensorRT's ONNX parser makes of an exported node; the build-time calls
// (capabilities, output types and shapes, format support, configure, workspace) on the
// diagnostic model's shapes; serialize -> create in the runtime phase; tampered fields refused;
// and an enqueue with no GPU must fail cleanly. Prints "ok" lines; exits 1 on the first failure.
#include <NvInferRuntime.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace nvinfer1;

int g_failures = 0;

void expect(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok" : "FAIL", what);
  if (!ok) ++g_failures;
}

// A logger finder like TensorRT's: collects the plugins' messages.
class CaptureLogger : public ILogger {
 public:
  void log(Severity severity, const char* msg) noexcept override {
    if (severity <= Severity::kWARNING) last = msg;
  }
  std::string last;
};

class CaptureFinder : public ILoggerFinder {
 public:
  ILogger* findLogger() noexcept override { return &logger; }
  CaptureLogger logger;
};

// The fields TensorRT's ONNX parser makes of the exporter's attributes (manifest config).
struct NodeFields {
  int32_t ints[8] = {128, 128, 32, 2, 128, 3, 1, 0};
  float ratio = 0.5f;
  char layout[9] = "adjacent";
  std::vector<PluginField> fields;
  NodeFields() {
    fields.emplace_back("high_ratio", &ratio, PluginFieldType::kFLOAT32, 1);
    fields.emplace_back("group_size", &ints[0], PluginFieldType::kINT32, 1);
    fields.emplace_back("residual_size", &ints[1], PluginFieldType::kINT32, 1);
    fields.emplace_back("sink_tokens", &ints[2], PluginFieldType::kINT32, 1);
    fields.emplace_back("value_bits", &ints[3], PluginFieldType::kINT32, 1);
    fields.emplace_back("value_group_size", &ints[4], PluginFieldType::kINT32, 1);
    fields.emplace_back("pair_layout", layout, PluginFieldType::kCHAR, 9);
    fields.emplace_back("key_high_bits", &ints[5], PluginFieldType::kINT32, 1);
    fields.emplace_back("key_low_bits", &ints[6], PluginFieldType::kINT32, 1);
  }
  PluginFieldCollection collection() const { return PluginFieldCollection{(int32_t)fields.size(), fields.data()}; }
};

Dims dims(std::initializer_list<int64_t> extents) {
  Dims d{};
  d.nbDims = static_cast<int32_t>(extents.size());
  int i = 0;
  for (int64_t e : extents) d.d[i++] = e;
  return d;
}

DynamicPluginTensorDesc desc(const Dims& d, DataType type, int64_t max_tokens = -1) {
  DynamicPluginTensorDesc x{};
  x.desc.dims = d;
  x.desc.type = type;
  x.desc.format = TensorFormat::kLINEAR;
  x.min = x.opt = x.max = d;
  for (int i = 0; i < d.nbDims; ++i)
    if (d.d[i] < 0) {
      x.min.d[i] = 1;
      x.opt.d[i] = 1;
      x.max.d[i] = max_tokens;
    }
  return x;
}

// The diagnostic model's state at capacity 512 tokens (B 1, H 2, D 32, manifest config): G = 3.
std::vector<DynamicPluginTensorDesc> state_descs() {
  const DataType h = DataType::kHALF, b = DataType::kINT8;
  return {desc(dims({1, 2, 32, 32}), h),     desc(dims({1, 2, 32, 32}), h),     desc(dims({1, 2, 128, 32}), h),
          desc(dims({1, 2, 128, 32}), h),    desc(dims({1, 2, 3, 1024}), b),    desc(dims({1, 2, 3, 32}), h),
          desc(dims({1, 2, 3, 32}), h),      desc(dims({1, 2, 3, 128, 8}), b),  desc(dims({1, 2, 3, 128, 1}), h),
          desc(dims({1, 2, 3, 128, 1}), h),  desc(dims({1, 4}), b)};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: pnmix_trt_probe libpnmix_trt_plugins.so\n");
    return 2;
  }
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::fprintf(stderr, "dlopen: %s\n", dlerror());
    return 2;
  }
  using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);
  using SetLoggerFinder = void (*)(ILoggerFinder*);
  auto get_creators = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
  auto set_finder = reinterpret_cast<SetLoggerFinder>(dlsym(lib, "setLoggerFinder"));
  expect(get_creators && set_finder, "getCreators and setLoggerFinder are exported");
  if (!get_creators || !set_finder) return 1;
  CaptureFinder finder;
  set_finder(&finder);

  int32_t count = 0;
  IPluginCreatorInterface* const* creators = get_creators(count);
  expect(count == 2 && creators, "two creators");
  IPluginCreatorV3One* attention_creator = nullptr;
  IPluginCreatorV3One* append_creator = nullptr;
  for (int32_t i = 0; i < count; ++i) {
    expect(std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0, "creator is V3One");
    auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
    expect(std::strcmp(c->getPluginVersion(), "1") == 0 && std::strcmp(c->getPluginNamespace(), "") == 0,
           "plugin version 1, namespace '' (export/ops.py)");
    const PluginFieldCollection* names = c->getFieldNames();
    expect(names && names->nbFields == 9 && std::strcmp(names->fields[0].name, "high_ratio") == 0 &&
               names->fields[0].type == PluginFieldType::kFLOAT32 &&
               names->fields[6].type == PluginFieldType::kCHAR,
           "advertised fields are the config's, with the exporter's types");
    if (std::strcmp(c->getPluginName(), "PnMixAttention") == 0) attention_creator = c;
    if (std::strcmp(c->getPluginName(), "PnMixAppend") == 0) append_creator = c;
  }
  expect(attention_creator && append_creator, "PnMixAttention and PnMixAppend");
  if (!attention_creator || !append_creator) return 1;

  // ---- build phase, from the parser's fields ----------------------------------------------------
  NodeFields node;
  const PluginFieldCollection fc = node.collection();
  IPluginV3* attention = attention_creator->createPlugin("pnmix_attention", &fc, TensorRTPhase::kBUILD);
  IPluginV3* append = append_creator->createPlugin("pnmix_append", &fc, TensorRTPhase::kBUILD);
  expect(attention && append, "createPlugin from an exported node's fields");
  if (!attention || !append) return 1;
  auto* att_core = static_cast<IPluginV3OneCore*>(attention->getCapabilityInterface(PluginCapabilityType::kCORE));
  auto* att_build = static_cast<IPluginV3OneBuild*>(attention->getCapabilityInterface(PluginCapabilityType::kBUILD));
  auto* att_run = static_cast<IPluginV3OneRuntime*>(attention->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  auto* app_build = static_cast<IPluginV3OneBuild*>(append->getCapabilityInterface(PluginCapabilityType::kBUILD));
  auto* app_run = static_cast<IPluginV3OneRuntime*>(append->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  expect(att_core && att_build && att_run && app_build && app_run, "core, build and runtime capabilities");
  expect(std::strcmp(att_core->getPluginName(), "PnMixAttention") == 0, "core name");
  expect(att_build->getNbOutputs() == 1 && app_build->getNbOutputs() == 11, "1 and 11 outputs");

  // inputs as the exported graph has them: n dynamic (up to 512)
  std::vector<DynamicPluginTensorDesc> att_in = {desc(dims({1, 4, -1, 32}), DataType::kHALF, 512),
                                                 desc(dims({1, 2, -1, 32}), DataType::kHALF, 512),
                                                 desc(dims({1, 2, -1, 32}), DataType::kHALF, 512),
                                                 desc(dims({}), DataType::kINT64), desc(dims({}), DataType::kINT64)};
  for (auto& s : state_descs()) att_in.push_back(s);
  std::vector<DynamicPluginTensorDesc> app_in(att_in.begin() + 1, att_in.end());
  app_in.push_back(desc(dims({1, 4, -1, 32}), DataType::kFLOAT, 512));  // the ordering input (attention)

  DataType in_types[16], out_types[11];
  for (size_t i = 0; i < att_in.size(); ++i) in_types[i] = att_in[i].desc.type;
  expect(att_build->getOutputDataTypes(out_types, 1, in_types, 16) == 0 && out_types[0] == DataType::kFLOAT,
         "attention output is fp32");
  for (size_t i = 0; i < app_in.size(); ++i) in_types[i] = app_in[i].desc.type;
  bool same = app_build->getOutputDataTypes(out_types, 11, in_types, 16) == 0;
  for (int i = 0; i < 11; ++i) same = same && out_types[i] == app_in[4 + i].desc.type;
  expect(same, "present_<name> has <name>'s type");

  // format support: the exported types pass, others do not
  std::vector<DynamicPluginTensorDesc> io = att_in;
  io.push_back(desc(dims({1, 4, -1, 32}), DataType::kFLOAT, 512));
  bool all = true;
  for (int pos = 0; pos < 17; ++pos) all = all && att_build->supportsFormatCombination(pos, io.data(), 16, 1);
  expect(all, "attention takes the exported types");
  io[1].desc.type = DataType::kFLOAT;
  expect(!att_build->supportsFormatCombination(1, io.data(), 16, 1), "attention refuses fp32 k_new");
  io[1].desc.type = DataType::kHALF;
  io[9].desc.type = DataType::kUINT8;
  expect(!att_build->supportsFormatCombination(9, io.data(), 16, 1), "attention refuses UINT8 codes");
  io[9].desc.type = DataType::kINT8;
  io[5].desc.format = TensorFormat::kHWC8;
  expect(!att_build->supportsFormatCombination(5, io.data(), 16, 1), "attention refuses non-linear formats");
  std::vector<DynamicPluginTensorDesc> app_io = app_in;
  for (int i = 0; i < 11; ++i) app_io.push_back(app_in[4 + i]);
  all = true;
  for (int pos = 0; pos < 27; ++pos) all = all && app_build->supportsFormatCombination(pos, app_io.data(), 16, 11);
  expect(all, "append takes the exported types (and the ordering input)");
  app_io[16 + 4].desc.type = DataType::kHALF;  // present_key_codes as fp16
  expect(!app_build->supportsFormatCombination(16 + 4, app_io.data(), 16, 11), "append output type must match");

  // configure and workspace (no GPU: the kernels' sizing falls back to one SM, 48 KiB shared memory)
  std::vector<DynamicPluginTensorDesc> att_out = {desc(dims({1, 4, -1, 32}), DataType::kFLOAT, 512)};
  expect(att_build->configurePlugin(att_in.data(), 16, att_out.data(), 1) == 0, "attention configures");
  std::vector<DynamicPluginTensorDesc> app_out(app_in.begin() + 4, app_in.begin() + 15);
  expect(app_build->configurePlugin(app_in.data(), 16, app_out.data(), 11) == 0, "append configures");
  expect(app_build->configurePlugin(app_in.data(), 15, app_out.data(), 11) == 0, "append configures without order");
  const size_t att_ws = att_build->getWorkspaceSize(att_in.data(), 16, att_out.data(), 1);
  const size_t app_ws = app_build->getWorkspaceSize(app_in.data(), 16, app_out.data(), 11);
  std::printf("info workspace attention %zu bytes, append %zu bytes (no GPU: 1 SM)\n", att_ws, app_ws);
  expect(att_ws >= 512u * 4 * 34 * 4 && app_ws > 0, "workspace sized from the profile maximum");
  auto bad_in = att_in;
  bad_in[5 + 4].desc.dims.d[3] = 1000;  // key_codes with the wrong KB
  expect(att_build->configurePlugin(bad_in.data(), 16, att_out.data(), 1) != 0, "a wrong state shape is refused");
  expect(finder.logger.last.find("key_codes") != std::string::npos, "... and logged through setLoggerFinder");
  bad_in = att_in;
  bad_in[0].desc.dims.d[1] = 3;  // Hq not a multiple of H
  expect(att_build->configurePlugin(bad_in.data(), 16, att_out.data(), 1) != 0, "q heads must be a multiple of H");

  // output shapes: copies of the inputs' expressions (the builder is never used)
  DimsExprs exprs[16] = {};
  for (int i = 0; i < 16; ++i) exprs[i].nbDims = att_in[i].desc.dims.nbDims;
  DimsExprs outs[11] = {};
  alignas(16) unsigned char fake_builder[64] = {};
  IExprBuilder& builder = *reinterpret_cast<IExprBuilder*>(fake_builder);
  expect(att_build->getOutputShapes(exprs, 16, nullptr, 0, outs, 1, builder) == 0 && outs[0].nbDims == 4,
         "attention output shape is q's");
  for (int i = 0; i < 16; ++i) exprs[i].nbDims = app_in[i].desc.dims.nbDims;
  bool shapes_ok = app_build->getOutputShapes(exprs, 16, nullptr, 0, outs, 11, builder) == 0;
  for (int i = 0; i < 11; ++i) shapes_ok = shapes_ok && outs[i].nbDims == app_in[4 + i].desc.dims.nbDims;
  expect(shapes_ok, "append output shapes are the state's");

  // ---- serialize, then the runtime phase -------------------------------------------------------------
  const PluginFieldCollection* saved = att_run->getFieldsToSerialize();
  expect(saved && saved->nbFields == 9 && saved->fields[0].type == PluginFieldType::kFLOAT64,
         "serialized fields (high_ratio as float64)");
  IPluginV3* restored = attention_creator->createPlugin("pnmix_attention", saved, TensorRTPhase::kRUNTIME);
  expect(restored != nullptr, "runtime createPlugin from the serialized fields");
  if (restored) {
    auto* rb = static_cast<IPluginV3OneBuild*>(restored->getCapabilityInterface(PluginCapabilityType::kBUILD));
    expect(std::strcmp(rb->getMetadataString(), att_build->getMetadataString()) == 0, "same config after the trip");
    delete restored;
  }
  IPluginV3* attached = att_run->attachToContext(nullptr);
  expect(attached != nullptr, "attachToContext clones");

  // tampered collections are refused (and logged), never read beyond
  node.ints[0] = 12;
  PluginFieldCollection tampered = node.collection();
  expect(attention_creator->createPlugin("x", &tampered, TensorRTPhase::kBUILD) == nullptr, "group_size 12 refused");
  expect(finder.logger.last.find("group_size") != std::string::npos, "... with a reason naming the field");
  node.ints[0] = 128;
  tampered = node.collection();
  tampered.nbFields = 8;
  expect(append_creator->createPlugin("x", &tampered, TensorRTPhase::kRUNTIME) == nullptr, "truncated collection refused");
  tampered.nbFields = -3;
  expect(append_creator->createPlugin("x", &tampered, TensorRTPhase::kRUNTIME) == nullptr, "negative count refused");
  expect(append_creator->createPlugin("x", nullptr, TensorRTPhase::kRUNTIME) == nullptr, "null collection refused");

  // runtime shapes, then an enqueue: without a GPU it must fail cleanly, not crash
  std::vector<PluginTensorDesc> run_in;
  for (auto& d : att_in) run_in.push_back(d.desc);
  run_in[0].dims.d[2] = run_in[1].dims.d[2] = run_in[2].dims.d[2] = 1;
  PluginTensorDesc run_out = att_out[0].desc;
  run_out.dims.d[2] = 1;
  auto* attached_run =
      attached ? static_cast<IPluginV3OneRuntime*>(attached->getCapabilityInterface(PluginCapabilityType::kRUNTIME))
               : nullptr;
  expect(attached_run && attached_run->onShapeChange(run_in.data(), 16, &run_out, 1) == 0, "onShapeChange (decode)");
  if (attached_run) {
    std::vector<const void*> ptrs(16, nullptr);
    void* out_ptr = nullptr;
    const int32_t status = attached_run->enqueue(run_in.data(), &run_out, ptrs.data(), &out_ptr, nullptr, nullptr);
    expect(status != 0, "enqueue without a device fails with an error code");
  }
  delete attached;
  delete attention;
  delete append;
  std::printf("%s: %d failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
  return g_failures ? 1 : 0;
}
