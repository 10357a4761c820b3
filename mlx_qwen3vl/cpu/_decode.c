/* The work between the weight GEMVs of a CPU decode step, in C (see cpu/decode.py).
 *
 * A decode step streams the decoder's weights through ~200 numpy GEMVs. Everything between them
 * (RMS norms, q/k norm and rotary, attention over the KV cache, SwiGLU) runs with caches the last
 * GEMV has just flushed, so its cost is set by how many calls it takes: four C calls per layer
 * instead of numpy's many (NumpyOps; both timed in benchmarks/README.md, "What bounds each
 * figure"). The attention reads each cached key and value once for all query heads of its group.
 *
 * Same float32 formulas as the numpy versions; only the summation order (and exp, a polynomial
 * within ~2 ulp) differ. Arrays must be C-contiguous float32 (checked, with the sizes); what the
 * axes mean is the caller's contract, documented at each entry point.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One build runs on any x86-64, with AVX2/FMA loops where the CPU has them (GCC's ifunc). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define VECTOR_512
#else
#define VECTOR_CLONES
#endif

/* exp over float32 lanes: 2^n * p(r) with r = x - n ln2 (Cephes' polynomial, within ~2 ulp).
 * Below the smallest normal result it gives 0, above ~88.38 +inf (expf overflows at 88.72). GCC
 * vector extensions, so the loop is SIMD on any target (the compiler won't vectorize the scalar
 * form without -ffast-math, which would also drop the inf/NaN semantics the softmax relies on). */
#pragma GCC diagnostic ignored "-Wpsabi" /* static inline helpers only: no ABI crosses a boundary */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define EXP_LO -87.3365f
#define EXP_HI 88.3762626647949f

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
static inline v8f pick(v8i mask, v8f a, v8f b) { return (v8f)((mask & (v8i)a) | (~mask & (v8i)b)); }
static inline v8f vmax(v8f a, v8f b) { return pick(a > b, a, b); }

static inline v8f exp8(v8f x) {
    v8f c = pick(x < splat(EXP_LO), splat(EXP_LO), pick(x > splat(EXP_HI), splat(EXP_HI), x));
    v8f t = c * splat(1.44269504088896341f);
    v8i n = __builtin_convertvector(t + pick(t < splat(0.0f), splat(-0.5f), splat(0.5f)), v8i);
    v8f nf = __builtin_convertvector(n, v8f);
    v8f r = c - nf * splat(0.693359375f) + nf * splat(2.12194440e-4f);
    v8f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    v8f y = p * (v8f)((n + 127) << 23);
    y = pick(x < splat(EXP_LO), splat(0.0f), y);
    return pick(x > splat(EXP_HI), splat(INFINITY), y);
}

static inline v8f load8(const float *a) {
    v8f v;
    memcpy(&v, a, sizeof v);
    return v;
}

static inline void store8(float *a, v8f v) { memcpy(a, &v, sizeof v); }

/* a[i] = exp(a[i] - shift); the last n % 8 through a padded copy */
static inline void exp_shifted(float *a, float shift, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) store8(a + i, exp8(load8(a + i) - splat(shift)));
    if (i < n) {
        float tail[8] = {0};
        memcpy(tail, a + i, (size_t)(n - i) * sizeof(float));
        store8(tail, exp8(load8(tail) - splat(shift)));
        memcpy(a + i, tail, (size_t)(n - i) * sizeof(float));
    }
}

static inline float max_of(const float *a, Py_ssize_t n) {
    v8f m = splat(a[0]);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) m = vmax(m, load8(a + i));
    float best = a[0];
    for (int j = 0; j < 8; j++) best = m[j] > best ? m[j] : best;
    for (; i < n; i++) best = a[i] > best ? a[i] : best;
    return best;
}


static inline float dot(const float *a, const float *b, Py_ssize_t n) {
    float s = 0.0f;
    for (Py_ssize_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ---- buffers ---------------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    float *data;
    Py_ssize_t n;
} fbuf;

static int get_f32(PyObject *obj, fbuf *b, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0) return -1;
    const char *f = b->view.format;
    if (b->view.itemsize != 4 || !f || !(strcmp(f, "f") == 0 || strcmp(f, "<f") == 0 || strcmp(f, "=f") == 0)) {
        PyBuffer_Release(&b->view);
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous float32 array", name);
        return -1;
    }
    b->data = (float *)b->view.buf;
    b->n = b->view.len / 4;
    return 0;
}

static void release(fbuf *bufs, int count) {
    for (int i = 0; i < count; i++) PyBuffer_Release(&bufs[i].view);
}

