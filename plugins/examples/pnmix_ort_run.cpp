// plugins/examples/pnmix_ort_run.cpp: greedy generation from a pn-mix LLM file (`pnmix export
// --model`) through ONNX Runtime's C API, over token ids (no tokenizer here). docs/ORT.md.
//
//   pnmix_ort_run --model m.onnx --tokens ID,ID,... [--max-new-tokens N] [--threads T]
//                 [--ops native|functions] [--ort-library PATH] [--pnmix-ort PATH] [--eos ID]
//
// ONNX Runtime is loaded at run time (dlopen; by default the onnxruntime wheel's library, found
// from where this program is installed, <site-packages>/pnmix/lib), so nothing of it is needed to
// build. --ops native registers libpnmix_ort (beside this program by default), whose kernels run
// the pn-mix nodes; --ops functions registers nothing and ONNX Runtime runs the function bodies the
// file carries. What the program does is pnmix/backends/onnxruntime/llm_session.py's LlmSession
// and greedy: the prompt as ONE call (seq_len 0, new_len n), then one call per new token, the
// argmax of the last position's logits. No state byte is copied between calls: with the native ops
// each present.<l>.<state> output is the past.<l>.<state> input's own OrtValue (the append kernel
// updates it in place, as LlmSession's I/O binding does); with the function bodies (which read the
// past while they write the present) ONNX Runtime allocates the presents and they become the next
// call's pasts. It prints one JSON object (the names of `pnmix generate --json`); any failure is
// `error: <one line>` and exit 2.
#include <dlfcn.h>
#include <glob.h>
#include <limits.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "example_json.h"
#include "ort/ort_c_api.h"
#include "pnmix/format.h"
#include "pnmix/params.h"

namespace {

// Every failure: one line for `error: ...` (main prints it, exits 2; RAII releases what was made).
struct Failure : std::runtime_error {
  explicit Failure(const std::string& message) : std::runtime_error(message) {}
};

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  std::replace(text.begin(), text.end(), '\r', ' ');
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

[[noreturn]] void fail(const std::string& message) { throw Failure(one_line(message)); }

// The shared readers (example_json.h) with this program's error exit.
pnmix_config config_from(const std::string& json) { return pnmix_example::config_from(json, "pnmix.config", fail); }
std::vector<int64_t> parse_ids(const std::string& text, int64_t vocab) { return pnmix_example::parse_ids(text, vocab, fail); }
using pnmix_example::layer_tensor;

// ---- arguments --------------------------------------------------------------------------------

struct Args {
  std::string model, tokens, ops = "native", ort_library, pnmix_ort;
  int64_t max_new_tokens = 16, threads = 0, eos = -1;
};

int64_t parse_int(const std::string& key, const std::string& value, int64_t lowest) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || errno == ERANGE || v < lowest)
    fail(key + " must be an integer >= " + std::to_string(lowest) + ", got '" + value + "'");
  return v;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    if (i + 1 >= argc) fail("missing value after " + key + " (see docs/ORT.md)");
    const std::string value = argv[++i];
    if (key == "--model") a.model = value;
    else if (key == "--tokens") a.tokens = value;
    else if (key == "--max-new-tokens") a.max_new_tokens = parse_int(key, value, 1);
    else if (key == "--threads") a.threads = parse_int(key, value, 0);
    else if (key == "--ops") a.ops = value;
    else if (key == "--ort-library") a.ort_library = value;
    else if (key == "--pnmix-ort") a.pnmix_ort = value;
    else if (key == "--eos") a.eos = parse_int(key, value, 0);
    else fail("unknown option " + key + " (see docs/ORT.md)");
  }
  if (a.model.empty() || a.tokens.empty())
    fail("usage: pnmix_ort_run --model M.onnx --tokens ID,ID,... [--max-new-tokens N] [--threads T] "
         "[--ops native|functions] [--ort-library PATH] [--pnmix-ort PATH] [--eos ID]");
  if (a.ops != "native" && a.ops != "functions") fail("--ops must be native or functions, got '" + a.ops + "'");
  if (a.threads > INT_MAX) fail("--threads is too large");
  return a;
}

