// mlxrt's CPU kernels for MLX: the SwiGLU activation, the softmax and the attention built on it,
// bit for bit what MLX's own CPU kernels compute, eight lanes at a time (AVX2 + FMA).
//
// MLX's CPU backend on x86-64 Linux runs its elementwise kernels one float at a time
// (`mlx/backend/cpu/simd/base_simd.h`: `max_size` is 1 there) and its `exp` calls `fmaf` six
// times an element: ~14 ns an element for `mx.exp`, ~19 for the sigmoid, against ~1 for numpy.
// The SiLU of the MLPs and the softmax of the attention are most of a CPU prefill's time that
// is not matrix products. The functions here evaluate the same formulas
// (`mlx/backend/cpu/simd/math.h` `exp`, `unary_ops.h` `Sigmoid`, `softmax.cpp`) with the same
// roundings: an FMA instruction rounds once as `fmaf` does, IEEE division and products are the
// same in a vector register, and every sum keeps MLX's order. The Python side
// (`engine/native/__init__.py`) checks the results against MLX's at load and falls back to
// MLX's own ops on any difference, on machines without AVX2, and on Metal.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <thread>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mx = mlx::core;
namespace nb = nanobind;
using namespace nb::literals;

namespace mlxrt {

#define MLXRT_AVX2 __attribute__((target("avx2,fma")))
#define MLXRT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))

// `simd::exp` of `mlx/backend/cpu/simd/math.h`, eight floats at a time. MLX computes
// `floor(x + 0.5)` with `0.5` a double: floor(x) + 1 where x - floor(x) >= 0.5 is the same
// integer (that difference is exact in float for every x, Sterbenz's lemma).
MLXRT_AVX2 static inline __m256 exp8(__m256 x_init) {
  const __m256 x = _mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f));
  const __m256 low = _mm256_floor_ps(x);
  const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(x, low), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  const __m256 ipart = _mm256_add_ps(low, _mm256_and_ps(up, _mm256_set1_ps(1.0f)));
  const __m256 fpart = _mm256_sub_ps(x, ipart);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, fpart, _mm256_set1_ps(1.000000000000000f));
  const __m256i epart = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 result = _mm256_mul_ps(_mm256_castsi256_ps(epart), p);
  result = _mm256_blendv_ps(result, x_init, _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q));
  result = _mm256_blendv_ps(result, _mm256_set1_ps(std::numeric_limits<float>::infinity()), _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  result = _mm256_blendv_ps(result, _mm256_setzero_ps(), _mm256_cmp_ps(x_init, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
  return result;
}

// `Sigmoid` of `mlx/backend/cpu/unary_ops.h`: y = 1 / (1 + exp(|x|)), then y below zero, 1 - y above.
MLXRT_AVX2 static inline __m256 sigmoid8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, exp8(magnitude)));
  return _mm256_blendv_ps(_mm256_sub_ps(one, y), y, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}


MLXRT_AVX2 static void exp_rows(const float* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, exp8(_mm256_loadu_ps(in + i)));
  }
  if (i < n) {
    float a[8] = {0}, o[8];
    std::memcpy(a, in + i, (n - i) * sizeof(float));
    _mm256_storeu_ps(o, exp8(_mm256_loadu_ps(a)));
    std::memcpy(out + i, o, (n - i) * sizeof(float));
  }
}

// mlx-lm's `swiglu(gate, x)`: `nn.silu(gate) * x`, that is (gate * sigmoid(gate)) * x.
MLXRT_AVX2 static void swiglu_kernel(const float* gate, const float* up, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), _mm256_loadu_ps(up + i)));
  }
  if (i < n) {
    float a[8] = {0}, b[8] = {0}, o[8];
    std::memcpy(a, gate + i, (n - i) * sizeof(float));
    std::memcpy(b, up + i, (n - i) * sizeof(float));
    const __m256 g = _mm256_loadu_ps(a);
    _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), _mm256_loadu_ps(b)));
    std::memcpy(out + i, o, (n - i) * sizeof(float));
  }
}

// `softmax<float, float>` of `mlx/backend/cpu/softmax.cpp` with one lane (`N = 1`, as on x86):
// the row's maximum (NaN wins, as `simd::maximum`), exp(x - max) stored, the normalizer summed
// from 0 in the row's order, its reciprocal `1 / s`, and the products. Eight rows' sums run
// side by side (each in its own order) so that the additions' latency overlaps.
MLXRT_AVX2 static void softmax_rows(const float* in, float* out, size_t rows, size_t m) {
  constexpr size_t G = 8;
  for (size_t r0 = 0; r0 < rows; r0 += G) {
    const size_t g = std::min(G, rows - r0);
    float sums[G];
    for (size_t r = 0; r < g; r++) {
      const float* x = in + (r0 + r) * m;
      float* y = out + (r0 + r) * m;
      float maximum = -std::numeric_limits<float>::infinity();
      bool nan = false;
      size_t k = 0;
      __m256 vmax = _mm256_set1_ps(maximum);
      __m256 vnan = _mm256_setzero_ps();
      for (; k + 8 <= m; k += 8) {
        const __m256 v = _mm256_loadu_ps(x + k);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        vmax = _mm256_max_ps(vmax, v);
      }
      nan = _mm256_movemask_ps(vnan) != 0;
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vmax);
      for (int l = 0; l < 8; l++) maximum = lanes[l] > maximum ? lanes[l] : maximum;
      for (; k < m; k++) {
        nan |= std::isnan(x[k]);
        maximum = x[k] > maximum ? x[k] : maximum;
      }
      if (nan) maximum = std::numeric_limits<float>::quiet_NaN();
      const __m256 vm = _mm256_set1_ps(maximum);
      k = 0;
      for (; k + 8 <= m; k += 8) {
        _mm256_storeu_ps(y + k, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + k), vm)));
      }
      if (k < m) {
        float a[8] = {0}, o[8];
        for (size_t j = k; j < m; j++) a[j - k] = x[j] - maximum;
        _mm256_storeu_ps(o, exp8(_mm256_loadu_ps(a)));
        std::memcpy(y + k, o, (m - k) * sizeof(float));
      }
      sums[r] = 0.0f;
    }
    if (g == G) {
      for (size_t k = 0; k < m; k++) {
        for (size_t r = 0; r < G; r++) sums[r] += out[(r0 + r) * m + k];
      }
    } else {
      for (size_t r = 0; r < g; r++) {
        const float* y = out + (r0 + r) * m;
        for (size_t k = 0; k < m; k++) sums[r] += y[k];
      }
    }
    for (size_t r = 0; r < g; r++) {
      float* y = out + (r0 + r) * m;
      const float normalizer = 1 / sums[r];
      const __m256 vn = _mm256_set1_ps(normalizer);
      size_t k = 0;
      for (; k + 8 <= m; k += 8) _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(y + k), vn));
      for (; k < m; k++) y[k] *= normalizer;
    }
  }
}

// `simd::sincos` of `mlx/backend/cpu/simd/math.h` (Cephes), both results, eight floats at a time;
// `sincos_checked`'s arguments past 2^23 go to libm's sinf/cosf, as MLX's do.
MLXRT_AVX2 static inline void sincos8(__m256 in, __m256* sine, __m256* cosine) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256i one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2), four = _mm256_set1_epi32(4);
  const __m256 negative = _mm256_cmp_ps(in, _mm256_setzero_ps(), _CMP_LT_OQ);
  __m256 x = _mm256_andnot_ps(sign_bit, in);
  const __m256 scaled = _mm256_mul_ps(x, _mm256_set1_ps(1.27323954473516f));
  __m256i emm2 = _mm256_cvttps_epi32(scaled);
  emm2 = _mm256_andnot_si256(one, _mm256_add_epi32(emm2, one));
  const __m256 y = _mm256_cvtepi32_ps(emm2);
  const __m256 poly = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(emm2, two), two));
  x = _mm256_fmadd_ps(y, _mm256_set1_ps(-0.78515625f), x);
  x = _mm256_fmadd_ps(y, _mm256_set1_ps(-2.4187564849853515625e-4f), x);
  x = _mm256_fmadd_ps(y, _mm256_set1_ps(-3.77489497744594108e-8f), x);
  const __m256 sign_sin = _mm256_xor_ps(negative, _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(emm2, four), four)));
  const __m256 sign_cos = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_sub_epi32(emm2, two), four), four));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y1 = _mm256_fmadd_ps(z, _mm256_set1_ps(2.443315711809948e-5f), _mm256_set1_ps(-1.388731625493765e-3f));
  __m256 y2 = _mm256_fmadd_ps(z, _mm256_set1_ps(-1.9515295891e-4f), _mm256_set1_ps(8.3321608736e-3f));
  y1 = _mm256_fmadd_ps(y1, z, _mm256_set1_ps(4.166664568298827e-2f));
  y2 = _mm256_fmadd_ps(y2, z, _mm256_set1_ps(-1.6666654611e-1f));
  y1 = _mm256_mul_ps(y1, z);
  y2 = _mm256_mul_ps(y2, z);
  y1 = _mm256_mul_ps(y1, z);
  y2 = _mm256_fmadd_ps(x, y2, x);
  y1 = _mm256_fmadd_ps(z, _mm256_set1_ps(-0.5f), y1);
  y1 = _mm256_add_ps(y1, _mm256_set1_ps(1.0f));
  const __m256 ys = _mm256_blendv_ps(y2, y1, poly);
  const __m256 yc = _mm256_blendv_ps(y1, y2, poly);
  __m256 s = _mm256_blendv_ps(ys, _mm256_xor_ps(ys, sign_bit), sign_sin);
  __m256 c = _mm256_blendv_ps(_mm256_xor_ps(yc, sign_bit), yc, sign_cos);
  const __m256 large = _mm256_cmp_ps(_mm256_andnot_ps(sign_bit, in), _mm256_set1_ps(8388608.0f), _CMP_GT_OQ);
  if (_mm256_movemask_ps(large)) {
    alignas(32) float values[8], sines[8], cosines[8];
    _mm256_store_ps(values, in);
    _mm256_store_ps(sines, s);
    _mm256_store_ps(cosines, c);
    for (int l = 0; l < 8; l++) {
      if (std::fabs(values[l]) > 8388608.0f) {
        sines[l] = std::sin(values[l]);
        cosines[l] = std::cos(values[l]);
      }
    }
    s = _mm256_load_ps(sines);
    c = _mm256_load_ps(cosines);
  }
  *sine = s;
  *cosine = c;
}

