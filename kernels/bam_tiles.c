/* The elementwise passes of the tiled BAM attention op (kernels/bam_attention_cpu.py), fused: one pass
 * over a logit tile in the forward, two in the backward, where the PyTorch reference makes about ten
 * (prior, mask, softmax, softmax gradient, the prior gradient's anti-diagonal sums). The matmuls stay
 * in torch. Built at first use by kernels/bam_attention_cpu.py with the system C compiler, OpenMP
 * from the libgomp torch already loaded (one thread pool), and vectorised exp (glibc's libmvec).
 *
 * A tile holds rows (b, h, i), i < R, of queries qs + i against C keys in reverse order: column c is
 * key ks + C - 1 - c. Row i may attend to keys lo_i .. qs + i (lo holds the causal, window and
 * document masks), which are the columns first .. last below: a contiguous range, so masked entries
 * are never computed, only zeroed. The prior tile is Toeplitz: entry (i, c) is prior[h*prior_h + i + c].
 * Row tables (lse, the prior's row scale, lo, ...) are passed from the tile's first row on, with their
 * strides in elements between batch entries (0: shared by the batch) and heads.
 */
#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0, exactly 0 below `floor` (where the float type's normal range ends: what the
 * flushed denormals of configure_cpu would give). glibc's vector exp takes a scalar slow path for any
 * lane outside its range, and a prior's far keys put most lanes there: the clamp keeps every lane in. */
#define EXP_OR_ZERO(EXP, x, floor) ((x) < (floor) ? 0 : EXP((x) < (floor) ? (floor) : (x)))

