/* The scaling domain's passes over a group of whole slices, in C: what sinkformer.sinkhorn.native runs on
 * the CPU for a group without masks (see that module's docstring for the mathematics and the layouts).
 *
 * For each slice (n x m, row-major, in cache): the double shift of the scores and K~ = exp(S - r_i - c_j)
 * in place, the iterations u <- a / (K~ v), v <- b / (K~^T u) from v = exp(c) (a row normalisation and the
 * column sums of the next one in one pass over the slice); and the exact gradient of the n_iters map,
 * dS = scale K~ (G + X Y^T), with G = diag(u) dP diag(v) given and the rank-n_iters correction X Y^T from
 * the reverse recursion through the scalings.
 *
 * Compiled at first use by sinkformer.sinkhorn.native with the C compiler of the machine (-O3
 * -march=native); the loops vectorise through "omp simd". Each exported function splits its slices over
 * `threads` threads of the OpenMP runtime where built with -fopenmp (only where PyTorch's own runtime,
 * GNU OpenMP, is the one loaded: one pool of threads for both), else runs them in order. Slices are
 * independent, so the results do not depend on the thread count. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_INDEX omp_get_thread_num()
#else
#define THREAD_INDEX 0
#endif

/* e^x for x <= 0 in float32: Cody-Waite reduction by ln 2 (round to nearest by the 1.5 * 2^23 trick),
 * the degree-6 polynomial of Cephes' expf on [-ln2/2, ln2/2], scaled by 2^k through the exponent bits;
 * exactly 0 below -87.3 (where e^x is below float32's smallest normal number). */
static inline float exp_nonpositive_f32(float x) {
    const int under = x < -87.3f;
    x = under ? -87.3f : x;
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return under ? 0.0f : p * scale;
}

static inline double exp_nonpositive_f64(double x) { return exp(x); }

/* One definition per dtype: T the element type, SFX the suffix of the exported names. */
#define DEFINE_PASSES(T, SFX, EXP)                                                                            \
                                                                                                              \
/* sum_j x_j y_j, and y += s x, over m elements: the two loops every pass is made of. */                      \
static inline T dot_##SFX(const T *x, const T *y, int64_t m) {                                                \
    T total = 0;                                                                                              \
    _Pragma("omp simd reduction(+:total)")                                                                    \
    for (int64_t j = 0; j < m; j++) total += x[j] * y[j];                                                     \
    return total;                                                                                             \
}                                                                                                             \
static inline void add_scaled_##SFX(T *y, const T *x, T s, int64_t m) {                                       \
    _Pragma("omp simd")                                                                                       \
    for (int64_t j = 0; j < m; j++) y[j] += x[j] * s;                                                         \
}                                                                                                             \
                                                                                                              \
/* Forward of slice s of X (c, n, m; rows ld apart, slices n ld): the scores in, K~ out. us (c, n, Lu), vs    \
 * (c, m, Lv): the iterates [u1, u3, ..] and [v0 = e^c, v2, ..] (Lu = ceil(T / 2), Lv = floor(T / 2) + 1);    \
 * row_shift (c, n), col_shift (c, m); work: 2 m elements. a, b: the marginals (each row a, each column b). */\
