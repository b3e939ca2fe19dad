/* Static FP8 (e4m3fn) quantization of weight rows with its error, in one pass over each row.
 *
 * For every element: x = float(w) * inv[row], clamped to +-448 (NaN kept), rounded to the nearest
 * e4m3fn value (ties to even; below 2^-6 to a multiple of 2^-9), stored as its byte; and
 * max |q * scale[row] - float(w)| over the rows (NaN when a weight or a product is not finite).
 * Bit for bit what kernels/codecs/fp8.py's torch path computes (torch's fp32 -> e4m3fn conversion
 * rounds the same way). Built by kernels/codecs/native_fp8.py; `target_clones` picks the AVX-512,
 * AVX2 or baseline body on the CPU it runs on.
 */
#include <stdint.h>
#include <string.h>

#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define E4M3_MAX 448.0f

static inline uint32_t bits_of(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }
static inline float bits_as_float(uint32_t b) { float x; memcpy(&x, &b, 4); return x; }

/* One element: its e4m3fn byte, and |q * s - f| as ordered integer bits (the max of non-negative
 * floats by an integer max; NaN above inf). Branch-free (masks) so that the loop vectorizes. */
static inline uint8_t quantize_one(float f, float v, float s, uint32_t *error) {
    float x = f * v;
    uint32_t xb = bits_of(x);
    uint32_t sign = xb & 0x80000000u;
    uint32_t nan_mask = -(uint32_t)((xb & 0x7fffffffu) > 0x7f800000u);
    float c = x > E4M3_MAX ? E4M3_MAX : x;
    c = c < -E4M3_MAX ? -E4M3_MAX : c;
    uint32_t a = bits_of(c) & 0x7fffffffu; /* NaN: c is NaN too; both results are masked below */
    /* normals (|c| >= 2^-6): RNE to 3 mantissa bits on the fp32 pattern */
    uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    uint32_t normal_code = (((r >> 23) - 120u) << 3) | ((r >> 20) & 7u);
    uint32_t normal_value = r & 0xfff00000u;
    /* subnormals: multiples of 2^-9, RNE through the 2^23 magic number (|c| * 512 < 8) */
    uint32_t normal_mask = -(uint32_t)(a >= 0x3c800000u);
    float scaled = bits_as_float(a & ~normal_mask & ~nan_mask) * 512.0f;
    float rounded = (scaled + 8388608.0f) - 8388608.0f;
    uint32_t sub_code = (uint32_t)(int32_t)rounded; /* 0..8; 8 is the byte of 2^-6 */
    uint32_t sub_value = bits_of(rounded * (1.0f / 512.0f));
    uint32_t code = (normal_code & normal_mask) | (sub_code & ~normal_mask);
    code = (code & ~nan_mask) | (0x7fu & nan_mask);
    uint32_t value = ((normal_value & normal_mask) | (sub_value & ~normal_mask)) | sign;
    value = (value & ~nan_mask) | (xb & nan_mask);
    *error = bits_of(bits_as_float(value) * s - f) & 0x7fffffffu;
    return (uint8_t)(code | (sign >> 24));
}

#define QUANTIZE_ROWS(NAME, T, TO_FLOAT)                                                          \
    CLONES uint32_t NAME(const T *w, int64_t rows, int64_t k, int64_t row_stride, const float *inv, \
                         const float *scale, uint8_t *restrict out, int measure) {                 \
        uint32_t worst = 0;                                                                        \
        for (int64_t i = 0; i < rows; i++) {                                                       \
            const T *restrict src = w + i * row_stride;                                            \
            uint8_t *restrict dst = out + i * k;                                                   \
            const float v = inv[i], s = scale[i];                                                  \
            uint32_t row_worst = 0;                                                                \
            for (int64_t j = 0; j < k; j++) {                                                      \
                uint32_t e;                                                                        \
                dst[j] = quantize_one(TO_FLOAT(src[j]), v, s, &e);                                 \
                row_worst = e > row_worst ? e : row_worst;                                         \
            }                                                                                      \
            worst = row_worst > worst ? row_worst : worst;                                         \
        }                                                                                          \
        return measure ? worst : 0;                                                                \
    }

static inline float bf16_to_float(uint16_t h) { return bits_as_float((uint32_t)h << 16); }
static inline float same_float(float f) { return f; }

QUANTIZE_ROWS(kiln_fp8_quantize_bf16, uint16_t, bf16_to_float)
QUANTIZE_ROWS(kiln_fp8_quantize_f32, float, same_float)

/* max |w| of each row into amax[row] (NaN when the row has one): sign bits cleared, the patterns of
 * non-negative floats order as integers (NaN above inf). */
#define ROW_ABSMAX(NAME, T, BITS_T, MAGNITUDE, TO_FLOAT)                                           \
    CLONES void NAME(const T *w, int64_t rows, int64_t k, int64_t row_stride, float *amax) {       \
        for (int64_t i = 0; i < rows; i++) {                                                       \
            const BITS_T *restrict src = (const BITS_T *)(w + i * row_stride);                     \
            BITS_T best = 0;                                                                       \
            for (int64_t j = 0; j < k; j++) {                                                      \
                BITS_T m = src[j] & MAGNITUDE;                                                     \
                best = m > best ? m : best;                                                        \
            }                                                                                      \
            amax[i] = TO_FLOAT(best);                                                              \
        }                                                                                          \
    }

static inline float bits_to_float(uint32_t b) { return bits_as_float(b); }

ROW_ABSMAX(kiln_row_absmax_bf16, uint16_t, uint16_t, 0x7fffu, bf16_to_float)
ROW_ABSMAX(kiln_row_absmax_f32, float, uint32_t, 0x7fffffffu, bits_to_float)
