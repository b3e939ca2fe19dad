/* One decode step of a dense Llama-family model (Llama, Mistral, Qwen2, Qwen3) in one native call.
 *
 * The eager forward (runtime/model.py) is the reference: this file computes the same step with the
 * same rounding points — activations rounded to the model's activation dtype (bf16) at every linear
 * layer's input and output, and in an fp32 model where a layer's kernel runs a bf16 torch op at that
 * batch size (its input and its product: cpu_int4's op always, cpu_int8's below its widened GEMM's
 * batch; `bf16_rows`), an fp32 residual stream, RoPE / attention / SwiGLU in fp32, the KV cache
 * written in its own dtype (bf16, fp32 or e4m3 with a per-layer scale) — but without per-op dispatch:
 * every thread of a small spinning pool runs the whole step, splitting each layer's output rows,
 * with a barrier between dependent phases.
 *
 * Weights are read where the loader mapped them, in the layouts the CPU kernels store:
 *   INT4   kernels/cpu_int4.py: torch's CPU int4 pack (N, K/2) uint8 in row blocks of `block_n`,
 *          for each k the block's bytes hold rows (d, d + block_n/2) ("split") or (2d, 2d + 1);
 *          scales_and_zeros (K/op_group, N, 2) bf16; optional exact zero offsets (G, N) fp32.
 *   INT8   kernels/cpu_int8.py: (N, K) int8 and (N,) bf16 scales, times int16-quantized activations (below).
 *   F32 / BF16 / F16  dense (N, K) weights (F16: a tied fp16 embedding as the LM head).
 *   W4A8   kernels/cpu_w4a8.py: 4-bit codes x int8 activations, its bodies included from
 *          kernels/native/w4a8_gemv.h (one home for the kernel and its layout).
 *   W8A8   kernels/cpu_w8a8.py: (N, K) int8 x per-token int8 activations, (N,) fp32 scales; bit for
 *          bit its torch path (exact int32 sums, then sum * scale_t * scale_n).
 * Built by runtime/native_decode.py with the machine's compiler; `target_clones` picks the
 * AVX-512, AVX2 or baseline body of each hot loop on the CPU that loads it.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>

#include "w4a8_gemv.h"

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define MAX_THREADS 64
#define MAX_BATCH 256
#define MAX_GQA 64 /* query heads per kv head */
#ifndef DOTS_PREFETCH_BYTES
#define DOTS_PREFETCH_BYTES 8192
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 6144 /* how far ahead of the int4 stream a step asks for its weights */
#endif

/* the widest body this CPU runs, read once (kiln_pool_start / the first step) */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static int isa = ISA_SCALAR;
static pthread_once_t isa_once = PTHREAD_ONCE_INIT;

static int detected_isa = ISA_SCALAR;
static int detected_w4a8 = W4A8_SCALAR, w4a8_level = W4A8_SCALAR; /* cpu_w4a8's body, under the same cap */

static void detect_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        detected_isa = ISA_AVX512;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        detected_isa = ISA_AVX2;
    isa = detected_isa;
    detected_w4a8 = w4a8_level = w4a8_detect();
}

/* The body in use, capped at `cap` (0 scalar, 1 AVX2, 2 AVX-512; tests run each one): the one set.
   cap < 0 only reads it. */
int kiln_set_isa(int cap) {
    pthread_once(&isa_once, detect_isa);
    if (cap < 0) return isa;
    isa = cap < detected_isa ? cap : detected_isa;
    w4a8_level = cap < detected_w4a8 ? cap : detected_w4a8;
    return isa;
}

enum { W_INT4 = 0, W_INT8 = 1, W_F32 = 2, W_BF16 = 3, W_F16 = 4, W_W4A8 = 5, W_W8A8 = 6 };
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2 };

typedef struct {
    int32_t kind, n, k;
    int32_t block_n, split, op_group; /* INT4; W4A8: op_group is the weight group */
    int32_t zo_groups;                /* INT4: rows of zero_offsets, 0 when none */
    int32_t round_out;                /* round the output to bf16 */
    int32_t bf16_rows;                /* below this many tokens the kernel's torch op is bf16 in and out:
                                         its input and its product (before the bias) are rounded */
    const void *weight;               /* INT4 (N, K/2) u8 | INT8 (N, K) i8 | (N, K) f32 / bf16 | W4A8 codes */
    const uint16_t *scales;           /* INT4 (K/op_group, N, 2) bf16 | INT8 (N,) bf16 */
    const float *zero_offsets;        /* INT4 (zo_groups, N) */
    const float *bias;                /* (N,) or NULL */
    const float *scales32;            /* W4A8 (N/16, G, 2, 16) | W8A8 (N,) */
} kiln_linear;

typedef struct {
    const float *input_norm, *post_norm; /* (hidden,) */
    const float *q_norm, *k_norm;        /* (head_dim,) or NULL */
    kiln_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* (slots, kv_heads, max_len, head_dim) */
    float k_scale, v_scale;  /* FP8 cache */
} kiln_layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, max_len, vocab;
    int32_t kv_kind, round_act, embed_kind, head_round_in; /* embed_kind: W_F32, W_BF16 or W_F16 */
    float eps, attn_scale;
    const void *embed;               /* (vocab, hidden) bf16 or f32 */
    const float *final_norm;         /* (hidden,) */
    const float *cos, *sin;          /* (max_len, head_dim): cos|cos, -sin|sin */
    const kiln_linear *head;         /* the LM head (round_out 0: fp32 logits) */
    const kiln_layer *layers;
} kiln_model;

/* ---------------------------------------------------------------- numbers */

typedef union {
    float f;
    uint32_t u;
} bits32;
static inline uint32_t f2u(float x) { return ((bits32){.f = x}).u; }
static inline float u2f(uint32_t u) { return ((bits32){.u = u}).f; }
static inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float x) { /* round to nearest even; NaN stays NaN */
    uint32_t u = f2u(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

static float e4m3_table[256];
static pthread_once_t e4m3_once = PTHREAD_ONCE_INIT;

static void make_e4m3_table(void) {
    for (int b = 0; b < 256; b++) {
        int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        if (e == 15 && m == 7) v = NAN;
        e4m3_table[b] = s ? -v : v;
    }
}

/* fp32 -> e4m3fn byte, round to nearest even, saturated to +-448 (the cache clamps first) */
static inline uint8_t f32_to_e4m3(float x) {
    uint32_t xb = f2u(x), sign = (xb >> 24) & 0x80u;
    if ((xb & 0x7fffffffu) > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    float c = fminf(fmaxf(x, -448.0f), 448.0f);
    uint32_t a = f2u(c) & 0x7fffffffu;
    if (a >= 0x3c800000u) { /* normal: RNE to 3 mantissa bits */
        uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
        return (uint8_t)(sign | ((((r >> 23) - 120u) << 3) | ((r >> 20) & 7u)));
    }
    float scaled = u2f(a) * 512.0f; /* subnormal: a multiple of 2^-9 */
    float rounded = (scaled + 8388608.0f) - 8388608.0f;
    return (uint8_t)(sign | (uint32_t)(int32_t)rounded);
}

/* ---------------------------------------------------------------- thread pool */

typedef void (*job_fn)(void *arg, int tid, int nthreads);

static struct {
    int nthreads, spin_us;
    pthread_t threads[MAX_THREADS];
    _Atomic uint32_t generation;
    _Atomic int finished, sleeping, ready;
    uint32_t start_generation;
    _Atomic int barrier_count;
    _Atomic uint32_t barrier_phase;
    job_fn fn;
    void *arg;
    pthread_mutex_t lock;
} pool = {.nthreads = 1, .lock = PTHREAD_MUTEX_INITIALIZER};

static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER; /* one step at a time on the pool */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t value) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
}

/* Every thread of a step meets here between dependent phases (spinning: phases last microseconds). */
static void barrier(int nthreads) {
    if (nthreads == 1) return;
    uint32_t phase = atomic_load_explicit(&pool.barrier_phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.barrier_count, 1, memory_order_acq_rel) == nthreads - 1) {
        atomic_store_explicit(&pool.barrier_count, 0, memory_order_relaxed);
        atomic_store_explicit(&pool.barrier_phase, phase + 1, memory_order_release);
    } else {
        while (atomic_load_explicit(&pool.barrier_phase, memory_order_acquire) == phase) cpu_relax();
    }
}

/* A worker spins for `spin_us` after each step (decode steps come back to back), then sleeps.
 * It starts from the generation the pool had when it was made: a step started before the thread
 * first runs is still its to join. */