// `mx.fast.rope` (forward, no `freqs`) as MLX evaluates it on the CPU (`mlx/fast.cpp`'s fallback):
// positions (t + offset) * scale, inverse frequencies exp(-j * (log(base) / (dims / 2))),
// theta = position * frequency, and each pair (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos),
// the pairs split in halves (or interleaved: `traditional`), dimensions past `dims` copied.
MLXRT_AVX2 static void rope_rows(const float* in, float* out, const int32_t* offsets, bool per_row, int B, int N, int T, int D, int dims,
                                 bool traditional, float base, float scale) {
  const int half = dims / 2;
  const int padded = (half + 7) / 8 * 8;
  std::vector<float> inv(padded, 0.0f), angles(padded), cosines(padded), sines(padded);
  const float step = std::log(base) / half;
  for (int j = 0; j < half; j++) inv[j] = static_cast<float>(-j) * step;
  for (int j = 0; j < padded; j += 8) _mm256_storeu_ps(inv.data() + j, exp8(_mm256_loadu_ps(inv.data() + j)));
  for (int b = 0; b < B; b++) {
    const float offset = static_cast<float>(offsets[per_row ? b : 0]);
    for (int t = 0; t < T; t++) {
      const float position = (static_cast<float>(t) + offset) * scale;
      for (int j = 0; j < padded; j += 8) {
        __m256 sv, cv;
        sincos8(_mm256_mul_ps(_mm256_set1_ps(position), _mm256_loadu_ps(inv.data() + j)), &sv, &cv);
        _mm256_storeu_ps(sines.data() + j, sv);
        _mm256_storeu_ps(cosines.data() + j, cv);
      }
      for (int n = 0; n < N; n++) {
        const size_t row = ((static_cast<size_t>(b) * N + n) * T + t) * D;
        const float* x = in + row;
        float* y = out + row;
        if (traditional) {
          for (int j = 0; j < half; j++) {
            const float x1 = x[2 * j], x2 = x[2 * j + 1], c = cosines[j], s = sines[j];
            const float a = x1 * c, b2 = x2 * s, e = x1 * s, f = x2 * c;
            y[2 * j] = a - b2;
            y[2 * j + 1] = e + f;
          }
        } else {
          int j = 0;
          for (; j + 8 <= half; j += 8) {
            const __m256 x1 = _mm256_loadu_ps(x + j), x2 = _mm256_loadu_ps(x + half + j);
            const __m256 c = _mm256_loadu_ps(cosines.data() + j), s = _mm256_loadu_ps(sines.data() + j);
            _mm256_storeu_ps(y + j, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
            _mm256_storeu_ps(y + half + j, _mm256_add_ps(_mm256_mul_ps(x1, s), _mm256_mul_ps(x2, c)));
          }
          for (; j < half; j++) {
            const float x1 = x[j], x2 = x[half + j], c = cosines[j], s = sines[j];
            const float a = x1 * c, b2 = x2 * s, e = x1 * s, f = x2 * c;
            y[j] = a - b2;
            y[half + j] = e + f;
          }
        }
        for (int k = dims; k < D; k++) y[k] = x[k];
      }
    }
  }
}

// `mx.fast.rms_norm(x, weight, eps)` as MLX evaluates it on the CPU (`mlx/fast.cpp`'s fallback):
// x * rsqrt(mean(x * x) + eps) * weight, the mean a sum from 0 in the row's order (`reduce.cpp`'s
// `contiguous_reduce` with one lane) times (float)(1.0 / n), rsqrt as 1 / sqrt. Eight rows' sums
// run side by side.
MLXRT_AVX2 static void rms_norm_rows(const float* in, const float* weight, float* out, size_t rows, size_t m, float eps) {
  constexpr size_t G = 8;
  const float normalizer = static_cast<float>(1.0 / static_cast<double>(m));
  for (size_t r0 = 0; r0 < rows; r0 += G) {
    const size_t g = std::min(G, rows - r0);
    float sums[G] = {0};
    if (g == G) {
      for (size_t k = 0; k < m; k++) {
        for (size_t r = 0; r < G; r++) {
          const float v = in[(r0 + r) * m + k];
          const float square = v * v;
          sums[r] += square;
        }
      }
    } else {
      for (size_t r = 0; r < g; r++) {
        const float* x = in + (r0 + r) * m;
        for (size_t k = 0; k < m; k++) {
          const float square = x[k] * x[k];
          sums[r] += square;
        }
      }
    }
    for (size_t r = 0; r < g; r++) {
      const float mean = sums[r] * normalizer;
      const float scale = 1.0f / std::sqrt(mean + eps);
      const float* x = in + (r0 + r) * m;
      float* y = out + (r0 + r) * m;
      const __m256 vs = _mm256_set1_ps(scale);
      size_t k = 0;
      for (; k + 8 <= m; k += 8) {
        _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), vs), _mm256_loadu_ps(weight + k)));
      }
      for (; k < m; k++) {
        const float normed = x[k] * scale;
        y[k] = normed * weight[k];
      }
    }
  }
}

// CBLAS, as MLX's CPU matmul calls it (`mlx/backend/cpu/gemms/cblas.cpp`); the symbol resolves to
// the BLAS MLX uses (OpenBLAS, preloaded by `runtime.blas`, else MLX's own).
extern "C" void cblas_sgemm(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
                            float beta, float* c, int ldc);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// OpenBLAS runs a product on its worker threads once m * n * k exceeds 65,536 x 4
// (`interface/gemm.c`'s SMP threshold x GEMM_MULTITHREAD_THRESHOLD). Two of the engine's CPU lanes
// making such calls at once each wait on the other's use of the same pool of workers: one step of
// rows 2,048 positions wide took 4.7 s against 0.25 s with one call at a time (BENCHMARKS.md). So
// those calls take turns here (each still on every core); smaller ones run side by side.
constexpr double kThreadedProduct = 65536.0 * 4;
static std::mutex threaded_products;
// Below this many multiply-adds a step's attention runs on the calling thread alone (one
// row's three KV heads at ~100 positions take a few microseconds: less than handing them over).
constexpr double kSharedAttention = 3.0 * 3 * 256 * 64;

