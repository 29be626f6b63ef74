/* The portable variant of decode attention (built for any x86-64): no vector decoder, so
 * every shape takes the loops of cpu_attention.c. */
#include "cpu_attention.h"

int vec_decode_takes(int G, int D, int block_size) {
    (void)G, (void)D, (void)block_size;
    return 0;
}

/* Never called: vec_decode_takes takes no shape. */
void vec_decode_sequence(const decode_call* call, int s, float* scores, int64_t stride_g,
                         float* work) {
    (void)call, (void)s, (void)scores, (void)stride_g, (void)work;
}

void vec_decode_head(const decode_call* call, int s, int hk, float* scores, int64_t stride_g,
                     float* work) {
    (void)call, (void)s, (void)hk, (void)scores, (void)stride_g, (void)work;
}