bool is_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return static_cast<bool>(in);
}

// The folder this program lies in (/proc/self/exe), "" when unknown.
std::string program_dir() {
  char buffer[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buffer, sizeof(buffer) - 1);
  if (n <= 0) return "";
  const std::string path(buffer, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/'));
}

// The onnxruntime wheel's library: installed as <site-packages>/pnmix/lib/pnmix_ort_run, the wheel's
// is <site-packages>/onnxruntime/capi/libonnxruntime.so.<version>.
std::string default_ort_library() {
  const std::string pattern = program_dir() + "/../../onnxruntime/capi/libonnxruntime.so*";
  glob_t found{};
  std::string path;
  if (glob(pattern.c_str(), 0, nullptr, &found) == 0 && found.gl_pathc > 0) path = found.gl_pathv[found.gl_pathc - 1];
  globfree(&found);
  if (path.empty())
    fail("ONNX Runtime's library not found (looked for " + pattern +
         "): pass --ort-library PATH (the onnxruntime wheel's capi/libonnxruntime.so.*)");
  return path;
}

// ---- ONNX Runtime: the library, statuses, owned objects ---------------------------------------

const OrtApi* g_api = nullptr;  // set once by load_runtime; the deleters below use it

void check(OrtStatus* status, const std::string& what) {
  if (!status) return;
  const std::string message = g_api->GetErrorMessage(status);
  g_api->ReleaseStatus(status);
  fail(what + ": " + message);
}

#define PNMIX_ORT_OWNER(Type)                                         \
  struct Type##Release {                                              \
    void operator()(Ort##Type* p) const { if (p) g_api->Release##Type(p); } \
  };                                                                  \
  using Type##Ptr = std::unique_ptr<Ort##Type, Type##Release>;
PNMIX_ORT_OWNER(Env)
PNMIX_ORT_OWNER(SessionOptions)
PNMIX_ORT_OWNER(Session)
PNMIX_ORT_OWNER(Value)
PNMIX_ORT_OWNER(MemoryInfo)
PNMIX_ORT_OWNER(TypeInfo)
PNMIX_ORT_OWNER(TensorTypeAndShapeInfo)
PNMIX_ORT_OWNER(ModelMetadata)
#undef PNMIX_ORT_OWNER

struct Runtime {
  void* library = nullptr;  // kept loaded for the program's life
  std::string version;
};

Runtime load_runtime(const std::string& path) {
  if (!is_file(path)) fail("cannot read ONNX Runtime's library " + path);
  Runtime r;
  r.library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!r.library) fail("cannot load ONNX Runtime's library " + path + ": " + dlerror());
  using GetApiBase = const OrtApiBase* (*)();
  const auto get_base = reinterpret_cast<GetApiBase>(dlsym(r.library, "OrtGetApiBase"));
  if (!get_base) fail(path + " is not ONNX Runtime's library (no OrtGetApiBase)");
  const OrtApiBase* base = get_base();
  r.version = base->GetVersionString();
  // The oldest table with every slot called here and libpnmix_ort's kernels (ort_c_api.h).
  g_api = base->GetApi(PNMIX_ORT_API_MIN);
  if (!g_api)
    fail("ONNX Runtime " + r.version + " (" + path + ") is too old: pnmix needs " PNMIX_ORT_API_MIN_RELEASE
         " or later (C API version " + std::to_string(PNMIX_ORT_API_MIN) + ")");
  return r;
}