static void sgemm(int trans_b, int m, int n, int k, const float* a, int lda, const float* b, int ldb, float* c, int ldc) {
  std::unique_lock<std::mutex> turn(threaded_products, std::defer_lock);
  if (static_cast<double>(m) * n * k > kThreadedProduct) turn.lock();
  cblas_sgemm(kRowMajor, kNoTrans, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}

// Where a row's first `width` positions of KV head 0 start in the pool when its blocks there run
// contiguously (then every head's are read in place), else -1 (copied into a scratch run).
static int64_t contiguous_start(const int32_t* own, int width, int block_size, int positions) {
  const int needed = (width + block_size - 1) / block_size;
  for (int b = 1; b < needed; b++) {
    if (own[b] != own[0] + b) return -1;
  }
  const int64_t start = static_cast<int64_t>(own[0]) * block_size;
  return start + width <= positions ? start : -1;
}

// Defined with the quantized products (below): whether they use AVX-512, and the helper thread.
static bool has_avx512();
static bool cpu_has_avx512();
static void share_chunks(int chunks, const std::function<void(int)>& work);

// The two products of a decode step's attention, written here where OpenBLAS's own path for them is
// slow, each bit for bit what `cblas_sgemm` returns for it. OpenBLAS (0.3.21, AVX-512 kernels) runs
// `q @ k^T` (M = query heads per KV head, N = positions, K = dim, keys transposed) through its
// packing path once M * N > 1,200 (`sgemm_small_kernel_permit`): 34 us a call at 530 positions
// against 1.5 at 160, ~90 calls a step (SmolLM2: 3.0 ms of a step at 530 positions, 5.8 at 1,024).
// That path sums each score as one FMA chain over the dimensions in order, from zero; so does
// `scores_chain`, sixteen positions at a time (their keys transposed in registers). `p @ v` runs
// through OpenBLAS's small-matrix kernel up to M * N * K = 10^6, one FMA chain over the positions
// in order per output; so does `values_chain`. Elsewhere (a short row's scores, a very long row's
// values) the products stay OpenBLAS's. `chains_match_blas` checks each kernel against
// `cblas_sgemm` on first use (with another BLAS, or another order, the products stay
// `cblas_sgemm`'s), and tests/engine/native/test_native.py the whole attention against MLX's.
static bool blas_small_scores(int n_rep, int width, int dim) {
  return static_cast<int64_t>(n_rep) * width <= 1200 && dim >= 32 && static_cast<double>(n_rep) * width * dim <= 1e6;
}
static bool blas_small_values(int n_rep, int width, int dim) { return static_cast<double>(n_rep) * width * dim <= 1e6; }

// Sixteen rows of sixteen floats transposed in place (`t[i]`'s lane j becomes `t[j]`'s lane i).
MLXRT_AVX512 static inline void transpose16(__m512 t[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_ps(t[i], t[i + 1]);
    a[i + 1] = _mm512_unpackhi_ps(t[i], t[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    b[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[i]), _mm512_castps_pd(a[i + 2])));
    b[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[i]), _mm512_castps_pd(a[i + 2])));
    b[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a[i + 1]), _mm512_castps_pd(a[i + 3])));
    b[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a[i + 1]), _mm512_castps_pd(a[i + 3])));
  }
  // b[4g + c]: rows 4g..4g+3's column c of each 128-bit lane; the lanes then gathered across rows.
  for (int c = 0; c < 4; c++) {
    const __m512 x0 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0x88), x1 = _mm512_shuffle_f32x4(b[c], b[4 + c], 0xDD);
    const __m512 y0 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0x88), y1 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], 0xDD);
    t[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    t[c + 8] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    t[c + 4] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    t[c + 12] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// Where position j's keys (or values) of one KV head start: `start + j` rows into `head` where the
// row's positions run contiguously there, else row `j % block_size` of its block `own[j / block_size]`.
struct Rows {
  const float* head;
  const int32_t* own;
  int64_t start;  // (-1: read through the blocks)
  int block_size, dim;
  const float* at(int j) const {
    const int64_t row = start >= 0 ? start + j : static_cast<int64_t>(own[j / block_size]) * block_size + j % block_size;
    return head + static_cast<size_t>(row) * dim;
  }
};

// scores[i * ld + j] = sum over d of q[i * dim + d] * keys[j * dim + d], one FMA chain over d in
// order from zero, for i < n_rep, j < width (`dim` a multiple of 16): sixteen positions at a time,
// their keys transposed in registers sixteen dimensions at a time (again for each eight queries).
MLXRT_AVX512 static void scores_chain(const float* q, int n_rep, const Rows& keys, int width, int dim, float* scores, int ld) {
  const size_t row_bytes = static_cast<size_t>(dim) * sizeof(float);
  for (int j0 = 0; j0 < width; j0 += 16) {
    const int n = std::min(16, width - j0);
    if (j0 + 48 <= width) {  // (two blocks ahead: the strided loads stall on memory otherwise)
      for (int j = j0 + 32; j < j0 + 48; j++) {
        const char* ahead = reinterpret_cast<const char*>(keys.at(j));
        for (size_t b = 0; b < row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      }
    }
    const float* rows[16];
    for (int j = 0; j < n; j++) rows[j] = keys.at(j0 + j);
    const __mmask16 lanes = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
    for (int i0 = 0; i0 < n_rep; i0 += 8) {
      const int m = std::min(8, n_rep - i0);
      const float* qi = q + static_cast<size_t>(i0) * dim;
      __m512 acc[8];
      for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
      for (int d0 = 0; d0 < dim; d0 += 16) {
        __m512 t[16];
        if (n == 16) {
          for (int j = 0; j < 16; j++) t[j] = _mm512_loadu_ps(rows[j] + d0);
        } else {
          for (int j = 0; j < 16; j++) t[j] = j < n ? _mm512_loadu_ps(rows[j] + d0) : _mm512_setzero_ps();
        }
        transpose16(t);
        for (int d = 0; d < 16; d++) {
          for (int i = 0; i < 8; i++) {
            if (i < m) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qi[static_cast<size_t>(i) * dim + d0 + d]), t[d], acc[i]);
          }
        }
      }
      for (int i = 0; i < m; i++) _mm512_mask_storeu_ps(scores + static_cast<size_t>(i0 + i) * ld + j0, lanes, acc[i]);
    }
  }
}

// out[i * dim + d] = sum over j of p[i * ld + j] * values[j * dim + d], one FMA chain over j in
// order from zero, for i < n_rep (`dim` a multiple of 16).
MLXRT_AVX512 static void values_chain(const float* p, int n_rep, int ld, const Rows& values, int width, int dim, float* out) {
  for (int d0 = 0; d0 < dim; d0 += 64) {
    const int c = std::min(4, (dim - d0) / 16);
    for (int i0 = 0; i0 < n_rep; i0 += 4) {
      const int m = std::min(4, n_rep - i0);
      __m512 acc[4][4];
      for (int i = 0; i < 4; i++)
        for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();
      for (int j = 0; j < width; j++) {
        const float* row = values.at(j) + d0;
        __m512 v[4];
        for (int u = 0; u < 4; u++) v[u] = u < c ? _mm512_loadu_ps(row + 16 * u) : _mm512_setzero_ps();
        for (int i = 0; i < 4; i++) {
          if (i >= m) break;
          const __m512 weight = _mm512_set1_ps(p[static_cast<size_t>(i0 + i) * ld + j]);
          for (int u = 0; u < 4; u++) {
            if (u < c) acc[i][u] = _mm512_fmadd_ps(weight, v[u], acc[i][u]);
          }
        }
      }
      for (int i = 0; i < m; i++)
        for (int u = 0; u < c; u++) _mm512_storeu_ps(out + static_cast<size_t>(i0 + i) * dim + d0 + 16 * u, acc[i][u]);
    }
  }
}

// Whether the two kernels return `cblas_sgemm`'s bits here (checked once, on shapes where
// OpenBLAS takes the paths they mirror: wide scores, values up to 10^6 products).
static bool chains_match_blas() {
  static const bool match = [] {
    if (!cpu_has_avx512()) return false;
    uint32_t seed = 12345;
    auto next = [&seed] {
      seed = seed * 1664525u + 1013904223u;
      return static_cast<float>(static_cast<int32_t>(seed >> 8) - (1 << 23)) / static_cast<float>(1 << 23);
    };
    for (const int dim : {64, 128}) {
      for (const int width : {403, 650, 2100}) {
        const int n_rep = 3;
        std::vector<float> q(static_cast<size_t>(n_rep) * dim), keys(static_cast<size_t>(width) * dim), a(static_cast<size_t>(n_rep) * width),
            b(a.size()), oa(q.size()), ob(q.size());
        for (auto& x : q) x = next();
        for (auto& x : keys) x = next();
        cblas_sgemm(kRowMajor, kNoTrans, kTrans, n_rep, width, dim, 1.0f, q.data(), dim, keys.data(), dim, 0.0f, a.data(), width);
        const Rows rows{keys.data(), nullptr, 0, 16, dim};
        scores_chain(q.data(), n_rep, rows, width, dim, b.data(), width);
        if (std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0) return false;
        for (auto& x : a) x = std::fabs(x) / static_cast<float>(width);
        if (!blas_small_values(n_rep, width, dim)) continue;
        cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, n_rep, dim, width, 1.0f, a.data(), width, keys.data(), dim, 0.0f, oa.data(), dim);
        values_chain(a.data(), n_rep, width, rows, width, dim, ob.data());
        if (std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) != 0) return false;
      }
    }
    return true;
  }();
  return match;
}

// The same two products on AVX2 machines, where OpenBLAS (0.3.21's Haswell and Zen kernels) has no
// small-matrix path: every call packs both matrices (`sgemm_incopy`, `sgemm_itcopy`) before its
// kernel runs, ~180 calls a SmolLM2 decode step, 12.7% of a served stream's CPU at ~700 positions
// (perf, two cores; more than the attention's arithmetic by far). Its kernels sum each output of a
// product with up to three rows (`n_rep` <= 3, OpenBLAS's N after the row-major transposition) as
// one FMA chain over K in order, from zero, per block of K its driver takes (`GEMM_Q` positions,
// the remainder halved as level3.c and, for threaded products, level3_thread.c do; each block's sum
// added to the output in turn). `scores_chain_avx2` (K = dim: one block) and `values_chain_avx2`
// (K = positions) sum so. Four and more rows take other kernels (even and odd K in two chains), so
// `avx2_order` checks each (n_rep, dim) against `cblas_sgemm` on first use, over widths on both sides
// of every block boundary and of OpenBLAS's threading threshold, and finds the block rule; what
// does not match stays `cblas_sgemm`'s.
struct Avx2Order {
  bool scores = false;           // scores_chain_avx2 is cblas_sgemm's
  bool values = false;           // values_chain_avx2, for products OpenBLAS runs on one thread
  bool values_threaded = false;  // ... and for the ones it threads (kThreadedProduct)
  int q = 0, unroll = 0;         // the driver's K block and the unroll its halves are rounded to
  bool threaded_halves = false;  // threaded products halve a remainder as level3_thread.c does
};

// The length of the next block of K a driver takes with `left` of K to go.
static int k_block(int left, const Avx2Order& order, bool threaded) {
  if (left >= 2 * order.q) return order.q;
  if (left <= order.q) return left;
  if (threaded && order.threaded_halves) return (left + 1) / 2;
  return ((left / 2 + order.unroll - 1) / order.unroll) * order.unroll;
}

