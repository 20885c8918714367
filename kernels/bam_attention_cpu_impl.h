/* The kernels of bam_attention_cpu.c for one element type and head width, included from there once
 * per pair it compiles, which defines before each inclusion: T the element type; KD the head width,
 * a constant, or D (the functions' argument) where it is known at run time only; NAME(x) x with the
 * pair's suffix (forward_f32_64); EXP, LOG and FLOOR, T's exp, log and the end of its normal range
 * (EXP_OR_ZERO's floor); NEG a masked logit. */

/* This pair's vectors: V holds VL values, a row vector of a tile is NV of them; PASS keys (or columns)
 * per pass of the row-vector products: NACC sums, at least one row vector. */
#define V NAME(V)
#define VU NAME(VU)
#define VL NAME(VL)
#define NV NAME(NV)
#define PASS NAME(PASS)
typedef T V __attribute__((vector_size(VBYTES)));
typedef T VU __attribute__((vector_size(VBYTES), aligned(sizeof(T)))); /* unaligned */
enum { VL = VBYTES / sizeof(T), NV = ROWS / VL };
enum { PASS = NACC / NV > 0 ? NACC / NV : 1 };

/* out[u] = (add ? out[u] : 0) + sum_{i < count} x[i * xi + u * xu] * rows[i], for u < U: U row
 * vectors (ROWS apart) as sums of row vectors times scalars. The logits: keys c0.. against the
 * transposed queries (rows qt[d], x = k); a tile times values: output columns d0.. (rows pt[c], x = v). */
static inline __attribute__((always_inline)) void NAME(row_products)(T *out, int add, const T *rows, int64_t count,
                                                                     const T *x, int64_t xi, int64_t xu, int U) {
    V s[4][NV];
    for (int u = 0; u < U; u++)
        for (int w = 0; w < NV; w++) s[u][w] = add ? ((V *)(out + u * ROWS))[w] : (V){0};
    for (int64_t i = 0; i < count; i++) {
        const V *rv = (const V *)(rows + i * ROWS);
        for (int u = 0; u < U; u++) {
            const T c = x[i * xi + u * xu];
            for (int w = 0; w < NV; w++) s[u][w] += c * rv[w];
        }
    }
    for (int u = 0; u < U; u++)
        for (int w = 0; w < NV; w++) ((V *)(out + u * ROWS))[w] = s[u][w];
}

/* acc[c][:] += sum_{r < R} t[c][r] * x[r][:] for keys c0 .. c0 + U - 1, along the head dimension
 * (DV vectors: D = DV·VL) */
static inline __attribute__((always_inline)) void NAME(rows_sum_v)(T *acc, const T *t, const T *x, int64_t DV,
                                                                   int64_t R, int64_t c0, int U) {
    V s[8][16];
    for (int u = 0; u < U; u++)
        for (int64_t e = 0; e < DV; e++) s[u][e] = (V){0};
    for (int64_t r = 0; r < R; r++) {
        const VU *xr = (const VU *)(x + r * DV * VL);
        for (int u = 0; u < U; u++) {
            const T w = t[(c0 + u) * ROWS + r];
            for (int64_t e = 0; e < DV; e++) s[u][e] += w * xr[e];
        }
    }
    for (int u = 0; u < U; u++) {
        VU *a = (VU *)(acc + (c0 + u) * DV * VL);
        for (int64_t e = 0; e < DV; e++) a[e] += s[u][e];
    }
}

/* st[c] = the logits of key kb + c against the block's rows (rows of a key-major tile), plus the
 * prior, NEG where masked (when `mask`); n keys. */
static void NAME(logits)(T *st, const T *qt, const T *k, const T *prior, const T *a, const int64_t *lor, int64_t N,
                         int64_t D, int64_t qs, int64_t R, int64_t kb, int64_t n, int mask) {
    int64_t c = 0;
    for (; c + PASS <= n; c += PASS) NAME(row_products)(st + c * ROWS, 0, qt, KD, k + (kb + c) * D, 1, D, PASS);
    for (; c < n; c++) NAME(row_products)(st + c * ROWS, 0, qt, KD, k + (kb + c) * D, 1, D, 1);
    /* masks: only where the tile crosses a row's diagonal or first key, or has padding rows */
    const int masked = mask && (kb + n - 1 > qs || kb < lor[R - 1] || R < ROWS);
    for (c = 0; c < n; c++) {
        T *x = st + c * ROWS;
        const int64_t j = kb + c;
        if (prior) {
            const T *pr = prior + (N - 1 - j + qs);
            for (int64_t r = 0; r < ROWS; r++) x[r] += a[r] * pr[r];
        }
        if (masked)
            for (int64_t r = 0; r < ROWS; r++) x[r] = j >= lor[r] && j <= qs + r ? x[r] : NEG;
    }
}