static void *worker_main(void *p) {
    int tid = (int)(intptr_t)p;
    uint32_t seen = pool.start_generation;
    atomic_fetch_add(&pool.ready, 1);
    for (;;) {
        uint64_t start = now_ns(), budget = (uint64_t)pool.spin_us * 1000ull;
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen) {
            cpu_relax();
            if (++spins < 256) continue;
            spins = 0;
            /* between steps the caller runs Python (sampling, the HTTP thread's writes): a thread
             * that wants this core gets it, and the worker is back within a time slice */
            sched_yield();
            if (now_ns() - start < budget) continue;
            atomic_fetch_add(&pool.sleeping, 1);
            if (atomic_load(&pool.generation) == seen) futex_wait(&pool.generation, seen);
            atomic_fetch_sub(&pool.sleeping, 1);
            start = now_ns();
        }
        seen = g;
        pool.fn(pool.arg, tid, pool.nthreads);
        atomic_fetch_add_explicit(&pool.finished, 1, memory_order_acq_rel);
    }
    return NULL;
}

/* A forked child has none of the parent's workers: it steps alone until it starts its own. */
static void pool_after_fork(void) {
    pool.nthreads = 1;
    atomic_store(&pool.ready, 0);
    atomic_store(&pool.sleeping, 0);
    atomic_store(&pool.barrier_count, 0);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&run_lock, NULL);
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void register_fork_handler(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* Start the pool's threads (once per process; the count cannot change afterwards); its size. */
int kiln_pool_start(int nthreads, int spin_us) {
    pthread_once(&isa_once, detect_isa);
    pthread_once(&fork_once, register_fork_handler);
    pthread_mutex_lock(&pool.lock);
    int started = pool.nthreads;
    if (started == 1 && nthreads > 1) {
        if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
        pool.spin_us = spin_us;
        pool.start_generation = atomic_load(&pool.generation);
        int made = 1;
        for (; made < nthreads; made++) {
            if (pthread_create(&pool.threads[made], NULL, worker_main, (void *)(intptr_t)made)) break;
            pthread_detach(pool.threads[made]);
        }
        while (atomic_load(&pool.ready) < made - 1) cpu_relax(); /* every worker is looking */
        pool.nthreads = made;
        started = made;
    }
    pthread_mutex_unlock(&pool.lock);
    return started;
}

static void run_parallel(job_fn fn, void *arg) {
    pthread_mutex_lock(&run_lock);
    int n = pool.nthreads;
    if (n == 1) {
        fn(arg, 0, 1);
        pthread_mutex_unlock(&run_lock);
        return;
    }
    pool.fn = fn;
    pool.arg = arg;
    atomic_store_explicit(&pool.finished, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_acq_rel);
    if (atomic_load(&pool.sleeping)) futex_wake_all(&pool.generation);
    fn(arg, 0, n);
    while (atomic_load_explicit(&pool.finished, memory_order_acquire) != n - 1) cpu_relax();
    pthread_mutex_unlock(&run_lock);
}

/* ---------------------------------------------------------------- linear layers */

/* rows [r0, r1) of y (M, N) = x (M, K) @ W.T, x already rounded as the layer takes it */

/* The 64 codes of one k of a 64-row split block (32 bytes: byte d holds rows d and d + 32) as floats,
 * rows in order: 0-15, 16-31, 32-47, 48-63. */
AVX512 static inline void int4_codes64_avx512(const uint8_t *p, __m512 out[4]) {
    const __m512i low4 = _mm512_set1_epi32(15);
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    const __m512i e0 = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(b));      /* rows 0-15, 32-47 */
    const __m512i e1 = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1)); /* rows 16-31, 48-63 */
    out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(e0, low4));
    out[1] = _mm512_cvtepi32_ps(_mm512_and_si512(e1, low4));
    out[2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(e0, 4));
    out[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(e1, 4));
}

/* the group's codes of one 64-row block as floats, (group, 64) rows in order: for several tokens */
AVX512 static void int4_group64_floats_avx512(const uint8_t *p, int group, float *wq) {
    for (int kk = 0; kk < group; kk++, p += 32, wq += 64) {
        __m512 w[4];
        int4_codes64_avx512(p, w);
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(wq + 16 * j, w[j]);
    }
}

/* acc[m] (64 rows) += scale * codes.x + (zero - 8 * scale + offset) * xsum for one group; `off`: the
 * group's exact zero offsets of these rows, or NULL */
AVX512 static inline void int4_scale64_avx512(const uint32_t *sz, const float *off, const __m512 parts[4],
                                              float xs, float *acc) {
    const __m512 eight = _mm512_set1_ps(8.0f), xsv = _mm512_set1_ps(xs);
    for (int j = 0; j < 4; j++) {
        const __m512i pair = _mm512_loadu_si512((const void *)(sz + 16 * j));
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xffff0000u)));
        float *o = acc + 16 * j;
        __m512 v = _mm512_fmadd_ps(s, parts[j], _mm512_loadu_ps(o));
        __m512 zero = _mm512_fnmadd_ps(eight, s, z);
        if (off) zero = _mm512_add_ps(zero, _mm512_loadu_ps(off + 16 * j));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(zero, xsv, v));
    }
}

/* INT4, one block of 64 rows split (d, d + 32): per op group, the unscaled codes times x accumulate
 * in registers, then y += scale * acc + (zero - 8 * scale) * sum(x over the group).
 * The scale / zero pairs of 16 rows are 16 uint32: scale in the low half, zero in the high half. */
AVX512 static void int4_block64_avx512(const kiln_linear *L, const float *x, const float *xsum, int m_rows,
                                       int r0, float *acc, float *wq, int fold) {
    const int k = L->k, group = L->op_group, groups = k / group;
    const uint8_t *base = (const uint8_t *)L->weight + (size_t)r0 * (k / 2);
    for (int i = 0; i < m_rows * 64; i++) acc[i] = 0.0f;
    for (int g = 0; g < groups; g++) {
        const uint32_t *sz = (const uint32_t *)(L->scales + ((size_t)g * L->n + r0) * 2);
        const float *off = fold ? L->zero_offsets + (size_t)g * L->n + r0 : NULL;
        const uint8_t *pg = base + (size_t)g * group * 32;
        if (m_rows == 1) { /* one token: convert and multiply in registers */
            __m512 parts[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int kk = 0; kk < group; kk++) {
                _mm_prefetch((const char *)(pg + (size_t)kk * 32 + PREFETCH_BYTES), _MM_HINT_T0);
                __m512 w[4];
                int4_codes64_avx512(pg + (size_t)kk * 32, w);
                const __m512 xv = _mm512_set1_ps(x[g * group + kk]);
                for (int j = 0; j < 4; j++) parts[j] = _mm512_fmadd_ps(w[j], xv, parts[j]);
            }
            int4_scale64_avx512(sz, off, parts, xsum[g], acc);
            continue;
        }
        _mm_prefetch((const char *)(pg + PREFETCH_BYTES), _MM_HINT_T0);
        int4_group64_floats_avx512(pg, group, wq); /* once for every token */
        for (int m = 0; m < m_rows; m += 2) { /* two tokens at a time: 8 accumulators */
            const float *x0 = x + (size_t)m * k + g * group;
            const float *x1 = m + 1 < m_rows ? x0 + k : x0;
            __m512 a[2][4];
            for (int j = 0; j < 4; j++) a[0][j] = a[1][j] = _mm512_setzero_ps();
            for (int kk = 0; kk < group; kk++) {
                const float *wk = wq + (size_t)kk * 64;
                const __m512 xv0 = _mm512_set1_ps(x0[kk]), xv1 = _mm512_set1_ps(x1[kk]);
                for (int j = 0; j < 4; j++) {
                    const __m512 wv = _mm512_loadu_ps(wk + 16 * j);
                    a[0][j] = _mm512_fmadd_ps(wv, xv0, a[0][j]);
                    a[1][j] = _mm512_fmadd_ps(wv, xv1, a[1][j]);
                }
            }
            int4_scale64_avx512(sz, off, a[0], xsum[m * groups + g], acc + (size_t)m * 64);
            if (m + 1 < m_rows)
                int4_scale64_avx512(sz, off, a[1], xsum[(m + 1) * groups + g], acc + (size_t)(m + 1) * 64);
        }
    }
}