#define DEFINE_TILE_OPS(T, EXP, LOG, FLOOR, SUFFIX)                                                      \
    /* logits (B, H, R, C) in place -> exp(logit - the row's max), 0 where masked; rinv[bh*R + i] = 1 / \
     * the row's sum (the caller scales the product with V: R·D multiplications instead of R·C), and  \
     * lse[b*lse_b + h*lse_h + i] = its logsumexp. prior or NULL; pscale[b*pscale_b + h*pscale_h + i] \
     * multiplies the prior (SSMax's c_i), NULL for 1; lo[b*lo_b + i] the row's first key. */          \
    void tile_forward_##SUFFIX(T *x, T *rinv, T *lse, int64_t lse_b, int64_t lse_h, const T *prior,     \
                               int64_t prior_h, const T *pscale, int64_t pscale_b, int64_t pscale_h,     \
                               const int64_t *lo, int64_t lo_b, int64_t B, int64_t H, int64_t R,         \
                               int64_t C, int64_t qs, int64_t ks) {                                      \
        _Pragma("omp parallel for collapse(2) schedule(static)") for (int64_t bh = 0; bh < B * H; bh++) { \
            for (int64_t i = 0; i < R; i++) {                                                            \
                const int64_t b = bh / H, h = bh % H;                                                    \
                T *row = x + (bh * R + i) * C;                                                           \
                const int64_t first = ks + C - 1 - (qs + i), last = ks + C - 1 - lo[b * lo_b + i];       \
                const T a = pscale ? pscale[b * pscale_b + h * pscale_h + i] : (T)1;                     \
                const T *pr = prior ? prior + h * prior_h + i : 0;                                       \
                T m = row[first]; /* the diagonal is always allowed: the range is never empty */         \
                if (pr) {                                                                                \
                    m += a * pr[first];                                                                  \
                    for (int64_t c = first; c <= last; c++) {                                            \
                        row[c] += a * pr[c];                                                             \
                        m = row[c] > m ? row[c] : m;                                                     \
                    }                                                                                    \
                } else {                                                                                 \
                    for (int64_t c = first + 1; c <= last; c++) m = row[c] > m ? row[c] : m;             \
                }                                                                                        \
                T sum = 0;                                                                               \
                _Pragma("omp simd reduction(+ : sum)") for (int64_t c = first; c <= last; c++) {         \
                    row[c] = EXP_OR_ZERO(EXP, row[c] - m, FLOOR);                                        \
                    sum += row[c];                                                                       \
                }                                                                                        \
                for (int64_t c = 0; c < first; c++) row[c] = 0;                                          \
                for (int64_t c = last + 1; c < C; c++) row[c] = 0;                                       \
                rinv[bh * R + i] = (T)1 / sum;                                                           \
                lse[b * lse_b + h * lse_h + i] = m + LOG(sum);                                           \
            }                                                                                            \
        }                                                                                                \
    }                                                                                                    \
                                                                                                         \
    /* The backward of one tile: x holds the recomputed logits q·f·kᵀ (B, H, R, C), g = dO·Vᵀ; on return \
     * x holds the probabilities and g dL/dlogits = p·(g - Σ_c p·g), both 0 where masked. With a prior, \
     * sums[bh*sums_bh + m] += w_i·dL/dlogits[i, c] over i + c = m (the prior's anti-diagonal sums, at \
     * the prior's offsets; w = the row weights wscale[b*wscale_b + i], or 1 where NULL).              \
     * The probabilities exp(logit - lse) are divided by their recomputed sum (in the pass that makes \
     * the gradient: no extra pass), as the reference's softmax is, so that a row whose weight sits on \
     * one key gets the reference's near-zero gradient rather than lse's rounding times the prior's    \
     * derivative; a row with one allowed key gets exactly zero. */                                    \
    void tile_backward_##SUFFIX(T *x, T *g, const T *lse, int64_t lse_b, int64_t lse_h, const T *prior,  \
                                int64_t prior_h, const T *pscale, int64_t pscale_b, int64_t pscale_h,    \
                                const T *wscale, int64_t wscale_b, T *sums, int64_t sums_bh,             \
                                const int64_t *lo, int64_t lo_b, int64_t B, int64_t H, int64_t R,        \
                                int64_t C, int64_t qs, int64_t ks) {                                     \
        _Pragma("omp parallel for schedule(static)") for (int64_t bh = 0; bh < B * H; bh++) {            \
            const int64_t b = bh / H, h = bh % H;                                                        \
            for (int64_t i = 0; i < R; i++) {                                                            \
                T *row = x + (bh * R + i) * C, *grow = g + (bh * R + i) * C;                             \
                const int64_t first = ks + C - 1 - (qs + i), last = ks + C - 1 - lo[b * lo_b + i];       \
                const T a = pscale ? pscale[b * pscale_b + h * pscale_h + i] : (T)1;                     \
                const T *pr = prior ? prior + h * prior_h + i : 0;                                       \
                const T l = lse[b * lse_b + h * lse_h + i];                                              \
                T d = 0, sum = 0;                                                                        \
                if (pr) {                                                                                \
                    _Pragma("omp simd reduction(+ : d, sum)") for (int64_t c = first; c <= last; c++) {  \
                        row[c] = EXP_OR_ZERO(EXP, row[c] + a * pr[c] - l, FLOOR);                        \
                        sum += row[c];                                                                   \
                        d += row[c] * grow[c];                                                           \
                    }                                                                                    \
                } else {                                                                                 \
                    _Pragma("omp simd reduction(+ : d, sum)") for (int64_t c = first; c <= last; c++) {  \
                        row[c] = EXP_OR_ZERO(EXP, row[c] - l, FLOOR);                                    \
                        sum += row[c];                                                                   \
                        d += row[c] * grow[c];                                                           \
                    }                                                                                    \
                }                                                                                        \
                for (int64_t c = 0; c < first; c++) row[c] = grow[c] = 0;                                \
                for (int64_t c = last + 1; c < C; c++) row[c] = grow[c] = 0;                             \
                if (first == last) { /* one key: p = 1, no gradient (exactly, whatever the rounding) */  \
                    row[first] = 1;                                                                      \
                    grow[first] = 0;                                                                     \
                    continue;                                                                            \
                }                                                                                        \
                const T inv = (T)1 / sum;                                                                \
                d *= inv;                                                                                \
                if (pr) {                                                                                \
                    T *diag = sums + bh * sums_bh + i;                                                   \
                    const T w = wscale ? wscale[b * wscale_b + i] : (T)1;                                \
                    for (int64_t c = first; c <= last; c++) {                                            \
                        row[c] *= inv;                                                                   \
                        grow[c] = row[c] * (grow[c] - d);                                                \
                        diag[c] += w * grow[c];                                                          \
                    }                                                                                    \
                } else {                                                                                 \
                    for (int64_t c = first; c <= last; c++) {                                            \
                        row[c] *= inv;                                                                   \
                        grow[c] = row[c] * (grow[c] - d);                                                \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

DEFINE_TILE_OPS(float, expf, logf, -87.0f, f32)
DEFINE_TILE_OPS(double, exp, log, -708.0, f64)
