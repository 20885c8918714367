/* BAM attention on CPU in fused tiles (kernels/bam_attention_cpu.py): a query block of ROWS rows meets
 * its keys KEYS at a time, and each tile's products, prior, masks and softmax stay in the core's
 * caches; nothing of size N x N, nor a block x N slab, is ever written. The forward keeps a running
 * max and sum per row (online softmax) and returns the output, both, and the key of each row's max; the backward
 * recomputes each tile from them and sums the gradients of the keys and values over the query
 * blocks, those of the queries over the key blocks, and the prior's gradient along anti-diagonals.
 *
 * Layout: a tile is held transposed, t[c * ROWS + r] for key c and query row r, so that every loop
 * over a tile runs along its ROWS rows with a constant trip count (the compiler's vectors): the
 * logits as key-row by query-column products (keys against the block's transposed queries), the
 * prior as the row vector table[N - 1 - j + i] (contiguous in i for a key j), the masks as compares
 * with the rows' first keys. Products summed over a tile's rows (dK, dV) run along the head
 * dimension instead; fp32 is compiled for D = 32, 64 and 128 as constants (any other D, and fp64,
 * take the same code with D known at run time only).
 *
 * Arguments: q (the queries times scale and SSMax's factor), k, v, out, dq, dk, dv are (B·H, N, D)
 * row-major; stats (B·H, N, 2) each row's logit max and log of its sum, top (B·H, N) the key of that max,
 * delta and rowsum (B·H, N); lo[b * lo_b + i] the first key row i may see (causal, window and
 * documents: row i sees keys lo_i .. i), kstart[b * ks_b + blk] the first key any row of query block
 * blk sees; prior (or NULL) a table per head (stride prior_h) of the prior at offset m = N - 1 - (j - i),
 * ROWS entries longer than 2N - 1 (the last block's padding rows read it); pscale[b * ps_b + h * ps_h
 * + i] multiplies the prior (SSMax's c_i; NULL for 1), wscale[b * ws_b + h * ws_h + i] weights the prior's
 * gradient sums (NULL for 1); sums (B·H, stride sums_bh) receive them at the table's offsets.
 */
/* The exp and prior loops below are left to the compiler's vectoriser, which GCC keeps to 256-bit
 * vectors by default even where 512-bit ones exist: the wider ones took the backward at 1 x 2,048
 * tokens, 4 heads of 32, from 13.8 to 12.0 ms (a scratch timing beside tools/bench_cpu_attention.py). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#pragma GCC target("prefer-vector-width=512")
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 64 /* query rows per block: 4 AVX-512 vectors of fp32, 8 AVX2 ones */
#define KEYS 64 /* keys per tile */
const int64_t tile_rows = ROWS;

/* exp(x) for x <= 0, exactly 0 below `floor` (where the float type's normal range ends: what the
 * flushed denormals of configure_cpu would give). glibc's vector exp takes a scalar slow path for any
 * lane outside its range, and a prior's far keys put most lanes there: the clamp keeps every lane in. */
#define EXP_OR_ZERO(EXP, x, floor) ((x) < (floor) ? 0 : EXP((x) < (floor) ? (floor) : (x)))

#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* The tile's products run on the compiler's vector types (GCC/Clang vector extensions) so that their
 * sums stay in registers; written as plain loops over arrays they went through the stack. The vectors
 * are the machine's own width: wider ones, split by the compiler, ran 35x slower on AVX2. NACC: the
 * sums a product keeps in flight, half the vector registers (or all of SSE's and AVX2's 16, less what
 * the operands need). */
#if defined(__AVX512F__)
#define VBYTES 64
#define NACC 16
#elif defined(__AVX__)
#define VBYTES 32
#define NACC 8
#else
#define VBYTES 16
#define NACC 8
#endif

const int64_t vector_bytes = VBYTES; /* read by kernels/dispatch.py */

/* Each kernel is written once, as plain C over an element type T and a head width KD, in
 * bam_attention_cpu_impl.h, and compiled once per (type, width) pair by including it with the pair's
 * definitions (that header lists them). The exported entry points: fp32 (training's) with the head
 * widths 32, 64 and 128 compiled as constants, any other at run time; fp64 (the tests' oracle runs)
 * at run time only. NEG marks a masked logit: below any real one (the prior is capped near -1e26 by
 * EXP_CAP). */
