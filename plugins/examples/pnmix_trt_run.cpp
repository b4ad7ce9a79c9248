// plugins/examples/pnmix_trt_run.cpp: embed a pn-mix TensorRT engine in a C++ program.
//
//   pnmix_trt_run --engine model.plan --plugins libpnmix_trt_plugins.so [--text hamlet.txt]
//                 [--prefill 384] [--decode 64]
//   pnmix_trt_run --engine llm.plan --plugins libpnmix_trt_plugins.so --tokens 1,2,3
//                 [--max-new-tokens 16]
//
// An engine of an LLM file (`pnmix export --model`; its model.plan.json says "kind": "llm") is run
// as a greedy generator over token ids (no tokenizer here): the prompt ids as one prefill call,
// then one token per call, each layer's packed state bound in place (past.<l>.<name> and
// present.<l>.<name> share one device buffer). It prints the generated ids, prefill and decode
// tokens/s and the packed cache bytes as JSON. Otherwise the engine is the diagnostic model's:
//
// Loads the plugin library into TensorRT's registry, deserializes the engine (built by
// `pnmix build-engine`, which writes model.plan.json next to it), keeps the packed cache on the
// device for the whole run, and runs the protocol's token stream: one prefill, `decode` decode
// steps, then the final evaluation of the decode queries against the final cache. It prints one
// JSON object: the cache's byte accounting, the protocol checks that need no reference
// (mask unchanged, attention calls, online vs final-cache delta) and the timings.
//
// The cache is updated in place: each state tensor <name> and its output present_<name> are bound
// to the same device buffer, so no state byte is copied between steps (docs/TENSORRT.md).
#include <NvInfer.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "example_json.h"
#include "pnmix/format.h"
#include "pnmix/params.h"

namespace {


[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "error: %s\n", message.c_str());
  std::exit(2);
}

// The shared readers (example_json.h) with this program's error exit.
std::string json_value(const std::string& json, const std::string& key) {
  return pnmix_example::json_value(json, key, "engine description", die);
}
pnmix_config config_from(const std::string& json) { return pnmix_example::config_from(json, "engine description", die); }
std::vector<int64_t> parse_ids(const std::string& text, int64_t vocab) { return pnmix_example::parse_ids(text, vocab, die); }
using pnmix_example::layer_tensor;

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(err));
}

class Logger : public nvinfer1::ILogger {
 public:
  void log(Severity severity, const char* msg) noexcept override {
    if (severity <= Severity::kWARNING) std::fprintf(stderr, "[TensorRT] %s\n", msg);
  }
};

struct Args {
  std::string engine, plugins, text = "pnmix/data/hamlet.txt", tokens;
  int64_t prefill = 384, decode = 64, max_new_tokens = 16;
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    if (i + 1 >= argc) die("missing value after " + key);
    const std::string value = argv[++i];
    if (key == "--engine") a.engine = value;
    else if (key == "--plugins") a.plugins = value;
    else if (key == "--text") a.text = value;
    else if (key == "--prefill") a.prefill = std::atoll(value.c_str());
    else if (key == "--decode") a.decode = std::atoll(value.c_str());
    else if (key == "--tokens") a.tokens = value;
    else if (key == "--max-new-tokens") a.max_new_tokens = std::atoll(value.c_str());
    else die("unknown option " + key + " (see the comment at the top of pnmix_trt_run.cpp)");
  }
  if (a.engine.empty() || a.plugins.empty()) die("usage: pnmix_trt_run --engine PLAN --plugins LIB [--text FILE]");
  if (a.prefill < 1 || a.decode < 0) die("--prefill must be >= 1 and --decode >= 0");
  if (a.max_new_tokens < 0) die("--max-new-tokens must be >= 0");
  return a;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) die("cannot read " + path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

bool json_has(const std::string& json, const std::string& key) {
  return json.find("\"" + key + "\"") != std::string::npos;
}

int64_t volume(const nvinfer1::Dims& d) {
  int64_t v = 1;
  for (int i = 0; i < d.nbDims; ++i) v *= d.d[i];
  return v;
}

double elapsed_ms(std::chrono::steady_clock::time_point began) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count();
}