// Eight rows of eight floats transposed in place.
MLXRT_AVX2 static inline void transpose8(__m256 t[8]) {
  __m256 a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_ps(t[i], t[i + 1]);
    a[i + 1] = _mm256_unpackhi_ps(t[i], t[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    b[i] = _mm256_shuffle_ps(a[i], a[i + 2], 0x44);
    b[i + 1] = _mm256_shuffle_ps(a[i], a[i + 2], 0xEE);
    b[i + 2] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0x44);
    b[i + 3] = _mm256_shuffle_ps(a[i + 1], a[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm256_permute2f128_ps(b[i], b[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(b[i], b[i + 4], 0x31);
  }
}

// scores[i * ld + j] = sum over d of q[i * dim + d] * keys[j * dim + d], one FMA chain over d in
// order from zero, for i < n_rep <= 3, j < width (`dim` a multiple of 8): sixteen positions at a
// time, as two tiles of eight whose keys are transposed in registers eight dimensions at a time
// (six chains in flight: with one tile, its three waited on the FMA's latency. SmolLM2's attention
// a layer at 700 positions, one row: 110 us with OpenBLAS's products, 95 with one tile, 52 with two).
MLXRT_AVX2 static void scores_chain_avx2(const float* q, int n_rep, const Rows& keys, int width, int dim, float* scores, int ld) {
  constexpr int kTiles = 2;
  const size_t row_bytes = static_cast<size_t>(dim) * sizeof(float);
  for (int j0 = 0; j0 < width; j0 += 8 * kTiles) {
    const int n = std::min(8 * kTiles, width - j0);
    for (int j = j0 + 32; j < std::min(j0 + 48, width); j++) {  // (two steps ahead)
      const char* ahead = reinterpret_cast<const char*>(keys.at(j));
      for (size_t b = 0; b < row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    const float* rows[8 * kTiles];
    for (int j = 0; j < 8 * kTiles; j++) rows[j] = keys.at(j0 + std::min(j, n - 1));  // (a short step repeats its last row)
    __m256 acc[kTiles][3];
    for (int t = 0; t < kTiles; t++)
      for (int i = 0; i < 3; i++) acc[t][i] = _mm256_setzero_ps();
    for (int d0 = 0; d0 < dim; d0 += 8) {
      __m256 tile[kTiles][8];
      for (int t = 0; t < kTiles; t++) {
        for (int j = 0; j < 8; j++) tile[t][j] = _mm256_loadu_ps(rows[8 * t + j] + d0);
        transpose8(tile[t]);
      }
      for (int d = 0; d < 8; d++) {
        for (int i = 0; i < 3; i++) {
          if (i >= n_rep) break;
          const __m256 qd = _mm256_set1_ps(q[static_cast<size_t>(i) * dim + d0 + d]);
          for (int t = 0; t < kTiles; t++) acc[t][i] = _mm256_fmadd_ps(qd, tile[t][d], acc[t][i]);
        }
      }
    }
    for (int i = 0; i < n_rep; i++) {
      float* to = scores + static_cast<size_t>(i) * ld + j0;
      if (n == 8 * kTiles) {
        for (int t = 0; t < kTiles; t++) _mm256_storeu_ps(to + 8 * t, acc[t][i]);
      } else {
        alignas(32) float lanes[8 * kTiles];
        for (int t = 0; t < kTiles; t++) _mm256_store_ps(lanes + 8 * t, acc[t][i]);
        std::memcpy(to, lanes, static_cast<size_t>(n) * sizeof(float));
      }
    }
  }
}

// out[i * dim + d] = sum over j of p[i * ld + j] * values[j * dim + d] for i < n_rep (`dim` a
// multiple of 8): one FMA chain over j from zero per block of positions `k_block` gives, each
// block's sum added to the output in turn.
MLXRT_AVX2 static void values_chain_avx2(const float* p, int n_rep, int ld, const Rows& values, int width, int dim, float* out, const Avx2Order& order,
                                          bool threaded) {
  for (int d0 = 0; d0 < dim; d0 += 32) {
    const int c = std::min(4, (dim - d0) / 8);
    for (int i0 = 0; i0 < n_rep; i0 += 3) {
      const int m = std::min(3, n_rep - i0);
      for (int from = 0; from < width;) {
        const int len = k_block(width - from, order, threaded);
        __m256 acc[3][4];
        for (int i = 0; i < 3; i++)
          for (int u = 0; u < 4; u++) acc[i][u] = _mm256_setzero_ps();
        for (int j = from; j < from + len; j++) {
          const float* row = values.at(j) + d0;
          __m256 v[4];
          for (int u = 0; u < 4; u++) v[u] = u < c ? _mm256_loadu_ps(row + 8 * u) : _mm256_setzero_ps();
          for (int i = 0; i < 3; i++) {
            if (i >= m) break;
            const __m256 weight = _mm256_set1_ps(p[static_cast<size_t>(i0 + i) * ld + j]);
            for (int u = 0; u < 4; u++) {
              if (u < c) acc[i][u] = _mm256_fmadd_ps(weight, v[u], acc[i][u]);
            }
          }
        }
        for (int i = 0; i < m; i++) {
          for (int u = 0; u < c; u++) {
            float* to = out + static_cast<size_t>(i0 + i) * dim + d0 + 8 * u;
            _mm256_storeu_ps(to, from == 0 ? acc[i][u] : _mm256_add_ps(_mm256_loadu_ps(to), acc[i][u]));
          }
        }
        from += len;
      }
    }
  }
}

// What of the two products `scores_chain_avx2` and `values_chain_avx2` compute as `cblas_sgemm`
// does for `n_rep` query heads of `dim` dimensions (see above): checked once per pair, bit for bit.
static Avx2Order find_avx2_order(int n_rep, int dim) {
  Avx2Order found;
  if (n_rep < 1 || n_rep > 3 || dim % 8 != 0 || dim > 256) return found;
  uint32_t seed = 2024u + static_cast<uint32_t>(n_rep * 1000 + dim);
  auto next = [&seed] {
    seed = seed * 1664525u + 1013904223u;
    return static_cast<float>(static_cast<int32_t>(seed >> 8) - (1 << 23)) / static_cast<float>(1 << 23);
  };
  // (Short tiles; both sides of K blocks of 256-512 and of their halved remainders; both sides of
  // the threading threshold for these shapes; long rows.)
  std::vector<int> widths = {1, 3, 7, 8, 9, 17, 100, 255, 257, 319, 321, 383, 385, 511, 513, 650, 700, 841, 1000, 1211, 1433, 2100, 3001};
  const int threshold = static_cast<int>(kThreadedProduct / (static_cast<double>(n_rep) * dim));
  for (int w : {threshold - 9, threshold, threshold + 1, threshold + 37}) {
    if (w > 0) widths.push_back(w);
  }
  const int most = *std::max_element(widths.begin(), widths.end());
  std::vector<float> q(static_cast<size_t>(n_rep) * dim), keys(static_cast<size_t>(most) * dim), p(static_cast<size_t>(n_rep) * most);
  for (auto& x : q) x = next();
  for (auto& x : keys) x = next();
  for (auto& x : p) x = std::fabs(next()) / static_cast<float>(most);
  std::vector<float> a(static_cast<size_t>(n_rep) * most), b(a.size()), oa(q.size()), ob(q.size());
  found.scores = true;
  for (int w : widths) {
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, n_rep, w, dim, 1.0f, q.data(), dim, keys.data(), dim, 0.0f, a.data(), w);
    scores_chain_avx2(q.data(), n_rep, Rows{keys.data(), nullptr, 0, 16, dim}, w, dim, b.data(), w);
    if (std::memcmp(a.data(), b.data(), static_cast<size_t>(n_rep) * w * sizeof(float)) != 0) found.scores = false;
  }
  auto values_match = [&](const Avx2Order& order, bool threaded) {
    for (int w : widths) {
      if ((static_cast<double>(n_rep) * dim * w > kThreadedProduct) != threaded) continue;
      cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, n_rep, dim, w, 1.0f, p.data(), most, keys.data(), dim, 0.0f, oa.data(), dim);
      values_chain_avx2(p.data(), n_rep, most, Rows{keys.data(), nullptr, 0, 16, dim}, w, dim, ob.data(), order, threaded);
      if (std::memcmp(oa.data(), ob.data(), oa.size() * sizeof(float)) != 0) return false;
    }
    return true;
  };
  for (const int q_block : {320, 384, 256, 512, 768}) {
    for (const int unroll : {8, 16, 4, 2, 1}) {
      Avx2Order order = found;
      order.q = q_block;
      order.unroll = unroll;
      if (!values_match(order, false)) continue;
      order.values = true;
      for (const bool halves : {true, false}) {
        order.threaded_halves = halves;
        if (values_match(order, true)) {
          order.values_threaded = true;
          break;
        }
      }
      if (!order.values_threaded) order.threaded_halves = false;
      return order;
    }
  }
  return found;
}

// `find_avx2_order` for (n_rep, dim), found once per pair.
static Avx2Order avx2_order(int n_rep, int dim) {
  static std::mutex lock;
  static std::vector<std::tuple<int, int, Avx2Order>> known;
  std::lock_guard<std::mutex> hold(lock);
  for (const auto& [r, d, order] : known) {
    if (r == n_rep && d == dim) return order;
  }
  known.emplace_back(n_rep, dim, find_avx2_order(n_rep, dim));
  return std::get<2>(known.back());
}

// Whether the attention may use `scores_chain` and `values_chain` (tests turn them off to check
// them against OpenBLAS's products).
static std::atomic<bool> attention_chains_on{true};

bool set_attention_chains(bool on) {
  attention_chains_on.store(on);
  return on && (has_avx512() ? chains_match_blas() : avx2_order(3, 64).scores);
}

// Which of a decode step's attention products for `n_rep` query heads per KV head of `dim`
// dimensions the kernel computes itself on this machine (AVX2: `avx2_order`; AVX-512: its chains
// where `chains_match_blas`): (scores, values, values of products OpenBLAS threads).
std::tuple<bool, bool, bool> attention_chains_cover(int n_rep, int dim) {
  if (has_avx512()) {
    const bool on = dim % 16 == 0 && dim <= 256 && chains_match_blas();
    return {on, on, false};
  }
  const Avx2Order order = avx2_order(n_rep, dim);
  return {order.scores, order.values, order.values_threaded};
}

// One decode step's attention over paged KV: for each row and KV head, over the row's first
// `width` positions, the same matrix products as `engine.kv.attention.decode_attention`
// makes MLX run on the gathered batch (`q @ k^T`: M = query heads per KV head, N = width, K = dim,
// keys transposed; `p @ v`: K = width), with the mask (`where` with float32's lowest, or added) and
// the softmax above between them: bit for bit that function's result over `_gather_blocks`' batch,
// without the batch's copy. With `lengths` (no mask) row r attends over its first lengths[r]
// positions only (clamped to [1, width]): bit for bit `decode_attention` over that row alone, as
// `PagedSlots._attend_rows` runs it, without the padded positions' work. The kernels' own products
// read each position in its block; OpenBLAS's read the row's positions in place where its blocks
// run contiguously in the pool, else a copy. Each (row, KV head) is one chunk of work, shared with
// the helper thread when no product of it is OpenBLAS's threaded one.
static void paged_attention_rows(const float* q, const float* pool_k, const float* pool_v, const int32_t* blocks, const bool* bool_mask,
                                 const float* add_mask, bool mask_per_row, const int32_t* lengths, float* out, int rows, int kv_heads, int n_rep,
                                 int dim, int positions, int per_row, int width, int block_size) {
  constexpr float lowest = std::numeric_limits<float>::lowest();
  const bool on = attention_chains_on.load(std::memory_order_relaxed);
  const bool chains = on && has_avx512() && dim % 16 == 0 && dim <= 256 && chains_match_blas();
  const Avx2Order order = on && !has_avx512() ? avx2_order(n_rep, dim) : Avx2Order{};
  auto row_width = [&](int r) { return lengths != nullptr ? std::clamp(lengths[r], 1, width) : width; };
  auto threaded_values = [&](int w) { return static_cast<double>(n_rep) * w * dim > kThreadedProduct; };
  auto own_scores = [&](int w) { return chains ? !blas_small_scores(n_rep, w, dim) : order.scores; };
  auto own_values = [&](int w) { return chains ? blas_small_values(n_rep, w, dim) : threaded_values(w) ? order.values_threaded : order.values; };
  auto attend = [&](int r, int h, std::vector<float>& scratch_k, std::vector<float>& scratch_v, std::vector<float>& scores) {
    const int32_t* own = blocks + static_cast<size_t>(r) * per_row;
    const size_t mask_row = mask_per_row ? static_cast<size_t>(r) * width : 0;
    const int w = row_width(r);
    const int64_t start = contiguous_start(own, w, block_size, positions);
    const float* head_k = pool_k + static_cast<size_t>(h) * positions * dim;
    const float* head_v = pool_v + static_cast<size_t>(h) * positions * dim;
    const Rows key_rows{head_k, own, start, block_size, dim}, value_rows{head_v, own, start, block_size, dim};
    auto contiguous = [&](const float* head, std::vector<float>& scratch) -> const float* {
      if (start >= 0) return head + static_cast<size_t>(start) * dim;
      scratch.resize(static_cast<size_t>(width) * dim);
      for (int from = 0, b = 0; from < w; from += block_size, b++) {
        const int n = std::min(block_size, w - from);
        const size_t at = (static_cast<size_t>(own[b]) * block_size) * dim;
        std::memcpy(scratch.data() + static_cast<size_t>(from) * dim, head + at, static_cast<size_t>(n) * dim * sizeof(float));
      }
      return scratch.data();
    };
    scores.resize(static_cast<size_t>(n_rep) * width);
    const float* queries = q + (static_cast<size_t>(r) * kv_heads + h) * n_rep * dim;
    if (own_scores(w)) {
      if (chains) {
        scores_chain(queries, n_rep, key_rows, w, dim, scores.data(), w);
      } else {
        scores_chain_avx2(queries, n_rep, key_rows, w, dim, scores.data(), w);
      }
    } else {
      sgemm(kTrans, n_rep, w, dim, queries, dim, contiguous(head_k, scratch_k), dim, scores.data(), w);
    }
    if (bool_mask != nullptr || add_mask != nullptr) {
      for (int i = 0; i < n_rep; i++) {
        float* row = scores.data() + static_cast<size_t>(i) * width;
        for (int k = 0; k < width; k++) {
          row[k] = bool_mask != nullptr ? (bool_mask[mask_row + k] ? row[k] : lowest) : row[k] + add_mask[mask_row + k];
        }
      }
    }
    softmax_rows(scores.data(), scores.data(), n_rep, w);
    float* result = out + (static_cast<size_t>(r) * kv_heads + h) * n_rep * dim;
    if (own_values(w)) {
      if (chains) {
        values_chain(scores.data(), n_rep, w, value_rows, w, dim, result);
      } else {
        values_chain_avx2(scores.data(), n_rep, w, value_rows, w, dim, result, order, threaded_values(w));
      }
    } else {
      sgemm(kNoTrans, n_rep, dim, w, scores.data(), w, contiguous(head_v, scratch_v), dim, result, dim);
    }
  };
  bool threaded = false;  // (whether some product is OpenBLAS's threaded one: then one chunk at a time)
  for (int r = 0; r < rows && !threaded; r++) {
    const int w = row_width(r);
    threaded = (!own_scores(w) || !own_values(w)) && static_cast<double>(n_rep) * w * dim > kThreadedProduct;
  }
  const int chunks = rows * kv_heads;
  if (threaded || static_cast<double>(chunks) * n_rep * width * dim < kSharedAttention) {
    std::vector<float> scratch_k, scratch_v, scores;
    for (int c = 0; c < chunks; c++) attend(c / kv_heads, c % kv_heads, scratch_k, scratch_v, scores);
    return;
  }
  share_chunks(chunks, [&](int c) {
    thread_local std::vector<float> scratch_k, scratch_v, scores;
    attend(c / kv_heads, c % kv_heads, scratch_k, scratch_v, scores);
  });
}

static void allocate_output(const mx::array& in, mx::array& out) {
  if (in.is_donatable() && in.flags().row_contiguous && in.dtype() == out.dtype() && in.size() == out.size()) {
    out.copy_shared_buffer(in);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
}

// `src` (`shape`, `strides` in elements of `item` bytes) written row-major to `dst`.
static void strided_copy(const char* src, char* dst, const mx::Shape& shape, const mx::Strides& strides, size_t item) {
  const int nd = static_cast<int>(shape.size());
  if (nd == 0) {
    std::memcpy(dst, src, item);
    return;
  }
  size_t outer = 1;
  for (int d = 0; d < nd - 1; d++) outer *= static_cast<size_t>(shape[d]);
  const int64_t inner = shape[nd - 1], step = strides[nd - 1];
  std::vector<int64_t> index(nd, 0);
  for (size_t o = 0; o < outer; o++) {
    int64_t offset = 0;
    for (int d = 0; d < nd - 1; d++) offset += index[d] * strides[d];
    const char* row = src + offset * static_cast<int64_t>(item);
    if (step == 1) {
      std::memcpy(dst, row, static_cast<size_t>(inner) * item);
    } else {
      for (int64_t i = 0; i < inner; i++) std::memcpy(dst + i * item, row + i * step * static_cast<int64_t>(item), item);
    }
    dst += static_cast<size_t>(inner) * item;
    for (int d = nd - 2; d >= 0 && ++index[d] == shape[d]; d--) index[d] = 0;
  }
}

// What the primitives here share: CPU only, one output shaped as the first input (`allocate`d
// first), written by one kernel queued on the stream (`run`), over row-contiguous inputs. The
// primitives take their inputs as they are (a transposed or sliced view too): an input that is not
// row-contiguous when evaluated is copied into a new buffer by a task queued before the kernel's.
// (A `contiguous` node in front of each input instead cost every input ~5 us of evaluation, copied
// or not: ~400 nodes in a SmolLM2 decode step, whose inputs are all contiguous already.)
class CpuPrimitive : public mx::Primitive {
 public:
  CpuPrimitive(mx::Stream stream, const char* name) : mx::Primitive(stream), name_(name) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) final {
    if (std::all_of(inputs.begin(), inputs.end(), [](const mx::array& a) { return a.flags().row_contiguous; })) {
      evaluate(inputs, outputs);  // (the inputs themselves: a donatable first input stays donatable)
    } else {
      evaluate(contiguous(inputs), outputs);
    }
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("[mlxrt.") + name_ + "] CPU only");
  }
  const char* name() const override { return name_; }
  bool is_equivalent(const mx::Primitive& other) const override { return std::strcmp(name_, other.name()) == 0; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 protected:
  // `eval_cpu` with row-contiguous inputs.
  virtual void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) = 0;

  // The output's buffer: the first input's where `donate` and it may be given, else a new one
  // (before a kernel takes `out.data()`).
  static mx::array& allocate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, bool donate) {
    auto& out = outputs[0];
    if (donate) {
      allocate_output(inputs[0], out);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    return out;
  }

  template <typename F>
  void run(const std::vector<mx::array>& inputs, mx::array& out, F&& kernel) {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    queue(std::forward<F>(kernel));
  }

  // `task` queued on the stream, after everything queued on it so far, without counting as one of
  // the encoder's dispatches. MLX counts every tenth dispatch as a task and its evaluating thread
  // waits whenever more than ten are unfinished, woken at each completion; MLX's own evaluation
  // queues one more dispatch per node after the kernel's (holding its buffers), which keeps that
  // bound. Uncounted, a decode step makes half the tasks and wakes the evaluating thread half as
  // often: SmolLM2 Q4's c1 step 8.00 against 8.64 ms (pinned; windows alternating in one process,
  // faster in 14 of 16); four rows' unchanged.
  template <typename F>
  void queue(F&& task) {
    mx::scheduler::enqueue(stream(), std::forward<F>(task));
  }

 private:
  // `inputs`, each one that is not row-contiguous replaced by a copy that is (held by the encoder
  // until the tasks queued so far have run).
  std::vector<mx::array> contiguous(const std::vector<mx::array>& inputs) {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    std::vector<mx::array> result;
    result.reserve(inputs.size());
    for (const auto& a : inputs) {
      if (a.flags().row_contiguous) {
        result.push_back(a);
        continue;
      }
      mx::array copy(a.shape(), a.dtype(), nullptr, {});
      copy.set_data(mx::allocator::malloc(copy.nbytes()));
      encoder.set_input_array(a);
      encoder.set_output_array(copy);
      queue([src = a.data<char>(), dst = copy.data<char>(), shape = a.shape(), strides = a.strides(), item = a.itemsize()]() {
        strided_copy(src, dst, shape, strides, item);
      });
      encoder.add_temporary(copy);
      result.push_back(std::move(copy));
    }
    return result;
  }

  const char* name_;
};

class SwiGLU : public CpuPrimitive {
 public:
  explicit SwiGLU(mx::Stream stream) : CpuPrimitive(stream, "MlxrtSwiGLU") {}
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = allocate(inputs, outputs, true);
    run(inputs, out, [g = inputs[0].data<float>(), u = inputs[1].data<float>(), o = out.data<float>(), n = out.size()]() { swiglu_kernel(g, u, o, n); });
  }
};

class Exp : public CpuPrimitive {
 public:
  explicit Exp(mx::Stream stream) : CpuPrimitive(stream, "MlxrtExp") {}
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = allocate(inputs, outputs, true);
    run(inputs, out, [x = inputs[0].data<float>(), y = out.data<float>(), n = out.size()]() { exp_rows(x, y, n); });
  }
};

class Softmax : public CpuPrimitive {
 public:
  explicit Softmax(mx::Stream stream) : CpuPrimitive(stream, "MlxrtSoftmax") {}
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = allocate(inputs, outputs, true);
    const size_t m = inputs[0].shape().back();
    run(inputs, out, [x = inputs[0].data<float>(), y = out.data<float>(), rows = inputs[0].size() / m, m]() { softmax_rows(x, y, rows, m); });
  }
};