#define T float
#define EXP expf
#define LOG logf
#define FLOOR -87.0f
#define NEG -1e37f

#define KD 32
#define NAME(x) x##_f32_32
#include "bam_attention_cpu_impl.h"
#undef KD
#undef NAME

#define KD 64
#define NAME(x) x##_f32_64
#include "bam_attention_cpu_impl.h"
#undef KD
#undef NAME

#define KD 128
#define NAME(x) x##_f32_128
#include "bam_attention_cpu_impl.h"
#undef KD
#undef NAME

#define KD D /* known at run time only: the functions' argument D */
#define NAME(x) x##_f32_any
#include "bam_attention_cpu_impl.h"
#undef KD
#undef NAME

void flash_forward_f32(const T *q, const T *k, const T *v, T *out, T *stats, int64_t *top, const T *prior,
                       int64_t prior_h, const T *pscale, int64_t ps_b, int64_t ps_h, const int64_t *lo, int64_t lo_b,
                       const int64_t *kstart, int64_t ks_b, int64_t B, int64_t H, int64_t N, int64_t D) {
    typeof(forward_f32_any) *forward = D == 32    ? forward_f32_32
                                       : D == 64  ? forward_f32_64
                                       : D == 128 ? forward_f32_128
                                                  : forward_f32_any;
    forward(q, k, v, out, stats, top, prior, prior_h, pscale, ps_b, ps_h, lo, lo_b, kstart, ks_b, B, H, N, D);
}

void flash_backward_f32(const T *q, const T *k, const T *v, const T *dout, const T *stats, const int64_t *top,
                        const T *delta, T *dq, T *rowsum, T *dk, T *dv, const T *prior, int64_t prior_h,
                        const T *pscale, int64_t ps_b, int64_t ps_h, const T *wscale, int64_t ws_b, int64_t ws_h,
                        T *sums, int64_t sums_bh, const int64_t *lo, int64_t lo_b, const int64_t *kstart, int64_t ks_b,
                        int64_t B, int64_t H, int64_t N, int64_t D) {
    typeof(backward_f32_any) *backward = D == 32    ? backward_f32_32
                                         : D == 64  ? backward_f32_64
                                         : D == 128 ? backward_f32_128
                                                    : backward_f32_any;
    backward(q, k, v, dout, stats, top, delta, dq, rowsum, dk, dv, prior, prior_h, pscale, ps_b, ps_h, wscale, ws_b,
             ws_h, sums, sums_bh, lo, lo_b, kstart, ks_b, B, H, N, D);
}

#undef T
#undef EXP
#undef LOG
#undef FLOOR
#undef NEG

#define T double
#define EXP exp
#define LOG log
#define FLOOR -708.0
#define NEG -1e300

#define KD D /* known at run time only: the functions' argument D */
#define NAME(x) x##_f64_any
#include "bam_attention_cpu_impl.h"
#undef KD
#undef NAME

void flash_forward_f64(const T *q, const T *k, const T *v, T *out, T *stats, int64_t *top, const T *prior,
                       int64_t prior_h, const T *pscale, int64_t ps_b, int64_t ps_h, const int64_t *lo, int64_t lo_b,
                       const int64_t *kstart, int64_t ks_b, int64_t B, int64_t H, int64_t N, int64_t D) {
    forward_f64_any(q, k, v, out, stats, top, prior, prior_h, pscale, ps_b, ps_h, lo, lo_b, kstart, ks_b, B, H, N, D);
}

void flash_backward_f64(const T *q, const T *k, const T *v, const T *dout, const T *stats, const int64_t *top,
                        const T *delta, T *dq, T *rowsum, T *dk, T *dv, const T *prior, int64_t prior_h,
                        const T *pscale, int64_t ps_b, int64_t ps_h, const T *wscale, int64_t ws_b, int64_t ws_h,
                        T *sums, int64_t sums_bh, const int64_t *lo, int64_t lo_b, const int64_t *kstart, int64_t ks_b,
                        int64_t B, int64_t H, int64_t N, int64_t D) {
    backward_f64_any(q, k, v, dout, stats, top, delta, dq, rowsum, dk, dv, prior, prior_h, pscale, ps_b, ps_h, wscale,
                     ws_b, ws_h, sums, sums_bh, lo, lo_b, kstart, ks_b, B, H, N, D);
}