// One device buffer per tensor the engine reads or writes, sized for the largest call.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { cuda_check(cudaMalloc(&ptr, std::max<size_t>(n, 1)), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// One state tensor's device buffer, its size checked against docs/FORMAT.md, zeroed: an empty cache.
std::unique_ptr<DeviceBuffer> zeroed_state(const nvinfer1::ICudaEngine* engine, const std::string& name,
                                           const pnmix_layout& L, int i, cudaStream_t stream) {
  const int64_t bytes = volume(engine->getTensorShape(name.c_str())) * pnmix::state_elem_bytes(i);
  if (bytes != pnmix::state_bytes(L, i)) die("state tensor " + name + " does not match docs/FORMAT.md for this config");
  std::unique_ptr<DeviceBuffer> buffer(new DeviceBuffer(static_cast<size_t>(bytes)));
  cuda_check(cudaMemsetAsync(buffer->ptr, 0, buffer->bytes, stream), "cudaMemset");
  return buffer;
}

// seq_len and new_len of a call: int64 device scalars, unless TensorRT made them shape inputs (host).
struct Lengths {
  DeviceBuffer seq{8}, added{8};
  bool on_host;
  int64_t host[2] = {0, 0};
  explicit Lengths(const nvinfer1::ICudaEngine* engine) : on_host(engine->isShapeInferenceIO("seq_len")) {}

  // Upload (cache_len, append) and bind both; false when the engine has no such inputs.
  bool bind(nvinfer1::IExecutionContext* context, int64_t cache_len, int64_t append, cudaStream_t stream) {
    host[0] = cache_len;
    host[1] = append;
    if (!on_host) {
      cuda_check(cudaMemcpyAsync(seq.ptr, &host[0], 8, cudaMemcpyHostToDevice, stream), "seq_len");
      cuda_check(cudaMemcpyAsync(added.ptr, &host[1], 8, cudaMemcpyHostToDevice, stream), "new_len");
    }
    return context->setTensorAddress("seq_len", on_host ? static_cast<void*>(&host[0]) : seq.ptr) &&
           context->setTensorAddress("new_len", on_host ? static_cast<void*>(&host[1]) : added.ptr);
  }
};

// The token input's shape of a call, [batch, n].
void set_tokens_shape(nvinfer1::IExecutionContext* context, const char* name, int64_t batch, int64_t n) {
  nvinfer1::Dims shape{};
  shape.nbDims = 2;
  shape.d[0] = batch;
  shape.d[1] = n;
  if (!context->setInputShape(name, shape)) die("the engine does not take this many tokens");
}

// One execution context per profile of `pnmix build-engine`: 0 decode (n = 1), 1 prefill and evaluation.
struct ProfileContexts {
  std::unique_ptr<nvinfer1::IExecutionContext> decode, prefill;
};

ProfileContexts profile_contexts(nvinfer1::ICudaEngine* engine, cudaStream_t stream) {
  ProfileContexts c{std::unique_ptr<nvinfer1::IExecutionContext>(engine->createExecutionContext()),
                    std::unique_ptr<nvinfer1::IExecutionContext>(engine->createExecutionContext())};
  if (!c.decode || !c.prefill) die("createExecutionContext failed");
  if (engine->getNbOptimizationProfiles() >= 2 && !c.prefill->setOptimizationProfileAsync(1, stream))
    die("no prefill profile");
  if (!c.decode->setOptimizationProfileAsync(0, stream)) die("no decode profile");
  return c;
}

struct Runner {
  nvinfer1::ICudaEngine* engine;
  cudaStream_t stream;
  int64_t batch, q_heads, head_dim, d_model, max_tokens;
  std::vector<std::unique_ptr<DeviceBuffer>> state;  // the cache, in STATE_NAMES order
  std::unique_ptr<DeviceBuffer> tokens, attention, output;
  std::unique_ptr<Lengths> lengths;

