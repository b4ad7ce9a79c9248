// The AVX-512 + VBMI + VNNI build of the attention kernel: as attend_avx512vbmi.cc for the fp32
// path; its integer path (attend_int8.inc) multiplies four codes per 32-bit lane with vpdpbusd
// (called only when cpuid reports AVX512_VNNI too).
#define PNMIX_W 16
#define PNMIX_ITEM_FN attend_item_avx512vnni
#include "attend_kernel.inc"
