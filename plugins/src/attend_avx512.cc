// The AVX-512 build of the attention kernel (16 lanes; called only when cpuid reports AVX-512F/BW/VL
// and the group size is a multiple of 16).
#define PNMIX_W 16
#define PNMIX_ITEM_FN attend_item_avx512
#include "attend_kernel.inc"