AVX2 static void int4_block32_avx2(const kiln_linear *L, const float *x, const float *xsum, int m_rows,
                                   int r0, float *acc, int fold) {
    const int k = L->k, group = L->op_group, groups = k / group;
    const uint8_t *base = (const uint8_t *)L->weight + (size_t)r0 * (k / 2);
    const __m256i low4 = _mm256_set1_epi32(15);
    for (int i = 0; i < m_rows * 32; i++) acc[i] = 0.0f;
    for (int g = 0; g < groups; g++) {
        const uint32_t *sz = (const uint32_t *)(L->scales + ((size_t)g * L->n + r0) * 2);
        const float *off = fold ? L->zero_offsets + (size_t)g * L->n + r0 : NULL;
        for (int m = 0; m < m_rows; m++) {
            const float *xm = x + (size_t)m * k;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int kk = g * group; kk < (g + 1) * group; kk++) {
                _mm_prefetch((const char *)(base + (size_t)kk * 16 + PREFETCH_BYTES), _MM_HINT_T0);
                const __m128i b = _mm_loadu_si128((const __m128i *)(base + (size_t)kk * 16));
                const __m256i e0 = _mm256_cvtepu8_epi32(b);                  /* rows 0-7, 16-23 */
                const __m256i e1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)); /* rows 8-15, 24-31 */
                const __m256 xv = _mm256_set1_ps(xm[kk]);
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(e0, low4)), xv, a0);
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(e1, low4)), xv, a1);
                a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(e0, 4)), xv, a2);
                a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(e1, 4)), xv, a3);
            }
            const __m256 xs = _mm256_set1_ps(xsum[m * groups + g]), eight = _mm256_set1_ps(8.0f);
            const __m256 parts[4] = {a0, a1, a2, a3};
            for (int j = 0; j < 4; j++) {
                const __m256i pair = _mm256_loadu_si256((const __m256i *)(sz + 8 * j));
                const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
                const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(pair, _mm256_set1_epi32((int)0xffff0000u)));
                float *o = acc + m * 32 + 8 * j;
                __m256 v = _mm256_fmadd_ps(s, parts[j], _mm256_loadu_ps(o));
                __m256 zero = _mm256_fnmadd_ps(eight, s, z);
                if (off) zero = _mm256_add_ps(zero, _mm256_loadu_ps(off + 8 * j));
                v = _mm256_fmadd_ps(zero, xs, v);
                _mm256_storeu_ps(o, v);
            }
        }
    }
}

/* INT4, any block of `nb` rows with adjacent pairs (2d, 2d + 1) or a split we have no fast body for */
static void int4_block_generic(const kiln_linear *L, const float *x, const float *xsum, int m_rows, int r0,
                               int nb, int split, float *acc) {
    const int k = L->k, group = L->op_group, groups = k / group, half = nb / 2;
    const uint8_t *base = (const uint8_t *)L->weight + (size_t)r0 * (k / 2);
    for (int i = 0; i < m_rows * nb; i++) acc[i] = 0.0f;
    for (int m = 0; m < m_rows; m++) {
        const float *xm = x + (size_t)m * k;
        for (int g = 0; g < groups; g++) {
            for (int r = 0; r < nb; r++) {
                int d = split ? r % half : r / 2;
                int high = split ? r >= half : r & 1;
                float a = 0.0f;
                for (int kk = g * group; kk < (g + 1) * group; kk++) {
                    uint8_t byte = base[(size_t)kk * half + d];
                    a += (float)(high ? byte >> 4 : byte & 15) * xm[kk];
                }
                const uint16_t *sz = L->scales + ((size_t)g * L->n + r0 + r) * 2;
                float s = bf16_to_f32(sz[0]), z = bf16_to_f32(sz[1]) - 8.0f * s;
                acc[m * nb + r] += s * a + z * xsum[m * groups + g];
            }
        }
    }
}

static void int4_rows(const kiln_linear *L, const float *x, int m_rows, int r0, int r1, float *y,
                      float *scratch) {
    const int k = L->k, n = L->n, group = L->op_group, groups = k / group;
    float *xsum = scratch;                              /* (M, groups) */
    float *acc = scratch + (size_t)m_rows * groups;     /* (M, 64) */
    float *zsum = acc + (size_t)m_rows * 64;            /* (M, zo_groups) */
    float *wq = zsum + (size_t)m_rows * L->zo_groups;   /* (op_group, 64): a group's codes as floats */
    for (int m = 0; m < m_rows; m++)
        for (int g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int kk = g * group; kk < (g + 1) * group; kk++) s += x[(size_t)m * k + kk];
            xsum[m * groups + g] = s;
        }
    const int zg = L->zo_groups;
    if (zg)
        for (int m = 0; m < m_rows; m++)
            for (int g = 0; g < zg; g++) {
                float s = 0.0f;
                for (int kk = g * (k / zg); kk < (g + 1) * (k / zg); kk++) s += x[(size_t)m * k + kk];
                zsum[m * zg + g] = s;
            }
    const int full_end = n / L->block_n * L->block_n;
    int r = r0;
    while (r < r1) {
        int nb = r < full_end ? L->block_n : n - full_end;
        int split = r < full_end && L->split;
        /* exact zero offsets in the op's groups are added by the vector bodies */
        int folded = zg == groups;
        if (split && nb == 64 && isa >= ISA_AVX512) int4_block64_avx512(L, x, xsum, m_rows, r, acc, wq, folded);
        else if (split && nb == 32 && isa >= ISA_AVX2) int4_block32_avx2(L, x, xsum, m_rows, r, acc, folded);
        else {
            int4_block_generic(L, x, xsum, m_rows, r, nb, split, acc);
            folded = 0;
        }
        for (int m = 0; m < m_rows; m++)
            for (int i = 0; i < nb; i++) {
                float v = acc[m * nb + i];
                if (zg && !folded)
                    for (int g = 0; g < zg; g++) v += zsum[m * zg + g] * L->zero_offsets[(size_t)g * n + r + i];
                y[(size_t)m * n + r + i] = v;
            }
        r += nb;
    }
}

/* y[m, r] = dot(x[m], row r) for row-major weights: tiles of 4 rows x TM tokens, so that each
 * weight load serves TM tokens and each x load 4 rows (a short row tile repeats its last row,
 * computed and not stored); the tokens past the last whole tile run one at a time — a tile of
 * repeated tokens would multiply every weight TM times over (the batch-1 head ran 4x the FMAs). */
#define ROW_DOTS_TILE(NAME, ATTR, T, VEC, WIDTH, TM, ZERO, FMA, LOADX, LOADW, HSUM, ELEM)                 \
    ATTR static void NAME(const T *w, int k, const float *x, int m_rows, int r0, int r1, int n, float *y) { \
        for (int r = r0; r < r1; r += 4) {                                                         \
            const T *wr[4];                                                                        \
            for (int i = 0; i < 4; i++) wr[i] = w + (size_t)(r + i < r1 ? r + i : r1 - 1) * k;     \
            for (int m = 0; m < m_rows; m += TM) {                                                 \
                const float *xm[TM];                                                               \
                for (int j = 0; j < TM; j++) xm[j] = x + (size_t)(m + j) * k;                      \
                VEC a[TM][4];                                                                      \
                for (int j = 0; j < TM; j++)                                                       \
                    for (int i = 0; i < 4; i++) a[j][i] = ZERO();                                  \
                int kk = 0;                                                                        \
                for (; kk + WIDTH <= k; kk += WIDTH) {                                             \
                    if (m == 0 && kk % 32 == 0) /* the rows' next lines, on the first pass */     \
                        for (int i = 0; i < 4; i++)                                                \
                            _mm_prefetch((const char *)(wr[i] + kk) + DOTS_PREFETCH_BYTES, _MM_HINT_T0); \
                    VEC wv[4];                                                                     \
                    for (int i = 0; i < 4; i++) wv[i] = LOADW(wr[i] + kk);                         \
                    for (int j = 0; j < TM; j++) {                                                 \
                        const VEC xv = LOADX(xm[j] + kk);                                          \
                        for (int i = 0; i < 4; i++) a[j][i] = FMA(wv[i], xv, a[j][i]);             \
                    }                                                                              \
                }                                                                                  \
                for (int j = 0; j < TM; j++)                                                       \
                    for (int i = 0; i < 4 && r + i < r1; i++) {                                    \
                        float s = HSUM(a[j][i]);                                                   \
                        for (int t = kk; t < k; t++) s += ELEM(wr[i][t]) * xm[j][t];               \
                        y[(size_t)(m + j) * n + r + i] = s;                                        \
                    }                                                                              \
            }                                                                                      \
        }                                                                                          \
    }

/* whole tiles of TM tokens, then the rest one token at a time */
#define TOKEN_TILES(NAME, T, TM, ARGS_DECL, CALL_TILE, CALL_ONE)                                   \
    static void NAME ARGS_DECL {                                                                   \
        const int full = m_rows / TM * TM;                                                         \
        if (full) CALL_TILE;                                                                       \
        for (int m = full; m < m_rows; m++) CALL_ONE;                                              \
    }

