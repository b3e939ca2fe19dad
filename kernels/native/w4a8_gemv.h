/* cpu_w4a8's integer-dot GEMV: 4-bit weights x 8-bit activations (kernels/cpu_w4a8.py).
 *
 * Included by kernels/native/w4a8.c (the kernel's own library) and by the native decode step, so
 * both run the same bodies. Everything here is static; nothing runs at load.
 *
 * Layout, written by the converter (cpu_w4a8.prepare):
 *   codes   (N/16, K/8, 16, 4) uint8: row block b, k chunk c, row r, byte j holds the codes of
 *           k = 8c + j (low nibble) and k = 8c + 4 + j (high nibble) of row 16b + r. A row's 8
 *           codes fill one 32-bit lane, so one 64-byte load is 16 rows x 8 k and `vpdpbusd` takes
 *           the low and the high nibbles as they lie.
 *   scales  (N/16, G, 2, 16) float32: per row block and weight group, the 16 rows' scales, then
 *           their offsets: w = code * scale + offset.
 * Activations, per token and weight group (w4a8_quantize_row): sx = amax / 127,
 * q = rint(x * (127 / amax)) (ties to even), csum = sx * sum(q). Then
 *   y[n] = sum_g (sx_g * scale[g, n]) * sum_k code * q + offset[g, n] * csum_g,
 * the integer sum of a group exact in int32, the rest in fp32.
 *
 * Bodies: AVX-512 VNNI (vpdpbusd, 16 rows per instruction), AVX2 (vpmaddubsw + vpmaddwd, 8 rows),
 * scalar; `w4a8_detect` picks one at run time.
 */
#ifndef KILN_W4A8_GEMV_H
#define KILN_W4A8_GEMV_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define W4A8_ROWS 16        /* rows per block */
#define W4A8_CHUNK_K 8      /* k per 64-byte chunk */
#define W4A8_CHUNK_BYTES 64 /* 16 rows x 8 codes */
#define W4A8_TILE 8         /* tokens sharing each weight load (AVX-512, scalar) */
#define W4A8_TILE_AVX2 4
#ifndef W4A8_PREFETCH_BYTES
#define W4A8_PREFETCH_BYTES 4096 /* how far ahead of the code stream a pass asks for it */
#endif

#define W4A8_ATTR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define W4A8_ATTR_AVX2 __attribute__((target("avx2,fma")))
#define W4A8_INLINE static inline __attribute__((always_inline))

enum { W4A8_SCALAR = 0, W4A8_AVX2 = 1, W4A8_AVX512 = 2 };

static inline int w4a8_detect(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return W4A8_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return W4A8_AVX2;
    return W4A8_SCALAR;
}

typedef struct {
    int32_t n, k, group;
    const uint8_t *codes; /* (N/16, K/8, 16, 4) */
    const float *scales;  /* (N/16, G, 2, 16) */
} w4a8_weight;

typedef struct {
    const int8_t *q;   /* (M, K) */
    const float *sx;   /* (M, G) */
    const float *csum; /* (M, G) sx * sum(q) */
} w4a8_acts;

/* ---------------------------------------------------------------- activations */

/* the sum of 8 int32 lanes */
W4A8_ATTR_AVX2 static inline int32_t w4a8_hsum_epi32_256(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static void w4a8_quantize_row_scalar(const float *x, int k, int group, int8_t *q, float *sx, float *csum) {
    for (int g0 = 0, g = 0; g0 < k; g0 += group, g++) {
        float amax = 0.0f;
        for (int i = g0; i < g0 + group; i++) {
            const float a = fabsf(x[i]);
            amax = a > amax ? a : amax;
        }
        if (!(amax > 0.0f)) {
            memset(q + g0, 0, (size_t)group);
            sx[g] = 0.0f, csum[g] = 0.0f;
            continue;
        }
        const float inv = 127.0f / amax;
        int sum = 0;
        for (int i = g0; i < g0 + group; i++) {
            float v = nearbyintf(x[i] * inv);
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            q[i] = (int8_t)v;
            sum += (int)v;
        }
        sx[g] = amax / 127.0f;
        csum[g] = sx[g] * (float)sum;
    }
}

/* the same numbers, 8 at a time (group % 8 == 0): cvtps2dq rounds to nearest even as nearbyintf */
W4A8_ATTR_AVX2 static void w4a8_quantize_row_avx2(const float *x, int k, int group, int8_t *q, float *sx,
                                                  float *csum) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int g0 = 0, g = 0; g0 < k; g0 += group, g++) {
        __m256 m = _mm256_setzero_ps();
        for (int i = g0; i < g0 + group; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float amax = _mm_cvtss_f32(h);
        if (!(amax > 0.0f)) {
            memset(q + g0, 0, (size_t)group);
            sx[g] = 0.0f, csum[g] = 0.0f;
            continue;
        }
        const __m256 inv = _mm256_set1_ps(127.0f / amax);
        __m256i sum = _mm256_setzero_si256();
        for (int i = g0; i < g0 + group; i += 8) {
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv)); /* |v| <= 127 */
            sum = _mm256_add_epi32(sum, v);
            const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(w16, w16));
        }
        sx[g] = amax / 127.0f;
        csum[g] = sx[g] * (float)w4a8_hsum_epi32_256(sum);
    }
}

