// The AVX2 + FMA + F16C build of the attention kernel (compiled with those flags, called only
// when cpuid reports them).
#define PNMIX_W 8
#define PNMIX_ITEM_FN attend_item_avx2
#include "attend_kernel.inc"