/* The end of every entry point: release the buffers, then None, or NULL with the error set. */
static PyObject *finish(fbuf *b, int count, int ok) {
    release(b, count);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* All of objs as float32 buffers, writable where `access` says 'w'; on failure none stays held. */
static int get_all(PyObject *const *objs, const char *const *names, const char *access, int count, fbuf *b) {
    for (int i = 0; i < count; i++)
        if (get_f32(objs[i], &b[i], access[i] == 'w', names[i]) < 0) {
            release(b, i);
            return -1;
        }
    return 0;
}

#define NEED(cond, msg)                                  \
    do {                                                 \
        if (!(cond)) {                                   \
            PyErr_SetString(PyExc_ValueError, msg);      \
            goto fail;                                   \
        }                                                \
    } while (0)

/* ---- kernels ---------------------------------------------------------------------------- */

VECTOR_CLONES
static void rms_norm_rows(float *x, const float *delta, const float *w, float eps, float *out,
                          Py_ssize_t rows, Py_ssize_t d) {
    for (Py_ssize_t i = 0; i < rows; i++) {
        float *xi = x + i * d, *oi = out + i * d;
        if (delta)
            for (Py_ssize_t j = 0; j < d; j++) xi[j] += delta[i * d + j];
        float ss = dot(xi, xi, d) / (float)d + eps;
        float scale = 1.0f / sqrtf(ss);
        for (Py_ssize_t j = 0; j < d; j++) oi[j] = xi[j] * scale * w[j];
    }
}

VECTOR_CLONES
static void qk_norm_rope_heads(float *qkv, Py_ssize_t batch, Py_ssize_t all_heads, Py_ssize_t heads,
                               Py_ssize_t q_heads, Py_ssize_t hd, const float *qw, const float *kw,
                               float eps, const float *cos, const float *sin, float *tmp) {
    Py_ssize_t half = hd / 2;
    for (Py_ssize_t b = 0; b < batch; b++) {
        const float *c = cos + b * hd, *s = sin + b * hd;
        for (Py_ssize_t h = 0; h < heads; h++) {
            float *a = qkv + (b * all_heads + h) * hd;
            const float *w = h < q_heads ? qw : kw;
            float scale = 1.0f / sqrtf(dot(a, a, hd) / (float)hd + eps);
            for (Py_ssize_t j = 0; j < hd; j++) tmp[j] = a[j] * scale * w[j];
            for (Py_ssize_t j = 0; j < half; j++) a[j] = tmp[j] * c[j] - tmp[j + half] * s[j];
            for (Py_ssize_t j = half; j < hd; j++) a[j] = tmp[j] * c[j] + tmp[j - half] * s[j];
        }
    }
}

static inline float hsum(v8f a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* q . k for head-size vectors, two accumulator chains, the row read front to back. Reading keys
 * strictly in order matters more than anything else here: rows interleaved (four keys at a time)
 * stream a cold cache slower than one row at a time (benchmarks/README.md). */
static inline float dot_row(const float *q, const float *k, Py_ssize_t hd) {
    if (hd % 16) return dot(q, k, hd);
    v8f a0 = splat(0.0f), a1 = a0;
    for (Py_ssize_t j = 0; j < hd; j += 16) a0 += load8(q + j) * load8(k + j), a1 += load8(q + j + 8) * load8(k + j + 8);
    return hsum(a0 + a1);
}

/* One query token per sequence against the cache's S earlier positions and the new key/value.
 * qkv (B, nq + 2 nkv, hd): the rotated queries, then the new keys, then the new values. keys /
 * values (B, nkv, cap, hd) are the cache's buffers (positions >= S unused). out (B, nq * hd).
 * Same math as decode.attend_cached: softmax((q * scale) . k - max) over the cached keys
 * and the new one, the weighted values summed, then divided by the weights' total.
 *
 * Memory access decides the speed: each key and value row is read once for every query head of
 * the group, front to back, in four streams (positions s, s + S/4, s + S/2, s + 3S/4 side by
 * side), which keeps more reads in flight than one core's prefetcher does for a single stream
 * (four streams against one and two: benchmarks/README.md, "What bounds each figure"). */
VECTOR_CLONES
static void attend_group(const float *qkv, const float *keys, const float *values, float *out,
                         float *scores, float *qs, Py_ssize_t b, Py_ssize_t g, Py_ssize_t nq,
                         Py_ssize_t nkv, Py_ssize_t hd, Py_ssize_t cap, Py_ssize_t S, float scale) {
    Py_ssize_t rep = nq / nkv, all = nq + 2 * nkv, row = S + 1, q = S / 4;
    const float *K = keys + (b * nkv + g) * cap * hd, *V = values + (b * nkv + g) * cap * hd;
    const float *knew = qkv + (b * all + nq + g) * hd, *vnew = qkv + (b * all + nq + nkv + g) * hd;
    float *o = out + (b * nq + g * rep) * hd;  /* the group's rep output heads, hd apart */
    for (Py_ssize_t r = 0; r < rep; r++)
        for (Py_ssize_t j = 0; j < hd; j++) qs[r * hd + j] = qkv[(b * all + g * rep + r) * hd + j] * scale;
    for (Py_ssize_t s = 0; s < q; s++)
        for (Py_ssize_t r = 0; r < rep; r++)
            for (Py_ssize_t t = 0; t < 4; t++)
                scores[r * row + s + t * q] = dot_row(qs + r * hd, K + (s + t * q) * hd, hd);
    for (Py_ssize_t s = 4 * q; s < S; s++)
        for (Py_ssize_t r = 0; r < rep; r++) scores[r * row + s] = dot_row(qs + r * hd, K + s * hd, hd);
    for (Py_ssize_t r = 0; r < rep; r++) {
        float *sc = scores + r * row;
        sc[S] = dot_row(qs + r * hd, knew, hd);
        exp_shifted(sc, max_of(sc, row), row);
    }
    memset(o, 0, rep * hd * sizeof(float));
    for (Py_ssize_t s = 0; s < q; s++) {
        const float *v0 = V + s * hd, *v1 = v0 + q * hd, *v2 = v1 + q * hd, *v3 = v2 + q * hd;
        for (Py_ssize_t r = 0; r < rep; r++) {
            const float *w = scores + r * row + s;
            float x0 = w[0], x1 = w[q], x2 = w[2 * q], x3 = w[3 * q], *or = o + r * hd;
            for (Py_ssize_t j = 0; j < hd; j++) or[j] += x0 * v0[j] + x1 * v1[j] + x2 * v2[j] + x3 * v3[j];
        }
    }
    for (Py_ssize_t s = 4 * q; s < S; s++)
        for (Py_ssize_t r = 0; r < rep; r++) {
            float x = scores[r * row + s], *or = o + r * hd;
            for (Py_ssize_t j = 0; j < hd; j++) or[j] += x * V[s * hd + j];
        }
    for (Py_ssize_t r = 0; r < rep; r++) {
        float *sc = scores + r * row, *or = o + r * hd;
        float total = 0.0f;
        for (Py_ssize_t s = 0; s < row; s++) total += sc[s];
        for (Py_ssize_t j = 0; j < hd; j++) or[j] = (or[j] + sc[S] * vnew[j]) / total;
    }
}

/* One row of a quantized cache as float32: codes (hd * bits / 8 bytes, element j in bits
 * [j * bits, (j + 1) * bits), MLX's packing), times its group's scale, plus its bias. */
static inline void dequant_row(const uint8_t *codes, const float *scales, const float *biases, Py_ssize_t hd,
                               Py_ssize_t gs, int bits, float *out) {
    for (Py_ssize_t g = 0; g < hd / gs; g++) {
        float sc = scales[g], bi = biases[g];
        float *o = out + g * gs;
        if (bits == 8) {
            const uint8_t *c = codes + g * gs;
            for (Py_ssize_t j = 0; j < gs; j++) o[j] = (float)c[j] * sc + bi;
        } else {
            const uint8_t *c = codes + g * gs / 2;
            for (Py_ssize_t j = 0; j < gs / 2; j++) {
                o[2 * j] = (float)(c[j] & 15) * sc + bi;
                o[2 * j + 1] = (float)(c[j] >> 4) * sc + bi;
            }
        }
    }
}

/* attend_group over a quantized cache: each cached key and value row is read once (its codes,
 * scales and biases, a third to a sixth of a float32 row's bytes) into one row of float32 on the
 * stack for all query heads of the group; nothing larger is ever dequantized. knew / vnew (the
 * step's own key and value) come in qkv already as the cache will hold them. */
VECTOR_CLONES
static void attend_group_quantized(const float *qkv, const uint8_t *kc, const float *ks, const float *kb,
                                   const uint8_t *vc, const float *vs, const float *vb, float *out, float *scores,
                                   float *qs, float *row, Py_ssize_t b, Py_ssize_t g, Py_ssize_t nq, Py_ssize_t nkv,
                                   Py_ssize_t hd, Py_ssize_t cap, Py_ssize_t S, float scale, int bits, Py_ssize_t gs) {
    Py_ssize_t rep = nq / nkv, all = nq + 2 * nkv, n = S + 1, bytes = hd * bits / 8, G = hd / gs;
    Py_ssize_t head = b * nkv + g;
    const uint8_t *K = kc + head * cap * bytes, *V = vc + head * cap * bytes;
    const float *Ks = ks + head * cap * G, *Kb = kb + head * cap * G, *Vs = vs + head * cap * G, *Vb = vb + head * cap * G;
    const float *knew = qkv + (b * all + nq + g) * hd, *vnew = qkv + (b * all + nq + nkv + g) * hd;
    float *o = out + (b * nq + g * rep) * hd;
    for (Py_ssize_t r = 0; r < rep; r++)
        for (Py_ssize_t j = 0; j < hd; j++) qs[r * hd + j] = qkv[(b * all + g * rep + r) * hd + j] * scale;
    for (Py_ssize_t s = 0; s < S; s++) {
        dequant_row(K + s * bytes, Ks + s * G, Kb + s * G, hd, gs, bits, row);
        for (Py_ssize_t r = 0; r < rep; r++) scores[r * n + s] = dot_row(qs + r * hd, row, hd);
    }
    for (Py_ssize_t r = 0; r < rep; r++) {
        float *sc = scores + r * n;
        sc[S] = dot_row(qs + r * hd, knew, hd);
        exp_shifted(sc, max_of(sc, n), n);
    }
    memset(o, 0, rep * hd * sizeof(float));
    for (Py_ssize_t s = 0; s < S; s++) {
        dequant_row(V + s * bytes, Vs + s * G, Vb + s * G, hd, gs, bits, row);
        for (Py_ssize_t r = 0; r < rep; r++) {
            float w = scores[r * n + s], *or = o + r * hd;
            for (Py_ssize_t j = 0; j < hd; j++) or[j] += w * row[j];
        }
    }
    for (Py_ssize_t r = 0; r < rep; r++) {
        float *sc = scores + r * n, *or = o + r * hd;
        float total = 0.0f;
        for (Py_ssize_t s = 0; s < n; s++) total += sc[s];
        for (Py_ssize_t j = 0; j < hd; j++) or[j] = (or[j] + sc[S] * vnew[j]) / total;
    }
}

VECTOR_CLONES
static void silu_mul_vec(const float *g, const float *u, float *out, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f x = load8(g + i);
        store8(out + i, x / (splat(1.0f) + exp8(-x)) * load8(u + i));
    }
    for (; i < n; i++) {
        float tail[8] = {g[i]};
        v8f e = exp8(-load8(tail));
        out[i] = g[i] / (1.0f + e[0]) * u[i];
    }
}

/* ---- Python entry points ------------------------------------------------------------------ */

/* rms_norm(x, delta, weight, eps, out): x += delta (unless None), then out = x * rsqrt(mean(x^2) +
 * eps) * weight, row by row over x's last axis (weight's length). */
static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    fbuf b[4];
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "rms_norm takes 5 arguments"), NULL;
    int has_delta = args[1] != Py_None;
    float eps = (float)PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) return NULL;
    PyObject *objs[4] = {args[0], has_delta ? args[1] : args[0], args[2], args[4]};
    const char *names[4] = {"x", "delta", "weight", "out"};
    if (get_all(objs, names, "wrrw", 4, b) < 0) return NULL;
    Py_ssize_t d = b[2].n;
    NEED(d > 0 && b[0].n % d == 0 && b[1].n == b[0].n && b[3].n == b[0].n, "rms_norm: shapes do not match");
    Py_BEGIN_ALLOW_THREADS
    rms_norm_rows(b[0].data, has_delta ? b[1].data : NULL, b[2].data, eps, b[3].data, b[0].n / d, d);
    Py_END_ALLOW_THREADS
    return finish(b, 4, 1);
