// A float32 linear layer for decoding steps on AVX-512 CPUs: out[m, n] = bias[n] + sum_k x[m, k] w[n, k].
//
// The weight is packed in panels of 16 output features (`pack` in __init__.py): panel p holds, for each k,
// w[16p + j, k] for j = 0..15, contiguous, zero past the last feature. Each thread takes a contiguous share
// of the panels, read once and in order; a few panels at a time are multiplied with a block of input rows,
// every accumulator in a register and no horizontal sum. Built at first use (`-march=native`) by
// lookahead.kernels.
#include <immintrin.h>
#include <omp.h>

static inline __mmask16 tail(int n, int col) { return n - col >= 16 ? 0xFFFF : (__mmask16)((1u << (n - col)) - 1); }

// P panels against MB input rows starting at m0.
#define KERNEL(P, MB)                                                                                      \
  static void kernel_##P##_##MB(const float *x, const float *wp, const float *bias, float *out, int n,      \
                                int k_size, int p, int m0) {                                               \
    __m512 acc[P][MB];                                                                                     \
    for (int q = 0; q < P; q++) {                                                                          \
      __m512 b = bias ? _mm512_maskz_loadu_ps(tail(n, 16 * (p + q)), bias + 16 * (p + q)) : _mm512_setzero_ps(); \
      for (int m = 0; m < MB; m++) acc[q][m] = b;                                                          \
    }                                                                                                      \
    const float *panel = wp + (long)p * k_size * 16;                                                       \
    const float *rows = x + (long)m0 * k_size;                                                             \
    for (int k = 0; k < k_size; k++) {                                                                     \
      __m512 w[P];                                                                                         \
      for (int q = 0; q < P; q++) w[q] = _mm512_loadu_ps(panel + ((long)q * k_size + k) * 16);             \
      for (int m = 0; m < MB; m++) {                                                                       \
        __m512 xv = _mm512_set1_ps(rows[(long)m * k_size + k]);                                            \
        for (int q = 0; q < P; q++) acc[q][m] = _mm512_fmadd_ps(w[q], xv, acc[q][m]);                      \
      }                                                                                                    \
    }                                                                                                      \
    for (int m = 0; m < MB; m++)                                                                           \
      for (int q = 0; q < P; q++)                                                                          \
        _mm512_mask_storeu_ps(out + (long)(m0 + m) * n + 16 * (p + q), tail(n, 16 * (p + q)), acc[q][m]); \
  }

KERNEL(4, 1) KERNEL(4, 2) KERNEL(4, 3) KERNEL(4, 4) KERNEL(4, 5) KERNEL(4, 6)
KERNEL(3, 1) KERNEL(3, 2) KERNEL(3, 3) KERNEL(3, 4) KERNEL(3, 5) KERNEL(3, 6) KERNEL(3, 7) KERNEL(3, 8)
KERNEL(2, 1) KERNEL(2, 2) KERNEL(2, 3) KERNEL(2, 4) KERNEL(2, 5) KERNEL(2, 6) KERNEL(2, 7) KERNEL(2, 8)
KERNEL(1, 1) KERNEL(1, 2) KERNEL(1, 3) KERNEL(1, 4) KERNEL(1, 5) KERNEL(1, 6) KERNEL(1, 7) KERNEL(1, 8)

typedef void (*kernel_t)(const float *, const float *, const float *, float *, int, int, int, int);
static const kernel_t KERNELS[5][9] = {
  [1] = {0, kernel_1_1, kernel_1_2, kernel_1_3, kernel_1_4, kernel_1_5, kernel_1_6, kernel_1_7, kernel_1_8},
  [2] = {0, kernel_2_1, kernel_2_2, kernel_2_3, kernel_2_4, kernel_2_5, kernel_2_6, kernel_2_7, kernel_2_8},
  [3] = {0, kernel_3_1, kernel_3_2, kernel_3_3, kernel_3_4, kernel_3_5, kernel_3_6, kernel_3_7, kernel_3_8},
  [4] = {0, kernel_4_1, kernel_4_2, kernel_4_3, kernel_4_4, kernel_4_5, kernel_4_6},
};

// x [m_size, k_size], wp: the packed weight of n features, bias [n] or NULL, out [m_size, n].
void linear_f32(const float *x, const float *wp, const float *bias, float *out, int m_size, int n, int k_size,
                int threads) {
  int panels = (n + 15) / 16;
  // Up to 6 rows: 4 panels a block (up to 24 accumulators); more: 3 panels against 8 rows at a time.
  int widest = m_size <= 6 ? 4 : 3, block_rows = m_size <= 6 ? m_size : 8;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), share = (panels + omp_get_num_threads() - 1) / omp_get_num_threads();
    int first = t * share, last = first + share < panels ? first + share : panels;
    for (int p = first; p < last;) {
      int width = last - p < widest ? last - p : widest;  // the share's last panels: fewer at once
      for (int m0 = 0; m0 < m_size; m0 += block_rows) {
        int rows = m_size - m0 < block_rows ? m_size - m0 : block_rows;
        KERNELS[width][rows](x, wp, bias, out, n, k_size, p, m0);
      }
      p += width;
    }
  }
}