static void forward_slice_##SFX(T *X, int64_t s, int64_t n, int64_t m, int64_t ld, int T_, T a, T b, T *us,   \
                                T *vs, T *row_shift, T *col_shift, T *work) {                                 \
    const int64_t Lu = (T_ + 1) / 2, Lv = T_ / 2 + 1;                                                         \
    T *col = work, *vc = work + m; /* the column sums, and the current v contiguous */                        \
    T *K = X + s * n * ld, *u = us + s * n * Lu, *v = vs + s * m * Lv;                                        \
    T *rs = row_shift + s * n, *cs = col_shift + s * m;                                                       \
    for (int64_t j = 0; j < m; j++) cs[j] = -INFINITY;                                                        \
    for (int64_t i = 0; i < n; i++) { /* row maxima, then the column maxima of S - r_i */                     \
        T *x = K + i * ld, top = -INFINITY;                                                                   \
        _Pragma("omp simd reduction(max:top)")                                                                \
        for (int64_t j = 0; j < m; j++) top = x[j] > top ? x[j] : top;                                        \
        rs[i] = top;                                                                                          \
        _Pragma("omp simd")                                                                                   \
        for (int64_t j = 0; j < m; j++) {                                                                     \
            T y = x[j] - top;                                                                                 \
            x[j] = y;                                                                                         \
            cs[j] = y > cs[j] ? y : cs[j];                                                                    \
        }                                                                                                     \
    }                                                                                                         \
    for (int64_t j = 0; j < m; j++) { col[j] = 0; vc[j] = EXP(cs[j]); v[j * Lv] = vc[j]; }                    \
    for (int64_t i = 0; i < n; i++) { /* K~ = e^{x - c}; normalisation 1 and the sums of 2 */                 \
        T *x = K + i * ld, total = 0;                                                                         \
        _Pragma("omp simd reduction(+:total)")                                                                \
        for (int64_t j = 0; j < m; j++) {                                                                     \
            T e = EXP(x[j] - cs[j]);                                                                          \
            x[j] = e;                                                                                         \
            total += e * vc[j];                                                                               \
        }                                                                                                     \
        T ui = a / total;                                                                                     \
        u[i * Lu] = ui;                                                                                       \
        add_scaled_##SFX(col, x, ui, m);                                                                      \
    }                                                                                                         \
    for (int t = 2, lu = 0, lv = 0; t <= T_; t += 2) {                                                        \
        lv++; /* normalisation t (columns), then t + 1 (rows) with the sums of t + 2 if it follows */         \
        for (int64_t j = 0; j < m; j++) { vc[j] = b / col[j]; v[j * Lv + lv] = vc[j]; col[j] = 0; }           \
        if (t == T_) break;                                                                                   \
        lu++;                                                                                                 \
        const int more = t + 2 <= T_;                                                                         \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            T *x = K + i * ld, ui = a / dot_##SFX(x, vc, m);                                                  \
            u[i * Lu + lu] = ui;                                                                              \
            if (more) add_scaled_##SFX(col, x, ui, m);                                                        \
        }                                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* Forward of c slices on `threads` threads; work: 2 m elements per thread. */                                \
void sinkhorn_forward_##SFX(T *X, int64_t c, int64_t n, int64_t m, int64_t ld, int T_, T a, T b, T *us, T *vs,\
                            T *row_shift, T *col_shift, T *work, int threads) {                               \
    (void)threads; /* unused without OpenMP */                                                                \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(threads > 1 && c > 1)")                \
    for (int64_t s = 0; s < c; s++)                                                                           \
        forward_slice_##SFX(X, s, n, m, ld, T_, a, b, us, vs, row_shift, col_shift,                           \
                            work + 2 * m * THREAD_INDEX);                                                     \
}                                                                                                             \
                                                                                                              \
/* K~ = e^{S - r_i - c_j} of c slices in place (rows ld apart), from the forward's shifts: the values its pass\
 * computed, bit for bit, for a backward that did not keep them. */                                           \
void sinkhorn_kernel_##SFX(T *X, int64_t c, int64_t n, int64_t m, int64_t ld, const T *row_shift,             \
                           const T *col_shift, int threads) {                                                 \
    (void)threads; /* unused without OpenMP */                                                                \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(threads > 1 && c > 1)")                \
    for (int64_t s = 0; s < c; s++)                                                                           \
        for (int64_t i = 0; i < n; i++) {                                                                     \
            T *x = X + (s * n + i) * ld;                                                                      \
            const T *cs = col_shift + s * m, r = row_shift[s * n + i];                                        \
            _Pragma("omp simd")                                                                               \
            for (int64_t j = 0; j < m; j++) { T y = x[j] - r; x[j] = EXP(y - cs[j]); }                        \
        }                                                                                                     \
}                                                                                                             \
                                                                                                              \
/* Backward of slice s: K (c, n, m; rows ldk apart) = K~; G (c, n, m; rows ldg apart) = diag(u) dP diag(v) in,\
 * dS out; us, vs as the forward wrote them; work: (T + 1) (n + m) elements. The reverse recursion: a row step\
 * u_t = a / (K v) turns the gradient du into x = -du u_t^2 / a (then dv += K^T x), a column step             \
 * v_t = b / (K^T u) turns dv into y = -dv v_t^2 / b (then du += K y); each adds the rank-one term x v_{t-1}^T\
 * or u_{t-1} y^T. */                                                                                         \