/* ot[d] += sum_c v[kb + c][d] * pt[c]: a key-major tile times the keys' rows, into a row vector
 * per output column. */
static void NAME(tile_times_rows)(T *ot, const T *pt, const T *v, int64_t D, int64_t kb, int64_t n) {
    int64_t d = 0;
    for (; d + PASS <= KD; d += PASS) NAME(row_products)(ot + d * ROWS, 1, pt, n, v + kb * D + d, D, 1, PASS);
    if (KD % PASS) /* a width that is no multiple of PASS (none of the constant ones) */
        for (; d < KD; d++) NAME(row_products)(ot + d * ROWS, 1, pt, n, v + kb * D + d, D, 1, 1);
}

/* acc[kb + c][:] += sum_{r < R} t[c][r] * x[r][:]: a tile's sums over its rows (dK, dV). */
static void NAME(rows_sum)(T *acc, const T *t, const T *x, int64_t D, int64_t R, int64_t kb, int64_t n) {
    if (KD % VL == 0 && KD <= 16 * VL) {
        const int64_t DV = KD / VL, per = NACC / DV; /* keys per pass: NACC sums */
        int64_t c = 0;
        if (per >= 8)
            for (; c + 8 <= n; c += 8) NAME(rows_sum_v)(acc + kb * D, t, x, DV, R, c, 8);
        else if (per >= 4)
            for (; c + 4 <= n; c += 4) NAME(rows_sum_v)(acc + kb * D, t, x, DV, R, c, 4);
        else if (per >= 2)
            for (; c + 2 <= n; c += 2) NAME(rows_sum_v)(acc + kb * D, t, x, DV, R, c, 2);
        for (; c < n; c++) NAME(rows_sum_v)(acc + kb * D, t, x, DV, R, c, 1);
        return;
    }
    for (int64_t c = 0; c < n; c++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t d = 0; d < KD; d++) acc[(kb + c) * D + d] += t[c * ROWS + r] * x[r * D + d];
}

