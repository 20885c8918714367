/* BAM attention on CPU in fused tiles (kernels/bam_attention_cpu.py): a query block of ROWS rows meets
 * its keys KEYS at a time, and each tile's products, prior, masks and softmax stay in the core's
 * caches; nothing of size N x N, nor a block x N slab, is ever written. The forward keeps a running
 * max and sum per row (online softmax) and returns the output and each row's logsumexp; the backward
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
 * row-major; lse, delta (B·H, N); lo[b * lo_b + i] the first key row i may see (causal, window and
 * documents: row i sees keys lo_i .. i), kstart[b * ks_b + blk] the first key any row of query block
 * blk sees; prior (or NULL) a table per head (stride prior_h) of the prior at offset m = N - 1 - (j - i),
 * ROWS entries longer than 2N - 1 (the last block's padding rows read it); pscale[b * ps_b + h * ps_h
 * + i] multiplies the prior (SSMax's c_i; NULL for 1), wscale[b * ws_b + i] weights the prior's
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

/* One query block's shared set-up: rows qs .. qs + R - 1 of head bh, R <= ROWS; padding rows (r >= R)
 * see no key and read zeros. */
#define BLOCK_SETUP(T, KD)                                                                                  \
    const int64_t b = bh / H, h = bh % H, qs = blk * ROWS, R = MIN(ROWS, N - qs);                      \
    const int64_t ks = kstart[b * ks_b + blk], ke = qs + R;                                            \
    int64_t lor[ROWS];                                                                                 \
    T a[ROWS];                                                                                         \
    for (int64_t r = 0; r < ROWS; r++) {                                                               \
        lor[r] = r < R ? lo[b * lo_b + qs + r] : INT64_MAX / 2;                                        \
        a[r] = r >= R ? 0 : pscale ? pscale[b * ps_b + h * ps_h + qs + r] : 1;                         \
    }                                                                                                  \
    for (int64_t d = 0; d < KD; d++)                                                                   \
        for (int64_t r = 0; r < ROWS; r++) qt[d * ROWS + r] = r < R ? q[(bh * N + qs + r) * D + d] : 0;

/* The tile's products run on the compiler's vector types (GCC/Clang vector extensions) so that their
 * sums stay in registers; written as plain loops over arrays they went through the stack. The vectors
 * are the machine's own width: wider ones, split by the compiler, ran 35x slower on AVX2. NACC: the
 * sums a product keeps in flight, half the vector registers (or all of SSE's and AVX2's 16, less what
 * the operands need). V: VL values; a row vector of a tile is NV of them. */
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