// The session: CPU execution provider; libpnmix_ort registered for --ops native.
SessionPtr open_session(const Args& args, OrtEnv* env) {
  OrtSessionOptions* raw = nullptr;
  check(g_api->CreateSessionOptions(&raw), "CreateSessionOptions");
  SessionOptionsPtr options(raw);
  if (args.threads > 0)
    check(g_api->SetIntraOpNumThreads(options.get(), static_cast<int>(args.threads)), "SetIntraOpNumThreads");
  if (args.ops == "native") {
    const std::string library = args.pnmix_ort.empty() ? program_dir() + "/libpnmix_ort.so" : args.pnmix_ort;
    if (!is_file(library))
      fail("--ops native needs libpnmix_ort: cannot read " + library +
           " (build the pnmix_ort target, pass --pnmix-ort PATH, or use --ops functions)");
    check(g_api->RegisterCustomOpsLibrary_V2(options.get(), library.c_str()),
          "ONNX Runtime cannot register " + library);
    // As pnmix/backends/onnxruntime/session.py's use_native_ops: the kernels' own thread count
    // (ONNX Runtime's intra-op threads keep spinning between ops: docs/OPS.md section 5.1 measures it).
    check(g_api->AddSessionConfigEntry(options.get(), "pnmix.threads", std::to_string(args.threads).c_str()),
          "AddSessionConfigEntry");
  }
  if (!is_file(args.model)) fail("cannot read the model " + args.model);
  OrtSession* session = nullptr;
  check(g_api->CreateSession(env, args.model.c_str(), options.get(), &session),
        "ONNX Runtime cannot load " + args.model);
  return SessionPtr(session);
}

// ---- the LLM file's metadata (pnmix.*, export/llm_file.py) -------------------------------------

struct Metadata {
  const OrtSession* session;
  const std::string& model;
  ModelMetadataPtr meta;
  OrtAllocator* allocator;

  // pnmix.<key>; `required` false: "" when absent.
  std::string get(const std::string& key, bool required = true) const {
    char* value = nullptr;
    check(g_api->ModelMetadataLookupCustomMetadataMap(meta.get(), allocator, ("pnmix." + key).c_str(), &value),
          "reading the model's metadata");
    if (!value) {
      if (required) fail(model + " lacks the metadata field pnmix." + key);
      return "";
    }
    std::string text(value);
    check(g_api->AllocatorFree(allocator, value), "AllocatorFree");
    return text;
  }

  int64_t integer(const std::string& key, int64_t lowest) const {
    const std::string text = get(key);
    char* end = nullptr;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || v < lowest)
      fail(model + " has unreadable pnmix metadata: " + key + " = '" + text + "'");
    return v;
  }
};

struct LlmFile {
  pnmix_layout layout;
  int64_t layers, vocab;
};

LlmFile read_llm_file(const OrtSession* session, const std::string& model, OrtAllocator* allocator) {
  OrtModelMetadata* raw = nullptr;
  check(g_api->SessionGetModelMetadata(session, &raw), "SessionGetModelMetadata");
  const Metadata meta{session, model, ModelMetadataPtr(raw), allocator};
  if (meta.get("kind", false) != "llm")
    fail(model + " is not a pn-mix LLM file (metadata pnmix.kind is not 'llm'; export one with "
         "`pnmix export --model`)");
  LlmFile f{};
  f.layout.config = config_from(meta.get("config"));
  f.layout.batch = meta.integer("batch", 1);
  f.layout.kv_heads = meta.integer("kv_heads", 1);
  f.layout.head_dim = meta.integer("head_dim", 1);
  f.layout.max_seq_len = meta.integer("max_seq_len", 1);
  f.layers = meta.integer("layers", 1);
  f.vocab = meta.integer("vocab_size", 1);
  if (f.layout.batch != 1) fail(model + " has batch " + std::to_string(f.layout.batch) + "; this program runs batch 1");
  if (const char* bad = pnmix::layout_error(f.layout)) fail(model + ": " + bad);
  return f;
}

// ---- the session's tensors ----------------------------------------------------------------------

struct TensorSpec {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> shape;
};

int64_t element_bytes(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return 1;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16: return 2;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32: return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64: return 8;
    default: return 0;
  }
}

TensorSpec spec_of(const OrtTensorTypeAndShapeInfo* info) {
  TensorSpec s;
  size_t rank = 0;
  check(g_api->GetTensorElementType(info, &s.type), "GetTensorElementType");
  check(g_api->GetDimensionsCount(info, &rank), "GetDimensionsCount");
  s.shape.resize(rank);
  check(g_api->GetDimensions(info, s.shape.data(), rank), "GetDimensions");
  return s;
}

// Names and types of the session's inputs or outputs.
struct Io {
  std::vector<std::string> names;
  std::vector<TensorSpec> specs;