#define ROW_DOTS(NAME, ATTR, T, VEC, WIDTH, TM, ZERO, FMA, LOADX, LOADW, HSUM, ELEM)                      \
    ROW_DOTS_TILE(NAME##_tile, ATTR, T, VEC, WIDTH, TM, ZERO, FMA, LOADX, LOADW, HSUM, ELEM)             \
    ROW_DOTS_TILE(NAME##_one, ATTR, T, VEC, WIDTH, 1, ZERO, FMA, LOADX, LOADW, HSUM, ELEM)               \
    TOKEN_TILES(NAME, T, TM,                                                                        \
                (const T *w, int k, const float *x, int m_rows, int r0, int r1, int n, float *y),      \
                NAME##_tile(w, k, x, full, r0, r1, n, y),                                          \
                NAME##_one(w, k, x + (size_t)m * k, 1, r0, r1, n, y + (size_t)m * n))

#define ELEM_F(v) ((float)(v))
#define ELEM_BF16(v) bf16_to_f32(v)
#define ELEM_F16(v) f16_to_f32(v)

AVX512 static inline __m512 w512_f32(const float *p) { return _mm512_loadu_ps(p); }
AVX512 static inline __m512 w512_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
AVX512 static inline __m512 w512_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
AVX2 static inline __m256 w256_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
AVX2 static inline __m256 w256_f32(const float *p) { return _mm256_loadu_ps(p); }
AVX2 static inline __m256 w256_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
AVX2 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float scalar_zero(void) { return 0.0f; }
static inline float scalar_fma(float a, float b, float c) { return a * b + c; }
static inline float scalar_load(const float *p) { return *p; }
static inline float scalar_bf16(const uint16_t *p) { return bf16_to_f32(*p); }

/* IEEE half -> float (subnormals, infinities and NaN included) */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    if (e == 31) return u2f(sign | 0x7f800000u | (m << 13));
    if (e == 0) return u2f(sign) + (sign ? -1.0f : 1.0f) * ldexpf((float)m, -24);
    return u2f(sign | ((e + 112u) << 23) | (m << 13));
}
static inline float scalar_f16(const uint16_t *p) { return f16_to_f32(*p); }
static inline float scalar_id(float v) { return v; }

ROW_DOTS(dots_f32_avx512, AVX512, float, __m512, 16, 4, _mm512_setzero_ps, _mm512_fmadd_ps, _mm512_loadu_ps, w512_f32, _mm512_reduce_add_ps, ELEM_F)
ROW_DOTS(dots_bf16_avx512, AVX512, uint16_t, __m512, 16, 4, _mm512_setzero_ps, _mm512_fmadd_ps, _mm512_loadu_ps, w512_bf16, _mm512_reduce_add_ps, ELEM_BF16)
ROW_DOTS(dots_f32_avx2, AVX2, float, __m256, 8, 2, _mm256_setzero_ps, _mm256_fmadd_ps, _mm256_loadu_ps, w256_f32, hsum256, ELEM_F)
ROW_DOTS(dots_bf16_avx2, AVX2, uint16_t, __m256, 8, 2, _mm256_setzero_ps, _mm256_fmadd_ps, _mm256_loadu_ps, w256_bf16, hsum256, ELEM_BF16)
ROW_DOTS(dots_f16_avx512, AVX512, uint16_t, __m512, 16, 4, _mm512_setzero_ps, _mm512_fmadd_ps, _mm512_loadu_ps, w512_f16, _mm512_reduce_add_ps, ELEM_F16)
ROW_DOTS(dots_f16_avx2, AVX2, uint16_t, __m256, 8, 2, _mm256_setzero_ps, _mm256_fmadd_ps, _mm256_loadu_ps, w256_f16, hsum256, ELEM_F16)
ROW_DOTS(dots_f16_scalar, , uint16_t, float, 1, 1, scalar_zero, scalar_fma, scalar_load, scalar_f16, scalar_id, ELEM_F16)
ROW_DOTS(dots_f32_scalar, , float, float, 1, 1, scalar_zero, scalar_fma, scalar_load, scalar_load, scalar_id, ELEM_F)
ROW_DOTS(dots_bf16_scalar, , uint16_t, float, 1, 1, scalar_zero, scalar_fma, scalar_load, scalar_bf16, scalar_id, ELEM_BF16)

typedef void (*dots_fn)(const void *w, int k, const float *x, int m_rows, int r0, int r1, int n, float *y);

/* ---------------------------------------------------------------- INT8 x int16 activations
 * An INT8 layer (the quantized head) multiplies its fp32 activations quantized per token to int16:
 * sx = amax / I8_QMAX, q = rint(x / sx) — an error of 2^-16 of the token's largest value, below
 * the bf16 rounding of a bf16 model — with integer dot products (vpmaddwd: 16 k per instruction on
 * AVX2, 32 on AVX-512), exact in int32 over spans of I8_SPAN k and summed in fp32 after: about twice
 * the rate of widening each code to fp32 for an FMA, which left the head compute-bound (15 GB/s on
 * an AVX2 core pair against 30 GB/s of memory bandwidth). Every body computes the same numbers. */
#define I8_QMAX 32767.0f
#define I8_SPAN 256 /* k per exact int32 sum: 256 x 32767 x 127 < 2^31 */
#define I8_MIN_AMAX 1e-30f

static void i8_quantize_rows(const float *x, int m_rows, int k, int16_t *q, float *sx) {
    for (int m = 0; m < m_rows; m++) {
        const float *xm = x + (size_t)m * k;
        float amax = 0.0f;
        for (int i = 0; i < k; i++) amax = fmaxf(amax, fabsf(xm[i]));
        int16_t *qm = q + (size_t)m * k;
        if (!(amax > I8_MIN_AMAX)) {
            memset(qm, 0, (size_t)k * sizeof(int16_t));
            sx[m] = 0.0f;
            continue;
        }
        const float inv = I8_QMAX / amax;
        for (int i = 0; i < k; i++) qm[i] = (int16_t)lrintf(xm[i] * inv);
        sx[m] = amax / I8_QMAX;
    }
}

static inline int32_t i8_span_tail(const int8_t *w, const int16_t *q, int a, int b) {
    int32_t t = 0;
    for (int i = a; i < b; i++) t += (int32_t)w[i] * q[i];
    return t;
}

/* The tile loop every body shares: TR rows x TM tokens, spans of I8_SPAN k, SPAN_SUMS(s, e, TM)
 * adding the rows' exact span sums into tot[j][i] (the body's vector loop, its tail in scalar). */
#define I8_TILES(TR, TM, SPAN_SUMS)                                                                   \
    for (int r = r0; r < r1; r += TR) {                                                               \
        const int8_t *wr[TR];                                                                          \
        for (int i = 0; i < TR; i++) wr[i] = w + (size_t)(r + i < r1 ? r + i : r1 - 1) * k;            \
        for (int m = 0; m < m_rows; m += TM) {                                                        \
            const int16_t *qm[TM];                                                                     \
            for (int j = 0; j < TM; j++) qm[j] = q + (size_t)(m + j) * k;                              \
            float tot[TM][TR] = {{0}};                                                                 \
            for (int s = 0; s < k; s += I8_SPAN) {                                                     \
                const int e = s + I8_SPAN < k ? s + I8_SPAN : k;                                       \
                SPAN_SUMS(s, e, TM)                                                                    \
            }                                                                                          \
            for (int j = 0; j < TM; j++)                                                               \
                for (int i = 0; i < TR && r + i < r1; i++) y[(size_t)(m + j) * n + r + i] = tot[j][i] * sx[m + j]; \
        }                                                                                              \
    }

#define I8_SCALAR_SPAN(s, e, TM)                                                                      \
    for (int j = 0; j < TM; j++)                                                                       \
        for (int i = 0; i < 4; i++) tot[j][i] += (float)i8_span_tail(wr[i], qm[j], s, e);

/* a body: tiles of TM tokens (NAME_tile), the rest one at a time (NAME_one) */
#define I8_BODY(NAME, ATTR, TM, SPAN)                                                                 \
    ATTR static void NAME##_tile(const int8_t *w, int k, const int16_t *q, const float *sx, int m_rows, int r0, \
                                 int r1, int n, float *y) {                                            \
        I8_TILES(4, TM, SPAN)                                                                          \
    }                                                                                                  \
    ATTR static void NAME##_one(const int8_t *w, int k, const int16_t *q, const float *sx, int m_rows, int r0, \
                                int r1, int n, float *y) {                                             \
        I8_TILES(4, 1, SPAN)                                                                           \
    }                                                                                                  \
    TOKEN_TILES(NAME, int8_t, TM,                                                                      \
                (const int8_t *w, int k, const int16_t *q, const float *sx, int m_rows, int r0, int r1, int n, \
                 float *y),                                                                            \
                NAME##_tile(w, k, q, sx, full, r0, r1, n, y),                                          \
                NAME##_one(w, k, q + (size_t)m * k, sx + m, 1, r0, r1, n, y + (size_t)m * n))

I8_BODY(i8_rows_scalar, , 1, I8_SCALAR_SPAN)

#define I8_AVX2_SPAN(s, e, TM)                                                                        \
    __m256i a[TM][4];                                                                                  \
    for (int j = 0; j < TM; j++)                                                                       \
        for (int i = 0; i < 4; i++) a[j][i] = _mm256_setzero_si256();                                  \
    int kk = s;                                                                                        \
    for (; kk + 16 <= e; kk += 16) {                                                                   \
        if (m == 0 && kk % 64 == 0)                                                                    \
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(wr[i] + kk) + DOTS_PREFETCH_BYTES, _MM_HINT_T0); \
        __m256i wv[4];                                                                                 \
        for (int i = 0; i < 4; i++) wv[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr[i] + kk))); \
        for (int j = 0; j < TM; j++) {                                                                 \
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(qm[j] + kk));                      \
            for (int i = 0; i < 4; i++) a[j][i] = _mm256_add_epi32(a[j][i], _mm256_madd_epi16(wv[i], xv)); \
        }                                                                                              \
    }                                                                                                  \
    for (int j = 0; j < TM; j++)                                                                       \
        for (int i = 0; i < 4; i++)                                                                    \
            tot[j][i] += (float)(w4a8_hsum_epi32_256(a[j][i]) + i8_span_tail(wr[i], qm[j], kk, e));

