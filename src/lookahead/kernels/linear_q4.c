// A linear layer with 4-bit weights for decoding steps on AVX-512 CPUs with bfloat16 dot products: GGUF Q4_1's
// scheme, each group of 32 inputs of a feature holding codes c in 0..15 with a scale s and a minimum mn, w = s c + mn.
//
// As torch's int4 kernel, the inputs are rounded to bfloat16 (then each code-input product is exact in float32) and
// the outputs too: out[m, n] = bf16(bias[n] + sum_g (s sum c x + mn sum x)), the sums over a group's 32 inputs in
// float32. Every row is computed on its own, in the same order whatever else is fed with it. Bfloat16 outputs carry
// 8 significant bits, so attention's products over them are exact in float32 and do not depend on the step's shape
// (one row or many, a cache or none): greedy decoding through a cache follows a full forward token for token. (A
// first version quantised the inputs to int8 per group, as llama.cpp does: float noise of ~1e-7 between two such
// paths flipped input codes and changed the default model's tokens within 3-30, by logit gaps of 0.1-0.7.)
//
// Packed (`pack_q4` in __init__.py): panel p holds 16 features; for each block of 4 inputs (k = 4b..4b + 3), 32
// bytes whose byte t carries element t of the first pair (k = 4b, 4b + 1) in its low nibble and element t of the
// second (4b + 2, 4b + 3) in its high one, element 2i + j of a pair being feature i's code for its input j (the
// order of one bfloat16 dot-product operand). Scales and zeros, bfloat16
// [panel, group, 2, 16]: w = s (c - 8) + zero, so mn = zero - 8 s (in float32). n a multiple of 16, k of 32.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef __AVX512BF16__

// Rounded to bfloat16's precision (to nearest, ties to even; finite values).
static inline __m512 to_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline __m512 from_bf16(const uint16_t *values) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)values)), 16));
}

// P panels against MB rows starting at m0; xb: the rows in bfloat16, xs: each row's sum over each group. A code c
// enters the product as the bfloat16 word 0x4300 | c, i.e. 128 + c (exact, as is its product with a bfloat16
// input): one bitwise operation instead of a lookup; the group's 128 * sum x is taken back with the minimum.
#define KERNEL(P, MB)                                                                                          \
  static void q4_##P##_##MB(const uint16_t *xb, const float *xs, const uint8_t *codes, const uint16_t *scales,  \
                            const float *bias, float *out, int n, int k_size, int p, int m0) {                 \
    const int groups = k_size / 32, quads = k_size / 4;                                                        \
    const __m512i low = _mm512_set1_epi16(0x000F), offset = _mm512_set1_epi16(0x4300);                        \
    __m512 acc[P][MB];                                                                                         \
    for (int q = 0; q < P; q++) {                                                                              \
      __m512 b = bias ? _mm512_loadu_ps(bias + 16 * (p + q)) : _mm512_setzero_ps();                           \
      for (int m = 0; m < MB; m++) acc[q][m] = b;                                                              \
    }                                                                                                          \
    for (int g = 0; g < groups; g++) {                                                                         \
      __m512 dot[P][MB];                                                                                       \
      for (int q = 0; q < P; q++)                                                                              \
        for (int m = 0; m < MB; m++) dot[q][m] = _mm512_setzero_ps();                                          \
      for (int b = 8 * g; b < 8 * g + 8; b++) {                                                                \
        __m512bh first[P], second[P];                                                                          \
        for (int q = 0; q < P; q++) {                                                                          \
          __m512i words = _mm512_cvtepu8_epi16(                                                                \
              _mm256_loadu_si256((const __m256i *)(codes + ((long)(p + q) * quads + b) * 32)));               \
          first[q] = (__m512bh)_mm512_ternarylogic_epi32(words, low, offset, 0xEA); /* (w & 0xF) | 0x4300 */  \
          second[q] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 4), offset);                          \
        }                                                                                                      \
        for (int m = 0; m < MB; m++) {                                                                         \
          const uint16_t *row = xb + (long)(m0 + m) * k_size + 4 * b;                                          \
          __m512bh x0 = (__m512bh)_mm512_set1_epi32(*(const int32_t *)row);                                    \
          __m512bh x1 = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(row + 2));                              \
          for (int q = 0; q < P; q++) dot[q][m] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(dot[q][m], first[q], x0), \
                                                                    second[q], x1);                            \
        }                                                                                                      \
      }                                                                                                        \
      for (int q = 0; q < P; q++) {                                                                            \
        const uint16_t *pair = scales + ((long)(p + q) * groups + g) * 32;                                     \
        __m512 s = from_bf16(pair), mn = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), s, from_bf16(pair + 16));   \
        for (int m = 0; m < MB; m++) {                                                                         \
          acc[q][m] = _mm512_fmadd_ps(dot[q][m], s, acc[q][m]);                                                \
          acc[q][m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[(long)(m0 + m) * groups + g]), acc[q][m]);         \
        }                                                                                                      \
      }                                                                                                        \
    }                                                                                                          \
    for (int m = 0; m < MB; m++)                                                                               \
      for (int q = 0; q < P; q++) _mm512_storeu_ps(out + (long)(m0 + m) * n + 16 * (p + q), to_bf16(acc[q][m])); \
  }