static void NAME(forward)(const T *q, const T *k, const T *v, T *out, T *stats, int64_t *top, const T *prior,
                          int64_t prior_h, const T *pscale, int64_t ps_b, int64_t ps_h, const int64_t *lo, int64_t lo_b,
                          const int64_t *kstart, int64_t ks_b, int64_t B, int64_t H, int64_t N, int64_t D) {
    const int64_t blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel
    {
        T *qt = aligned_alloc(64, sizeof(T) * (KD * ROWS * 2 + KEYS * ROWS));
        T *ot = qt + KD * ROWS, *st = ot + KD * ROWS;
        /* static, 1: the blocks' work grows along the sequence; round robin evens it out */
#pragma omp for collapse(2) schedule(static, 1)
        for (int64_t bh = 0; bh < B * H; bh++) {
            for (int64_t blk = 0; blk < blocks; blk++) {
                /* The block's rows qs .. qs + R - 1, R <= ROWS: their first keys lor, prior scales a and
                 * transposed queries qt; padding rows (r >= R) see no key and read zeros. Written out
                 * here and in the backward: made one inlined function, it changed both loops' machine
                 * code (their register allocation). */
                const int64_t b = bh / H, h = bh % H, qs = blk * ROWS, R = MIN(ROWS, N - qs);
                const int64_t ks = kstart[b * ks_b + blk], ke = qs + R;
                int64_t lor[ROWS];
                T a[ROWS];
                for (int64_t r = 0; r < ROWS; r++) {
                    lor[r] = r < R ? lo[b * lo_b + qs + r] : INT64_MAX / 2;
                    a[r] = r >= R ? 0 : pscale ? pscale[b * ps_b + h * ps_h + qs + r] : 1;
                }
                for (int64_t d = 0; d < KD; d++)
                    for (int64_t r = 0; r < ROWS; r++) qt[d * ROWS + r] = r < R ? q[(bh * N + qs + r) * D + d] : 0;
                const T *pr = prior ? prior + h * prior_h : 0;
                T m[ROWS], l[ROWS], corr[ROWS];
                /* the key of each row's largest logit, held as T: a select of T's width vectorises as
                 * the max beside it does (keys < 2^24, the longest sequence the config allows) */
                T at[ROWS];
                for (int64_t r = 0; r < ROWS; r++) m[r] = NEG, l[r] = 0, at[r] = (T)(qs + r);
                memset(ot, 0, sizeof(T) * KD * ROWS);
                for (int64_t kb = ks; kb < ke; kb += KEYS) {
                    const int64_t n = MIN(KEYS, ke - kb);
                    NAME(logits)(st, qt, k + bh * N * D, pr, a, lor, N, D, qs, R, kb, n, 1);
                    T mx[ROWS];
                    memcpy(mx, m, sizeof mx);
                    for (int64_t c = 0; c < n; c++)
                        for (int64_t r = 0; r < ROWS; r++) {
                            const int up = st[c * ROWS + r] > mx[r];
                            mx[r] = up ? st[c * ROWS + r] : mx[r];
                            at[r] = up ? (T)(kb + c) : at[r];
                        }
                    for (int64_t r = 0; r < ROWS; r++) {
                        corr[r] = EXP_OR_ZERO(EXP, m[r] - mx[r], FLOOR);
                        l[r] *= corr[r];
                        m[r] = mx[r];
                    }
                    for (int64_t c = 0; c < n; c++) {
                        T *x = st + c * ROWS;
                        for (int64_t r = 0; r < ROWS; r++) {
                            const T e = EXP_OR_ZERO(EXP, x[r] - m[r], FLOOR);
                            x[r] = x[r] > NEG ? e : 0;
                            l[r] += x[r];
                        }
                    }
                    for (int64_t d = 0; d < KD; d++)
                        for (int64_t r = 0; r < ROWS; r++) ot[d * ROWS + r] *= corr[r];
                    NAME(tile_times_rows)(ot, st, v + bh * N * D, D, kb, n);
                }
                for (int64_t r = 0; r < R; r++) {
                    const T inv = (T)1 / l[r];
                    for (int64_t d = 0; d < KD; d++) out[(bh * N + qs + r) * D + d] = ot[d * ROWS + r] * inv;
                    /* the max and the sum's log apart: exp(x - m - log l) in the backward keeps p's digits
                     * where one logsumexp of a large magnitude would round them */
                    stats[2 * (bh * N + qs + r)] = m[r];
                    stats[2 * (bh * N + qs + r) + 1] = LOG(l[r]);
                    top[bh * N + qs + r] = (int64_t)at[r];
                }
            }
        }
        free(qt);
    }
}

/* stats, top: the forward's (max, log of the sum) per row and the key of that max; delta[i] = sum_d
 * dO·O of row i (FlashAttention-2's D). dq and rowsum (each row's sum of dL/dlogits, 0 in exact
 * arithmetic: what rounding left there) are written whole, dk and dv must arrive zeroed, sums is added
 * to. One head per thread: its dk, dv and sums are its own.
 *
 * The prior's sums are centred: row i adds dS_ij·(X_ij - X_ij*) for j* = top_i rather than dS_ij·X_ij
 * (the same in exact arithmetic, as sum_j dS_ij = 0), by holding back its term at j* and adding
 * (held - rowsum) there at the row's end. delta = rowsum(dO·O) is not exactly sum_j p·dP, so the
 * dS_ij do not sum to 0, and a prior's X, large beside its spread over a row's likely keys, would turn
 * that rest into spurious gradients of θ; a row whose softmax is one key now adds exactly 0. */