class RMSNorm : public CpuPrimitive {
 public:
  RMSNorm(mx::Stream stream, float eps) : CpuPrimitive(stream, "MlxrtRMSNorm"), eps_(eps) {}
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = allocate(inputs, outputs, true);
    const size_t m = inputs[0].shape().back();
    run(inputs, out, [x = inputs[0].data<float>(), w = inputs[1].data<float>(), y = out.data<float>(), rows = inputs[0].size() / m, m, eps = eps_]() {
      rms_norm_rows(x, w, y, rows, m, eps);
    });
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && eps_ == static_cast<const RMSNorm&>(other).eps_;
  }

 private:
  float eps_;
};

class RoPE : public CpuPrimitive {
 public:
  RoPE(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : CpuPrimitive(stream, "MlxrtRoPE"), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& in = inputs[0];
    const auto& offset = inputs[1];
    auto& out = allocate(inputs, outputs, true);
    const int D = in.shape(-1), T = in.shape(-2), B = in.shape(0);
    const int N = static_cast<int>(in.size() / (static_cast<size_t>(B) * T * D));
    run(inputs, out,
        [x = in.data<float>(), y = out.data<float>(), o = offset.data<int32_t>(), per_row = offset.size() > 1, B, N, T, D, dims = dims_,
         traditional = traditional_, base = base_, scale = scale_]() { rope_rows(x, y, o, per_row, B, N, T, D, dims, traditional, base, scale); });
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    if (!CpuPrimitive::is_equivalent(other)) return false;
    const auto& o = static_cast<const RoPE&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
};

class PagedAttention : public CpuPrimitive {
 public:
  PagedAttention(mx::Stream stream, int width, int block_size) : CpuPrimitive(stream, "MlxrtPagedAttention"), width_(width), block_size_(block_size) {}
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& q = inputs[0];
    const auto& pool_k = inputs[1];
    const auto& blocks = inputs[3];
    auto& out = allocate(inputs, outputs, false);
    const bool* bool_mask = nullptr;
    const float* add_mask = nullptr;
    const int32_t* lengths = nullptr;
    bool per_row = false;
    if (inputs.size() == 5) {
      const auto& mask = inputs[4];
      if (mask.dtype() == mx::int32) {
        lengths = mask.data<int32_t>();
      } else if (mask.dtype() == mx::bool_) {
        bool_mask = mask.data<bool>();
      } else {
        add_mask = mask.data<float>();
      }
      per_row = mask.shape(0) > 1;
    }
    const int rows = q.shape(0), kv_heads = q.shape(1), n_rep = q.shape(2), dim = q.shape(3);
    const int positions = pool_k.shape(1), per_row_blocks = blocks.size() / rows;
    run(inputs, out,
        [q = q.data<float>(), k = pool_k.data<float>(), v = inputs[2].data<float>(), b = blocks.data<int32_t>(), bool_mask, add_mask, per_row, lengths,
         o = out.data<float>(), rows, kv_heads, n_rep, dim, positions, per_row_blocks, width = width_, block_size = block_size_]() {
          paged_attention_rows(q, k, v, b, bool_mask, add_mask, per_row, lengths, o, rows, kv_heads, n_rep, dim, positions, per_row_blocks, width,
                               block_size);
        });
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    if (!CpuPrimitive::is_equivalent(other)) return false;
    const auto& o = static_cast<const PagedAttention&>(other);
    return width_ == o.width_ && block_size_ == o.block_size_;
  }

