// The AVX-512 + VBMI build of the attention kernel: as attend_avx512.cc, with codes of 3..8 bits
// unpacked by one byte multishift (called only when cpuid reports AVX512_VBMI too).
#define PNMIX_W 16
#define PNMIX_ITEM_FN attend_item_avx512vbmi
#include "attend_kernel.inc"
