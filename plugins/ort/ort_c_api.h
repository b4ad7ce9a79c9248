/* plugins/ort/ort_c_api.h: the part of ONNX Runtime's C ABI that pnmix uses.
 *
 * The onnxruntime wheel ships no C headers, so this file declares, by hand, what libpnmix_ort
 * (plugins/ort/pnmix_ort.cc) and the example app (plugins/examples/pnmix_ort_run.cpp) call, from
 * the official include/onnxruntime/core/session/onnxruntime_c_api.h:
 *
 *   - the OrtApi slot list was taken from that header at ORT_API_VERSION 30 (ONNX Runtime 1.30),
 *     in its documented order, up to the last slot anyone here calls (KernelInfo_GetConfigEntries,
 *     slot 391, since 1.24). The table only ever grows at its end, so a prefix is a valid view of
 *     every newer runtime's table. Slots nobody calls are OrtUnusedSlot (a type-erased pointer)
 *     under their official names, so offsetof() works on every name in both headers;
 *   - OrtCustomOp in its documented field order (all fields through ReleaseAliasMap, ORT 1.20);
 *     its `version` says which fields the runtime may read;
 *   - the enums and opaque types those use.
 *
 * Versions: libpnmix_ort needs OrtApi version PNMIX_ORT_API_MIN (16, ONNX Runtime 1.16: the
 * custom op's CreateKernelV2/KernelComputeV2, which return an OrtStatus instead of throwing).
 * It uses KernelInfo_GetConfigEntries only when the runtime offers PNMIX_ORT_API_CONFIG_ENTRIES
 * (24, ONNX Runtime 1.24), and KernelContext_ParallelFor only from PNMIX_ORT_API_PARALLEL_FOR
 * (17, ONNX Runtime 1.17).
 *
 * With -DONNXRUNTIME_INCLUDE_DIR=<dir holding onnxruntime_c_api.h>, CMake defines
 * PNMIX_ORT_OFFICIAL_HEADER and this file includes the official header instead;
 * tests/backends/test_ort_abi.py compares the offsets of both (plugins/ort/abi_offsets.cc).
 */
#ifndef PNMIX_ORT_C_API_H
#define PNMIX_ORT_C_API_H

#define PNMIX_ORT_API_MIN 16            /* CreateKernelV2 / KernelComputeV2 */
#define PNMIX_ORT_API_MIN_RELEASE "1.16"
#define PNMIX_ORT_API_CONFIG_ENTRIES 24 /* KernelInfo_GetConfigEntries */
#define PNMIX_ORT_API_PARALLEL_FOR 17   /* KernelContext_ParallelFor */

#ifdef PNMIX_ORT_OFFICIAL_HEADER
#include <onnxruntime_c_api.h>
#else

#include <stddef.h>
#include <stdint.h>

/* The version of the declarations below: every slot through KernelInfo_GetConfigEntries (1.24). */
#define ORT_API_VERSION 24

