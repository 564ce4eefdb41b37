/* The paged attention kernel over an fp16 cache: paged_attention.c again, with KV_HALF. */
#define KV_HALF 1
#include "paged_attention.c"