/* M tokens x (M, K) -> their quantized activations (q (M, K), sx and csum (M, G)) */
static void w4a8_quantize(int level, const float *x, int m_rows, int k, int group, int8_t *q, float *sx,
                          float *csum) {
    const int g = k / group;
    for (int m = 0; m < m_rows; m++) {
        const float *xm = x + (size_t)m * k;
        int8_t *qm = q + (size_t)m * k;
        if (level >= W4A8_AVX2 && group % 8 == 0)
            w4a8_quantize_row_avx2(xm, k, group, qm, sx + (size_t)m * g, csum + (size_t)m * g);
        else
            w4a8_quantize_row_scalar(xm, k, group, qm, sx + (size_t)m * g, csum + (size_t)m * g);
    }
}

static inline int32_t w4a8_load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---------------------------------------------------------------- AVX-512 VNNI */

/* Row block b for tokens [m0, m0 + T): y (M, N) columns 16b .. 16b + 15. */
W4A8_INLINE W4A8_ATTR_AVX512 void w4a8_tile_avx512(const w4a8_weight *W, const w4a8_acts *A, int m0, const int T,
                                                  int b, float *y) {
    const int K = W->k, gs = W->group, G = K / gs, N = W->n, chunks = gs / W4A8_CHUNK_K;
    const uint8_t *p = W->codes + (size_t)b * (W4A8_ROWS / 2) * K;
    const float *sc = W->scales + (size_t)b * G * 2 * W4A8_ROWS;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 out[W4A8_TILE];
    for (int t = 0; t < T; t++) out[t] = _mm512_setzero_ps();
    for (int i = 0; i < G * 2 * W4A8_ROWS; i += 16) /* the next block's scales */
        _mm_prefetch((const char *)(sc + (size_t)G * 2 * W4A8_ROWS + i), _MM_HINT_T0);
    for (int g = 0; g < G; g++) {
        /* the low and the high nibbles into separate sums: two dependency chains per token, so that
         * a few tokens are not held to one vpdpbusd latency per instruction */
        __m512i acc_lo[W4A8_TILE], acc_hi[W4A8_TILE];
        for (int t = 0; t < T; t++) acc_lo[t] = acc_hi[t] = _mm512_setzero_si512();
        const int8_t *xq = A->q + (size_t)m0 * K + (size_t)g * gs;
        for (int c = 0; c < chunks; c++, p += W4A8_CHUNK_BYTES, xq += W4A8_CHUNK_K) {
            _mm_prefetch((const char *)p + W4A8_PREFETCH_BYTES, _MM_HINT_T0);
            const __m512i w = _mm512_loadu_si512((const void *)p);
            const __m512i lo = _mm512_and_si512(w, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(w, 4), low);
            for (int t = 0; t < T; t++) {
                const int8_t *xt = xq + (size_t)t * K;
                acc_lo[t] = _mm512_dpbusd_epi32(acc_lo[t], lo, _mm512_set1_epi32(w4a8_load4(xt)));
                acc_hi[t] = _mm512_dpbusd_epi32(acc_hi[t], hi, _mm512_set1_epi32(w4a8_load4(xt + 4)));
            }
        }
        const __m512 s = _mm512_loadu_ps(sc + (size_t)g * 2 * W4A8_ROWS);
        const __m512 o = _mm512_loadu_ps(sc + (size_t)g * 2 * W4A8_ROWS + W4A8_ROWS);
        for (int t = 0; t < T; t++) {
            const size_t at = (size_t)(m0 + t) * G + g;
            const __m512i acc = _mm512_add_epi32(acc_lo[t], acc_hi[t]);
            out[t] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(A->sx[at])), _mm512_cvtepi32_ps(acc), out[t]);
            out[t] = _mm512_fmadd_ps(o, _mm512_set1_ps(A->csum[at]), out[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(y + (size_t)(m0 + t) * N + (size_t)b * W4A8_ROWS, out[t]);
}

W4A8_ATTR_AVX512 static void w4a8_rows_avx512(const w4a8_weight *W, const w4a8_acts *A, int m_rows, int b0, int b1,
                                             float *y) {
    for (int b = b0; b < b1; b++)
        for (int m0 = 0; m0 < m_rows; m0 += W4A8_TILE) {
            switch (m_rows - m0 < W4A8_TILE ? m_rows - m0 : W4A8_TILE) {
            case 1: w4a8_tile_avx512(W, A, m0, 1, b, y); break;
            case 2: w4a8_tile_avx512(W, A, m0, 2, b, y); break;
            case 3: w4a8_tile_avx512(W, A, m0, 3, b, y); break;
            case 4: w4a8_tile_avx512(W, A, m0, 4, b, y); break;
            case 5: w4a8_tile_avx512(W, A, m0, 5, b, y); break;
            case 6: w4a8_tile_avx512(W, A, m0, 6, b, y); break;
            case 7: w4a8_tile_avx512(W, A, m0, 7, b, y); break;
            default: w4a8_tile_avx512(W, A, m0, 8, b, y); break;
            }
        }
}

/* ---------------------------------------------------------------- AVX2 */

/* Half `half` (8 rows) of row block b for tokens [m0, m0 + T). */
W4A8_INLINE W4A8_ATTR_AVX2 void w4a8_tile_avx2(const w4a8_weight *W, const w4a8_acts *A, int m0, const int T, int b,
                                              int half, float *y) {
    const int K = W->k, gs = W->group, G = K / gs, N = W->n, chunks = gs / W4A8_CHUNK_K;
    const uint8_t *p = W->codes + (size_t)b * (W4A8_ROWS / 2) * K + (size_t)half * 32;
    const float *sc = W->scales + (size_t)b * G * 2 * W4A8_ROWS + (size_t)half * 8;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 out[W4A8_TILE_AVX2];
    for (int t = 0; t < T; t++) out[t] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m256i acc[W4A8_TILE_AVX2];
        for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_si256();
        const int8_t *xq = A->q + (size_t)m0 * K + (size_t)g * gs;
        for (int c = 0; c < chunks; c++, p += W4A8_CHUNK_BYTES, xq += W4A8_CHUNK_K) {
            if (half == 0) _mm_prefetch((const char *)p + W4A8_PREFETCH_BYTES, _MM_HINT_T0);
            const __m256i w = _mm256_loadu_si256((const __m256i *)p);
            const __m256i lo = _mm256_and_si256(w, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(w, 4), low);
            for (int t = 0; t < T; t++) {
                const int8_t *xt = xq + (size_t)t * K;
                /* |4 products| <= 4 * 15 * 127: the 16-bit pair sums cannot saturate */
                const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(w4a8_load4(xt))),
                                                       _mm256_maddubs_epi16(hi, _mm256_set1_epi32(w4a8_load4(xt + 4))));
                acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(pairs, ones));
            }
        }
        const __m256 s = _mm256_loadu_ps(sc + (size_t)g * 2 * W4A8_ROWS);
        const __m256 o = _mm256_loadu_ps(sc + (size_t)g * 2 * W4A8_ROWS + W4A8_ROWS);
        for (int t = 0; t < T; t++) {
            const size_t at = (size_t)(m0 + t) * G + g;
            out[t] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(A->sx[at])), _mm256_cvtepi32_ps(acc[t]), out[t]);
            out[t] = _mm256_fmadd_ps(o, _mm256_set1_ps(A->csum[at]), out[t]);
        }
    }
    for (int t = 0; t < T; t++)
        _mm256_storeu_ps(y + (size_t)(m0 + t) * N + (size_t)b * W4A8_ROWS + (size_t)half * 8, out[t]);
}