fail:
    return finish(b, 4, 0);
}

/* qk_norm_rope(qkv, q_heads, k_heads, q_weight, k_weight, eps, cos, sin): in place on qkv (B,
 * q_heads + 2 k_heads, hd): RMS norm of each q head (q_weight) and k head (k_weight), then the
 * rotate-half rotary with cos / sin (B, hd). The v heads are left as they are. */
static PyObject *py_qk_norm_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    fbuf b[5];
    if (nargs != 8) return PyErr_Format(PyExc_TypeError, "qk_norm_rope takes 8 arguments"), NULL;
    Py_ssize_t nq = PyLong_AsSsize_t(args[1]), nkv = PyLong_AsSsize_t(args[2]);
    float eps = (float)PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    PyObject *objs[5] = {args[0], args[3], args[4], args[6], args[7]};
    const char *names[5] = {"qkv", "q_weight", "k_weight", "cos", "sin"};
    if (get_all(objs, names, "wrrrr", 5, b) < 0) return NULL;
    Py_ssize_t hd = b[1].n, all = nq + 2 * nkv;
    NEED(hd > 0 && hd % 2 == 0 && b[2].n == hd && nq > 0 && nkv > 0 && b[3].n % hd == 0,
         "qk_norm_rope: shapes do not match");
    Py_ssize_t batch = b[3].n / hd;
    NEED(b[4].n == b[3].n && b[0].n == batch * all * hd, "qk_norm_rope: shapes do not match");
    float *tmp = malloc(sizeof(float) * hd);
    if (!tmp) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    qk_norm_rope_heads(b[0].data, batch, all, nq + nkv, nq, hd, b[1].data, b[2].data, eps, b[3].data, b[4].data, tmp);
    Py_END_ALLOW_THREADS
    free(tmp);
    return finish(b, 5, 1);