  const TensorSpec* find(const std::string& name) const {
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == name) return &specs[i];
    return nullptr;
  }
};

Io session_io(const OrtSession* session, OrtAllocator* allocator, bool inputs) {
  size_t count = 0;
  check(inputs ? g_api->SessionGetInputCount(session, &count) : g_api->SessionGetOutputCount(session, &count),
        "SessionGetInputCount");
  Io io;
  for (size_t i = 0; i < count; ++i) {
    char* name = nullptr;
    check(inputs ? g_api->SessionGetInputName(session, i, allocator, &name)
                 : g_api->SessionGetOutputName(session, i, allocator, &name),
          "SessionGetInputName");
    io.names.emplace_back(name);
    check(g_api->AllocatorFree(allocator, name), "AllocatorFree");
    OrtTypeInfo* raw = nullptr;
    check(inputs ? g_api->SessionGetInputTypeInfo(session, i, &raw) : g_api->SessionGetOutputTypeInfo(session, i, &raw),
          "SessionGetInputTypeInfo");
    const TypeInfoPtr type(raw);
    const OrtTensorTypeAndShapeInfo* tensor = nullptr;
    check(g_api->CastTypeInfoToTensorInfo(type.get(), &tensor), "CastTypeInfoToTensorInfo");
    io.specs.push_back(tensor ? spec_of(tensor) : TensorSpec{});
  }
  return io;
}

int64_t volume(const std::vector<int64_t>& shape) {
  int64_t v = 1;
  for (int64_t d : shape) v *= d;
  return v;
}

// The file's interface (docs/OPS.md section 8), checked against the metadata's layout: the names,
// each state input of static shape with the bytes docs/FORMAT.md gives it, its present output.
void check_interface(const LlmFile& f, const Io& inputs, const Io& outputs, const std::string& model) {
  const std::string not_llm = model + " does not have an LLM file's interface (docs/OPS.md section 8): ";
  const TensorSpec* ids = inputs.find("input_ids");
  if (!ids || ids->type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 || ids->shape.size() != 2) fail(not_llm + "input_ids");
  for (const char* name : {"seq_len", "new_len"}) {
    const TensorSpec* s = inputs.find(name);
    if (!s || s->type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 || !s->shape.empty()) fail(not_llm + name);
  }
  const TensorSpec* logits = outputs.find("logits");
  if (!logits || logits->type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) fail(not_llm + "logits");
  for (int64_t l = 0; l < f.layers; ++l)
    for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
      const std::string past = layer_tensor("past", l, i);
      const TensorSpec* s = inputs.find(past);
      if (!s) fail(not_llm + "no input " + past);
      if (!outputs.find(layer_tensor("present", l, i))) fail(not_llm + "no output " + layer_tensor("present", l, i));
      for (int64_t d : s->shape)
        if (d < 0) fail(not_llm + past + " has a dynamic shape");
      if (element_bytes(s->type) != pnmix::state_elem_bytes(i) ||
          volume(s->shape) * element_bytes(s->type) != pnmix::state_bytes(f.layout, i))
        fail(past + " does not match docs/FORMAT.md for the file's pnmix.config and shapes");
    }
}

// ---- generation ---------------------------------------------------------------------------------

struct Generator {
  OrtSession* session;
  const LlmFile& file;
  OrtMemoryInfo* cpu;
  std::vector<std::string> input_names, output_names;  // input_ids, seq_len, new_len, past...; logits, present...
  std::vector<ValuePtr> state;                         // layer-major, STATE_NAMES order within a layer
  bool in_place;                                       // native ops: present written into past's buffer
  int64_t seq_len = 0;

  Generator(OrtSession* s, const LlmFile& f, OrtMemoryInfo* memory, const Io& inputs, OrtAllocator* allocator,
            bool native)
      : session(s), file(f), cpu(memory), in_place(native) {
    input_names = {"input_ids", "seq_len", "new_len"};
    output_names = {"logits"};
    for (int64_t l = 0; l < f.layers; ++l)
      for (int i = 0; i < PNMIX_NUM_STATE; ++i) {
        input_names.push_back(layer_tensor("past", l, i));
        output_names.push_back(layer_tensor("present", l, i));
        state.push_back(zeroed(*inputs.find(input_names.back()), allocator));
      }
  }