static void NAME(backward)(const T *q, const T *k, const T *v, const T *dout, const T *stats, const int64_t *top,
                           const T *delta, T *dq, T *rowsum, T *dk, T *dv, const T *prior, int64_t prior_h,
                           const T *pscale, int64_t ps_b, int64_t ps_h, const T *wscale, int64_t ws_b, int64_t ws_h,
                           T *sums, int64_t sums_bh, const int64_t *lo, int64_t lo_b, const int64_t *kstart,
                           int64_t ks_b, int64_t B, int64_t H, int64_t N, int64_t D) {
    const int64_t blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel
    {
        T *qt = aligned_alloc(64, sizeof(T) * (KD * ROWS * 3 + KEYS * ROWS * 2));
        T *dot = qt + KD * ROWS, *dqt = dot + KD * ROWS, *pt = dqt + KD * ROWS;
        T *dst = pt + KEYS * ROWS;
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            const T *kh = k + bh * N * D, *vh = v + bh * N * D, *pr = prior ? prior + (bh % H) * prior_h : 0;
            for (int64_t blk = 0; blk < blocks; blk++) {
                /* the block's set-up, as in the forward */
                const int64_t b = bh / H, h = bh % H, qs = blk * ROWS, R = MIN(ROWS, N - qs);
                const int64_t ks = kstart[b * ks_b + blk], ke = qs + R;
                int64_t lor[ROWS];
                T a[ROWS];
                for (int64_t r = 0; r < ROWS; r++) {
                    lor[r] = r < R ? lo[b * lo_b + qs + r] : INT64_MAX / 2;
                    a[r] = r >= R ? 0 : pscale ? pscale[b * ps_b + h * ps_h + qs + r] : 1;
                }
                for (int64_t d = 0; d < KD; d++)
                    for (int64_t r = 0; r < ROWS; r++) qt[d * ROWS + r] = r < R ? q[(bh * N + qs + r) * D + d] : 0;
                T mr[ROWS], ls[ROWS], dl[ROWS], w[ROWS], rs[ROWS], held[ROWS];
                T tj[ROWS];    /* each row's key j*, as T (see the forward) */
                int one[ROWS]; /* rows that see one key: p = 1, no gradient, exactly */
                for (int64_t r = 0; r < ROWS; r++) {
                    mr[r] = r < R ? stats[2 * (bh * N + qs + r)] : 0;
                    ls[r] = r < R ? stats[2 * (bh * N + qs + r) + 1] : 0;
                    tj[r] = r < R ? (T)top[bh * N + qs + r] : -1;
                    rs[r] = held[r] = 0;
                    dl[r] = r < R ? delta[bh * N + qs + r] : 0;
                    w[r] = r < R && wscale ? wscale[b * ws_b + h * ws_h + qs + r] : 1;
                    one[r] = lor[r] == qs + r;
                }
                for (int64_t d = 0; d < KD; d++)
                    for (int64_t r = 0; r < ROWS; r++) {
                        dot[d * ROWS + r] = r < R ? dout[(bh * N + qs + r) * D + d] : 0;
                        dqt[d * ROWS + r] = 0;
                    }
                for (int64_t kb = ks; kb < ke; kb += KEYS) {
                    const int64_t n = MIN(KEYS, ke - kb);
                    NAME(logits)(pt, qt, kh, pr, a, lor, N, D, qs, R, kb, n, 1);
                    for (int64_t c = 0; c < n; c++) {
                        T *x = pt + c * ROWS;
                        for (int64_t r = 0; r < ROWS; r++) {
                            const T e = EXP_OR_ZERO(EXP, x[r] - mr[r] - ls[r], FLOOR);
                            x[r] = x[r] > NEG ? e : 0;
                        }
                    }
                    /* dP = dO·Vᵀ, the logits' product with dO in place of the queries */
                    NAME(logits)(dst, dot, vh, 0, a, lor, N, D, qs, R, kb, n, 0);
                    for (int64_t c = 0; c < n; c++) {
                        T *g = dst + c * ROWS;
                        const T *p = pt + c * ROWS;
                        for (int64_t r = 0; r < ROWS; r++) {
                            g[r] = one[r] ? 0 : p[r] * (g[r] - dl[r]);
                            rs[r] += g[r];
                        }
                        if (pr) {
                            T *diag = sums + bh * sums_bh + (N - 1 - (kb + c) + qs);
                            for (int64_t r = 0; r < ROWS; r++) {
                                const int at = (T)(kb + c) == tj[r];
                                held[r] += at ? g[r] : 0;
                                diag[r] += at ? 0 : w[r] * g[r];
                            }
                        }
                    }
                    NAME(rows_sum)(dv + bh * N * D, pt, dout + (bh * N + qs) * D, D, R, kb, n);
                    NAME(rows_sum)(dk + bh * N * D, dst, q + (bh * N + qs) * D, D, R, kb, n);
                    NAME(tile_times_rows)(dqt, dst, kh, D, kb, n);
                }
                for (int64_t r = 0; r < R; r++) {
                    for (int64_t d = 0; d < KD; d++) dq[(bh * N + qs + r) * D + d] = dqt[d * ROWS + r];
                    rowsum[bh * N + qs + r] = rs[r];
                    if (pr)
                        sums[bh * sums_bh + N - 1 - (int64_t)tj[r] + qs + r] += w[r] * (held[r] - rs[r]);
                }
            }
        }
        free(qt);
    }
}

#undef V
#undef VU
#undef VL
#undef NV
#undef PASS