 private:
  int width_, block_size_;
};

// A decode step's attention after its projections, for a layer over paged KV (mlx-lm's llama
// attention, `engine.compiled`), as three primitives in place of the ~18 nodes they stand for
// (reshapes, transposes, two RoPEs, the scaling, two slice updates, the attention), doing the
// same operations on the same values, so the same bits:
// - `PoolWrite`: the rows' keys (rotated: `rope_rows`) or values, [rows, 1, kv_heads * dim], written
//   into a pool [kv_heads, positions, dim] at each row's slot (`writes`); the pool's buffer is the
//   output's where it may be given (as MLX's slice update), else copied first;
// - `DecodeAttention`: the queries [rows, 1, heads * dim] rotated and scaled, then
//   `paged_attention_rows` over each row's first `lengths` positions: [rows, 1, heads * dim].
struct RopeParams {
  int dims = 0;  // 0: no rotation
  bool traditional = false;
  float base = 0, scale = 1;
  bool operator==(const RopeParams& o) const { return dims == o.dims && traditional == o.traditional && base == o.base && scale == o.scale; }
};

class PoolWrite : public CpuPrimitive {
 public:
  PoolWrite(mx::Stream stream, RopeParams rope) : CpuPrimitive(stream, "MlxrtPoolWrite"), rope_(rope) {}
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& pool = inputs[0];
    auto& out = allocate(inputs, outputs, true);
    const int rows = inputs[1].shape(0), kv_heads = pool.shape(0), positions = pool.shape(1), dim = pool.shape(2);
    run(inputs, out,
        [in = pool.data<float>(), o = out.data<float>(), bytes = pool.nbytes(), x = inputs[1].data<float>(), where = inputs[2].data<int32_t>(),
         writes = inputs[3].data<int32_t>(), rows, kv_heads, positions, dim, rope = rope_]() {
          if (o != in) std::memcpy(o, in, bytes);
          std::vector<float> rotated;
          const float* rows_in = x;
          if (rope.dims) {
            rotated.resize(static_cast<size_t>(rows) * kv_heads * dim);
            rope_rows(x, rotated.data(), where, rows > 1, rows, kv_heads, 1, dim, rope.dims, rope.traditional, rope.base, rope.scale);
            rows_in = rotated.data();
          }
          for (int r = 0; r < rows; r++) {
            for (int h = 0; h < kv_heads; h++) {
              std::memcpy(o + (static_cast<size_t>(h) * positions + writes[r]) * dim, rows_in + (static_cast<size_t>(r) * kv_heads + h) * dim,
                          dim * sizeof(float));
            }
          }
        });
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return CpuPrimitive::is_equivalent(other) && rope_ == static_cast<const PoolWrite&>(other).rope_;
  }

 private:
  RopeParams rope_;
};

