// plugins/ort/abi_offsets.cc: prints offsetof(OrtApi, X) for every slot pnmix calls
// (PNMIX_ORT_CALLED_SLOTS), OrtCustomOp's field offsets and sizeof(OrtCustomOp), one "name offset"
// per line. Built twice: against ort_c_api.h's own declarations (pnmix_ort_abi_ours) and, with
// -DONNXRUNTIME_INCLUDE_DIR, against the official header (pnmix_ort_abi_official);
// tests/backends/test_ort_abi.py compares the two outputs.
#include <stddef.h>
#include <stdio.h>

#include "ort_c_api.h"

int main() {
#define PNMIX_X(slot) printf("OrtApi.%s %zu\n", #slot, offsetof(OrtApi, slot));
  PNMIX_ORT_CALLED_SLOTS(PNMIX_X)
#undef PNMIX_X
#define PNMIX_F(field) printf("OrtCustomOp.%s %zu\n", #field, offsetof(OrtCustomOp, field));
  PNMIX_F(version) PNMIX_F(CreateKernel) PNMIX_F(GetName) PNMIX_F(GetExecutionProviderType) PNMIX_F(GetInputType)
  PNMIX_F(GetInputTypeCount) PNMIX_F(GetOutputType) PNMIX_F(GetOutputTypeCount) PNMIX_F(KernelCompute)
  PNMIX_F(KernelDestroy) PNMIX_F(GetInputCharacteristic) PNMIX_F(GetOutputCharacteristic) PNMIX_F(GetInputMemoryType)
  PNMIX_F(GetVariadicInputMinArity) PNMIX_F(GetVariadicInputHomogeneity) PNMIX_F(GetVariadicOutputMinArity)
  PNMIX_F(GetVariadicOutputHomogeneity) PNMIX_F(CreateKernelV2) PNMIX_F(KernelComputeV2) PNMIX_F(InferOutputShapeFn)
  PNMIX_F(GetStartVersion) PNMIX_F(GetEndVersion) PNMIX_F(GetMayInplace) PNMIX_F(ReleaseMayInplace)
  PNMIX_F(GetAliasMap) PNMIX_F(ReleaseAliasMap)
#undef PNMIX_F
  printf("sizeof.OrtCustomOp %zu\n", sizeof(OrtCustomOp));
  printf("sizeof.OrtApiBase %zu\n", sizeof(OrtApiBase));
  return 0;
}