  // An empty cache: every state tensor allocated by ONNX Runtime's allocator and zeroed.
  static ValuePtr zeroed(const TensorSpec& spec, OrtAllocator* allocator) {
    OrtValue* value = nullptr;
    check(g_api->CreateTensorAsOrtValue(allocator, spec.shape.data(), spec.shape.size(), spec.type, &value),
          "CreateTensorAsOrtValue");
    ValuePtr owned(value);
    void* data = nullptr;
    check(g_api->GetTensorMutableData(value, &data), "GetTensorMutableData");
    std::memset(data, 0, static_cast<size_t>(volume(spec.shape) * element_bytes(spec.type)));
    return owned;
  }

  ValuePtr int64_tensor(int64_t* data, const std::vector<int64_t>& shape) const {
    OrtValue* value = nullptr;
    check(g_api->CreateTensorWithDataAsOrtValue(cpu, data, static_cast<size_t>(std::max<int64_t>(volume(shape), 1)) * 8,
                                                shape.data(), shape.size(), ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, &value),
          "CreateTensorWithDataAsOrtValue");
    return ValuePtr(value);
  }

  // One call: the ids appended at seq_len; the argmax of the last position's logits.
  int64_t step(std::vector<int64_t> ids) {
    const int64_t n = static_cast<int64_t>(ids.size());
    int64_t lengths[2] = {seq_len, n};
    const ValuePtr id_value = int64_tensor(ids.data(), {1, n});
    const ValuePtr seq_value = int64_tensor(&lengths[0], {});
    const ValuePtr new_value = int64_tensor(&lengths[1], {});
    std::vector<const OrtValue*> feeds = {id_value.get(), seq_value.get(), new_value.get()};
    for (const ValuePtr& v : state) feeds.push_back(v.get());
    std::vector<const char*> in_names, out_names;
    for (const std::string& s : input_names) in_names.push_back(s.c_str());
    for (const std::string& s : output_names) out_names.push_back(s.c_str());
    // null: ONNX Runtime allocates that output (logits; the presents of the function bodies)
    std::vector<OrtValue*> fetched(out_names.size(), nullptr);
    if (in_place)
      for (size_t k = 0; k < state.size(); ++k) fetched[k + 1] = state[k].get();
    check(g_api->Run(session, nullptr, in_names.data(), feeds.data(), feeds.size(), out_names.data(), out_names.size(),
                     fetched.data()),
          "ONNX Runtime failed to run the model");
    const ValuePtr logits(fetched[0]);
    if (!in_place)
      for (size_t k = 0; k < state.size(); ++k) state[k].reset(fetched[k + 1]);  // present -> next past
    seq_len += n;
    return argmax_last(logits.get());
  }

  int64_t argmax_last(OrtValue* logits) const {
    OrtTensorTypeAndShapeInfo* raw = nullptr;
    check(g_api->GetTensorTypeAndShape(logits, &raw), "GetTensorTypeAndShape");
    const TensorTypeAndShapeInfoPtr info(raw);
    const TensorSpec spec = spec_of(info.get());
    if (spec.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || spec.shape.empty() || spec.shape.back() != file.vocab)
      fail("the model's logits are not fp32 [..., vocab_size " + std::to_string(file.vocab) + "]");
    void* data = nullptr;
    check(g_api->GetTensorMutableData(logits, &data), "GetTensorMutableData");
    const float* last = static_cast<const float*>(data) + (volume(spec.shape) - file.vocab);
    return std::max_element(last, last + file.vocab) - last;
  }

  // Allocated bytes of all state tensors (LlmSession.cache_bytes()'s allocated_bytes).
  int64_t state_bytes() const {
    int64_t total = 0;
    for (int64_t l = 0; l < file.layers; ++l)
      for (int i = 0; i < PNMIX_NUM_STATE; ++i) total += pnmix::state_bytes(file.layout, i);
    return total;
  }
};

double seconds_since(std::chrono::steady_clock::time_point began) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char ch : text) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') out += std::string("\\") + ch;
    else if (c < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else out += ch;
  }
  return out + "\"";
}