fail:
    return finish(b, 5, 0);
}

/* attend(qkv, q_heads, k_heads, head_dim, keys, values, S, scale, out): see attend_group. */
static PyObject *py_attend(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    fbuf b[4];
    float *scratch = NULL;
    if (nargs != 9) return PyErr_Format(PyExc_TypeError, "attend takes 9 arguments"), NULL;
    Py_ssize_t nq = PyLong_AsSsize_t(args[1]), nkv = PyLong_AsSsize_t(args[2]), hd = PyLong_AsSsize_t(args[3]);
    Py_ssize_t S = PyLong_AsSsize_t(args[6]);
    float scale = (float)PyFloat_AsDouble(args[7]);
    if (PyErr_Occurred()) return NULL;
    PyObject *objs[4] = {args[0], args[4], args[5], args[8]};
    const char *names[4] = {"qkv", "keys", "values", "out"};
    if (get_all(objs, names, "rrrw", 4, b) < 0) return NULL;
    NEED(nq > 0 && nkv > 0 && nq % nkv == 0 && hd > 0 && S >= 0, "attend: head counts do not match");
    NEED(b[3].n % (nq * hd) == 0, "attend: out must be (B, q_heads * head_dim)");
    Py_ssize_t batch = b[3].n / (nq * hd), rep = nq / nkv;
    NEED(b[0].n == batch * (nq + 2 * nkv) * hd, "attend: qkv does not match out");
    NEED(b[1].n == b[2].n && b[1].n % (batch * nkv * hd) == 0, "attend: keys / values do not match");
    Py_ssize_t cap = b[1].n / (batch * nkv * hd);
    NEED(S <= cap, "attend: S exceeds the cache's capacity");
    /* One thread: inside a decode step a second one only fights the BLAS's spinning worker for the
     * other core, and the step measured slower with it (benchmarks/README.md). */
    scratch = malloc(sizeof(float) * (rep * (S + 1) + rep * hd));
    if (!scratch) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t bb = 0; bb < batch; bb++)
        for (Py_ssize_t g = 0; g < nkv; g++)
            attend_group(b[0].data, b[1].data, b[2].data, b[3].data, scratch, scratch + rep * (S + 1), bb, g,
                         nq, nkv, hd, cap, S, scale);
    Py_END_ALLOW_THREADS
    free(scratch);
    return finish(b, 4, 1);