static void backward_slice_##SFX(const T *Kt, T *G, int64_t s, int64_t n, int64_t m, int64_t ldk, int64_t ldg,\
                                 int T_, T a, T b, const T *us, const T *vs, T scale, T *work) {              \
    const int64_t Lu = (T_ + 1) / 2, Lv = T_ / 2 + 1;                                                         \
    T *du = work, *dv = du + n, *X = dv + m, *Y = X + (int64_t)T_ * n;                                        \
    const T *K = Kt + s * n * ldk, *u = us + s * n * Lu, *v = vs + s * m * Lv;                                \
    T *g = G + s * n * ldg;                                                                                   \
    for (int64_t j = 0; j < m; j++) dv[j] = 0;                                                                \
    for (int64_t i = 0; i < n; i++) { /* the gradients of the final scalings: (P dP) 1 / u, 1^T (P dP) / v */ \
        const T *k = K + i * ldk;                                                                             \
        T *gi = g + i * ldg, total = 0;                                                                       \
        _Pragma("omp simd reduction(+:total)")                                                                \
        for (int64_t j = 0; j < m; j++) { T p = k[j] * gi[j]; total += p; dv[j] += p; }                       \
        du[i] = total / u[i * Lu + Lu - 1];                                                                   \
    }                                                                                                         \
    for (int64_t j = 0; j < m; j++) dv[j] /= v[j * Lv + Lv - 1];                                              \
    for (int t = T_, l = 0; t >= 1; t--, l++) {                                                               \
        T *x = X + (int64_t)l * n, *y = Y + (int64_t)l * m;                                                   \
        if (t % 2) { /* row step: u_{(t+1)/2} from v_{(t-1)/2} */                                             \
            const int64_t iu = (t - 1) / 2, iv = (t - 1) / 2;                                                 \
            for (int64_t i = 0; i < n; i++) {                                                                 \
                T ui = u[i * Lu + iu];                                                                        \
                x[i] = -du[i] * ui * ui / a;                                                                  \
                du[i] = 0;                                                                                    \
            }                                                                                                 \
            for (int64_t j = 0; j < m; j++) y[j] = v[j * Lv + iv];                                            \
            if (t > 1)                                                                                        \
                for (int64_t i = 0; i < n; i++) add_scaled_##SFX(dv, K + i * ldk, x[i], m);                   \
        } else { /* column step: v_{t/2} from u_{t/2} */                                                      \
            const int64_t iv = t / 2, iu = t / 2 - 1;                                                         \
            for (int64_t j = 0; j < m; j++) {                                                                 \
                T vj = v[j * Lv + iv];                                                                        \
                y[j] = -dv[j] * vj * vj / b;                                                                  \
                dv[j] = 0;                                                                                    \
            }                                                                                                 \
            for (int64_t i = 0; i < n; i++) {                                                                 \
                x[i] = u[i * Lu + iu];                                                                        \
                du[i] += dot_##SFX(K + i * ldk, y, m);                                                        \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    for (int64_t i = 0; i < n; i++) { /* dS = scale K~ (G + X Y^T), row by row */                             \
        const T *k = K + i * ldk;                                                                             \
        T *gi = g + i * ldg;                                                                                  \
        for (int l = 0; l < T_; l++) add_scaled_##SFX(gi, Y + (int64_t)l * m, X[(int64_t)l * n + i], m);      \
        _Pragma("omp simd")                                                                                   \
        for (int64_t j = 0; j < m; j++) gi[j] *= scale * k[j];                                                \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* Backward of c slices on `threads` threads; work: (T + 1) (n + m) elements per thread. */                   \
void sinkhorn_backward_##SFX(const T *Kt, T *G, int64_t c, int64_t n, int64_t m, int64_t ldk, int64_t ldg,    \
                             int T_, T a, T b, const T *us, const T *vs, T scale, T *work, int threads) {     \
    (void)threads; /* unused without OpenMP */                                                                \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(threads > 1 && c > 1)")                \
    for (int64_t s = 0; s < c; s++)                                                                           \
        backward_slice_##SFX(Kt, G, s, n, m, ldk, ldg, T_, a, b, us, vs, scale,                               \
                             work + (int64_t)(T_ + 1) * (n + m) * THREAD_INDEX);                              \
}

/* The composed passes' operators on one cache block of R rows of one slice (row blocks: slices larger than the
 * engine takes whole). Per-row vectors are the block's R rows, per-column vectors the slice's m columns. */
#define DEFINE_ROW_BLOCKS(T, SFX, EXP)                                                                        \
                                                                                                              \
/* The forward's first sweep over a block: x (R, m) the scores in, E = e^{x - r_i - t_j} out, with r_i the row \
 * maxima (rs) and t_j the block's column maxima of x - r_i (t); u_i = a_i / (sum_j E_ij e^{t_j} + [a_i = 0]); \
 * the column sums col_j = sum_i e^{x_ij - r_i - top_j} u_i over the blocks so far, rescaled as top_j, the    \
 * running maximum of t_j, rises (the online shift). work: 2 m elements. */                                   \
void rows_first_##SFX(T *x, int64_t R, int64_t m, const T *a, T *rs, T *t, T *u, T *col, T *top, T *work) {   \
    for (int64_t j = 0; j < m; j++) { t[j] = -INFINITY; work[j] = 0; }                                        \
    for (int64_t i = 0; i < R; i++) {                                                                         \
        T *xi = x + i * m, high = -INFINITY;                                                                  \
        _Pragma("omp simd reduction(max:high)")                                                               \
        for (int64_t j = 0; j < m; j++) high = xi[j] > high ? xi[j] : high;                                   \
        rs[i] = high;                                                                                         \
        _Pragma("omp simd")                                                                                   \
        for (int64_t j = 0; j < m; j++) { T y = xi[j] - high; xi[j] = y; t[j] = y > t[j] ? y : t[j]; }        \
    }                                                                                                         \
    T *w = col == NULL ? NULL : work, *et = work + m; /* the block's own column sums E^T u; e^t */            \
    for (int64_t j = 0; j < m; j++) et[j] = EXP(t[j]);                                                        \
    for (int64_t i = 0; i < R; i++) {                                                                         \
        T *xi = x + i * m, total = 0;                                                                         \
        _Pragma("omp simd reduction(+:total)")                                                                \
        for (int64_t j = 0; j < m; j++) { T e = EXP(xi[j] - t[j]); xi[j] = e; total += e * et[j]; }           \
        T ui = a[i] / (total + (a[i] == 0));                                                                  \
        u[i] = ui;                                                                                            \
        if (w) add_scaled_##SFX(w, xi, ui, m);                                                                \
    }                                                                                                         \
    if (w)                                                                                                    \
        for (int64_t j = 0; j < m; j++) {                                                                     \
            T high = t[j] > top[j] ? t[j] : top[j];                                                           \
            col[j] = col[j] * EXP(top[j] - high) + w[j] * EXP(t[j] - high);                                   \
            top[j] = high;                                                                                    \
        }                                                                                                     \
    else                                                                                                      \
        for (int64_t j = 0; j < m; j++) top[j] = t[j] > top[j] ? t[j] : top[j];                               \
}                                                                                                             \
                                                                                                              \
/* The first sweep's E of a block (R, m) made K~ in place: K_ij = E_ij e^{t_j - c_j}, with t the block's column \
 * maxima and c the column shift (the same exponential as every other K~). work: m elements. */               \
void rows_rescale_##SFX(T *K, int64_t R, int64_t m, const T *t, const T *c, T *work) {                        \
    for (int64_t j = 0; j < m; j++) work[j] = EXP(t[j] - c[j]);                                               \
    for (int64_t i = 0; i < R; i++) {                                                                         \
        T *k = K + i * m;                                                                                     \
        _Pragma("omp simd")                                                                                   \
        for (int64_t j = 0; j < m; j++) k[j] *= work[j];                                                      \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* A sweep over a block of K~ (R, m): u_i = a_i / (sum_j K_ij v_j + [a_i = 0]) and, given col, col_j += sum_i \
 * K_ij u_i. */                                                                                               \
void rows_sweep_##SFX(const T *K, int64_t R, int64_t m, const T *v, const T *a, T *u, T *col) {               \
    for (int64_t i = 0; i < R; i++) {                                                                         \
        const T *k = K + i * m, ui = a[i] / (dot_##SFX(k, v, m) + (a[i] == 0));                               \
        u[i] = ui;                                                                                            \
        if (col) add_scaled_##SFX(col, k, ui, m);                                                             \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* A row step of the backward's reverse recursion over a block of K~ (R, m): total_i = du_i + sum_j K_ij ds_j, \
 * dr_i = total_i f_i and, given col, col_j += sum_i K_ij dr_i. */                                            \
void rows_step_##SFX(const T *K, int64_t R, int64_t m, const T *ds, const T *du, const T *f, T *total, T *dr, \
                     T *col) {                                                                                \
    for (int64_t i = 0; i < R; i++) {                                                                         \
        const T *k = K + i * m;                                                                               \
        total[i] = du[i] + dot_##SFX(k, ds, m);                                                               \
        dr[i] = total[i] * f[i];                                                                              \
        if (col) add_scaled_##SFX(col, k, dr[i], m);                                                          \
    }                                                                                                         \
}

/* Whether this build splits slices over threads (1: built with OpenMP). */
int sinkhorn_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The calling thread's OpenMP thread count as the runtime this library is bound to sees it (1 without OpenMP). */
int sinkhorn_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

DEFINE_PASSES(float, f32, exp_nonpositive_f32)
DEFINE_PASSES(double, f64, exp_nonpositive_f64)
DEFINE_ROW_BLOCKS(float, f32, exp_nonpositive_f32)
DEFINE_ROW_BLOCKS(double, f64, exp_nonpositive_f64)
