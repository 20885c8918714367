/* The ops of cpu_fused.c for one element type, included from there once per type, which defines before
 * each inclusion: T the element type; NAME(x) x with the type's suffix (rms_norm_forward_f32); EXP and
 * SQRT, T's exp and square root; EXP_MAX the largest exponent EXP takes without overflow. */

/* y = x · rstd · w, rstd[r] = 1 / sqrt(mean(x[r]²) + eps), for rows r of D values. */
void NAME(rms_norm_forward)(const T *x, const T *w, T *y, T *rstd, int64_t rows, int64_t D, double eps) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * D;
        T *yr = y + r * D;
        T ss = 0;
        for (int64_t d = 0; d < D; d++) ss += xr[d] * xr[d];
        const T rs = (T)1 / SQRT(ss / (T)D + (T)eps);
        rstd[r] = rs;
        for (int64_t d = 0; d < D; d++) yr[d] = xr[d] * rs * w[d];
    }
}

/* With n = x · rstd and g = dy · w: dx = rstd · (g - n · mean(g · n)), dw = Σ_r dy · n; partial holds
 * ceil(rows / NORM_BLOCK) × D values of scratch. */
void NAME(rms_norm_backward)(const T *x, const T *w, const T *rstd, const T *dy, T *dx, T *dw, T *partial, int64_t rows,
                             int64_t D) {
    const int64_t blocks = (rows + NORM_BLOCK - 1) / NORM_BLOCK;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        T *pb = partial + b * D;
        for (int64_t d = 0; d < D; d++) pb[d] = 0;
        const int64_t end = (b + 1) * NORM_BLOCK < rows ? (b + 1) * NORM_BLOCK : rows;
        for (int64_t r = b * NORM_BLOCK; r < end; r++) {
            const T *xr = x + r * D, *dyr = dy + r * D;
            T *dxr = dx + r * D;
            const T rs = rstd[r];
            T dot = 0;
            for (int64_t d = 0; d < D; d++) dot += dyr[d] * w[d] * xr[d];
            const T c = dot * rs * rs / (T)D; /* mean(g · n) · rstd⁻¹ · rstd², with n = x · rstd */
            for (int64_t d = 0; d < D; d++) {
                dxr[d] = rs * (dyr[d] * w[d] - xr[d] * c);
                pb[d] += dyr[d] * xr[d] * rs;
            }
        }
    }
    for (int64_t d = 0; d < D; d++) dw[d] = 0;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t d = 0; d < D; d++) dw[d] += partial[b * D + d];
}

/* gu: rows of [gate | up], 2·H values; out = silu(gate) · up (rows of H). The exponent is clamped to
 * the type's range (-ffast-math assumes no inf): silu is then exact to the type's precision. */
void NAME(swiglu_forward)(const T *gu, T *out, int64_t rows, int64_t H) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const T *g = gu + r * 2 * H, *u = g + H;
        T *o = out + r * H;
        for (int64_t j = 0; j < H; j++) {
            const T e = g[j] < -EXP_MAX ? EXP_MAX : -g[j];
            o[j] = g[j] / ((T)1 + EXP(e)) * u[j];
        }
    }
}

/* dgu = [dy · up · s · (1 + gate · (1 - s)) | dy · gate · s], s = sigmoid(gate). */
void NAME(swiglu_backward)(const T *gu, const T *dy, T *dgu, int64_t rows, int64_t H) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const T *g = gu + r * 2 * H, *u = g + H, *dyr = dy + r * H;
        T *dg = dgu + r * 2 * H, *du = dg + H;
        for (int64_t j = 0; j < H; j++) {
            const T e = g[j] < -EXP_MAX ? EXP_MAX : -g[j];
            const T s = (T)1 / ((T)1 + EXP(e));
            dg[j] = dyr[j] * u[j] * s * ((T)1 + g[j] * ((T)1 - s));
            du[j] = dyr[j] * g[j] * s;
        }
    }
}

/* Rows r = (b, n) of W = heads · D values, x's rows `x_row` apart: each pair (x[2k], x[2k+1]) of a
 * head times rot[n] = (cos, sin) of its k as a complex number, or its conjugate (the backward). out
 * is contiguous; rot holds N × D/2 (cos, sin) pairs. */
void NAME(rope)(const T *x, int64_t x_row, const T *rot, T *out, int64_t rows, int64_t N, int64_t W, int64_t D,
                int64_t conjugate) {
    const T sign = conjugate ? (T)-1 : (T)1;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * x_row, *rn = rot + (r % N) * D;
        T *o = out + r * W;
        for (int64_t h = 0; h < W; h += D)
            for (int64_t k = 0; k < D; k += 2) {
                const T c = rn[k], s = sign * rn[k + 1], x0 = xr[h + k], x1 = xr[h + k + 1];
                o[h + k] = x0 * c - x1 * s;
                o[h + k + 1] = x0 * s + x1 * c;
            }
    }
}