fail:
    free(scratch);
    return finish(b, 4, 0);
}

static int get_u8(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = view->format;
    if (view->itemsize != 1 || !f || !(strcmp(f, "B") == 0 || strcmp(f, "<B") == 0 || strcmp(f, "=B") == 0)) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous uint8 array", name);
        return -1;
    }
    return 0;
}

/* attend_quantized(qkv, q_heads, k_heads, head_dim, kdata, kscales, kbiases, vdata, vscales,
 * vbiases, S, scale, bits, group_size, out): attend over a quantized cache (attend_group_quantized):
 * kdata / vdata (B, nkv, cap, hd * bits / 8) uint8, the scales and biases (B, nkv, cap, hd / group_size)
 * float32; bits 4 or 8. */
static PyObject *py_attend_quantized(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    fbuf b[6];
    Py_buffer codes[2];
    float *scratch = NULL;
    int held = 0;
    if (nargs != 15) return PyErr_Format(PyExc_TypeError, "attend_quantized takes 15 arguments"), NULL;
    Py_ssize_t nq = PyLong_AsSsize_t(args[1]), nkv = PyLong_AsSsize_t(args[2]), hd = PyLong_AsSsize_t(args[3]);
    Py_ssize_t S = PyLong_AsSsize_t(args[10]), gs = PyLong_AsSsize_t(args[13]);
    long bits = PyLong_AsLong(args[12]);
    float scale = (float)PyFloat_AsDouble(args[11]);
    if (PyErr_Occurred()) return NULL;
    PyObject *objs[6] = {args[0], args[5], args[6], args[8], args[9], args[14]};
    const char *names[6] = {"qkv", "kscales", "kbiases", "vscales", "vbiases", "out"};
    if (get_all(objs, names, "rrrrrw", 6, b) < 0) return NULL;
    if (get_u8(args[4], &codes[0], "kdata") < 0) goto fail;
    held = 1;
    if (get_u8(args[7], &codes[1], "vdata") < 0) goto fail;
    held = 2;
    NEED(bits == 4 || bits == 8, "attend_quantized: bits must be 4 or 8");
    NEED(nq > 0 && nkv > 0 && nq % nkv == 0 && hd > 0 && S >= 0 && gs > 0 && hd % gs == 0 && gs % 2 == 0,
         "attend_quantized: head counts or group size do not match");
    NEED(b[5].n % (nq * hd) == 0, "attend_quantized: out must be (B, q_heads * head_dim)");
    Py_ssize_t batch = b[5].n / (nq * hd), rep = nq / nkv, bytes = hd * bits / 8, G = hd / gs;
    NEED(b[0].n == batch * (nq + 2 * nkv) * hd, "attend_quantized: qkv does not match out");
    NEED(codes[0].len == codes[1].len && codes[0].len % (batch * nkv * bytes) == 0,
         "attend_quantized: kdata / vdata do not match");
    Py_ssize_t cap = codes[0].len / (batch * nkv * bytes);
    for (int i = 1; i < 5; i++) NEED(b[i].n == batch * nkv * cap * G, "attend_quantized: scales / biases do not match");
    NEED(S <= cap, "attend_quantized: S exceeds the cache's capacity");
    scratch = malloc(sizeof(float) * (rep * (S + 1) + rep * hd + hd));
    if (!scratch) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t bb = 0; bb < batch; bb++)
        for (Py_ssize_t g = 0; g < nkv; g++)
            attend_group_quantized(b[0].data, codes[0].buf, b[1].data, b[2].data, codes[1].buf, b[3].data, b[4].data,
                                   b[5].data, scratch, scratch + rep * (S + 1), scratch + rep * (S + 1) + rep * hd, bb,
                                   g, nq, nkv, hd, cap, S, scale, (int)bits, gs);
    Py_END_ALLOW_THREADS
    free(scratch);
    for (int i = 0; i < held; i++) PyBuffer_Release(&codes[i]);
    return finish(b, 6, 1);
