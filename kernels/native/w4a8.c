/* cpu_w4a8's library (kernels/cpu_w4a8.py): the activations of M tokens quantized once, then the row
 * blocks of the layer shared by `nthreads` threads (the caller and nthreads - 1 made for the call:
 * prefill and the eager step's calls; the native decode step runs the same bodies on its own pool).
 * The bodies and the layout: w4a8_gemv.h. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>

#include "w4a8_gemv.h"

#define MAX_THREADS 64

static int detected = -1, level = W4A8_SCALAR;
static pthread_once_t detect_once = PTHREAD_ONCE_INIT;

static void detect(void) {
    detected = w4a8_detect();
    level = detected;
}

/* The body in use, capped at `cap` (0 scalar, 1 AVX2, 2 AVX-512 VNNI; tests run each): the one set.
   cap < 0 only reads it. */
int kiln_w4a8_level(int cap) {
    pthread_once(&detect_once, detect);
    if (cap < 0) return level;
    level = cap < detected ? cap : detected;
    return level;
}

/* x (M, K) fp32 -> q (M, K) int8, sx and csum (M, K / group): what every body multiplies. */
void kiln_w4a8_quantize(const float *x, int m_rows, int k, int group, int8_t *q, float *sx, float *csum) {
    pthread_once(&detect_once, detect);
    w4a8_quantize(level, x, m_rows, k, group, q, sx, csum);
}

typedef struct {
    const w4a8_weight *W;
    w4a8_acts A;
    int m_rows, b0, b1, lvl;
    float *y;
} share;

static void *run_share(void *p) {
    const share *s = (const share *)p;
    w4a8_rows(s->lvl, s->W, &s->A, s->m_rows, s->b0, s->b1, s->y);
    return NULL;
}

/* y (M, N) fp32 = x (M, K) fp32 through the layer; 0, or -1 when out of memory (nothing written). */
int kiln_w4a8_apply(const w4a8_weight *W, int m_rows, const float *x, float *y, int nthreads) {
    pthread_once(&detect_once, detect);
    if (m_rows <= 0) return 0; /* nothing to write (and no zero-size allocation to ask for) */
    float *scratch = aligned_alloc(64, w4a8_scratch_floats(m_rows, W->k, W->group) * sizeof(float));
    if (!scratch) return -1;
    int8_t *q;
    float *sx, *csum;
    const w4a8_acts A = w4a8_acts_in(scratch, m_rows, W->k, W->group, &q, &sx, &csum);
    w4a8_quantize(level, x, m_rows, W->k, W->group, q, sx, csum);
    const int blocks = W->n / W4A8_ROWS;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads > blocks) nthreads = blocks;
    if (nthreads < 1) nthreads = 1;
    share shares[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    int made[MAX_THREADS] = {0};
    for (int t = 0; t < nthreads; t++)
        shares[t] = (share){W, A, m_rows, blocks * t / nthreads, blocks * (t + 1) / nthreads, level, y};
    for (int t = 1; t < nthreads; t++) made[t] = pthread_create(&threads[t], NULL, run_share, &shares[t]) == 0;
    run_share(&shares[0]);
    for (int t = 1; t < nthreads; t++) {
        if (made[t]) pthread_join(threads[t], NULL);
        else run_share(&shares[t]); /* no thread: its share here */
    }
    free(scratch);
    return 0;
}