W4A8_ATTR_AVX2 static void w4a8_rows_avx2(const w4a8_weight *W, const w4a8_acts *A, int m_rows, int b0, int b1,
                                         float *y) {
    for (int b = b0; b < b1; b++)
        for (int half = 0; half < 2; half++)
            for (int m0 = 0; m0 < m_rows; m0 += W4A8_TILE_AVX2) {
                switch (m_rows - m0 < W4A8_TILE_AVX2 ? m_rows - m0 : W4A8_TILE_AVX2) {
                case 1: w4a8_tile_avx2(W, A, m0, 1, b, half, y); break;
                case 2: w4a8_tile_avx2(W, A, m0, 2, b, half, y); break;
                case 3: w4a8_tile_avx2(W, A, m0, 3, b, half, y); break;
                default: w4a8_tile_avx2(W, A, m0, 4, b, half, y); break;
                }
            }
}

/* ---------------------------------------------------------------- scalar */

static void w4a8_rows_scalar(const w4a8_weight *W, const w4a8_acts *A, int m_rows, int b0, int b1, float *y) {
    const int K = W->k, gs = W->group, G = K / gs, N = W->n;
    for (int b = b0; b < b1; b++) {
        const uint8_t *block = W->codes + (size_t)b * (W4A8_ROWS / 2) * K;
        const float *sc = W->scales + (size_t)b * G * 2 * W4A8_ROWS;
        for (int m = 0; m < m_rows; m++)
            for (int r = 0; r < W4A8_ROWS; r++) {
                float out = 0.0f;
                for (int g = 0; g < G; g++) {
                    int32_t acc = 0;
                    for (int kk = g * gs; kk < (g + 1) * gs; kk += W4A8_CHUNK_K) {
                        const uint8_t *lane = block + (size_t)(kk / W4A8_CHUNK_K) * W4A8_CHUNK_BYTES + r * 4;
                        const int8_t *xq = A->q + (size_t)m * K + kk;
                        for (int j = 0; j < 4; j++) acc += (lane[j] & 15) * xq[j] + (lane[j] >> 4) * xq[j + 4];
                    }
                    const size_t at = (size_t)m * G + g;
                    out += sc[g * 2 * W4A8_ROWS + r] * A->sx[at] * (float)acc;
                    out += sc[g * 2 * W4A8_ROWS + W4A8_ROWS + r] * A->csum[at];
                }
                y[(size_t)m * N + (size_t)b * W4A8_ROWS + r] = out;
            }
    }
}