fail:
    free(scratch);
    for (int i = 0; i < held; i++) PyBuffer_Release(&codes[i]);
    return finish(b, 6, 0);
}

/* silu_mul(gate, up, out): out = gate * sigmoid(gate) * up, as gate / (1 + exp(-gate)) * up. */
static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    fbuf b[3];
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "silu_mul takes 3 arguments"), NULL;
    const char *names[3] = {"gate", "up", "out"};
    if (get_all(args, names, "rrw", 3, b) < 0) return NULL;
    NEED(b[1].n == b[0].n && b[2].n == b[0].n, "silu_mul: shapes do not match");
    Py_BEGIN_ALLOW_THREADS
    silu_mul_vec(b[0].data, b[1].data, b[2].data, b[0].n);
    Py_END_ALLOW_THREADS
    return finish(b, 3, 1);
fail:
    return finish(b, 3, 0);
}

/* ---- a few rows against a streamed weight --------------------------------------------- */

/* out[j, n + r] = a[j] . w[n + r] for j < mg, r < nb, in vectors of type VT (W lanes): each
 * step loads the mg rows' lanes once and each of the nb weight rows' once, for mg * nb independent
 * accumulators (enough of them to hide the FMA latency; few enough to stay in registers). */
#define ROWS_TILE(VT, W)                                                                       \
    VT acc[4][MAX_GROUP];                                                                      \
    for (int r = 0; r < nb; r++)                                                               \
        for (int j = 0; j < mg; j++) acc[r][j] = (VT){0};                                      \
    Py_ssize_t k = 0;                                                                          \
    for (; k + W <= K; k += W) {                                                               \
        VT av[MAX_GROUP];                                                                      \
        for (int j = 0; j < mg; j++) memcpy(&av[j], a + j * K + k, sizeof(VT));                \
        for (int r = 0; r < nb; r++) {                                                         \
            VT wv;                                                                             \
            memcpy(&wv, w + (n + r) * K + k, sizeof(VT));                                      \
            for (int j = 0; j < mg; j++) acc[r][j] += wv * av[j];                              \
        }                                                                                      \
    }                                                                                          \
    for (int r = 0; r < nb; r++)                                                               \
        for (int j = 0; j < mg; j++) {                                                         \
            float s = 0.0f;                                                                    \
            for (int l = 0; l < W; l++) s += acc[r][j][l];                                     \
            for (Py_ssize_t kk = k; kk < K; kk++) s += w[(n + r) * K + kk] * a[j * K + kk];    \
            out[j * N + n + r] = s;                                                            \
        }