I8_BODY(i8_rows_avx2, AVX2, 2, I8_AVX2_SPAN)

#define I8_AVX512_SPAN(s, e, TM)                                                                      \
    __m512i a[TM][4];                                                                                  \
    for (int j = 0; j < TM; j++)                                                                       \
        for (int i = 0; i < 4; i++) a[j][i] = _mm512_setzero_si512();                                  \
    int kk = s;                                                                                        \
    for (; kk + 32 <= e; kk += 32) {                                                                   \
        if (m == 0 && kk % 64 == 0)                                                                    \
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(wr[i] + kk) + DOTS_PREFETCH_BYTES, _MM_HINT_T0); \
        __m512i wv[4];                                                                                 \
        for (int i = 0; i < 4; i++) wv[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr[i] + kk))); \
        for (int j = 0; j < TM; j++) {                                                                 \
            const __m512i xv = _mm512_loadu_si512((const void *)(qm[j] + kk));                         \
            for (int i = 0; i < 4; i++) a[j][i] = _mm512_add_epi32(a[j][i], _mm512_madd_epi16(wv[i], xv)); \
        }                                                                                              \
    }                                                                                                  \
    for (int j = 0; j < TM; j++)                                                                       \
        for (int i = 0; i < 4; i++)                                                                    \
            tot[j][i] += (float)(_mm512_reduce_add_epi32(a[j][i]) + i8_span_tail(wr[i], qm[j], kk, e));

I8_BODY(i8_rows_avx512, AVX512, 4, I8_AVX512_SPAN)

/* rows [r0, r1) of an INT8 layer, before its scales: the input quantized by this thread for itself */
static void i8_rows(const kiln_linear *L, const float *x, int m_rows, int r0, int r1, float *y, float *scratch) {
    const int k = L->k;
    float *sx = scratch;
    int16_t *q = (int16_t *)(scratch + (size_t)(m_rows + 15) / 16 * 16);
    i8_quantize_rows(x, m_rows, k, q, sx);
    const int8_t *w = (const int8_t *)L->weight;
    if (isa == ISA_AVX512) i8_rows_avx512(w, k, q, sx, m_rows, r0, r1, L->n, y);
    else if (isa == ISA_AVX2) i8_rows_avx2(w, k, q, sx, m_rows, r0, r1, L->n, y);
    else i8_rows_scalar(w, k, q, sx, m_rows, r0, r1, L->n, y);
}

/* ---------------------------------------------------------------- W8A8 */

#define W8A8_MIN_AMAX 1e-10f /* kernels/codecs/int8.py MIN_AMAX */
#define W8A8_SCALE_DIVISOR 127.5f

/* cpu_w8a8's per-token activations: s = max(amax, MIN_AMAX) / 127.5, q = clamp(rint(x / s), -128,
 * 127), kept as q + 128: vpdpbusd's unsigned operand */
static void w8a8_quantize_row(const float *x, int k, uint8_t *xu, float *scale) {
    float amax = 0.0f;
    for (int i = 0; i < k; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float s = (amax > W8A8_MIN_AMAX ? amax : W8A8_MIN_AMAX) / W8A8_SCALE_DIVISOR;
    for (int i = 0; i < k; i++) {
        float v = nearbyintf(x[i] / s);
        v = v < -128.0f ? -128.0f : v > 127.0f ? 127.0f : v;
        xu[i] = (uint8_t)((int)v + 128);
    }
    *scale = s;
}

static inline float w8a8_out(int32_t sum, float scale_t, float scale_n) { return ((float)sum * scale_t) * scale_n; }

/* rows [r0, r1) in tiles of 4 rows x 4 tokens; sum (q + 128) * w - 128 * sum w = sum q * w */
W4A8_ATTR_AVX512 static void w8a8_rows_avx512(const int8_t *w, const float *ws, int k, const uint8_t *xu,
                                             const float *xs, int m_rows, int r0, int r1, int n, float *y) {
    const __m512i ones = _mm512_set1_epi8(1);
    const int kv = k / 64 * 64;
    for (int r = r0; r < r1; r += 4) {
        const int8_t *wr[4];
        int32_t wsum[4];
        for (int i = 0; i < 4; i++) wr[i] = w + (size_t)(r + i < r1 ? r + i : r1 - 1) * k;
        __m512i s[4];
        for (int i = 0; i < 4; i++) s[i] = _mm512_setzero_si512();
        for (int kk = 0; kk < kv; kk += 64) /* the rows' sums, bringing them into L1 */
            for (int i = 0; i < 4; i++) {
                _mm_prefetch((const char *)(wr[i] + kk) + DOTS_PREFETCH_BYTES, _MM_HINT_T0);
                s[i] = _mm512_dpbusd_epi32(s[i], ones, _mm512_loadu_si512((const void *)(wr[i] + kk)));
            }
        for (int i = 0; i < 4; i++) {
            wsum[i] = _mm512_reduce_add_epi32(s[i]);
            for (int t = kv; t < k; t++) wsum[i] += wr[i][t];
        }
        for (int m = 0; m < m_rows; m += 4) {
            const uint8_t *xm[4];
            for (int j = 0; j < 4; j++) xm[j] = xu + (size_t)(m + j < m_rows ? m + j : m_rows - 1) * k;
            __m512i a[4][4];
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 4; i++) a[j][i] = _mm512_setzero_si512();
            for (int kk = 0; kk < kv; kk += 64) {
                __m512i wv[4];
                for (int i = 0; i < 4; i++) wv[i] = _mm512_loadu_si512((const void *)(wr[i] + kk));
                for (int j = 0; j < 4; j++) {
                    const __m512i xv = _mm512_loadu_si512((const void *)(xm[j] + kk));
                    for (int i = 0; i < 4; i++) a[j][i] = _mm512_dpbusd_epi32(a[j][i], xv, wv[i]);
                }
            }
            for (int j = 0; j < 4 && m + j < m_rows; j++)
                for (int i = 0; i < 4 && r + i < r1; i++) {
                    int32_t sum = _mm512_reduce_add_epi32(a[j][i]);
                    for (int t = kv; t < k; t++) sum += (int32_t)xm[j][t] * wr[i][t];
                    y[(size_t)(m + j) * n + r + i] = w8a8_out(sum - 128 * wsum[i], xs[m + j], ws[r + i]);
                }
        }
    }
}