class DecodeAttention : public CpuPrimitive {
 public:
  DecodeAttention(mx::Stream stream, int heads, RopeParams rope, float scale, int width, int block_size)
      : CpuPrimitive(stream, "MlxrtDecodeAttention"), heads_(heads), rope_(rope), scale_(scale), width_(width), block_size_(block_size) {}
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = allocate(inputs, outputs, false);
    const auto& pool_k = inputs[1];
    const int rows = inputs[0].shape(0), kv_heads = pool_k.shape(0), positions = pool_k.shape(1), dim = pool_k.shape(2);
    const int per_row_blocks = static_cast<int>(inputs[3].size() / rows);
    run(inputs, out,
        [q = inputs[0].data<float>(), pk = pool_k.data<float>(), pv = inputs[2].data<float>(), blocks = inputs[3].data<int32_t>(),
         where = inputs[4].data<int32_t>(), lengths = inputs[5].data<int32_t>(), o = out.data<float>(), rows, kv_heads, positions, dim, per_row_blocks,
         heads = heads_, rope = rope_, scale = scale_, width = width_, block_size = block_size_]() {
          std::vector<float> queries(static_cast<size_t>(rows) * heads * dim);
          rope_rows(q, queries.data(), where, rows > 1, rows, heads, 1, dim, rope.dims, rope.traditional, rope.base, rope.scale);
          for (float& x : queries) x = scale * x;
          paged_attention_rows(queries.data(), pk, pv, blocks, nullptr, nullptr, false, lengths, o, rows, kv_heads, heads / kv_heads, dim, positions,
                               per_row_blocks, width, block_size);
        });
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    if (!CpuPrimitive::is_equivalent(other)) return false;
    const auto& o = static_cast<const DecodeAttention&>(other);
    return heads_ == o.heads_ && rope_ == o.rope_ && scale_ == o.scale_ && width_ == o.width_ && block_size_ == o.block_size_;
  }

 private:
  int heads_;
  RopeParams rope_;
  float scale_;
  int width_, block_size_;
};

static void check_float32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) {
    throw std::invalid_argument(std::string("[mlxrt.native] ") + what + " must be float32");
  }
}

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  check_float32(gate, "swiglu's gate");
  check_float32(up, "swiglu's input");
  if (gate.shape() != up.shape()) {
    throw std::invalid_argument("[mlxrt.native] swiglu's gate and input must have one shape");
  }
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGLU>(mx::to_stream(s)), {gate, up});
}

// `mx.fast.rms_norm(x, weight, eps)` for float32 with a weight.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  check_float32(x, "rms_norm's input");
  check_float32(weight, "rms_norm's weight");
  if (x.ndim() == 0 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("[mlxrt.native] rms_norm's weight must be a vector as long as the input's last axis");
  }
  auto stream = mx::to_stream(s);
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(stream, eps), {x, weight});
}

// `mx.fast.rope(x, dims, traditional=, base=, scale=, offset=)` for float32, without `freqs`.
mx::array rope(const mx::array& x, int dims, bool traditional, float base, float scale, const mx::array& offset, mx::StreamOrDevice s) {
  check_float32(x, "rope's input");
  if (x.ndim() < 3 || dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) {
    throw std::invalid_argument("[mlxrt.native] rope needs an input of 3 or more dimensions and an even dims up to its last axis");
  }
  if (offset.ndim() > 1 || (offset.size() != 1 && offset.size() != static_cast<size_t>(x.shape(0))) || !mx::issubdtype(offset.dtype(), mx::integer)) {
    throw std::invalid_argument("[mlxrt.native] rope's offset must be an integer scalar or one per batch item");
  }
  auto stream = mx::to_stream(s);
  auto o = mx::astype(offset, mx::int32, stream);
  return mx::array(x.shape(), mx::float32, std::make_shared<RoPE>(stream, dims, traditional, base, scale), {x, o});
}

// `decode_attention`'s stacked attention over each row's first `width` positions in its blocks:
// `queries` [rows, kv_heads, query heads per KV head, dim] already scaled, pools [kv_heads,
// positions, dim], `blocks` [rows * n] block ids (row-major), `mask` [rows or 1, 1, 1, width].
mx::array paged_attention(const mx::array& queries, const mx::array& pool_keys, const mx::array& pool_values, const mx::array& blocks, int width,
                          int block_size, const std::optional<mx::array>& mask, const std::optional<mx::array>& lengths, mx::StreamOrDevice s) {
  check_float32(queries, "paged attention's queries");
  check_float32(pool_keys, "paged attention's keys");
  check_float32(pool_values, "paged attention's values");
  if (queries.ndim() != 4 || pool_keys.ndim() != 3 || pool_keys.shape() != pool_values.shape() || pool_keys.shape(0) != queries.shape(1) ||
      pool_keys.shape(2) != queries.shape(3) || blocks.dtype() != mx::int32 || blocks.ndim() != 1 || blocks.size() % queries.shape(0) != 0 ||
      width <= 0 || block_size <= 0 || pool_keys.shape(1) % block_size != 0 ||
      static_cast<size_t>(width) > (blocks.size() / queries.shape(0)) * static_cast<size_t>(block_size)) {
    throw std::invalid_argument("[mlxrt.native] paged attention: mismatched queries, pools, blocks or width");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {queries, pool_keys, pool_values, blocks};
  if (mask) {
    const auto& m = *mask;
    if (m.ndim() != 4 || m.shape(1) != 1 || m.shape(2) != 1 || m.shape(3) != width || (m.shape(0) != 1 && m.shape(0) != queries.shape(0)) ||
        (m.dtype() != mx::bool_ && m.dtype() != mx::float32)) {
      throw std::invalid_argument("[mlxrt.native] paged attention's mask must be [rows or 1, 1, 1, width], boolean or float32");
    }
    inputs.push_back(m);
  }
  if (lengths) {
    const auto& n = *lengths;
    if (mask || n.dtype() != mx::int32 || n.ndim() != 1 || n.shape(0) != queries.shape(0)) {
      throw std::invalid_argument("[mlxrt.native] paged attention's lengths must be int32 [rows], without a mask");
    }
    inputs.push_back(n);
  }
  return mx::array(queries.shape(), mx::float32, std::make_shared<PagedAttention>(stream, width, block_size), std::move(inputs));
}

static void check_rows(const mx::array& a, int rows, const char* what) {
  if (a.dtype() != mx::int32 || a.ndim() != 1 || a.shape(0) != rows) throw std::invalid_argument(std::string("[mlxrt.native] ") + what + " must be int32 [rows]");
}

static RopeParams rope_params(int dims, bool traditional, float base, float scale, int head_dim) {
  if (dims < 0 || dims % 2 != 0 || dims > head_dim) throw std::invalid_argument("[mlxrt.native] rope_dims must be even, up to the heads' width (0: none)");
  return RopeParams{dims, traditional, base, scale};
}

// `PoolWrite` (above): `pool` [kv_heads, positions, dim] with `new_rows` [rows, 1, kv_heads * dim]
// (rotated at `positions` first where `rope_dims`) at each row's slot `writes`.
mx::array pool_write(const mx::array& pool, const mx::array& new_rows, const mx::array& positions, const mx::array& writes, int rope_dims,
                     bool traditional, float base, float rope_scale, mx::StreamOrDevice s) {
  check_float32(pool, "pool_write's pool");
  check_float32(new_rows, "pool_write's rows");
  if (pool.ndim() != 3 || new_rows.ndim() != 3 || new_rows.shape(1) != 1 || new_rows.shape(2) != pool.shape(0) * pool.shape(2)) {
    throw std::invalid_argument("[mlxrt.native] pool_write: rows [rows, 1, kv_heads * dim] into a pool [kv_heads, positions, dim]");
  }
  check_rows(positions, new_rows.shape(0), "pool_write's positions");
  check_rows(writes, new_rows.shape(0), "pool_write's writes");
  auto rope = rope_params(rope_dims, traditional, base, rope_scale, pool.shape(2));
  return mx::array(pool.shape(), mx::float32, std::make_shared<PoolWrite>(mx::to_stream(s), rope), {pool, new_rows, positions, writes});
}

// `DecodeAttention`'s operands checked.
static void check_decode_attention(const mx::array& queries, const mx::array& pool_keys, const mx::array& pool_values, const mx::array& blocks,
                                   const mx::array& positions, const mx::array& lengths, int heads, int width, int block_size) {
  for (const auto* a : {&queries, &pool_keys, &pool_values}) check_float32(*a, "decode attention's queries and pools");
  if (pool_keys.ndim() != 3 || pool_keys.shape() != pool_values.shape() || queries.ndim() != 3 || queries.shape(1) != 1 || heads <= 0 ||
      heads % pool_keys.shape(0) != 0 || queries.shape(2) != heads * pool_keys.shape(2)) {
    throw std::invalid_argument("[mlxrt.native] decode attention: queries [rows, 1, heads * dim] over pools [kv_heads, positions, dim]");
  }
  const int rows = queries.shape(0);
  check_rows(positions, rows, "decode attention's positions");
  check_rows(lengths, rows, "decode attention's lengths");
  if (blocks.dtype() != mx::int32 || blocks.ndim() != 1 || blocks.size() % rows != 0 || width <= 0 || block_size <= 0 ||
      pool_keys.shape(1) % block_size != 0 || static_cast<size_t>(width) > (blocks.size() / rows) * static_cast<size_t>(block_size)) {
    throw std::invalid_argument("[mlxrt.native] decode attention: mismatched blocks or width");
  }
}

// `DecodeAttention` (above).
mx::array decode_attention(const mx::array& queries, const mx::array& pool_keys, const mx::array& pool_values, const mx::array& blocks,
                           const mx::array& positions, const mx::array& lengths, int heads, int rope_dims, bool traditional, float base, float rope_scale,
                           float scale, int width, int block_size, mx::StreamOrDevice s) {
  check_decode_attention(queries, pool_keys, pool_values, blocks, positions, lengths, heads, width, block_size);
  auto rope = rope_params(rope_dims, traditional, base, rope_scale, pool_keys.shape(2));
  auto primitive = std::make_shared<DecodeAttention>(mx::to_stream(s), heads, rope, scale, width, block_size);
  return mx::array(queries.shape(), mx::float32, primitive, {queries, pool_keys, pool_values, blocks, positions, lengths});
}

// `mx.exp(x)` for float32 (the kernel the others build on, exposed to be checked against MLX's).
mx::array exp(const mx::array& x, mx::StreamOrDevice s) {
  check_float32(x, "exp's input");
  auto stream = mx::to_stream(s);
  return mx::array(x.shape(), mx::float32, std::make_shared<Exp>(stream), {x});
}

// `mx.softmax(x, axis=-1, precise=True)` for float32.
mx::array softmax(const mx::array& x, mx::StreamOrDevice s) {
  check_float32(x, "softmax's input");
  auto stream = mx::to_stream(s);
  return mx::array(x.shape(), mx::float32, std::make_shared<Softmax>(stream), {x});
}

// `mx.fast.scaled_dot_product_attention` as MLX evaluates it on the CPU (its `fallback` in
// `mlx/fast.cpp`: the same ops in the same order), the softmax above in place of MLX's.
mx::array sdpa(const mx::array& queries, const mx::array& keys, const mx::array& values, float scale, const std::string& mask_mode,
               const std::optional<mx::array>& mask_arr, mx::StreamOrDevice sd) {
  check_float32(queries, "attention's queries");
  check_float32(keys, "attention's keys");
  check_float32(values, "attention's values");
  auto s = mx::to_stream(sd);
  const int n_q_heads = queries.shape(-3), n_kv_heads = keys.shape(-3);
  std::optional<mx::array> mask;
  if (mask_arr) {
    auto m = *mask_arr;
    if (m.dtype() != mx::bool_) m = mx::astype(m, mx::float32, s);
    auto mask_shape = queries.shape();
    mask_shape.back() = keys.shape(-2);
    mask = mx::broadcast_to(m, mask_shape, s);
  }
  const bool do_causal = mask_mode == "causal";
  auto q = mx::multiply(mx::array(scale, queries.dtype()), queries, s);
  const int n_repeats = n_q_heads / n_kv_heads;
  auto k = keys;
  auto v = values;
  if (n_repeats > 1) {
    q = mx::unflatten(q, 1, {n_kv_heads, n_repeats}, s);
    k = mx::expand_dims(k, 2, s);
    v = mx::expand_dims(v, 2, s);
  }
  auto scores = mx::matmul(q, mx::swapaxes(k, -1, -2, s), s);
  if (mask || do_causal) {
    mx::array m = mask ? *mask : mx::array(0);
    if (do_causal) {
      const int kL = k.shape(-2), qL = q.shape(-2), offset = kL - qL;
      auto q_idx = mx::expand_dims(mx::arange(offset, qL + offset, s), 1, s);
      auto k_idx = mx::expand_dims(mx::arange(0, kL, s), 0, s);
      m = mx::greater_equal(q_idx, k_idx, s);
    }
    if (n_repeats > 1 && m.ndim() >= 3) {
      m = m.shape(-3) == 1 ? mx::expand_dims(m, -3, s) : mx::unflatten(m, -3, {n_kv_heads, n_repeats}, s);
    }
    if (m.dtype() == mx::bool_) {
      scores = mx::where(m, scores, mx::array(std::numeric_limits<float>::lowest(), mx::float32), s);
    } else {
      scores = mx::add(scores, m, s);
    }
  }
  scores = softmax(scores, s);
  auto out = mx::matmul(scores, v, s);
  if (n_repeats > 1) out = mx::flatten(out, 1, 2, s);
  return out;
}

// The id of the OS thread that runs `stream`'s tasks (Linux's `gettid`), as the int32 value of
// the array this evaluates to: what `engine.affinity` pins to a core of its own.
class ThreadId : public CpuPrimitive {
 public:
  explicit ThreadId(mx::Stream stream) : CpuPrimitive(stream, "MlxrtThreadId") {}
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = allocate(inputs, outputs, false);
    run(inputs, out, [o = out.data<int32_t>()]() { *o = static_cast<int32_t>(syscall(SYS_gettid)); });
  }
};