#define MAX_GROUP 8 /* rows of `a` per pass over a weight panel */
typedef float v16f __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) void tile8(const float *a, const float *w, float *out, Py_ssize_t K,
                                                        Py_ssize_t N, Py_ssize_t n, const int mg, const int nb) {
    ROWS_TILE(v8f, 8)
}

static inline __attribute__((always_inline)) void tile16(const float *a, const float *w, float *out, Py_ssize_t K,
                                                         Py_ssize_t N, Py_ssize_t n, const int mg, const int nb) {
    ROWS_TILE(v16f, 16)
}

/* Weight rows [n0, n1) against the mg rows of `a`, nb weight rows a tile (the last few one by one). */
#define ROWS_PANEL(TILE, NB)                                                                   \
    switch (mg) {                                                                              \
    case 1: ROWS_SPAN(TILE, 1, NB(1)) break;                                                   \
    case 2: ROWS_SPAN(TILE, 2, NB(2)) break;                                                   \
    case 3: ROWS_SPAN(TILE, 3, NB(3)) break;                                                   \
    case 4: ROWS_SPAN(TILE, 4, NB(4)) break;                                                   \
    case 5: ROWS_SPAN(TILE, 5, NB(5)) break;                                                   \
    case 6: ROWS_SPAN(TILE, 6, NB(6)) break;                                                   \
    case 7: ROWS_SPAN(TILE, 7, NB(7)) break;                                                   \
    default: ROWS_SPAN(TILE, 8, NB(8)) break;                                                  \
    }
#define ROWS_SPAN(TILE, MG, NBV)                                                               \
    {                                                                                          \
        Py_ssize_t n = n0;                                                                     \
        for (; n + (NBV) <= n1; n += (NBV)) TILE(a, w, out, K, N, n, MG, NBV);                 \
        for (; n < n1; n++) TILE(a, w, out, K, N, n, MG, 1);                                   \
    }
/* Weight rows per tile for mg rows: 16 AVX2 registers (v8f), 32 AVX-512 ones (v16f: 6 rows x 4 weight rows
 * = 24 accumulators, the widest tile that fits; a tile's shape never changes an element's sum). */
#define NB8(mg) ((mg) <= 2 ? 4 : (mg) <= 3 ? 3 : (mg) <= 5 ? 2 : 1)
#define NB16(mg) ((mg) <= 6 ? 4 : 2)
#define GROUP8 4
#define GROUP16 6
#define PANEL 64 /* weight rows each group of `a` rows reads in turn (from cache after the first) */

static inline __attribute__((always_inline)) void panel8(const float *a, const float *w, float *out, Py_ssize_t K,
                                                         Py_ssize_t N, Py_ssize_t n0, Py_ssize_t n1, int mg) {
    ROWS_PANEL(tile8, NB8)
}

static inline __attribute__((always_inline)) void panel16(const float *a, const float *w, float *out, Py_ssize_t K,
                                                          Py_ssize_t N, Py_ssize_t n0, Py_ssize_t n1, int mg) {
    ROWS_PANEL(tile16, NB16)
}

/* All M rows: one group reads the weight once; more rows go over it a panel at a time, group by
 * group, so the weight still comes from memory once (later groups read the panel from cache). */
#define ROWS_ALL(PANEL_FN, G)                                                                  \
    if (M <= G) {                                                                              \
        PANEL_FN(a, w, out, K, N, n0, n1, (int)M);                                             \
        return;                                                                                \
    }                                                                                          \
    for (Py_ssize_t p = n0; p < n1; p += PANEL) {                                              \
        Py_ssize_t p1 = p + PANEL < n1 ? p + PANEL : n1;                                       \
        for (Py_ssize_t m0 = 0; m0 < M; m0 += G)                                               \
            PANEL_FN(a + m0 * K, w, out + m0 * N, K, N, p, p1, M - m0 < G ? (int)(M - m0) : G); \
    }