KERNEL(4, 1) KERNEL(4, 2)
KERNEL(2, 1) KERNEL(2, 2) KERNEL(2, 3) KERNEL(2, 4)
KERNEL(1, 1) KERNEL(1, 2) KERNEL(1, 3) KERNEL(1, 4) KERNEL(1, 5) KERNEL(1, 6) KERNEL(1, 7) KERNEL(1, 8)

typedef void (*q4_kernel_t)(const uint16_t *, const float *, const uint8_t *, const uint16_t *, const float *,
                            float *, int, int, int, int);
static const q4_kernel_t Q4_KERNELS[5][9] = {
  [1] = {0, q4_1_1, q4_1_2, q4_1_3, q4_1_4, q4_1_5, q4_1_6, q4_1_7, q4_1_8},
  [2] = {0, q4_2_1, q4_2_2, q4_2_3, q4_2_4},
  [4] = {0, q4_4_1, q4_4_2},
};

// x [m_size, k_size] float; codes, scales: packed as above for n features; bias [n] or NULL; out [m_size, n].
void linear_q4(const float *x, const uint8_t *codes, const uint16_t *scales, const float *bias, float *out,
               int m_size, int n, int k_size, int threads) {
  int groups = k_size / 32, panels = n / 16;
  uint16_t *xb = malloc(sizeof(uint16_t) * m_size * k_size);
  float *xs = malloc(sizeof(float) * m_size * groups);
  // Each group of 32 inputs of each row: rounded to bfloat16, and the rounded values' sum (a fixed tree of additions).
  for (int r = 0; r < m_size * groups; r++) {
    __m512 v0 = to_bf16(_mm512_loadu_ps(x + (long)r * 32)), v1 = to_bf16(_mm512_loadu_ps(x + (long)r * 32 + 16));
    __m512i high = _mm512_srli_epi32(_mm512_castps_si512(v0), 16), high1 = _mm512_srli_epi32(_mm512_castps_si512(v1), 16);
    _mm256_storeu_si256((__m256i *)(xb + (long)r * 32), _mm512_cvtepi32_epi16(high));
    _mm256_storeu_si256((__m256i *)(xb + (long)r * 32 + 16), _mm512_cvtepi32_epi16(high1));
    xs[r] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
  }
  // Up to 2 rows: 4 panels a block; up to 4: 2 panels; more: 1 panel against 8 rows at a time.
  int widest = m_size <= 2 ? 4 : (m_size <= 4 ? 2 : 1), block_rows = m_size <= 4 ? m_size : 8;
  #pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), share = (panels + omp_get_num_threads() - 1) / omp_get_num_threads();
    int first = t * share, last = first + share < panels ? first + share : panels;
    for (int p = first; p < last;) {
      int width = last - p >= widest ? widest : (last - p >= 2 && widest >= 2 ? 2 : 1);
      for (int m0 = 0; m0 < m_size; m0 += block_rows) {
        int rows = m_size - m0 < block_rows ? m_size - m0 : block_rows;
        Q4_KERNELS[width][rows](xb, xs, codes, scales, bias, out, n, k_size, p, m0);
      }
      p += width;
    }
  }
  free(xb);
  free(xs);
}

#endif
