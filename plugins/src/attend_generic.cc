// The portable build of the attention kernel (baseline instruction set, 8-lane vectors).
#define PNMIX_W 8
#define PNMIX_ITEM_FN attend_item_generic
#include "attend_kernel.inc"