VECTOR_CLONES
static void matmul_rows_v8(const float *a, const float *w, float *out, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N,
                           Py_ssize_t n0, Py_ssize_t n1) {
    ROWS_ALL(panel8, GROUP8)
}

#ifdef VECTOR_512
/* AVX-512: twice the lanes per FMA and twice the registers, where the loop is bound by the FMAs
 * (from ~4 rows on) rather than by the weight's memory traffic. */
__attribute__((target("arch=x86-64-v4"))) static void matmul_rows_v16(const float *a, const float *w, float *out,
                                                                      Py_ssize_t M, Py_ssize_t K, Py_ssize_t N,
                                                                      Py_ssize_t n0, Py_ssize_t n1) {
    ROWS_ALL(panel16, GROUP16)
}
#endif

/* The widest vectors this CPU has: 16 lanes (AVX-512) or 8. */
static int rows_lanes(void) {
#ifdef VECTOR_512
    if (__builtin_cpu_supports("x86-64-v4")) return 16;
#endif
    return 8;
}

static void matmul_rows_vec(const float *a, const float *w, float *out, Py_ssize_t M, Py_ssize_t K, Py_ssize_t N,
                            Py_ssize_t n0, Py_ssize_t n1, long lanes) {
#ifdef VECTOR_512
    if (lanes == 16) {
        matmul_rows_v16(a, w, out, M, K, N, n0, n1);
        return;
    }
#endif
    matmul_rows_v8(a, w, out, M, K, N, n0, n1);
}

/* matmul_rows(a (M, K), w (N, K), out (M, N), n0, n1[, lanes]): out[:, n0:n1] = a @ w[n0:n1].T,
 * without the GIL (cpu/kernels.py runs disjoint column ranges on several threads); `lanes` 8 or
 * 16 picks the loop (tests run both; 16 only where the CPU has it), 0 or absent the widest. */
static PyObject *py_matmul_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    fbuf b[3];
    if (nargs != 5 && nargs != 6) return PyErr_Format(PyExc_TypeError, "matmul_rows takes 5 or 6 arguments"), NULL;
    Py_ssize_t n0 = PyLong_AsSsize_t(args[3]), n1 = PyLong_AsSsize_t(args[4]);
    long lanes = nargs == 6 ? PyLong_AsLong(args[5]) : 0;
    if (PyErr_Occurred()) return NULL;
    if (lanes == 0) lanes = rows_lanes();
    if (lanes != 8 && lanes != rows_lanes())
        return PyErr_Format(PyExc_ValueError, "matmul_rows: %ld lanes; this CPU takes 8 or %d", lanes, rows_lanes()),
               NULL;
    const char *names[3] = {"a", "w", "out"};
    if (get_all(args, names, "rrw", 3, b) < 0) return NULL;
    NEED(b[0].view.ndim == 2 && b[1].view.ndim == 2 && b[2].view.ndim == 2, "matmul_rows: 2-D arrays");
    Py_ssize_t M = b[0].view.shape[0], K = b[0].view.shape[1], N = b[1].view.shape[0];
    NEED(b[1].view.shape[1] == K && b[2].view.shape[0] == M && b[2].view.shape[1] == N && 0 <= n0 && n0 <= n1
         && n1 <= N, "matmul_rows: shapes do not match");
    Py_BEGIN_ALLOW_THREADS
    matmul_rows_vec(b[0].data, b[1].data, b[2].data, M, K, N, n0, n1, lanes);
    Py_END_ALLOW_THREADS
    return finish(b, 3, 1);
fail:
    return finish(b, 3, 0);
}

static PyMethodDef methods[] = {
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, NULL},
    {"qk_norm_rope", (PyCFunction)(void (*)(void))py_qk_norm_rope, METH_FASTCALL, NULL},
    {"attend", (PyCFunction)(void (*)(void))py_attend, METH_FASTCALL, NULL},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, METH_FASTCALL, NULL},
    {"attend_quantized", (PyCFunction)(void (*)(void))py_attend_quantized, METH_FASTCALL, NULL},
    {"matmul_rows", (PyCFunction)(void (*)(void))py_matmul_rows, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decode", NULL, -1, methods};

/* cpu/decode.py uses the module only when INTERFACE matches its own: an install built from an older
 * _decode.c (an editable checkout pulled without reinstalling) falls back to numpy instead of
 * failing mid-decode. Bump it with any change to the calls above (a call added, attend_quantized
 * or matmul_rows, is looked up by name: an older build without it runs that one in numpy). */
PyMODINIT_FUNC PyInit__decode(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "INTERFACE", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