  // One engine call: tokens [B, n] (host), attention out [B, Hq, n, D] copied to `attention_out`.
  double run(nvinfer1::IExecutionContext* context, const std::vector<int64_t>& host_tokens, int64_t start,
             int64_t n, int64_t cache_len, int64_t append, std::vector<float>* attention_out) {
    if (n > max_tokens) die("a call with more tokens than the engine's prefill profile");
    // tokens: every batch row reads the same text
    std::vector<int64_t> rows(static_cast<size_t>(batch * n));
    for (int64_t b = 0; b < batch; ++b)
      std::copy(host_tokens.begin() + start, host_tokens.begin() + start + n, rows.begin() + b * n);
    cuda_check(cudaMemcpyAsync(tokens->ptr, rows.data(), rows.size() * 8, cudaMemcpyHostToDevice, stream), "tokens");
    set_tokens_shape(context, "tokens", batch, n);
    bool ok = context->setTensorAddress("tokens", tokens->ptr) && lengths->bind(context, cache_len, append, stream) &&
              context->setTensorAddress("attention", attention->ptr) &&
              context->setTensorAddress("output", output->ptr);
    for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
      // In place: the state input and its present_ output are one device buffer.
      const std::string present = std::string("present_") + pnmix::state_name(i);
      ok = ok && context->setTensorAddress(pnmix::state_name(i), state[i]->ptr) &&
           context->setTensorAddress(present.c_str(), state[i]->ptr);
    }
    if (!ok) die("binding the engine's tensors failed: was it built from a pnmix export?");
    cuda_check(cudaStreamSynchronize(stream), "upload");
    const auto began = std::chrono::steady_clock::now();
    if (!context->enqueueV3(stream)) die("TensorRT failed to run the engine (see its log above)");
    cuda_check(cudaStreamSynchronize(stream), "engine run");
    const double ms = elapsed_ms(began);
    if (attention_out) {
      attention_out->resize(static_cast<size_t>(batch * q_heads * n * head_dim));
      cuda_check(cudaMemcpy(attention_out->data(), attention->ptr, attention_out->size() * 4, cudaMemcpyDeviceToHost),
                 "attention");
    }
    return ms;
  }

  std::vector<uint8_t> download(int i) const {
    std::vector<uint8_t> host(state[i]->bytes);
    cuda_check(cudaMemcpy(host.data(), state[i]->ptr, host.size(), cudaMemcpyDeviceToHost), "state");
    return host;
  }
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(std::min<double>(v.size() - 1, std::floor(p * (v.size() - 1) + 0.5)))];
}

// The plugins, then the engine: the registry must know the creators before deserializing.
struct LoadedEngine {
  Logger logger;
  std::unique_ptr<nvinfer1::IRuntime> runtime;
  std::unique_ptr<nvinfer1::ICudaEngine> engine;
};

void load_engine(const Args& args, LoadedEngine& out) {
  out.runtime.reset(nvinfer1::createInferRuntime(out.logger));
  if (!out.runtime) die("createInferRuntime failed");
  if (out.runtime->getPluginRegistry().loadLibrary(args.plugins.c_str()) == nullptr)
    die("TensorRT cannot load the plugin library " + args.plugins);
  const std::string plan = read_file(args.engine);
  out.engine.reset(out.runtime->deserializeCudaEngine(plan.data(), plan.size()));
  if (!out.engine) die("TensorRT cannot deserialize " + args.engine);
}

// ---- the LLM engine: greedy generation over token ids ----------------------------------------

struct LlmRunner {
  nvinfer1::ICudaEngine* engine;
  cudaStream_t stream;
  int64_t layers, vocab, max_tokens;
  std::vector<std::unique_ptr<DeviceBuffer>> state;  // layer-major, STATE_NAMES order within a layer
  std::unique_ptr<DeviceBuffer> ids, logits;
  std::unique_ptr<Lengths> lengths;

  // One call: ids at positions seq_len.., appended; returns the argmax of the last position's logits.
  int64_t step(nvinfer1::IExecutionContext* context, const int64_t* host_ids, int64_t n, int64_t cache_len) {
    if (n > max_tokens) die("the prompt has more tokens than the engine's prefill profile (" +
                            std::to_string(max_tokens) + ")");
    cuda_check(cudaMemcpyAsync(ids->ptr, host_ids, static_cast<size_t>(n) * 8, cudaMemcpyHostToDevice, stream), "ids");
    set_tokens_shape(context, "input_ids", 1, n);
    bool ok = context->setTensorAddress("input_ids", ids->ptr) && lengths->bind(context, cache_len, n, stream) &&
              context->setTensorAddress("logits", logits->ptr);
    for (int64_t l = 0; l < layers; ++l)
      for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
        void* buffer = state[l * PNMIX_NUM_STATE + i]->ptr;  // in place: past and present are one buffer
        ok = ok && context->setTensorAddress(layer_tensor("past", l, i).c_str(), buffer) &&
             context->setTensorAddress(layer_tensor("present", l, i).c_str(), buffer);
      }
    if (!ok) die("binding the engine's tensors failed: was it built from `pnmix export --model`?");
    if (!context->enqueueV3(stream)) die("TensorRT failed to run the engine (see its log above)");
    std::vector<float> host(static_cast<size_t>(vocab));
    cuda_check(cudaMemcpyAsync(host.data(), logits->ptr, host.size() * 4, cudaMemcpyDeviceToHost, stream), "logits");
    cuda_check(cudaStreamSynchronize(stream), "engine run");
    return std::max_element(host.begin(), host.end()) - host.begin();
  }
};