/* Rows [16 b0, 16 b1) of y (M, N) from quantized activations, with the body of `level`. */
static void w4a8_rows(int level, const w4a8_weight *W, const w4a8_acts *A, int m_rows, int b0, int b1, float *y) {
    if (b0 >= b1) return;
    if (level == W4A8_AVX512) w4a8_rows_avx512(W, A, m_rows, b0, b1, y);
    else if (level == W4A8_AVX2) w4a8_rows_avx2(W, A, m_rows, b0, b1, y);
    else w4a8_rows_scalar(W, A, m_rows, b0, b1, y);
}

/* floats of scratch the quantized activations of M tokens take (q, sx, csum; 64-byte multiples) */
static inline size_t w4a8_scratch_floats(int m_rows, int k, int group) {
    const size_t q = ((size_t)m_rows * k + 63) / 64 * 16, g = ((size_t)m_rows * (k / group) + 15) / 16 * 16;
    return q + 2 * g;
}

/* Carve the activations of M tokens out of `scratch` (w4a8_scratch_floats of them). */
static inline w4a8_acts w4a8_acts_in(float *scratch, int m_rows, int k, int group, int8_t **q, float **sx,
                                     float **csum) {
    const size_t qf = ((size_t)m_rows * k + 63) / 64 * 16, g = ((size_t)m_rows * (k / group) + 15) / 16 * 16;
    *q = (int8_t *)scratch;
    *sx = scratch + qf;
    *csum = scratch + qf + g;
    return (w4a8_acts){*q, *sx, *csum};
}

#endif