/* 16-bit products (vpmaddwd): tiles of 4 rows x 2 tokens */
AVX2 static void w8a8_rows_avx2(const int8_t *w, const float *ws, int k, const uint8_t *xu, const float *xs,
                               int m_rows, int r0, int r1, int n, float *y) {
    const __m256i bias = _mm256_set1_epi16(128);
    const int kv = k / 16 * 16;
    for (int r = r0; r < r1; r += 4) {
        const int8_t *wr[4];
        for (int i = 0; i < 4; i++) wr[i] = w + (size_t)(r + i < r1 ? r + i : r1 - 1) * k;
        for (int m = 0; m < m_rows; m += 2) {
            const uint8_t *xm[2];
            for (int j = 0; j < 2; j++) xm[j] = xu + (size_t)(m + j < m_rows ? m + j : m_rows - 1) * k;
            __m256i a[2][4];
            for (int j = 0; j < 2; j++)
                for (int i = 0; i < 4; i++) a[j][i] = _mm256_setzero_si256();
            for (int kk = 0; kk < kv; kk += 16) {
                __m256i wv[4];
                if (m == 0 && kk % 64 == 0)
                    for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(wr[i] + kk) + DOTS_PREFETCH_BYTES, _MM_HINT_T0);
                for (int i = 0; i < 4; i++) wv[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wr[i] + kk)));
                for (int j = 0; j < 2; j++) {
                    const __m256i xv =
                        _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(xm[j] + kk))), bias);
                    for (int i = 0; i < 4; i++) a[j][i] = _mm256_add_epi32(a[j][i], _mm256_madd_epi16(wv[i], xv));
                }
            }
            for (int j = 0; j < 2 && m + j < m_rows; j++)
                for (int i = 0; i < 4 && r + i < r1; i++) {
                    int32_t sum = w4a8_hsum_epi32_256(a[j][i]);
                    for (int t = kv; t < k; t++) sum += ((int32_t)xm[j][t] - 128) * wr[i][t];
                    y[(size_t)(m + j) * n + r + i] = w8a8_out(sum, xs[m + j], ws[r + i]);
                }
        }
    }
}

static void w8a8_rows_scalar(const int8_t *w, const float *ws, int k, const uint8_t *xu, const float *xs, int m_rows,
                             int r0, int r1, int n, float *y) {
    for (int m = 0; m < m_rows; m++)
        for (int r = r0; r < r1; r++) {
            const int8_t *wr = w + (size_t)r * k;
            const uint8_t *xm = xu + (size_t)m * k;
            int32_t sum = 0;
            for (int t = 0; t < k; t++) sum += ((int32_t)xm[t] - 128) * wr[t];
            y[(size_t)m * n + r] = w8a8_out(sum, xs[m], ws[r]);
        }
}

/* rows [r0, r1) of a W8A8 layer: this thread quantizes the input for itself, then multiplies */
static void w8a8_rows(const kiln_linear *L, const float *x, int m_rows, int r0, int r1, float *y, float *scratch) {
    const int k = L->k;
    float *xs = scratch;
    uint8_t *xu = (uint8_t *)(scratch + ((m_rows + 15) / 16 * 16));
    for (int m = 0; m < m_rows; m++) w8a8_quantize_row(x + (size_t)m * k, k, xu + (size_t)m * k, xs + m);
    const int8_t *w = (const int8_t *)L->weight;
    if (w4a8_level == W4A8_AVX512) w8a8_rows_avx512(w, L->scales32, k, xu, xs, m_rows, r0, r1, L->n, y);
    else if (w4a8_level == W4A8_AVX2) w8a8_rows_avx2(w, L->scales32, k, xu, xs, m_rows, r0, r1, L->n, y);
    else w8a8_rows_scalar(w, L->scales32, k, xu, xs, m_rows, r0, r1, L->n, y);
}

static dots_fn pick_dots(int kind) {
    static const void *table[3][3] = {
        {(const void *)dots_f32_scalar, (const void *)dots_f32_avx2, (const void *)dots_f32_avx512},
        {(const void *)dots_bf16_scalar, (const void *)dots_bf16_avx2, (const void *)dots_bf16_avx512},
        {(const void *)dots_f16_scalar, (const void *)dots_f16_avx2, (const void *)dots_f16_avx512},
    };
    int row = kind == W_F32 ? 0 : kind == W_BF16 ? 1 : 2;
    return (dots_fn)table[row][isa];
}

/* whether layer L takes its M tokens rounded to bf16: the model's activations are bf16, or its
 * kernel's op is bf16 at this batch (the eager forward's rounding points) */
static inline int rounds_input(const kiln_linear *L, int m_rows, int round_act) {
    return round_act || m_rows < L->bf16_rows;
}

/* rows [r0, r1) of one linear layer: y (M, N), with its scales, bias and output rounding */
static void linear_rows(const kiln_linear *L, const float *x, int m_rows, int r0, int r1, float *y,
                        float *scratch) {
    if (r0 >= r1) return;
    const int n = L->n, k = L->k;
    switch (L->kind) {
    case W_INT4: int4_rows(L, x, m_rows, r0, r1, y, scratch); break;
    case W_W8A8: w8a8_rows(L, x, m_rows, r0, r1, y, scratch); break;
    case W_W4A8: {
        /* every thread quantizes the layer's input for itself: microseconds, and no barrier */
        const w4a8_weight W = {n, k, L->op_group, (const uint8_t *)L->weight, L->scales32};
        int8_t *q;
        float *sx, *csum;
        const w4a8_acts A = w4a8_acts_in(scratch, m_rows, k, L->op_group, &q, &sx, &csum);
        w4a8_quantize(w4a8_level, x, m_rows, k, L->op_group, q, sx, csum);
        w4a8_rows(w4a8_level, &W, &A, m_rows, r0 / W4A8_ROWS, (r1 + W4A8_ROWS - 1) / W4A8_ROWS, y);
        break;
    }
    case W_INT8:
        i8_rows(L, x, m_rows, r0, r1, y, scratch);
        for (int m = 0; m < m_rows; m++)
            for (int r = r0; r < r1; r++) y[(size_t)m * n + r] *= bf16_to_f32(L->scales[r]);
        break;
    default: pick_dots(L->kind)(L->weight, k, x, m_rows, r0, r1, n, y); break;
    }
    /* torch's bf16 int4 / int8 ops hand back bf16 before the bias is added */
    const int op_rounds = m_rows < L->bf16_rows;
    for (int m = 0; m < m_rows; m++)
        for (int r = r0; r < r1; r++) {
            float v = y[(size_t)m * n + r];
            if (op_rounds) v = round_bf16(v);
            if (L->bias) v += L->bias[r];
            y[(size_t)m * n + r] = L->round_out ? round_bf16(v) : v;
        }
}

/* This thread's rows of a layer: whole int4 pack blocks, in contiguous shares */
static void my_rows(const kiln_linear *L, int tid, int nthreads, int *r0, int *r1) {
    int unit = L->kind == W_INT4 ? L->block_n : 16;
    int units = (L->n + unit - 1) / unit;
    int a = (int)((long)units * tid / nthreads), b = (int)((long)units * (tid + 1) / nthreads);
    *r0 = a * unit < L->n ? a * unit : L->n;
    *r1 = b * unit < L->n ? b * unit : L->n;
    if (L->kind == W_INT4 && tid == nthreads - 1) *r1 = L->n; /* a short tail block */
}

/* ---------------------------------------------------------------- the step */

typedef struct {
    const kiln_model *model;
    int m_rows;
    const int64_t *tokens, *slots, *positions;
    float *logits;
    float *resid, *normed, *qkv, *attn, *o, *gate_up, *act, *down; /* (M, ...) */
    float *scratch;  /* per thread */
    size_t scratch_floats;
} step_state;

static void rms_norm_rows(const float *x, const float *w, int n, float eps, int round, float *out) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) {
        float v = x[i] * inv * w[i];
        out[i] = round ? round_bf16(v) : v;
    }
}

static inline void kv_store(void *base, int kind, size_t i, float v, float scale) {
    switch (kind) {
    case KV_BF16: ((uint16_t *)base)[i] = f32_to_bf16(v); break;
    case KV_FP8: ((uint8_t *)base)[i] = f32_to_e4m3(v / scale); break;
    default: ((float *)base)[i] = v;
    }
}

/* q/k heads of one token: optional per-head RMSNorm, then RoPE at `pos` (in place, fp32) */
static void norm_and_rope(const kiln_model *md, const float *norm_w, float *head, int pos) {
    const int d = md->head_dim, h = d / 2;
    if (norm_w) rms_norm_rows(head, norm_w, d, md->eps, 0, head);
    const float *c = md->cos + (size_t)pos * d, *s = md->sin + (size_t)pos * d;
    float rolled[512];
    for (int i = 0; i < d; i++) rolled[i] = head[(i + h) % d];
    for (int i = 0; i < d; i++) head[i] = head[i] * c[i] + rolled[i] * s[i];
}

/* exp for the SwiGLU / softmax loops, vectorizable (no libm call): 2^n * p(r), |r| <= ln2 / 2,
 * a degree-6 polynomial; relative error below 2e-7 over the range fp32 exp covers */