int run_llm(const Args& args, const std::string& description) {
  const auto wall_began = std::chrono::steady_clock::now();
  const pnmix_config config = config_from(description);
  const int64_t capacity = std::atoll(json_value(description, "capacity").c_str());
  LlmRunner r{};
  r.layers = std::atoll(json_value(description, "layers").c_str());
  r.vocab = std::atoll(json_value(description, "vocab_size").c_str());
  if (r.layers < 1 || r.vocab < 1) die("engine description: bad 'layers' or 'vocab_size'");
  std::vector<int64_t> ids = parse_ids(args.tokens, r.vocab);
  const int64_t prompt = static_cast<int64_t>(ids.size());
  if (prompt + args.max_new_tokens > capacity)
    die("the prompt's " + std::to_string(prompt) + " tokens + --max-new-tokens exceed the engine's capacity (" +
        std::to_string(capacity) + ")");

  LoadedEngine loaded;
  load_engine(args, loaded);
  nvinfer1::ICudaEngine* engine = loaded.engine.get();
  r.engine = engine;
  cuda_check(cudaStreamCreate(&r.stream), "cudaStreamCreate");
  const nvinfer1::Dims sink = engine->getTensorShape(layer_tensor("past", 0, PNMIX_SINK_K).c_str());
  if (sink.nbDims != 4) die("the engine's I/O is not a `pnmix export --model` file's");
  pnmix_layout L{config, 1, sink.d[1], sink.d[3], capacity};
  if (const char* bad = pnmix::layout_error(L)) die(std::string("engine description: ") + bad);
  for (int64_t l = 0; l < r.layers; ++l)
    for (int i = 0; i < PNMIX_NUM_STATE; ++i) r.state.push_back(zeroed_state(engine, layer_tensor("past", l, i), L, i, r.stream));
  const int profiles = engine->getNbOptimizationProfiles();
  r.max_tokens = engine->getProfileShape("input_ids", profiles - 1, nvinfer1::OptProfileSelector::kMAX).d[1];
  r.ids.reset(new DeviceBuffer(static_cast<size_t>(r.max_tokens * 8)));
  r.logits.reset(new DeviceBuffer(static_cast<size_t>(r.vocab * 4)));
  r.lengths.reset(new Lengths(engine));
  const ProfileContexts contexts = profile_contexts(engine, r.stream);
  cuda_check(cudaStreamSynchronize(r.stream), "setup");

  auto began = std::chrono::steady_clock::now();
  std::vector<int64_t> generated{r.step(contexts.prefill.get(), ids.data(), prompt, 0)};
  const double prefill_ms = elapsed_ms(began);
  began = std::chrono::steady_clock::now();
  while (static_cast<int64_t>(generated.size()) < args.max_new_tokens) {
    const int64_t position = prompt + static_cast<int64_t>(generated.size()) - 1;
    generated.push_back(r.step(contexts.decode.get(), &generated.back(), 1, position));
  }
  const double decode_ms = elapsed_ms(began);
  if (args.max_new_tokens == 0) generated.clear();  // the prefill ran; nothing asked for

  const int64_t cached = prompt + std::max<int64_t>(0, static_cast<int64_t>(generated.size()) - 1);
  const int64_t steps = std::max<int64_t>(0, static_cast<int64_t>(generated.size()) - 1);
  std::string out_ids;
  for (size_t i = 0; i < generated.size(); ++i) out_ids += (i ? ", " : "") + std::to_string(generated[i]);
  std::printf(
      "{\n  \"engine\": \"%s\",\n  \"kind\": \"llm\",\n  \"layers\": %lld,\n  \"prompt_tokens\": %lld,\n"
      "  \"generated_ids\": [%s],\n  \"cached_tokens\": %lld,\n  \"packed_cache_bytes\": %lld,\n"
      "  \"timing\": {\"prefill_ms\": %.4f, \"prefill_tokens_per_s\": %.2f, \"decode_ms\": %.4f, "
      "\"decode_tokens_per_s\": %.2f},\n  \"elapsed_seconds\": %.4f\n}\n",
      args.engine.c_str(), (long long)r.layers, (long long)prompt, out_ids.c_str(), (long long)cached,
      (long long)(r.layers * pnmix::persistent_bytes(L, cached)), prefill_ms, prompt / (prefill_ms / 1e3), decode_ms,
      steps ? steps / (decode_ms / 1e3) : 0.0, elapsed_ms(wall_began) / 1e3);
  cudaStreamDestroy(r.stream);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  const auto wall_began = std::chrono::steady_clock::now();
  const std::string description = read_file(args.engine + ".json");
  const bool llm = json_has(description, "kind") && json_value(description, "kind") == "llm";
  if (llm != !args.tokens.empty())
    die(llm ? "this is an LLM engine: give the prompt as --tokens ID,ID,..."
            : "--tokens is for an LLM engine (pnmix export --model); this engine is the diagnostic model's");
  if (llm) return run_llm(args, description);
  const pnmix_config config = config_from(description);
  const int64_t capacity = std::atoll(json_value(description, "capacity").c_str());
  const std::string text = read_file(args.text);
  const int64_t total = args.prefill + args.decode;
  if (static_cast<int64_t>(text.size()) < total) die("the text has fewer bytes than prefill + decode tokens");
  if (total > capacity) die("prefill + decode tokens exceed the engine's cache capacity");
  std::vector<int64_t> host_tokens(text.begin(), text.begin() + total);
  for (auto& t : host_tokens) t = static_cast<unsigned char>(t);  // byte vocabulary

  // 1. The plugins, then the engine.
  LoadedEngine loaded;
  load_engine(args, loaded);
  nvinfer1::ICudaEngine* engine = loaded.engine.get();

  // 2. Buffers, the cache kept on the device for the whole run (zeros: an empty cache).
  Runner r{};
  r.engine = engine;
  cuda_check(cudaStreamCreate(&r.stream), "cudaStreamCreate");
  const nvinfer1::Dims sink = engine->getTensorShape("sink_k");
  const nvinfer1::Dims att = engine->getTensorShape("attention");
  const nvinfer1::Dims out = engine->getTensorShape("output");
  if (sink.nbDims != 4 || att.nbDims != 4 || out.nbDims != 3) die("the engine's I/O is not a pnmix export's");
  r.batch = sink.d[0];
  r.q_heads = att.d[1];
  r.head_dim = att.d[3];
  r.d_model = out.d[2];
  const int profiles = engine->getNbOptimizationProfiles();
  r.max_tokens = engine->getProfileShape("tokens", profiles - 1, nvinfer1::OptProfileSelector::kMAX).d[1];
  pnmix_layout L{config, r.batch, sink.d[1], sink.d[3], capacity};
  if (const char* bad = pnmix::layout_error(L)) die(std::string("engine description: ") + bad);
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) r.state.push_back(zeroed_state(engine, pnmix::state_name(i), L, i, r.stream));
  r.tokens.reset(new DeviceBuffer(static_cast<size_t>(r.batch * r.max_tokens * 8)));
  r.attention.reset(new DeviceBuffer(static_cast<size_t>(r.batch * r.q_heads * r.max_tokens * r.head_dim * 4)));
  r.output.reset(new DeviceBuffer(static_cast<size_t>(r.batch * r.max_tokens * r.d_model * 4)));
  r.lengths.reset(new Lengths(engine));

  // 3. One execution context per profile: 0 decode (n = 1), 1 prefill and evaluation.
  const ProfileContexts contexts = profile_contexts(engine, r.stream);

  // 4. The protocol: prefill, decode steps (the online outputs), final evaluation.
  std::vector<float> attention;
  const double prefill_ms = r.run(contexts.prefill.get(), host_tokens, 0, args.prefill, 0, args.prefill, nullptr);
  const std::vector<uint8_t> mask_after_prefill = r.download(PNMIX_PAIR_MASK);
  std::vector<double> decode_ms;
  std::vector<std::vector<float>> online;
  for (int64_t t = args.prefill; t < total; ++t) {
    decode_ms.push_back(r.run(contexts.decode.get(), host_tokens, t, 1, t, 1, &attention));
    online.push_back(attention);
  }
  double max_delta = 0.0;
  int64_t calls = 1 + args.decode;
  if (args.decode > 0) {
    r.run(contexts.prefill.get(), host_tokens, args.prefill, args.decode, total, 0, &attention);  // [B, Hq, decode, D]
    ++calls;
    for (int64_t t = 0; t < args.decode; ++t)
      for (int64_t bh = 0; bh < r.batch * r.q_heads; ++bh)
        for (int64_t c = 0; c < r.head_dim; ++c) {
          const float a = online[t][bh * r.head_dim + c];
          const float b = attention[(bh * args.decode + t) * r.head_dim + c];
          max_delta = std::max(max_delta, static_cast<double>(std::fabs(a - b)));
        }
  }
  const bool mask_unchanged = r.download(PNMIX_PAIR_MASK) == mask_after_prefill;

  // 5. The metrics the engine alone can give (quality metrics need the reference: pnmix verify --engine).
  int64_t key_bytes = 0, value_bytes = 0;
  for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
    const int64_t bytes = pnmix::shape_bytes(L, i, pnmix::used_shape(L, i, total));
    const bool key_side = i == PNMIX_SINK_K || i == PNMIX_RESIDUAL_K || i == PNMIX_KEY_CODES ||
                          i == PNMIX_KEY_STEP || i == PNMIX_KEY_OFFSET || i == PNMIX_PAIR_MASK;
    (key_side ? key_bytes : value_bytes) += bytes;
  }
  const pnmix::Lengths n = pnmix::lengths(config, total);
  cudaDeviceProp prop{};
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  double decode_sum = 0.0;
  for (double ms : decode_ms) decode_sum += ms;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_began).count();
  const double per_sequence = static_cast<double>(r.batch);
  std::printf(
      "{\n  \"engine\": \"%s\",\n  \"batch\": %lld,\n  \"prefill_tokens\": %lld,\n  \"decode_tokens\": %lld,\n"
      "  \"metrics\": {\n    \"key_bytes\": %lld,\n    \"value_bytes\": %lld,\n    \"persistent_cache_bytes\": %lld,\n"
      "    \"quantized_tokens\": %lld,\n    \"sink_tokens\": %lld,\n    \"residual_tokens\": %lld,\n"
      "    \"key_bits_per_element_including_sink_residual\": %.15g,\n    \"saliency_computations\": 1,\n"
      "    \"mask_unchanged_after_decode\": %s,\n    \"actual_attention_calls\": %lld,\n"
      "    \"online_vs_final_cache_attention_max_delta\": %.9g\n  },\n"
      "  \"timing_ms\": {\"prefill\": %.4f, \"decode_mean\": %.4f, \"decode_p50\": %.4f, \"decode_max\": %.4f},\n"
      "  \"runtime\": {\"device_kind\": \"cuda\", \"accelerator_model\": \"%s\", \"elapsed_seconds\": %.4f}\n}\n",
      args.engine.c_str(), (long long)r.batch, (long long)args.prefill, (long long)args.decode,
      (long long)(key_bytes / r.batch), (long long)(value_bytes / r.batch),
      (long long)((key_bytes + value_bytes) / r.batch), (long long)(n.groups * config.group_size),
      (long long)n.sink, (long long)n.residual,
      static_cast<double>(key_bytes) * 8.0 / per_sequence / static_cast<double>(total * L.kv_heads * L.head_dim),
      mask_unchanged ? "true" : "false", (long long)calls, max_delta, prefill_ms,
      decode_ms.empty() ? 0.0 : decode_sum / decode_ms.size(), percentile(decode_ms, 0.5),
      decode_ms.empty() ? 0.0 : *std::max_element(decode_ms.begin(), decode_ms.end()), prop.name, elapsed);
  cudaStreamDestroy(r.stream);
  return mask_unchanged ? 0 : 1;
}