mx::array stream_thread_id(mx::StreamOrDevice s) {
  return mx::array(mx::Shape{}, mx::int32, std::make_shared<ThreadId>(mx::to_stream(s)), {mx::array(0, mx::int32)});
}

#include "quantized.h"
#include "layer.h"

static void share_chunks(int chunks, const std::function<void(int)>& work) { Helper::instance().share(chunks, work); }

static int helper_thread_id() { return Helper::instance().thread_id(); }

static bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace mlxrt

NB_MODULE(_kernels, m) {
  m.doc() = "mlxrt's CPU kernels for MLX (AVX2), bit for bit MLX's own results";
  m.attr("supported") = mlxrt::cpu_supported();
  m.def("swiglu", &mlxrt::swiglu, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(), "mlx-lm's swiglu(gate, up) for float32 on the CPU.");
  m.def("exp", &mlxrt::exp, "x"_a, nb::kw_only(), "stream"_a = nb::none(), "mx.exp(x) for float32 on the CPU.");
  m.def("paged_attention", &mlxrt::paged_attention, "queries"_a, "pool_keys"_a, "pool_values"_a, "blocks"_a, nb::kw_only(), "width"_a, "block_size"_a,
        "mask"_a = nb::none(), "lengths"_a = nb::none(), "stream"_a = nb::none(), "A decode step's grouped attention over paged KV (float32, CPU).");
  m.def("pool_write", &mlxrt::pool_write, "pool"_a, "rows"_a, "positions"_a, "writes"_a, nb::kw_only(), "rope_dims"_a = 0, "traditional"_a = false,
        "base"_a = 0.0f, "rope_scale"_a = 1.0f, "stream"_a = nb::none(),
        "A paged pool with each row's keys (rotated where rope_dims) or values written at its slot (float32, CPU).");
  m.def("decode_attention", &mlxrt::decode_attention, "queries"_a, "pool_keys"_a, "pool_values"_a, "blocks"_a, "positions"_a, "lengths"_a,
        nb::kw_only(), "heads"_a, "rope_dims"_a, "traditional"_a, "base"_a, "rope_scale"_a, "scale"_a, "width"_a, "block_size"_a, "stream"_a = nb::none(),
        "A decode step's rotated, scaled queries' attention over paged KV (float32, CPU).");
  m.def("normed_products", &mlxrt::normed_products, "x"_a, "weight"_a, "eps"_a, "products"_a, nb::kw_only(), "stream"_a = nb::none(),
        "[rms_norm(x, weight, eps) @ w.T (+ bias)] for each product (w, scales, biases, bias or None, group_size, bits, bias_ratio): one node (float32, CPU).");
  m.def("layer_tail", &mlxrt::layer_tail, "x"_a, "queries"_a, "pool_keys"_a, "pool_values"_a, "blocks"_a, "positions"_a, "lengths"_a, "weight"_a,
        "products"_a, nb::kw_only(), "heads"_a, "rope_dims"_a, "traditional"_a, "base"_a, "rope_scale"_a, "scale"_a, "width"_a, "block_size"_a, "eps"_a,
        "stream"_a = nb::none(),
        "A llama decoder layer after its queries, keys and values: decode attention, output product, residual, norm, SwiGLU MLP, residual (one node).");
  m.def("rope", &mlxrt::rope, "x"_a, "dims"_a, nb::kw_only(), "traditional"_a, "base"_a, "scale"_a, "offset"_a, "stream"_a = nb::none(),
        "mx.fast.rope (no freqs) for float32 on the CPU.");
  m.def("rms_norm", &mlxrt::rms_norm, "x"_a, "weight"_a, "eps"_a, nb::kw_only(), "stream"_a = nb::none(), "mx.fast.rms_norm(x, weight, eps) for float32 on the CPU.");
  m.def("softmax", &mlxrt::softmax, "x"_a, nb::kw_only(), "stream"_a = nb::none(), "mx.softmax(x, axis=-1, precise=True) for float32 on the CPU.");
  m.def("quantized_matmul", &mlxrt::quantized_matmul, "x"_a, "w"_a, "scales"_a, "biases"_a, nb::kw_only(), "group_size"_a, "bits"_a,
        "helped"_a = true, "bias_ratio"_a = 0.0f, "stream"_a = nb::none(),
        "mx.quantized_matmul(x, w, scales, biases, transpose=True) for affine 4/8-bit weights, float32 on the CPU (bias_ratio: a power of two that biases are exactly scales times, else 0).");
  m.def("set_attention_chains", &mlxrt::set_attention_chains, "on"_a,
        "Let paged attention compute its wide products itself where they match cblas_sgemm bit for bit (on), or not; returns whether it does.");
  m.def("attention_chains_cover", &mlxrt::attention_chains_cover, "n_rep"_a, "dim"_a,
        "Which of paged attention's products (scores, values, values OpenBLAS would thread) it computes itself for n_rep query heads per KV head of dim dimensions.");
  m.def("quantized_isa", &mlxrt::quantized_isa, "The instruction set quantized_matmul uses: 'avx512' or 'avx2'.");
  m.def("set_avx512", &mlxrt::set_avx512, "on"_a, "Let quantized_matmul use AVX-512 where the CPU has it (on), or not; returns whether it does.");
  m.def("scaled_dot_product_attention", &mlxrt::sdpa, "queries"_a, "keys"_a, "values"_a, nb::kw_only(), "scale"_a, "mask_mode"_a = "",
        "mask"_a = nb::none(), "stream"_a = nb::none(), "mx.fast.scaled_dot_product_attention for float32 on the CPU, without sinks.");
  m.def("stream_thread_id", &mlxrt::stream_thread_id, nb::kw_only(), "stream"_a = nb::none(),
        "An int32 scalar that evaluates to the OS id (gettid) of the thread running the stream's tasks.");
  m.def("helper_thread_id", &mlxrt::helper_thread_id, "The OS id (gettid) of the quantized products' helper thread (started if it was not).");
}