#define DEFINE_PRODUCTS(T, SUF)                                                                          \
    typedef T V_##SUF __attribute__((vector_size(VBYTES)));                                              \
    typedef T VU_##SUF __attribute__((vector_size(VBYTES), aligned(sizeof(T)))); /* unaligned */         \
    enum { VL_##SUF = VBYTES / sizeof(T), NV_##SUF = ROWS / VL_##SUF };                                  \
    /* keys (or columns) per pass of the row-vector products: NACC sums, at least one row vector */      \
    enum { U_##SUF = NACC / NV_##SUF > 0 ? NACC / NV_##SUF : 1 };                                        \
                                                                                                         \
    /* out[u] = (add ? out[u] : 0) + sum_{i < count} x[i * xi + u * xu] * rows[i], for u < U: U row \
     * vectors (ROWS apart) as sums of row vectors times scalars. The logits: keys c0.. against the   \
     * transposed queries (rows qt[d], x = k); a tile times values: output columns d0.. (rows pt[c], x = v). */ \
    static inline __attribute__((always_inline)) void row_products_##SUF(T *out, int add, const T *rows,  \
                                                                      int64_t count, const T *x,        \
                                                                      int64_t xi, int64_t xu, int U) {  \
        V_##SUF s[4][NV_##SUF];                                                                          \
        for (int u = 0; u < U; u++)                                                                      \
            for (int w = 0; w < NV_##SUF; w++) s[u][w] = add ? ((V_##SUF *)(out + u * ROWS))[w] : (V_##SUF){0}; \
        for (int64_t i = 0; i < count; i++) {                                                            \
            const V_##SUF *rv = (const V_##SUF *)(rows + i * ROWS);                                      \
            for (int u = 0; u < U; u++) {                                                                \
                const T c = x[i * xi + u * xu];                                                          \
                for (int w = 0; w < NV_##SUF; w++) s[u][w] += c * rv[w];                                 \
            }                                                                                            \
        }                                                                                                \
        for (int u = 0; u < U; u++)                                                                      \
            for (int w = 0; w < NV_##SUF; w++) ((V_##SUF *)(out + u * ROWS))[w] = s[u][w];               \
    }                                                                                                    \
                                                                                                         \
    /* acc[c][:] += sum_{r < R} t[c][r] * x[r][:] for keys c0 .. c0 + U - 1, along the head dimension  \
     * (DV vectors: D = DV·VL) */                                                                      \
    static inline __attribute__((always_inline)) void rows_sum_v_##SUF(T *acc, const T *t, const T *x, \
                                                                    int64_t DV, int64_t R, int64_t c0, \
                                                                    int U) {                           \
        V_##SUF s[8][16];                                                                                \
        for (int u = 0; u < U; u++)                                                                      \
            for (int64_t e = 0; e < DV; e++) s[u][e] = (V_##SUF){0};                                     \
        for (int64_t r = 0; r < R; r++) {                                                                \
            const VU_##SUF *xr = (const VU_##SUF *)(x + r * DV * VL_##SUF);                              \
            for (int u = 0; u < U; u++) {                                                                \
                const T w = t[(c0 + u) * ROWS + r];                                                      \
                for (int64_t e = 0; e < DV; e++) s[u][e] += w * xr[e];                                   \
            }                                                                                            \
        }                                                                                                \
        for (int u = 0; u < U; u++) {                                                                    \
            VU_##SUF *a = (VU_##SUF *)(acc + (c0 + u) * DV * VL_##SUF);                                  \
            for (int64_t e = 0; e < DV; e++) a[e] += s[u][e];                                            \
        }                                                                                                \
    }

#define DEFINE_FLASH(T, EXP, LOG, FLOOR, NEG, SUF, DN, KD)                                                \
    /* st[c] = the logits of key kb + c against the block's rows (rows of a key-major tile), plus the \
     * prior, NEG where masked (when `mask`); n keys. */                                               \
    static void logits_##SUF##_##DN(T *st, const T *qt, const T *k, const T *prior, const T *a,        \
                                    const int64_t *lor, int64_t N, int64_t D, int64_t qs, int64_t R,    \
                                    int64_t kb, int64_t n, int mask) {                                 \
        enum { U = U_##SUF };                                                                          \
        int64_t c = 0;                                                                                 \
        for (; c + U <= n; c += U) row_products_##SUF(st + c * ROWS, 0, qt, KD, k + (kb + c) * D, 1, D, U); \
        for (; c < n; c++) row_products_##SUF(st + c * ROWS, 0, qt, KD, k + (kb + c) * D, 1, D, 1);      \
        /* masks: only where the tile crosses a row's diagonal or first key, or has padding rows */    \
        const int masked = mask && (kb + n - 1 > qs || kb < lor[R - 1] || R < ROWS);                   \
        for (c = 0; c < n; c++) {                                                                      \
            T *x = st + c * ROWS;                                                                      \
            const int64_t j = kb + c;                                                                  \
            if (prior) {                                                                               \
                const T *pr = prior + (N - 1 - j + qs);                                                \
                for (int64_t r = 0; r < ROWS; r++) x[r] += a[r] * pr[r];                               \
            }                                                                                          \
            if (masked)                                                                                \
                for (int64_t r = 0; r < ROWS; r++) x[r] = j >= lor[r] && j <= qs + r ? x[r] : NEG;     \
        }                                                                                              \
    }                                                                                                  \
                                                                                                       \
    /* ot[d] += sum_c v[kb + c][d] * pt[c]: a key-major tile times the keys' rows, into a row vector \
     * per output column. */                                                                           \
    static void tile_times_rows_##SUF##_##DN(T *ot, const T *pt, const T *v, int64_t D, int64_t kb,    \
                                             int64_t n) {                                              \
        enum { U = U_##SUF };                                                                          \
        int64_t d = 0;                                                                                 \
        for (; d + U <= KD; d += U) row_products_##SUF(ot + d * ROWS, 1, pt, n, v + kb * D + d, D, 1, U); \
        if (KD % U) /* a width that is no multiple of U (none of the constant ones) */                \
            for (; d < KD; d++) row_products_##SUF(ot + d * ROWS, 1, pt, n, v + kb * D + d, D, 1, 1);      \
    }                                                                                                  \
                                                                                                       \
    /* acc[kb + c][:] += sum_{r < R} t[c][r] * x[r][:]: a tile's sums over its rows (dK, dV). */       \
    static void rows_sum_##SUF##_##DN(T *acc, const T *t, const T *x, int64_t D, int64_t R, int64_t kb, \
                                      int64_t n) {                                                     \
        if (KD % VL_##SUF == 0 && KD <= 16 * VL_##SUF) {                                               \
            const int64_t DV = KD / VL_##SUF, per = NACC / DV; /* keys per pass: NACC sums */         \
            int64_t c = 0;                                                                             \
            if (per >= 8)                                                                              \
                for (; c + 8 <= n; c += 8) rows_sum_v_##SUF(acc + kb * D, t, x, DV, R, c, 8);          \
            else if (per >= 4)                                                                         \
                for (; c + 4 <= n; c += 4) rows_sum_v_##SUF(acc + kb * D, t, x, DV, R, c, 4);          \
            else if (per >= 2)                                                                         \
                for (; c + 2 <= n; c += 2) rows_sum_v_##SUF(acc + kb * D, t, x, DV, R, c, 2);          \
            for (; c < n; c++) rows_sum_v_##SUF(acc + kb * D, t, x, DV, R, c, 1);                      \
            return;                                                                                    \
        }                                                                                              \
        for (int64_t c = 0; c < n; c++)                                                                \
            for (int64_t r = 0; r < R; r++)                                                            \
                for (int64_t d = 0; d < KD; d++) acc[(kb + c) * D + d] += t[c * ROWS + r] * x[r * D + d]; \
    }                                                                                                  \
                                                                                                       \
    static void forward_##SUF##_##DN(const T *q, const T *k, const T *v, T *out, T *lse,              \
                                     const T *prior, int64_t prior_h, const T *pscale, int64_t ps_b,   \
                                     int64_t ps_h, const int64_t *lo, int64_t lo_b,                    \
                                     const int64_t *kstart, int64_t ks_b, int64_t B, int64_t H,        \
                                     int64_t N, int64_t D) {                                           \
        const int64_t blocks = (N + ROWS - 1) / ROWS;                                                  \
        _Pragma("omp parallel") {                                                                      \
            T *qt = aligned_alloc(64, sizeof(T) * (KD * ROWS * 2 + KEYS * ROWS));                                 \
            T *ot = qt + KD * ROWS, *st = ot + KD * ROWS;                                              \
            /* static, 1: the blocks' work grows along the sequence; round robin evens it out */       \
            _Pragma("omp for collapse(2) schedule(static, 1)") for (int64_t bh = 0; bh < B * H; bh++) { \
                for (int64_t blk = 0; blk < blocks; blk++) {                                           \
                    BLOCK_SETUP(T, KD)                                                                 \
                    const T *pr = prior ? prior + h * prior_h : 0;                                     \
                    T m[ROWS], l[ROWS], corr[ROWS];                                                    \
                    for (int64_t r = 0; r < ROWS; r++) m[r] = NEG, l[r] = 0;                           \
                    memset(ot, 0, sizeof(T) * KD * ROWS);                                              \
                    for (int64_t kb = ks; kb < ke; kb += KEYS) {                                       \
                        const int64_t n = MIN(KEYS, ke - kb);                                          \
                        logits_##SUF##_##DN(st, qt, k + bh * N * D, pr, a, lor, N, D, qs, R, kb, n, 1);  \
                        T mx[ROWS];                                                                    \
                        memcpy(mx, m, sizeof mx);                                                      \
                        for (int64_t c = 0; c < n; c++)                                                \
                            for (int64_t r = 0; r < ROWS; r++) mx[r] = st[c * ROWS + r] > mx[r] ? st[c * ROWS + r] : mx[r]; \
                        for (int64_t r = 0; r < ROWS; r++) {                                           \
                            corr[r] = EXP_OR_ZERO(EXP, m[r] - mx[r], FLOOR);                          \
                            l[r] *= corr[r];                                                           \
                            m[r] = mx[r];                                                              \
                        }                                                                              \
                        for (int64_t c = 0; c < n; c++) {                                              \
                            T *x = st + c * ROWS;                                                      \
                            for (int64_t r = 0; r < ROWS; r++) {                                       \
                                const T e = EXP_OR_ZERO(EXP, x[r] - m[r], FLOOR);                      \
                                x[r] = x[r] > NEG ? e : 0;                                             \
                                l[r] += x[r];                                                          \
                            }                                                                          \
                        }                                                                              \
                        for (int64_t d = 0; d < KD; d++)                                               \
                            for (int64_t r = 0; r < ROWS; r++) ot[d * ROWS + r] *= corr[r];            \
                        tile_times_rows_##SUF##_##DN(ot, st, v + bh * N * D, D, kb, n);                \
                    }                                                                                  \
                    for (int64_t r = 0; r < R; r++) {                                                  \
                        const T inv = (T)1 / l[r];                                                     \
                        for (int64_t d = 0; d < KD; d++) out[(bh * N + qs + r) * D + d] = ot[d * ROWS + r] * inv; \
                        lse[bh * N + qs + r] = m[r] + LOG(l[r]);                                       \
                    }                                                                                  \
                }                                                                                      \
            }                                                                                          \
            free(qt);                                                                                  \
        }                                                                                              \
    }                                                                                                  \
                                                                                                       \
    /* delta[i] = sum_d dO·O of row i (FlashAttention-2's D). dq is written whole, dk and dv must   \
     * arrive zeroed, sums is added to. One head per thread: its dk, dv and sums are its own. */       \
    static void backward_##SUF##_##DN(const T *q, const T *k, const T *v, const T *dout,              \
                                      const T *lse, const T *delta, T *dq, T *dk, T *dv,               \
                                      const T *prior, int64_t prior_h, const T *pscale, int64_t ps_b,  \
                                      int64_t ps_h, const T *wscale, int64_t ws_b, T *sums,            \
                                      int64_t sums_bh, const int64_t *lo, int64_t lo_b,                \
                                      const int64_t *kstart, int64_t ks_b, int64_t B, int64_t H,       \
                                      int64_t N, int64_t D) {                                          \
        const int64_t blocks = (N + ROWS - 1) / ROWS;                                                  \
        _Pragma("omp parallel") {                                                                      \
            T *qt = aligned_alloc(64, sizeof(T) * (KD * ROWS * 3 + KEYS * ROWS * 2));                             \
            T *dot = qt + KD * ROWS, *dqt = dot + KD * ROWS, *pt = dqt + KD * ROWS;                    \
            T *dst = pt + KEYS * ROWS;                                                                 \
            _Pragma("omp for schedule(static)") for (int64_t bh = 0; bh < B * H; bh++) {               \
                const T *kh = k + bh * N * D, *vh = v + bh * N * D, *pr = prior ? prior + (bh % H) * prior_h : 0; \
                for (int64_t blk = 0; blk < blocks; blk++) {                                           \
                    BLOCK_SETUP(T, KD)                                                                 \
                    T l[ROWS], dl[ROWS], w[ROWS];                                                      \
                    int one[ROWS]; /* rows that see one key: p = 1, no gradient, exactly */            \
                    for (int64_t r = 0; r < ROWS; r++) {                                               \
                        l[r] = r < R ? lse[bh * N + qs + r] : 0;                                       \
                        dl[r] = r < R ? delta[bh * N + qs + r] : 0;                                    \
                        w[r] = r < R && wscale ? wscale[b * ws_b + qs + r] : 1;                        \
                        one[r] = lor[r] == qs + r;                                                     \
                    }                                                                                  \
                    for (int64_t d = 0; d < KD; d++)                                                   \
                        for (int64_t r = 0; r < ROWS; r++) {                                           \
                            dot[d * ROWS + r] = r < R ? dout[(bh * N + qs + r) * D + d] : 0;           \
                            dqt[d * ROWS + r] = 0;                                                     \
                        }                                                                              \
                    for (int64_t kb = ks; kb < ke; kb += KEYS) {                                       \
                        const int64_t n = MIN(KEYS, ke - kb);                                          \
                        logits_##SUF##_##DN(pt, qt, kh, pr, a, lor, N, D, qs, R, kb, n, 1);               \
                        for (int64_t c = 0; c < n; c++) {                                              \
                            T *x = pt + c * ROWS;                                                      \
                            for (int64_t r = 0; r < ROWS; r++) {                                       \
                                const T e = EXP_OR_ZERO(EXP, x[r] - l[r], FLOOR);                      \
                                x[r] = x[r] > NEG ? e : 0;                                             \
                            }                                                                          \
                        }                                                                              \
                        /* dP = dO·Vᵀ, the logits' product with dO in place of the queries */          \
                        logits_##SUF##_##DN(dst, dot, vh, 0, a, lor, N, D, qs, R, kb, n, 0);           \
                        for (int64_t c = 0; c < n; c++) {                                              \
                            T *g = dst + c * ROWS;                                                     \
                            const T *p = pt + c * ROWS;                                                \
                            for (int64_t r = 0; r < ROWS; r++) g[r] = one[r] ? 0 : p[r] * (g[r] - dl[r]); \
                            if (pr) {                                                                  \
                                T *diag = sums + bh * sums_bh + (N - 1 - (kb + c) + qs);               \
                                for (int64_t r = 0; r < ROWS; r++) diag[r] += w[r] * g[r];             \
                            }                                                                          \
                        }                                                                              \
                        rows_sum_##SUF##_##DN(dv + bh * N * D, pt, dout + (bh * N + qs) * D, D, R, kb, n); \
                        rows_sum_##SUF##_##DN(dk + bh * N * D, dst, q + (bh * N + qs) * D, D, R, kb, n); \
                        tile_times_rows_##SUF##_##DN(dqt, dst, kh, D, kb, n);                          \
                    }                                                                                  \
                    for (int64_t r = 0; r < R; r++)                                                    \
                        for (int64_t d = 0; d < KD; d++) dq[(bh * N + qs + r) * D + d] = dqt[d * ROWS + r]; \
                }                                                                                      \
            }                                                                                          \
            free(qt);                                                                                  \
        }                                                                                              \
    }

/* The exported entry points: fp32 (training's) with the head widths 32, 64 and 128 compiled as
 * constants, any other at run time; fp64 (the tests' oracle runs) at run time only. */
#define PICK_f32(fn, D) (D == 32 ? fn##_f32_32 : D == 64 ? fn##_f32_64 : D == 128 ? fn##_f32_128 : fn##_f32_any)
#define PICK_f64(fn, D) fn##_f64_any
#define DEFINE_ENTRIES(T, SUF)                                                                           \
    void flash_forward_##SUF(const T *q, const T *k, const T *v, T *out, T *lse, const T *prior,          \
                             int64_t prior_h, const T *pscale, int64_t ps_b, int64_t ps_h,               \
                             const int64_t *lo, int64_t lo_b, const int64_t *kstart, int64_t ks_b,       \
                             int64_t B, int64_t H, int64_t N, int64_t D) {                               \
        PICK_##SUF(forward, D)(q, k, v, out, lse, prior, prior_h, pscale, ps_b, ps_h, lo, lo_b, kstart,  \
                               ks_b, B, H, N, D);                                                        \
    }                                                                                                    \
    void flash_backward_##SUF(const T *q, const T *k, const T *v, const T *dout, const T *lse,           \
                              const T *delta, T *dq, T *dk, T *dv, const T *prior, int64_t prior_h,      \
                              const T *pscale, int64_t ps_b, int64_t ps_h, const T *wscale,              \
                              int64_t ws_b, T *sums, int64_t sums_bh, const int64_t *lo, int64_t lo_b,  \
                              const int64_t *kstart, int64_t ks_b, int64_t B, int64_t H, int64_t N,     \
                              int64_t D) {                                                               \
        PICK_##SUF(backward, D)(q, k, v, dout, lse, delta, dq, dk, dv, prior, prior_h, pscale, ps_b,     \
                                ps_h, wscale, ws_b, sums, sums_bh, lo, lo_b, kstart, ks_b, B, H, N, D);  \
    }

/* NEG marks a masked logit: below any real one (the prior is capped near -1e26 by EXP_CAP) */
DEFINE_PRODUCTS(float, f32)
DEFINE_FLASH(float, expf, logf, -87.0f, -1e37f, f32, 32, 32)
DEFINE_FLASH(float, expf, logf, -87.0f, -1e37f, f32, 64, 64)
DEFINE_FLASH(float, expf, logf, -87.0f, -1e37f, f32, 128, 128)
DEFINE_FLASH(float, expf, logf, -87.0f, -1e37f, f32, any, D)
DEFINE_ENTRIES(float, f32)
DEFINE_PRODUCTS(double, f64)
DEFINE_FLASH(double, exp, log, -708.0, -1e300, f64, any, D)
DEFINE_ENTRIES(double, f64)