#ifdef __cplusplus
extern "C" {
#define NO_EXCEPTION noexcept
#else
#define NO_EXCEPTION
#endif

#ifdef _WIN32
#define ORT_API_CALL __stdcall
#define ORTCHAR_T wchar_t
#else
#define ORT_API_CALL
#define ORTCHAR_T char
#endif
#define ORT_MUST_USE_RESULT __attribute__((warn_unused_result))

typedef enum ONNXTensorElementDataType {
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT16,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_STRING,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT32,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT64,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_COMPLEX64,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_COMPLEX128,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FN,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E4M3FNUZ,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E5M2,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E5M2FNUZ,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT4,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT4,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT4E2M1,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT2,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_INT2,
  ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT8E8M0
} ONNXTensorElementDataType;

typedef enum OrtLoggingLevel {
  ORT_LOGGING_LEVEL_VERBOSE,
  ORT_LOGGING_LEVEL_INFO,
  ORT_LOGGING_LEVEL_WARNING,
  ORT_LOGGING_LEVEL_ERROR,
  ORT_LOGGING_LEVEL_FATAL
} OrtLoggingLevel;

/* The codes through ORT_EP_FAIL (newer runtimes append more). */
typedef enum OrtErrorCode {
  ORT_OK,
  ORT_FAIL,
  ORT_INVALID_ARGUMENT,
  ORT_NO_SUCHFILE,
  ORT_NO_MODEL,
  ORT_ENGINE_ERROR,
  ORT_RUNTIME_EXCEPTION,
  ORT_INVALID_PROTOBUF,
  ORT_MODEL_LOADED,
  ORT_NOT_IMPLEMENTED,
  ORT_INVALID_GRAPH,
  ORT_EP_FAIL
} OrtErrorCode;

typedef enum GraphOptimizationLevel {
  ORT_DISABLE_ALL = 0,
  ORT_ENABLE_BASIC = 1,
  ORT_ENABLE_EXTENDED = 2,
  ORT_ENABLE_LAYOUT = 3,
  ORT_ENABLE_ALL = 99
} GraphOptimizationLevel;

typedef enum OrtAllocatorType {
  OrtInvalidAllocator = -1,
  OrtDeviceAllocator = 0,
  OrtArenaAllocator = 1,
  OrtReadOnlyAllocator = 2
} OrtAllocatorType;

typedef enum OrtMemType {
  OrtMemTypeCPUInput = -2,
  OrtMemTypeCPUOutput = -1,
  OrtMemTypeCPU = OrtMemTypeCPUOutput,
  OrtMemTypeDefault = 0
} OrtMemType;

typedef enum OrtCustomOpInputOutputCharacteristic {
  INPUT_OUTPUT_REQUIRED = 0,
  INPUT_OUTPUT_OPTIONAL,
  INPUT_OUTPUT_VARIADIC
} OrtCustomOpInputOutputCharacteristic;

#define ORT_RUNTIME_CLASS(X) \
  struct Ort##X;             \
  typedef struct Ort##X Ort##X

ORT_RUNTIME_CLASS(Env);
ORT_RUNTIME_CLASS(Status);
ORT_RUNTIME_CLASS(MemoryInfo);
ORT_RUNTIME_CLASS(Session);
ORT_RUNTIME_CLASS(Value);
ORT_RUNTIME_CLASS(RunOptions);
ORT_RUNTIME_CLASS(TypeInfo);
ORT_RUNTIME_CLASS(TensorTypeAndShapeInfo);
ORT_RUNTIME_CLASS(SessionOptions);
ORT_RUNTIME_CLASS(CustomOpDomain);
ORT_RUNTIME_CLASS(ModelMetadata);
ORT_RUNTIME_CLASS(KernelInfo);
ORT_RUNTIME_CLASS(KernelContext);
ORT_RUNTIME_CLASS(ShapeInferContext);
ORT_RUNTIME_CLASS(KeyValuePairs);
ORT_RUNTIME_CLASS(CustomOp);

typedef OrtStatus* OrtStatusPtr;

/* OrtAllocator's first members (the struct grew later; nothing here creates one). */
typedef struct OrtAllocator {
  uint32_t version;
  void*(ORT_API_CALL* Alloc)(struct OrtAllocator* this_, size_t size);
  void(ORT_API_CALL* Free)(struct OrtAllocator* this_, void* p);
  const struct OrtMemoryInfo*(ORT_API_CALL* Info)(const struct OrtAllocator* this_);
} OrtAllocator;

struct OrtApi;
typedef struct OrtApi OrtApi;

struct OrtApiBase {
  /* null when the runtime is older than `version` */
  const OrtApi*(ORT_API_CALL* GetApi)(uint32_t version) NO_EXCEPTION;
  const char*(ORT_API_CALL* GetVersionString)(void) NO_EXCEPTION;
};
typedef struct OrtApiBase OrtApiBase;

const OrtApiBase* ORT_API_CALL OrtGetApiBase(void) NO_EXCEPTION;

#define ORT_API2_STATUS(NAME, ...) OrtStatusPtr(ORT_API_CALL* NAME)(__VA_ARGS__) NO_EXCEPTION ORT_MUST_USE_RESULT
#define ORT_CLASS_RELEASE(X) void(ORT_API_CALL* Release##X)(Ort##X * input) NO_EXCEPTION

/* A slot nobody here calls: only its size and place matter. */
typedef void (*OrtUnusedSlot)(void);

/* The function table, slot for slot (numbers: the slot index). */
struct OrtApi {
  /*   0 */ OrtStatus*(ORT_API_CALL* CreateStatus)(OrtErrorCode code, const char* msg) NO_EXCEPTION;
  /*   1 */ OrtErrorCode(ORT_API_CALL* GetErrorCode)(const OrtStatus* status) NO_EXCEPTION;
  /*   2 */ const char*(ORT_API_CALL* GetErrorMessage)(const OrtStatus* status) NO_EXCEPTION;
  /*   3 */ ORT_API2_STATUS(CreateEnv, OrtLoggingLevel log_severity_level, const char* logid, OrtEnv** out);
  /*   4 */ OrtUnusedSlot CreateEnvWithCustomLogger;
  /*   5 */ OrtUnusedSlot EnableTelemetryEvents;
  /*   6 */ OrtUnusedSlot DisableTelemetryEvents;
  /*   7 */ ORT_API2_STATUS(CreateSession, const OrtEnv* env, const ORTCHAR_T* model_path, const OrtSessionOptions* options, OrtSession** out);
  /*   8 */ OrtUnusedSlot CreateSessionFromArray;
  /*   9 */ ORT_API2_STATUS(Run, OrtSession* session, const OrtRunOptions* run_options, const char* const* input_names, const OrtValue* const* inputs, size_t input_len, const char* const* output_names, size_t output_names_len, OrtValue** outputs);
  /*  10 */ ORT_API2_STATUS(CreateSessionOptions, OrtSessionOptions** options);
  /*  11 */ OrtUnusedSlot SetOptimizedModelFilePath;
  /*  12 */ OrtUnusedSlot CloneSessionOptions;
  /*  13 */ OrtUnusedSlot SetSessionExecutionMode;
  /*  14 */ OrtUnusedSlot EnableProfiling;
  /*  15 */ OrtUnusedSlot DisableProfiling;
  /*  16 */ OrtUnusedSlot EnableMemPattern;
  /*  17 */ OrtUnusedSlot DisableMemPattern;
  /*  18 */ OrtUnusedSlot EnableCpuMemArena;
  /*  19 */ OrtUnusedSlot DisableCpuMemArena;
  /*  20 */ OrtUnusedSlot SetSessionLogId;
  /*  21 */ OrtUnusedSlot SetSessionLogVerbosityLevel;
  /*  22 */ OrtUnusedSlot SetSessionLogSeverityLevel;
  /*  23 */ ORT_API2_STATUS(SetSessionGraphOptimizationLevel, OrtSessionOptions* options, GraphOptimizationLevel graph_optimization_level);
  /*  24 */ ORT_API2_STATUS(SetIntraOpNumThreads, OrtSessionOptions* options, int intra_op_num_threads);
  /*  25 */ OrtUnusedSlot SetInterOpNumThreads;
  /*  26 */ ORT_API2_STATUS(CreateCustomOpDomain, const char* domain, OrtCustomOpDomain** out);
  /*  27 */ ORT_API2_STATUS(CustomOpDomain_Add, OrtCustomOpDomain* custom_op_domain, const OrtCustomOp* op);
  /*  28 */ ORT_API2_STATUS(AddCustomOpDomain, OrtSessionOptions* options, OrtCustomOpDomain* custom_op_domain);
  /*  29 */ ORT_API2_STATUS(RegisterCustomOpsLibrary, OrtSessionOptions* options, const char* library_path, void** library_handle);
  /*  30 */ ORT_API2_STATUS(SessionGetInputCount, const OrtSession* session, size_t* out);
  /*  31 */ ORT_API2_STATUS(SessionGetOutputCount, const OrtSession* session, size_t* out);
  /*  32 */ OrtUnusedSlot SessionGetOverridableInitializerCount;
  /*  33 */ ORT_API2_STATUS(SessionGetInputTypeInfo, const OrtSession* session, size_t index, OrtTypeInfo** type_info);
  /*  34 */ ORT_API2_STATUS(SessionGetOutputTypeInfo, const OrtSession* session, size_t index, OrtTypeInfo** type_info);
  /*  35 */ OrtUnusedSlot SessionGetOverridableInitializerTypeInfo;
  /*  36 */ ORT_API2_STATUS(SessionGetInputName, const OrtSession* session, size_t index, OrtAllocator* allocator, char** value);
  /*  37 */ ORT_API2_STATUS(SessionGetOutputName, const OrtSession* session, size_t index, OrtAllocator* allocator, char** value);
  /*  38 */ OrtUnusedSlot SessionGetOverridableInitializerName;
  /*  39 */ OrtUnusedSlot CreateRunOptions;
  /*  40 */ OrtUnusedSlot RunOptionsSetRunLogVerbosityLevel;
  /*  41 */ OrtUnusedSlot RunOptionsSetRunLogSeverityLevel;
  /*  42 */ OrtUnusedSlot RunOptionsSetRunTag;
  /*  43 */ OrtUnusedSlot RunOptionsGetRunLogVerbosityLevel;
  /*  44 */ OrtUnusedSlot RunOptionsGetRunLogSeverityLevel;
  /*  45 */ OrtUnusedSlot RunOptionsGetRunTag;
  /*  46 */ OrtUnusedSlot RunOptionsSetTerminate;
  /*  47 */ OrtUnusedSlot RunOptionsUnsetTerminate;
  /*  48 */ ORT_API2_STATUS(CreateTensorAsOrtValue, OrtAllocator* allocator, const int64_t* shape, size_t shape_len, ONNXTensorElementDataType type, OrtValue** out);
  /*  49 */ ORT_API2_STATUS(CreateTensorWithDataAsOrtValue, const OrtMemoryInfo* info, void* p_data, size_t p_data_len, const int64_t* shape, size_t shape_len, ONNXTensorElementDataType type, OrtValue** out);
  /*  50 */ OrtUnusedSlot IsTensor;
  /*  51 */ ORT_API2_STATUS(GetTensorMutableData, OrtValue* value, void** out);
  /*  52 */ OrtUnusedSlot FillStringTensor;
  /*  53 */ OrtUnusedSlot GetStringTensorDataLength;
  /*  54 */ OrtUnusedSlot GetStringTensorContent;
  /*  55 */ ORT_API2_STATUS(CastTypeInfoToTensorInfo, const OrtTypeInfo* type_info, const OrtTensorTypeAndShapeInfo** out);
  /*  56 */ OrtUnusedSlot GetOnnxTypeFromTypeInfo;
  /*  57 */ OrtUnusedSlot CreateTensorTypeAndShapeInfo;
  /*  58 */ OrtUnusedSlot SetTensorElementType;
  /*  59 */ OrtUnusedSlot SetDimensions;
  /*  60 */ ORT_API2_STATUS(GetTensorElementType, const OrtTensorTypeAndShapeInfo* info, ONNXTensorElementDataType* out);
  /*  61 */ ORT_API2_STATUS(GetDimensionsCount, const OrtTensorTypeAndShapeInfo* info, size_t* out);
  /*  62 */ ORT_API2_STATUS(GetDimensions, const OrtTensorTypeAndShapeInfo* info, int64_t* dim_values, size_t dim_values_length);
  /*  63 */ OrtUnusedSlot GetSymbolicDimensions;
  /*  64 */ ORT_API2_STATUS(GetTensorShapeElementCount, const OrtTensorTypeAndShapeInfo* info, size_t* out);
  /*  65 */ ORT_API2_STATUS(GetTensorTypeAndShape, const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
  /*  66 */ OrtUnusedSlot GetTypeInfo;
  /*  67 */ OrtUnusedSlot GetValueType;
  /*  68 */ OrtUnusedSlot CreateMemoryInfo;
  /*  69 */ ORT_API2_STATUS(CreateCpuMemoryInfo, OrtAllocatorType type, OrtMemType mem_type, OrtMemoryInfo** out);
  /*  70 */ OrtUnusedSlot CompareMemoryInfo;
  /*  71 */ OrtUnusedSlot MemoryInfoGetName;
  /*  72 */ OrtUnusedSlot MemoryInfoGetId;
  /*  73 */ OrtUnusedSlot MemoryInfoGetMemType;
  /*  74 */ OrtUnusedSlot MemoryInfoGetType;
  /*  75 */ OrtUnusedSlot AllocatorAlloc;
  /*  76 */ ORT_API2_STATUS(AllocatorFree, OrtAllocator* ort_allocator, void* p);
  /*  77 */ OrtUnusedSlot AllocatorGetInfo;
  /*  78 */ ORT_API2_STATUS(GetAllocatorWithDefaultOptions, OrtAllocator** out);
  /*  79 */ OrtUnusedSlot AddFreeDimensionOverride;
  /*  80 */ OrtUnusedSlot GetValue;
  /*  81 */ OrtUnusedSlot GetValueCount;
  /*  82 */ OrtUnusedSlot CreateValue;
  /*  83 */ OrtUnusedSlot CreateOpaqueValue;
  /*  84 */ OrtUnusedSlot GetOpaqueValue;
  /*  85 */ ORT_API2_STATUS(KernelInfoGetAttribute_float, const OrtKernelInfo* info, const char* name, float* out);
  /*  86 */ ORT_API2_STATUS(KernelInfoGetAttribute_int64, const OrtKernelInfo* info, const char* name, int64_t* out);
  /*  87 */ ORT_API2_STATUS(KernelInfoGetAttribute_string, const OrtKernelInfo* info, const char* name, char* out, size_t* size);
  /*  88 */ ORT_API2_STATUS(KernelContext_GetInputCount, const OrtKernelContext* context, size_t* out);
  /*  89 */ ORT_API2_STATUS(KernelContext_GetOutputCount, const OrtKernelContext* context, size_t* out);
  /*  90 */ ORT_API2_STATUS(KernelContext_GetInput, const OrtKernelContext* context, size_t index, const OrtValue** out);
  /*  91 */ ORT_API2_STATUS(KernelContext_GetOutput, OrtKernelContext* context, size_t index, const int64_t* dim_values, size_t dim_count, OrtValue** out);
  /*  92 */ ORT_CLASS_RELEASE(Env);
  /*  93 */ ORT_CLASS_RELEASE(Status);
  /*  94 */ ORT_CLASS_RELEASE(MemoryInfo);
  /*  95 */ ORT_CLASS_RELEASE(Session);
  /*  96 */ ORT_CLASS_RELEASE(Value);
  /*  97 */ OrtUnusedSlot ReleaseRunOptions;
  /*  98 */ ORT_CLASS_RELEASE(TypeInfo);
  /*  99 */ ORT_CLASS_RELEASE(TensorTypeAndShapeInfo);
  /* 100 */ ORT_CLASS_RELEASE(SessionOptions);
  /* 101 */ ORT_CLASS_RELEASE(CustomOpDomain);
  /* 102 */ OrtUnusedSlot GetDenotationFromTypeInfo;
  /* 103 */ OrtUnusedSlot CastTypeInfoToMapTypeInfo;
  /* 104 */ OrtUnusedSlot CastTypeInfoToSequenceTypeInfo;
  /* 105 */ OrtUnusedSlot GetMapKeyType;
  /* 106 */ OrtUnusedSlot GetMapValueType;
  /* 107 */ OrtUnusedSlot GetSequenceElementType;
  /* 108 */ OrtUnusedSlot ReleaseMapTypeInfo;
  /* 109 */ OrtUnusedSlot ReleaseSequenceTypeInfo;
  /* 110 */ OrtUnusedSlot SessionEndProfiling;
  /* 111 */ ORT_API2_STATUS(SessionGetModelMetadata, const OrtSession* session, OrtModelMetadata** out);
  /* 112 */ OrtUnusedSlot ModelMetadataGetProducerName;
  /* 113 */ OrtUnusedSlot ModelMetadataGetGraphName;
  /* 114 */ OrtUnusedSlot ModelMetadataGetDomain;
  /* 115 */ OrtUnusedSlot ModelMetadataGetDescription;
  /* 116 */ ORT_API2_STATUS(ModelMetadataLookupCustomMetadataMap, const OrtModelMetadata* model_metadata, OrtAllocator* allocator, const char* key, char** value);
  /* 117 */ OrtUnusedSlot ModelMetadataGetVersion;
  /* 118 */ ORT_CLASS_RELEASE(ModelMetadata);
  /* 119 */ OrtUnusedSlot CreateEnvWithGlobalThreadPools;
  /* 120 */ OrtUnusedSlot DisablePerSessionThreads;
  /* 121 */ OrtUnusedSlot CreateThreadingOptions;
  /* 122 */ OrtUnusedSlot ReleaseThreadingOptions;
  /* 123 */ OrtUnusedSlot ModelMetadataGetCustomMetadataMapKeys;
  /* 124 */ OrtUnusedSlot AddFreeDimensionOverrideByName;
  /* 125 */ OrtUnusedSlot GetAvailableProviders;
  /* 126 */ OrtUnusedSlot ReleaseAvailableProviders;
  /* 127 */ OrtUnusedSlot GetStringTensorElementLength;
  /* 128 */ OrtUnusedSlot GetStringTensorElement;
  /* 129 */ OrtUnusedSlot FillStringTensorElement;
  /* 130 */ ORT_API2_STATUS(AddSessionConfigEntry, OrtSessionOptions* options, const char* config_key, const char* config_value);
  /* 131 */ OrtUnusedSlot CreateAllocator;
  /* 132 */ OrtUnusedSlot ReleaseAllocator;
  /* 133 */ OrtUnusedSlot RunWithBinding;
  /* 134 */ OrtUnusedSlot CreateIoBinding;
  /* 135 */ OrtUnusedSlot ReleaseIoBinding;
  /* 136 */ OrtUnusedSlot BindInput;
  /* 137 */ OrtUnusedSlot BindOutput;
  /* 138 */ OrtUnusedSlot BindOutputToDevice;
  /* 139 */ OrtUnusedSlot GetBoundOutputNames;
  /* 140 */ OrtUnusedSlot GetBoundOutputValues;
  /* 141 */ OrtUnusedSlot ClearBoundInputs;
  /* 142 */ OrtUnusedSlot ClearBoundOutputs;
  /* 143 */ OrtUnusedSlot TensorAt;
  /* 144 */ OrtUnusedSlot CreateAndRegisterAllocator;
  /* 145 */ OrtUnusedSlot SetLanguageProjection;
  /* 146 */ OrtUnusedSlot SessionGetProfilingStartTimeNs;
  /* 147 */ OrtUnusedSlot SetGlobalIntraOpNumThreads;
  /* 148 */ OrtUnusedSlot SetGlobalInterOpNumThreads;
  /* 149 */ OrtUnusedSlot SetGlobalSpinControl;
  /* 150 */ OrtUnusedSlot AddInitializer;
  /* 151 */ OrtUnusedSlot CreateEnvWithCustomLoggerAndGlobalThreadPools;
  /* 152 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_CUDA;
  /* 153 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_ROCM;
  /* 154 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_OpenVINO;
  /* 155 */ OrtUnusedSlot SetGlobalDenormalAsZero;
  /* 156 */ OrtUnusedSlot CreateArenaCfg;
  /* 157 */ OrtUnusedSlot ReleaseArenaCfg;
  /* 158 */ OrtUnusedSlot ModelMetadataGetGraphDescription;
  /* 159 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_TensorRT;
  /* 160 */ OrtUnusedSlot SetCurrentGpuDeviceId;
  /* 161 */ OrtUnusedSlot GetCurrentGpuDeviceId;
  /* 162 */ OrtUnusedSlot KernelInfoGetAttributeArray_float;
  /* 163 */ OrtUnusedSlot KernelInfoGetAttributeArray_int64;
  /* 164 */ OrtUnusedSlot CreateArenaCfgV2;
  /* 165 */ OrtUnusedSlot AddRunConfigEntry;
  /* 166 */ OrtUnusedSlot CreatePrepackedWeightsContainer;
  /* 167 */ OrtUnusedSlot ReleasePrepackedWeightsContainer;
  /* 168 */ OrtUnusedSlot CreateSessionWithPrepackedWeightsContainer;
  /* 169 */ OrtUnusedSlot CreateSessionFromArrayWithPrepackedWeightsContainer;
  /* 170 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_TensorRT_V2;
  /* 171 */ OrtUnusedSlot CreateTensorRTProviderOptions;
  /* 172 */ OrtUnusedSlot UpdateTensorRTProviderOptions;
  /* 173 */ OrtUnusedSlot GetTensorRTProviderOptionsAsString;
  /* 174 */ OrtUnusedSlot ReleaseTensorRTProviderOptions;
  /* 175 */ OrtUnusedSlot EnableOrtCustomOps;
  /* 176 */ OrtUnusedSlot RegisterAllocator;
  /* 177 */ OrtUnusedSlot UnregisterAllocator;
  /* 178 */ OrtUnusedSlot IsSparseTensor;
  /* 179 */ OrtUnusedSlot CreateSparseTensorAsOrtValue;
  /* 180 */ OrtUnusedSlot FillSparseTensorCoo;
  /* 181 */ OrtUnusedSlot FillSparseTensorCsr;
  /* 182 */ OrtUnusedSlot FillSparseTensorBlockSparse;
  /* 183 */ OrtUnusedSlot CreateSparseTensorWithValuesAsOrtValue;
  /* 184 */ OrtUnusedSlot UseCooIndices;
  /* 185 */ OrtUnusedSlot UseCsrIndices;
  /* 186 */ OrtUnusedSlot UseBlockSparseIndices;
  /* 187 */ OrtUnusedSlot GetSparseTensorFormat;
  /* 188 */ OrtUnusedSlot GetSparseTensorValuesTypeAndShape;
  /* 189 */ OrtUnusedSlot GetSparseTensorValues;
  /* 190 */ OrtUnusedSlot GetSparseTensorIndicesTypeShape;
  /* 191 */ OrtUnusedSlot GetSparseTensorIndices;
  /* 192 */ OrtUnusedSlot HasValue;
  /* 193 */ OrtUnusedSlot KernelContext_GetGPUComputeStream;
  /* 194 */ OrtUnusedSlot GetTensorMemoryInfo;
  /* 195 */ OrtUnusedSlot GetExecutionProviderApi;
  /* 196 */ OrtUnusedSlot SessionOptionsSetCustomCreateThreadFn;
  /* 197 */ OrtUnusedSlot SessionOptionsSetCustomThreadCreationOptions;
  /* 198 */ OrtUnusedSlot SessionOptionsSetCustomJoinThreadFn;
  /* 199 */ OrtUnusedSlot SetGlobalCustomCreateThreadFn;
  /* 200 */ OrtUnusedSlot SetGlobalCustomThreadCreationOptions;
  /* 201 */ OrtUnusedSlot SetGlobalCustomJoinThreadFn;
  /* 202 */ OrtUnusedSlot SynchronizeBoundInputs;
  /* 203 */ OrtUnusedSlot SynchronizeBoundOutputs;
  /* 204 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_CUDA_V2;
  /* 205 */ OrtUnusedSlot CreateCUDAProviderOptions;
  /* 206 */ OrtUnusedSlot UpdateCUDAProviderOptions;
  /* 207 */ OrtUnusedSlot GetCUDAProviderOptionsAsString;
  /* 208 */ OrtUnusedSlot ReleaseCUDAProviderOptions;
  /* 209 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_MIGraphX;
  /* 210 */ OrtUnusedSlot AddExternalInitializers;
  /* 211 */ OrtUnusedSlot CreateOpAttr;
  /* 212 */ OrtUnusedSlot ReleaseOpAttr;
  /* 213 */ OrtUnusedSlot CreateOp;
  /* 214 */ OrtUnusedSlot InvokeOp;
  /* 215 */ OrtUnusedSlot ReleaseOp;
  /* 216 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider;
  /* 217 */ OrtUnusedSlot CopyKernelInfo;
  /* 218 */ OrtUnusedSlot ReleaseKernelInfo;
  /* 219 */ OrtUnusedSlot GetTrainingApi;
  /* 220 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_CANN;
  /* 221 */ OrtUnusedSlot CreateCANNProviderOptions;
  /* 222 */ OrtUnusedSlot UpdateCANNProviderOptions;
  /* 223 */ OrtUnusedSlot GetCANNProviderOptionsAsString;
  /* 224 */ OrtUnusedSlot ReleaseCANNProviderOptions;
  /* 225 */ OrtUnusedSlot MemoryInfoGetDeviceType;
  /* 226 */ OrtUnusedSlot UpdateEnvWithCustomLogLevel;
  /* 227 */ OrtUnusedSlot SetGlobalIntraOpThreadAffinity;
  /* 228 */ ORT_API2_STATUS(RegisterCustomOpsLibrary_V2, OrtSessionOptions* options, const ORTCHAR_T* library_name);
  /* 229 */ OrtUnusedSlot RegisterCustomOpsUsingFunction;
  /* 230 */ OrtUnusedSlot KernelInfo_GetInputCount;
  /* 231 */ OrtUnusedSlot KernelInfo_GetOutputCount;
  /* 232 */ OrtUnusedSlot KernelInfo_GetInputName;
  /* 233 */ OrtUnusedSlot KernelInfo_GetOutputName;
  /* 234 */ OrtUnusedSlot KernelInfo_GetInputTypeInfo;
  /* 235 */ OrtUnusedSlot KernelInfo_GetOutputTypeInfo;
  /* 236 */ OrtUnusedSlot KernelInfoGetAttribute_tensor;
  /* 237 */ ORT_API2_STATUS(HasSessionConfigEntry, const OrtSessionOptions* options, const char* config_key, int* out);
  /* 238 */ ORT_API2_STATUS(GetSessionConfigEntry, const OrtSessionOptions* options, const char* config_key, char* config_value, size_t* size);
  /* 239 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_Dnnl;
  /* 240 */ OrtUnusedSlot CreateDnnlProviderOptions;
  /* 241 */ OrtUnusedSlot UpdateDnnlProviderOptions;
  /* 242 */ OrtUnusedSlot GetDnnlProviderOptionsAsString;
  /* 243 */ OrtUnusedSlot ReleaseDnnlProviderOptions;
  /* 244 */ OrtUnusedSlot KernelInfo_GetNodeName;
  /* 245 */ OrtUnusedSlot KernelInfo_GetLogger;
  /* 246 */ OrtUnusedSlot KernelContext_GetLogger;
  /* 247 */ OrtUnusedSlot Logger_LogMessage;
  /* 248 */ OrtUnusedSlot Logger_GetLoggingSeverityLevel;
  /* 249 */ OrtUnusedSlot KernelInfoGetConstantInput_tensor;
  /* 250 */ OrtUnusedSlot CastTypeInfoToOptionalTypeInfo;
  /* 251 */ OrtUnusedSlot GetOptionalContainedTypeInfo;
  /* 252 */ OrtUnusedSlot GetResizedStringTensorElementBuffer;
  /* 253 */ OrtUnusedSlot KernelContext_GetAllocator;
  /* 254 */ OrtUnusedSlot GetBuildInfoString;
  /* 255 */ OrtUnusedSlot CreateROCMProviderOptions;
  /* 256 */ OrtUnusedSlot UpdateROCMProviderOptions;
  /* 257 */ OrtUnusedSlot GetROCMProviderOptionsAsString;
  /* 258 */ OrtUnusedSlot ReleaseROCMProviderOptions;
  /* 259 */ OrtUnusedSlot CreateAndRegisterAllocatorV2;
  /* 260 */ OrtUnusedSlot RunAsync;
  /* 261 */ OrtUnusedSlot UpdateTensorRTProviderOptionsWithValue;
  /* 262 */ OrtUnusedSlot GetTensorRTProviderOptionsByName;
  /* 263 */ OrtUnusedSlot UpdateCUDAProviderOptionsWithValue;
  /* 264 */ OrtUnusedSlot GetCUDAProviderOptionsByName;
  /* 265 */ OrtUnusedSlot KernelContext_GetResource;
  /* 266 */ OrtUnusedSlot SetUserLoggingFunction;
  /* 267 */ OrtUnusedSlot ShapeInferContext_GetInputCount;
  /* 268 */ OrtUnusedSlot ShapeInferContext_GetInputTypeShape;
  /* 269 */ OrtUnusedSlot ShapeInferContext_GetAttribute;
  /* 270 */ OrtUnusedSlot ShapeInferContext_SetOutputTypeShape;
  /* 271 */ OrtUnusedSlot SetSymbolicDimensions;
  /* 272 */ OrtUnusedSlot ReadOpAttr;
  /* 273 */ OrtUnusedSlot SetDeterministicCompute;
  /* 274 */ ORT_API2_STATUS(KernelContext_ParallelFor, const OrtKernelContext* context, void (*fn)(void*, size_t), size_t total, size_t num_batch, void* usr_data);
  /* 275 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_OpenVINO_V2;
  /* 276 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_VitisAI;
  /* 277 */ OrtUnusedSlot KernelContext_GetScratchBuffer;
  /* 278 */ OrtUnusedSlot KernelInfoGetAllocator;
  /* 279 */ OrtUnusedSlot AddExternalInitializersFromFilesInMemory;
  /* 280 */ OrtUnusedSlot CreateLoraAdapter;
  /* 281 */ OrtUnusedSlot CreateLoraAdapterFromArray;
  /* 282 */ OrtUnusedSlot ReleaseLoraAdapter;
  /* 283 */ OrtUnusedSlot RunOptionsAddActiveLoraAdapter;
  /* 284 */ OrtUnusedSlot SetEpDynamicOptions;
  /* 285 */ OrtUnusedSlot ReleaseValueInfo;
  /* 286 */ OrtUnusedSlot ReleaseNode;
  /* 287 */ OrtUnusedSlot ReleaseGraph;
  /* 288 */ OrtUnusedSlot ReleaseModel;
  /* 289 */ OrtUnusedSlot GetValueInfoName;
  /* 290 */ OrtUnusedSlot GetValueInfoTypeInfo;
  /* 291 */ OrtUnusedSlot GetModelEditorApi;
  /* 292 */ OrtUnusedSlot CreateTensorWithDataAndDeleterAsOrtValue;
  /* 293 */ OrtUnusedSlot SessionOptionsSetLoadCancellationFlag;
  /* 294 */ OrtUnusedSlot GetCompileApi;
  /* 295 */ OrtUnusedSlot CreateKeyValuePairs;
  /* 296 */ OrtUnusedSlot AddKeyValuePair;
  /* 297 */ const char*(ORT_API_CALL* GetKeyValue)(const OrtKeyValuePairs* kvps, const char* key) NO_EXCEPTION;
  /* 298 */ OrtUnusedSlot GetKeyValuePairs;
  /* 299 */ OrtUnusedSlot RemoveKeyValuePair;
  /* 300 */ ORT_CLASS_RELEASE(KeyValuePairs);
  /* 301 */ OrtUnusedSlot RegisterExecutionProviderLibrary;
  /* 302 */ OrtUnusedSlot UnregisterExecutionProviderLibrary;
  /* 303 */ OrtUnusedSlot GetEpDevices;
  /* 304 */ OrtUnusedSlot SessionOptionsAppendExecutionProvider_V2;
  /* 305 */ OrtUnusedSlot SessionOptionsSetEpSelectionPolicy;
  /* 306 */ OrtUnusedSlot SessionOptionsSetEpSelectionPolicyDelegate;
  /* 307 */ OrtUnusedSlot HardwareDevice_Type;
  /* 308 */ OrtUnusedSlot HardwareDevice_VendorId;
  /* 309 */ OrtUnusedSlot HardwareDevice_Vendor;
  /* 310 */ OrtUnusedSlot HardwareDevice_DeviceId;
  /* 311 */ OrtUnusedSlot HardwareDevice_Metadata;
  /* 312 */ OrtUnusedSlot EpDevice_EpName;
  /* 313 */ OrtUnusedSlot EpDevice_EpVendor;
  /* 314 */ OrtUnusedSlot EpDevice_EpMetadata;
  /* 315 */ OrtUnusedSlot EpDevice_EpOptions;
  /* 316 */ OrtUnusedSlot EpDevice_Device;
  /* 317 */ OrtUnusedSlot GetEpApi;
  /* 318 */ OrtUnusedSlot GetTensorSizeInBytes;
  /* 319 */ OrtUnusedSlot AllocatorGetStats;
  /* 320 */ OrtUnusedSlot CreateMemoryInfo_V2;
  /* 321 */ OrtUnusedSlot MemoryInfoGetDeviceMemType;
  /* 322 */ OrtUnusedSlot MemoryInfoGetVendorId;
  /* 323 */ OrtUnusedSlot ValueInfo_GetValueProducer;
  /* 324 */ OrtUnusedSlot ValueInfo_GetValueNumConsumers;
  /* 325 */ OrtUnusedSlot ValueInfo_GetValueConsumers;
  /* 326 */ OrtUnusedSlot ValueInfo_GetInitializerValue;
  /* 327 */ OrtUnusedSlot ValueInfo_GetExternalInitializerInfo;
  /* 328 */ OrtUnusedSlot ValueInfo_IsRequiredGraphInput;
  /* 329 */ OrtUnusedSlot ValueInfo_IsOptionalGraphInput;
  /* 330 */ OrtUnusedSlot ValueInfo_IsGraphOutput;
  /* 331 */ OrtUnusedSlot ValueInfo_IsConstantInitializer;
  /* 332 */ OrtUnusedSlot ValueInfo_IsFromOuterScope;
  /* 333 */ OrtUnusedSlot Graph_GetName;
  /* 334 */ OrtUnusedSlot Graph_GetModelPath;
  /* 335 */ OrtUnusedSlot Graph_GetOnnxIRVersion;
  /* 336 */ OrtUnusedSlot Graph_GetNumOperatorSets;
  /* 337 */ OrtUnusedSlot Graph_GetOperatorSets;
  /* 338 */ OrtUnusedSlot Graph_GetNumInputs;
  /* 339 */ OrtUnusedSlot Graph_GetInputs;
  /* 340 */ OrtUnusedSlot Graph_GetNumOutputs;
  /* 341 */ OrtUnusedSlot Graph_GetOutputs;
  /* 342 */ OrtUnusedSlot Graph_GetNumInitializers;
  /* 343 */ OrtUnusedSlot Graph_GetInitializers;
  /* 344 */ OrtUnusedSlot Graph_GetNumNodes;
  /* 345 */ OrtUnusedSlot Graph_GetNodes;
  /* 346 */ OrtUnusedSlot Graph_GetParentNode;
  /* 347 */ OrtUnusedSlot Graph_GetGraphView;
  /* 348 */ OrtUnusedSlot Node_GetId;
  /* 349 */ OrtUnusedSlot Node_GetName;
  /* 350 */ OrtUnusedSlot Node_GetOperatorType;
  /* 351 */ OrtUnusedSlot Node_GetDomain;
  /* 352 */ OrtUnusedSlot Node_GetSinceVersion;
  /* 353 */ OrtUnusedSlot Node_GetNumInputs;
  /* 354 */ OrtUnusedSlot Node_GetInputs;
  /* 355 */ OrtUnusedSlot Node_GetNumOutputs;
  /* 356 */ OrtUnusedSlot Node_GetOutputs;
  /* 357 */ OrtUnusedSlot Node_GetNumImplicitInputs;
  /* 358 */ OrtUnusedSlot Node_GetImplicitInputs;
  /* 359 */ OrtUnusedSlot Node_GetNumAttributes;
  /* 360 */ OrtUnusedSlot Node_GetAttributes;
  /* 361 */ OrtUnusedSlot Node_GetAttributeByName;
  /* 362 */ OrtUnusedSlot OpAttr_GetTensorAttributeAsOrtValue;
  /* 363 */ OrtUnusedSlot OpAttr_GetType;
  /* 364 */ OrtUnusedSlot OpAttr_GetName;
  /* 365 */ OrtUnusedSlot Node_GetNumSubgraphs;
  /* 366 */ OrtUnusedSlot Node_GetSubgraphs;
  /* 367 */ OrtUnusedSlot Node_GetGraph;
  /* 368 */ OrtUnusedSlot Node_GetEpName;
  /* 369 */ OrtUnusedSlot ReleaseExternalInitializerInfo;
  /* 370 */ OrtUnusedSlot ExternalInitializerInfo_GetFilePath;
  /* 371 */ OrtUnusedSlot ExternalInitializerInfo_GetFileOffset;
  /* 372 */ OrtUnusedSlot ExternalInitializerInfo_GetByteSize;
  /* 373 */ OrtUnusedSlot GetRunConfigEntry;
  /* 374 */ OrtUnusedSlot EpDevice_MemoryInfo;
  /* 375 */ OrtUnusedSlot CreateSharedAllocator;
  /* 376 */ OrtUnusedSlot GetSharedAllocator;
  /* 377 */ OrtUnusedSlot ReleaseSharedAllocator;
  /* 378 */ OrtUnusedSlot GetTensorData;
  /* 379 */ OrtUnusedSlot GetSessionOptionsConfigEntries;
  /* 380 */ OrtUnusedSlot SessionGetMemoryInfoForInputs;
  /* 381 */ OrtUnusedSlot SessionGetMemoryInfoForOutputs;
  /* 382 */ OrtUnusedSlot SessionGetEpDeviceForInputs;
  /* 383 */ OrtUnusedSlot CreateSyncStreamForEpDevice;
  /* 384 */ OrtUnusedSlot SyncStream_GetHandle;
  /* 385 */ OrtUnusedSlot ReleaseSyncStream;
  /* 386 */ OrtUnusedSlot CopyTensors;
  /* 387 */ OrtUnusedSlot Graph_GetModelMetadata;
  /* 388 */ OrtUnusedSlot GetModelCompatibilityForEpDevices;
  /* 389 */ OrtUnusedSlot CreateExternalInitializerInfo;
  /* 390 */ OrtUnusedSlot TensorTypeAndShape_HasShape;
  /* 391 */ ORT_API2_STATUS(KernelInfo_GetConfigEntries, const OrtKernelInfo* info, OrtKeyValuePairs** out);
};

/* A custom op, field for field. The runtime reads a field only when `version` is at least the
 * API version that introduced it (noted on the right). */
struct OrtCustomOp {
  uint32_t version;
  void*(ORT_API_CALL* CreateKernel)(const struct OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char*(ORT_API_CALL* GetName)(const struct OrtCustomOp* op);
  const char*(ORT_API_CALL* GetExecutionProviderType)(const struct OrtCustomOp* op);
  ONNXTensorElementDataType(ORT_API_CALL* GetInputType)(const struct OrtCustomOp* op, size_t index);
  size_t(ORT_API_CALL* GetInputTypeCount)(const struct OrtCustomOp* op);
  ONNXTensorElementDataType(ORT_API_CALL* GetOutputType)(const struct OrtCustomOp* op, size_t index);
  size_t(ORT_API_CALL* GetOutputTypeCount)(const struct OrtCustomOp* op);
  void(ORT_API_CALL* KernelCompute)(void* op_kernel, OrtKernelContext* context);
  void(ORT_API_CALL* KernelDestroy)(void* op_kernel);
  OrtCustomOpInputOutputCharacteristic(ORT_API_CALL* GetInputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  OrtCustomOpInputOutputCharacteristic(ORT_API_CALL* GetOutputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  OrtMemType(ORT_API_CALL* GetInputMemoryType)(const struct OrtCustomOp* op, size_t index);  /* 13 */
  int(ORT_API_CALL* GetVariadicInputMinArity)(const struct OrtCustomOp* op);                 /* 14 */
  int(ORT_API_CALL* GetVariadicInputHomogeneity)(const struct OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicOutputMinArity)(const struct OrtCustomOp* op);
  int(ORT_API_CALL* GetVariadicOutputHomogeneity)(const struct OrtCustomOp* op);
  OrtStatusPtr(ORT_API_CALL* CreateKernelV2)(const struct OrtCustomOp* op, const OrtApi* api,  /* 16 */
                                             const OrtKernelInfo* info, void** kernel);
  OrtStatusPtr(ORT_API_CALL* KernelComputeV2)(void* op_kernel, OrtKernelContext* context);     /* 16 */
  OrtStatusPtr(ORT_API_CALL* InferOutputShapeFn)(const struct OrtCustomOp* op, OrtShapeInferContext*); /* 17 */
  int(ORT_API_CALL* GetStartVersion)(const struct OrtCustomOp* op);                          /* 17 */
  int(ORT_API_CALL* GetEndVersion)(const struct OrtCustomOp* op);
  size_t(ORT_API_CALL* GetMayInplace)(int** input_index, int** output_index);                /* 18 */
  void(ORT_API_CALL* ReleaseMayInplace)(int* input_index, int* output_index);
  size_t(ORT_API_CALL* GetAliasMap)(int** input_index, int** output_index);                  /* 20 */
  void(ORT_API_CALL* ReleaseAliasMap)(int* input_index, int* output_index);
};

#ifdef __cplusplus
}
#endif

#endif /* PNMIX_ORT_OFFICIAL_HEADER */

/* Every OrtApi slot either pnmix file calls, for the offset check (plugins/ort/abi_offsets.cc). */
#define PNMIX_ORT_CALLED_SLOTS(X) \
  X(CreateStatus) \
  X(GetErrorCode) \
  X(GetErrorMessage) \
  X(CreateEnv) \
  X(CreateSession) \
  X(Run) \
  X(CreateSessionOptions) \
  X(SetSessionGraphOptimizationLevel) \
  X(SetIntraOpNumThreads) \
  X(CreateCustomOpDomain) \
  X(CustomOpDomain_Add) \
  X(AddCustomOpDomain) \
  X(RegisterCustomOpsLibrary) \
  X(SessionGetInputCount) \
  X(SessionGetOutputCount) \
  X(SessionGetInputTypeInfo) \
  X(SessionGetOutputTypeInfo) \
  X(SessionGetInputName) \
  X(SessionGetOutputName) \
  X(CreateTensorAsOrtValue) \
  X(CreateTensorWithDataAsOrtValue) \
  X(GetTensorMutableData) \
  X(CastTypeInfoToTensorInfo) \
  X(GetTensorElementType) \
  X(GetDimensionsCount) \
  X(GetDimensions) \
  X(GetTensorShapeElementCount) \
  X(GetTensorTypeAndShape) \
  X(CreateCpuMemoryInfo) \
  X(AllocatorFree) \
  X(GetAllocatorWithDefaultOptions) \
  X(KernelInfoGetAttribute_float) \
  X(KernelInfoGetAttribute_int64) \
  X(KernelInfoGetAttribute_string) \
  X(KernelContext_GetInputCount) \
  X(KernelContext_GetOutputCount) \
  X(KernelContext_GetInput) \
  X(KernelContext_GetOutput) \
  X(ReleaseEnv) \
  X(ReleaseStatus) \
  X(ReleaseMemoryInfo) \
  X(ReleaseSession) \
  X(ReleaseValue) \
  X(ReleaseTypeInfo) \
  X(ReleaseTensorTypeAndShapeInfo) \
  X(ReleaseSessionOptions) \
  X(ReleaseCustomOpDomain) \
  X(SessionGetModelMetadata) \
  X(ModelMetadataLookupCustomMetadataMap) \
  X(ReleaseModelMetadata) \
  X(AddSessionConfigEntry) \
  X(RegisterCustomOpsLibrary_V2) \
  X(HasSessionConfigEntry) \
  X(GetSessionConfigEntry) \
  X(GetKeyValue) \
  X(KernelContext_ParallelFor) \
  X(ReleaseKeyValuePairs) \
  X(KernelInfo_GetConfigEntries)

#endif /* PNMIX_ORT_C_API_H */