std::string json_rate(int64_t tokens, double seconds) {
  if (tokens <= 0 || seconds <= 0.0) return "null";
  char text[64];
  std::snprintf(text, sizeof(text), "%.6g", tokens / seconds);
  return text;
}

int run(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  const Runtime runtime = load_runtime(args.ort_library.empty() ? default_ort_library() : args.ort_library);
  OrtEnv* raw_env = nullptr;
  check(g_api->CreateEnv(ORT_LOGGING_LEVEL_ERROR, "pnmix_ort_run", &raw_env), "CreateEnv");
  const EnvPtr env(raw_env);
  const SessionPtr session = open_session(args, env.get());
  OrtAllocator* allocator = nullptr;
  check(g_api->GetAllocatorWithDefaultOptions(&allocator), "GetAllocatorWithDefaultOptions");
  const LlmFile file = read_llm_file(session.get(), args.model, allocator);
  check_interface(file, session_io(session.get(), allocator, true), session_io(session.get(), allocator, false),
                  args.model);
  const std::vector<int64_t> prompt = parse_ids(args.tokens, file.vocab);
  const int64_t n = static_cast<int64_t>(prompt.size()), capacity = file.layout.max_seq_len;
  if (n > capacity)
    fail("cache capacity exceeded: 0 + " + std::to_string(n) + " tokens > max_seq_len " + std::to_string(capacity) +
         " of " + args.model + ": the prompt (export with a larger --max-seq-len)");
  // as `pnmix generate`: the last new token is never appended, so capacity - n + 1 tokens fit
  const int64_t max_new = std::min(args.max_new_tokens, capacity - n + 1);

  OrtMemoryInfo* raw_cpu = nullptr;
  check(g_api->CreateCpuMemoryInfo(OrtArenaAllocator, OrtMemTypeDefault, &raw_cpu), "CreateCpuMemoryInfo");
  const MemoryInfoPtr cpu(raw_cpu);
  Generator g(session.get(), file, cpu.get(), session_io(session.get(), allocator, true), allocator,
              args.ops == "native");

  auto began = std::chrono::steady_clock::now();
  std::vector<int64_t> generated{g.step(prompt)};
  const double prefill_seconds = seconds_since(began);
  began = std::chrono::steady_clock::now();
  while (static_cast<int64_t>(generated.size()) < max_new && generated.back() != args.eos)
    generated.push_back(g.step({generated.back()}));
  const double decode_seconds = seconds_since(began);

  const int64_t steps = static_cast<int64_t>(generated.size()) - 1;  // decode calls (pnmix/generate.py)
  std::string ids;
  for (size_t i = 0; i < generated.size(); ++i) ids += (i ? ", " : "") + std::to_string(generated[i]);
  std::printf(
      "{\"model\": %s, \"onnxruntime_version\": %s, \"provider\": \"CPUExecutionProvider\", \"ops\": \"%s\", "
      "\"threads\": %lld, \"prompt_tokens\": %lld, \"new_tokens\": %lld, \"token_ids\": [%s], "
      "\"prefill_seconds\": %.6f, \"decode_seconds\": %.6f, \"prefill_tokens_per_s\": %s, "
      "\"decode_tokens_per_s\": %s, \"cached_tokens\": %lld, \"state_bytes\": %lld, "
      "\"persistent_cache_bytes\": %lld}\n",
      json_string(args.model).c_str(), json_string(runtime.version).c_str(), args.ops.c_str(), (long long)args.threads,
      (long long)n, (long long)generated.size(), ids.c_str(), prefill_seconds, decode_seconds,
      json_rate(n, prefill_seconds).c_str(), json_rate(steps, decode_seconds).c_str(), (long long)g.seq_len,
      (long long)g.state_bytes(), (long long)(file.layers * pnmix::persistent_bytes(file.layout, g.seq_len)));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const Failure& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  } catch (const std::exception& e) {  // std::bad_alloc and the like: still one line, no abort
    std::fprintf(stderr, "error: %s\n", one_line(e.what()).c_str());
  }
  return 2;
}