static inline __attribute__((always_inline)) float fast_exp(float x) {
    x = x < -87.3f ? -87.3f : x > 88.7f ? 88.7f : x; /* not fminf / fmaxf: those stop the vectorizer */
    const float n = (x * 1.44269504089f + 12582912.0f) - 12582912.0f; /* nearest integer, ties even */
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return u2f(f2u(p) + ((uint32_t)(int32_t)n << 23));
}

/* One query head attends to positions [0, pos] of its kv head in `slot`: the cache rows are read
 * in their dtype and converted in registers (FP8 through the byte table, per row into `row`). */
/* Attention of `nh` query heads of one kv head (q, out: (nh, d)), one token at position `pos`: each
 * K and V row is read and widened once for all of them */
typedef float (*dot_fn)(const float *a, const float *b, int n);

static inline float dot_scalar(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* 16 lanes at a time, reduced once (the generic reduction spilled and added 16 scalars per call) */
AVX512 static inline float dot_avx512(const float *a, const float *b, int n) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float s = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

AVX2 static inline float dot_avx2(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum256(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline __attribute__((always_inline)) void attend_body(const kiln_model *md, const kiln_layer *ly,
                                                              const float *q, int nh, int slot, int pos,
                                                              int kv_head, float *scratch, float *out,
                                                              dot_fn dot) {
    const int d = md->head_dim, len = pos + 1, kind = md->kv_kind;
    const size_t base = (((size_t)slot * md->num_kv_heads + kv_head) * md->max_len) * d;
    float *row = scratch, *scores = scratch + d; /* scores (nh, len) */
    float best[MAX_GQA], inv[MAX_GQA];
    for (int h = 0; h < nh; h++) best[h] = -INFINITY;
    for (int p = 0; p < len; p++) {
        const size_t at = base + (size_t)p * d;
        const float *k = row;
        if (kind == KV_BF16) {
            const uint16_t *kb = (const uint16_t *)ly->k_cache + at;
#pragma omp simd
            for (int i = 0; i < d; i++) row[i] = u2f((uint32_t)kb[i] << 16);
        } else if (kind == KV_F32) {
            k = (const float *)ly->k_cache + at;
        } else {
            const uint8_t *k8 = (const uint8_t *)ly->k_cache + at;
            for (int i = 0; i < d; i++) row[i] = e4m3_table[k8[i]];
        }
        for (int h = 0; h < nh; h++) {
            float s = dot(q + (size_t)h * d, k, d);
            if (kind == KV_FP8) s *= ly->k_scale;
            s *= md->attn_scale;
            scores[(size_t)h * len + p] = s;
            best[h] = s > best[h] ? s : best[h];
        }
    }
    for (int h = 0; h < nh; h++) {
        float *sh = scores + (size_t)h * len, total = 0.0f;
        const float top = best[h];
#pragma omp simd reduction(+ : total)
        for (int p = 0; p < len; p++) {
            sh[p] = fast_exp(sh[p] - top);
            total += sh[p];
        }
        inv[h] = 1.0f / total;
    }
    for (int i = 0; i < nh * d; i++) out[i] = 0.0f;
    for (int p = 0; p < len; p++) {
        const size_t at = base + (size_t)p * d;
        const float *v = row;
        if (kind == KV_BF16) {
            const uint16_t *vb = (const uint16_t *)ly->v_cache + at;
#pragma omp simd
            for (int i = 0; i < d; i++) row[i] = u2f((uint32_t)vb[i] << 16);
        } else if (kind == KV_F32) {
            v = (const float *)ly->v_cache + at;
        } else {
            const uint8_t *v8 = (const uint8_t *)ly->v_cache + at;
            for (int i = 0; i < d; i++) row[i] = e4m3_table[v8[i]];
        }
        for (int h = 0; h < nh; h++) {
            float w = scores[(size_t)h * len + p] * inv[h];
            if (kind == KV_FP8) w *= ly->v_scale;
            float *oh = out + (size_t)h * d;
#pragma omp simd
            for (int i = 0; i < d; i++) oh[i] += w * v[i];
        }
    }
}

/* SwiGLU of `count` units starting at u: act = silu(gate) * up, rounded as the model rounds */
static inline __attribute__((always_inline)) void swiglu_body(const float *gate_up, int inter, int u0, int u1,
                                                              int round, float *act) {
    for (int u = u0; u < u1;) {
        const int m = u / inter, i0 = u % inter, i1 = (u1 - m * inter) < inter ? u1 - m * inter : inter;
        const float *g = gate_up + (size_t)m * 2 * inter, *up = g + inter;
        float *a = act + (size_t)m * inter;
#pragma omp simd
        for (int i = i0; i < i1; i++) {
            const float v = g[i] / (1.0f + fast_exp(-g[i])) * up[i];
            a[i] = round ? round_bf16(v) : v;
        }
        u += i1 - i0;
    }
}

AVX512 static void attend_avx512(const kiln_model *md, const kiln_layer *ly, const float *q, int nh, int slot,
                                   int pos, int kv_head, float *scratch, float *out) {
    attend_body(md, ly, q, nh, slot, pos, kv_head, scratch, out, dot_avx512);
}
AVX2 static void attend_avx2(const kiln_model *md, const kiln_layer *ly, const float *q, int nh, int slot,
                            int pos, int kv_head, float *scratch, float *out) {
    attend_body(md, ly, q, nh, slot, pos, kv_head, scratch, out, dot_avx2);
}
static void attend_scalar(const kiln_model *md, const kiln_layer *ly, const float *q, int nh, int slot,
                         int pos, int kv_head, float *scratch, float *out) {
    attend_body(md, ly, q, nh, slot, pos, kv_head, scratch, out, dot_scalar);
}
AVX512 static void swiglu_avx512(const float *gate_up, int inter, int u0, int u1, int round, float *act) {
    swiglu_body(gate_up, inter, u0, u1, round, act);
}
AVX2 static void swiglu_avx2(const float *gate_up, int inter, int u0, int u1, int round, float *act) {
    swiglu_body(gate_up, inter, u0, u1, round, act);
}
static void swiglu_scalar(const float *gate_up, int inter, int u0, int u1, int round, float *act) {
    swiglu_body(gate_up, inter, u0, u1, round, act);
}

static void shared_rows(int m_rows, int tid, int nthreads, int *a, int *b) {
    *a = m_rows * tid / nthreads;
    *b = m_rows * (tid + 1) / nthreads;
}

static void step_job(void *arg, int tid, int nthreads) {
    step_state *st = (step_state *)arg;
    const kiln_model *md = st->model;
    const int M = st->m_rows, H = md->hidden, D = md->head_dim;
    const int nq = md->num_heads * D, nkv = md->num_kv_heads * D, I = md->intermediate;
    const int qkv_n = nq + 2 * nkv;
    float *scratch = st->scratch + (size_t)tid * st->scratch_floats;
    int a, b, r0, r1;
    shared_rows(M, tid, nthreads, &a, &b);
    for (int m = a; m < b; m++) { /* the embedding rows */
        const int64_t t = st->tokens[m];
        const size_t at = (size_t)t * H;
        float *x = st->resid + (size_t)m * H;
        for (int i = 0; i < H; i++)
            x[i] = md->embed_kind == W_F32    ? ((const float *)md->embed)[at + i]
                   : md->embed_kind == W_BF16 ? bf16_to_f32(((const uint16_t *)md->embed)[at + i])
                                              : f16_to_f32(((const uint16_t *)md->embed)[at + i]);
    }
    for (int l = 0; l < md->num_layers; l++) {
        const kiln_layer *ly = &md->layers[l];
        for (int m = a; m < b; m++)
            rms_norm_rows(st->resid + (size_t)m * H, ly->input_norm, H, md->eps, rounds_input(&ly->qkv, M, md->round_act),
                          st->normed + (size_t)m * H);
        barrier(nthreads);
        my_rows(&ly->qkv, tid, nthreads, &r0, &r1);
        linear_rows(&ly->qkv, st->normed, M, r0, r1, st->qkv, scratch);
        barrier(nthreads);
        /* q/k norm + RoPE, the new k and v into the cache: one (token, kv head) per unit of work */
        int units = M * md->num_kv_heads;
        for (int u = units * tid / nthreads; u < units * (tid + 1) / nthreads; u++) {
            int m = u / md->num_kv_heads, kvh = u % md->num_kv_heads, pos = (int)st->positions[m];
            float *row = st->qkv + (size_t)m * qkv_n;
            int per = md->num_heads / md->num_kv_heads;
            for (int h = kvh * per; h < (kvh + 1) * per; h++) norm_and_rope(md, ly->q_norm, row + (size_t)h * D, pos);
            float *k = row + nq + (size_t)kvh * D, *v = row + nq + nkv + (size_t)kvh * D;
            norm_and_rope(md, ly->k_norm, k, pos);
            size_t at = (((size_t)st->slots[m] * md->num_kv_heads + kvh) * md->max_len + pos) * D;
            for (int i = 0; i < D; i++) {
                kv_store(ly->k_cache, md->kv_kind, at + i, k[i], ly->k_scale);
                kv_store(ly->v_cache, md->kv_kind, at + i, v[i], ly->v_scale);
            }
        }
        barrier(nthreads);
        /* a unit: some query heads of one kv head of one token, which share its K / V reads; a kv
         * group is split when there are too few groups to keep every thread busy */
        const int per = md->num_heads / md->num_kv_heads, groups = M * md->num_kv_heads;
        int splits = (2 * nthreads + groups - 1) / groups;
        splits = splits < 1 ? 1 : splits > per ? per : splits;
        units = groups * splits;
        for (int u = units * tid / nthreads; u < units * (tid + 1) / nthreads; u++) {
            const int g = u / splits, part = u % splits, m = g / md->num_kv_heads, kvh = g % md->num_kv_heads;
            const int h0 = kvh * per + per * part / splits, h1 = kvh * per + per * (part + 1) / splits;
            float *out = st->attn + (size_t)m * nq + (size_t)h0 * D;
            const float *q = st->qkv + (size_t)m * qkv_n + (size_t)h0 * D;
            const int slot = (int)st->slots[m], pos = (int)st->positions[m];
            if (isa == ISA_AVX512) attend_avx512(md, ly, q, h1 - h0, slot, pos, kvh, scratch, out);
            else if (isa == ISA_AVX2) attend_avx2(md, ly, q, h1 - h0, slot, pos, kvh, scratch, out);
            else attend_scalar(md, ly, q, h1 - h0, slot, pos, kvh, scratch, out);
            if (rounds_input(&ly->o, M, md->round_act))
                for (int i = 0; i < (h1 - h0) * D; i++) out[i] = round_bf16(out[i]);
        }
        barrier(nthreads);
        my_rows(&ly->o, tid, nthreads, &r0, &r1);
        linear_rows(&ly->o, st->attn, M, r0, r1, st->o, scratch);
        barrier(nthreads);
        for (int m = a; m < b; m++) {
            float *x = st->resid + (size_t)m * H;
            for (int i = 0; i < H; i++) x[i] += st->o[(size_t)m * H + i];
            rms_norm_rows(x, ly->post_norm, H, md->eps, rounds_input(&ly->gate_up, M, md->round_act),
                          st->normed + (size_t)m * H);
        }
        barrier(nthreads);
        my_rows(&ly->gate_up, tid, nthreads, &r0, &r1);
        linear_rows(&ly->gate_up, st->normed, M, r0, r1, st->gate_up, scratch);
        barrier(nthreads);
        units = M * I;
        {
            const int u0 = (int)((long)units * tid / nthreads), u1 = (int)((long)units * (tid + 1) / nthreads);
            const int round = rounds_input(&ly->down, M, md->round_act);
            if (isa == ISA_AVX512) swiglu_avx512(st->gate_up, I, u0, u1, round, st->act);
            else if (isa == ISA_AVX2) swiglu_avx2(st->gate_up, I, u0, u1, round, st->act);
            else swiglu_scalar(st->gate_up, I, u0, u1, round, st->act);
        }
        barrier(nthreads);
        my_rows(&ly->down, tid, nthreads, &r0, &r1);
        linear_rows(&ly->down, st->act, M, r0, r1, st->down, scratch);
        barrier(nthreads);
        for (int m = a; m < b; m++)
            for (int i = 0; i < H; i++) st->resid[(size_t)m * H + i] += st->down[(size_t)m * H + i];
    }
    for (int m = a; m < b; m++)
        rms_norm_rows(st->resid + (size_t)m * H, md->final_norm, H, md->eps, rounds_input(md->head, M, md->head_round_in),
                      st->normed + (size_t)m * H);
    barrier(nthreads);
    my_rows(md->head, tid, nthreads, &r0, &r1);
    linear_rows(md->head, st->normed, M, r0, r1, st->logits, scratch);
}

/* floats of per-thread scratch one layer needs for M tokens */
static size_t linear_scratch_floats(const kiln_linear *L, int m_rows) {
    if (L->kind == W_INT4) return (size_t)m_rows * (L->k / L->op_group + 64 + L->zo_groups) + (size_t)L->op_group * 64;
    if (L->kind == W_W4A8) return w4a8_scratch_floats(m_rows, L->k, L->op_group);
    if (L->kind == W_W8A8) return (size_t)(m_rows + 15) / 16 * 16 + ((size_t)m_rows * L->k + 3) / 4;
    if (L->kind == W_INT8) return (size_t)(m_rows + 15) / 16 * 16 + ((size_t)m_rows * L->k + 1) / 2;
    return 16;
}

static size_t scratch_floats_for(const kiln_model *md, int m_rows) {
    /* attention: the scores of a kv group's query heads and one row */
    size_t most = (size_t)md->max_len * (md->num_heads / md->num_kv_heads) + md->head_dim;
    const kiln_linear *all[4];
    for (int l = 0; l < md->num_layers; l++) {
        const kiln_layer *ly = &md->layers[l];
        all[0] = &ly->qkv, all[1] = &ly->o, all[2] = &ly->gate_up, all[3] = &ly->down;
        for (int i = 0; i < 4; i++) {
            const size_t need = linear_scratch_floats(all[i], m_rows);
            most = need > most ? need : most;
        }
    }
    const size_t need = linear_scratch_floats(md->head, m_rows);
    most = need > most ? need : most;
    return (most + 15) / 16 * 16;
}

/* One decode step: tokens (M,), their cache slots and positions -> logits (M, vocab) fp32.
 * Returns 0, or -1 when out of memory / M out of range (nothing written then). */
int kiln_decode_step(const kiln_model *md, int m_rows, const int64_t *tokens, const int64_t *slots,
                     const int64_t *positions, float *logits) {
    if (m_rows < 1 || m_rows > MAX_BATCH) return -1;
    pthread_once(&e4m3_once, make_e4m3_table);
    pthread_once(&isa_once, detect_isa);
    const int H = md->hidden, D = md->head_dim, I = md->intermediate;
    const size_t nq = (size_t)md->num_heads * D, qkv_n = nq + 2 * (size_t)md->num_kv_heads * D;
    const size_t per_row = 3 * (size_t)H + qkv_n + nq + H + 2 * (size_t)I + I + H;
    step_state st = {.model = md, .m_rows = m_rows, .tokens = tokens, .slots = slots, .positions = positions,
                     .logits = logits};
    st.scratch_floats = scratch_floats_for(md, m_rows);
    float *mem = aligned_alloc(64, ((per_row * m_rows + st.scratch_floats * pool.nthreads) * sizeof(float) + 63) / 64 * 64);
    if (!mem) return -1;
    float *p = mem;
    st.resid = p, p += (size_t)m_rows * H;
    st.normed = p, p += (size_t)m_rows * H;
    st.qkv = p, p += (size_t)m_rows * qkv_n;
    st.attn = p, p += (size_t)m_rows * nq;
    st.o = p, p += (size_t)m_rows * H;
    st.gate_up = p, p += (size_t)m_rows * 2 * I;
    st.act = p, p += (size_t)m_rows * I;
    st.down = p, p += (size_t)m_rows * H;
    p += (size_t)m_rows * H;
    st.scratch = p;
    run_parallel(step_job, &st);
    free(mem);
    return 0;
}

/* y (M, N) = x (M, K) @ W.T through one layer descriptor, on the pool: the kernel tests' entry. */
typedef struct {
    const kiln_linear *L;
    const float *x;
    int m_rows;
    float *y, *scratch;
    size_t scratch_floats;
} linear_job_state;

static void linear_job(void *arg, int tid, int nthreads) {
    linear_job_state *s = (linear_job_state *)arg;
    int r0, r1;
    my_rows(s->L, tid, nthreads, &r0, &r1);
    linear_rows(s->L, s->x, s->m_rows, r0, r1, s->y, s->scratch + (size_t)tid * s->scratch_floats);
}

int kiln_linear_apply(const kiln_linear *L, int m_rows, const float *x, float *y) {
    pthread_once(&isa_once, detect_isa);
    const size_t per = (linear_scratch_floats(L, m_rows) + 15) / 16 * 16;
    float *scratch = aligned_alloc(64, per * pool.nthreads * sizeof(float));
    if (!scratch) return -1;
    linear_job_state s = {L, x, m_rows, y, scratch, per};
    run_parallel(linear_job, &s);
    free(scratch);
    return 0;
}
