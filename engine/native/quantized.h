// mlxrt's CPU matrix products over MLX's affine-quantized weights (`mx.quantized_matmul` with
// `transpose=True`, 4 or 8 bits, groups of 32, 64 or 128, float32 inputs, scales and biases),
// included by `kernels.cpp` inside its namespace.
//
// MLX's CPU `quantized_matmul` on x86-64 walks one weight at a time (`_qmm_t`, `max_size` 1):
// ~1 ns a weight, ~3x float32's matrix-vector product and ~35x its 16-row product (PLATFORM.md),
// which is why mlxrt dequantized quantized models to float32 at load, reading ~6x a Q4 model's
// bytes each decode step. Here a decode step's few rows read the packed weights as stored:
// sixteen 4-bit (or eight 8-bit) weights become floats in two registers (`scale * q + bias`, one
// FMA), multiplied into up to eight rows' accumulators before the next sixteen are read. For 4 bits
// the input is reordered once per call (evens, then odds, of each sixteen) so that the low and high
// nibbles of eight bytes are two registers without a shuffle. Products of many rows (a prefill)
// dequantize a panel of output rows to float32 and hand it to BLAS's `sgemm`.
//
// A lone row (a c1 decode step) sums each group as `scale * sum(x * q) + bias * sum(x)` instead
// (`qmv_tile`). The results are the same function as MLX's with another summation order (float
// rounding, ~1e-6 relative); `engine/native/__init__.py` checks them against `mx.quantized_matmul` at load.

// Rows of `x` at or above this count go through dequantized panels and BLAS; for inputs of
// `kWideK` or more, only above `kWideTileRows` rows. A wide input's panel (1,024 features of 2,048
// floats or more: 8 MB and up) leaves the cache before BLAS reads it back, where the tiles read
// each chunk's weights from cache for every eight rows: 3,072 x 8,192 4-bit weights (a 3B model's
// down projection), 32 rows 41.4 against 8.8 ms, 128 rows 64.4 against 34.6; 2,048 x 8,192,
// 256 rows 78.5 against 51.2. Narrow inputs (576 x 1,536: 0.68 against 1.08 ms at 48 rows) keep
// the panels from 24 rows.
constexpr int kPanelRows = 24;
constexpr int kWideK = 2048;
constexpr int kWideTileRows = 256;
// Output features dequantized per panel: 128 x 1,536 float32 weights take 768 KiB (cache-resident).
constexpr int kPanelFeatures = 1024;

// `x` [rows, k] reordered for 4-bit weights: in each `span` (16, or 32 with AVX-512), the even
// positions then the odd ones (the low nibbles of eight bytes are weights 0, 2, ..., 14; their
// high nibbles 1, 3, ..., 15).
static void deinterleave(const float* x, float* out, size_t rows, int k, int span) {
  const int half = span / 2;
  for (size_t r = 0; r < rows; r++) {
    const float* src = x + r * k;
    float* dst = out + r * k;
    for (int b = 0; b < k; b += span) {
      for (int i = 0; i < half; i++) {
        dst[b + i] = src[b + 2 * i];
        dst[b + half + i] = src[b + 2 * i + 1];
      }
    }
  }
}

MLXRT_AVX2 static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Streaming the weights from memory, a lone row's product ran at ~10 GB/s where the same product
// from cache runs at ~15 (the hardware prefetchers do not run far enough ahead of a loop that
// computes between its loads): each tile fetches the next tile's weights, scales and biases into
// the cache while it computes, a share of them per group. A 576x1536 4-bit product streamed from
// memory on one core: 67 -> 47 us; 1536x576: 102 -> 44 us. (Prefetches do not fault: the last
// tile's, past the weights' end, are ignored.)
static inline void prefetch_lines(uintptr_t from, size_t bytes) {
  for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(from + b), _MM_HINT_T0);
}

// Group `g`'s share of the next `C`-feature tile (features [n, n + C)): its part of the tile's
// packed weights, and the line that holds its part of the tile's scales and of its biases (each
// line asked for 64 / (4 * C) times in a row: a prefetch of a line on its way costs ~nothing,
// where asking for the tile's scales all at once, 16 lines, stalled the loads: 1536x576, 46 vs 97 us).
template <int C>
static inline void prefetch_tile(const uint8_t* w, size_t row_bytes, const float* scales, const float* biases, int groups, int n, int g) {
  const size_t share = C * row_bytes / groups;  // (whole: a row holds `groups` groups of >= 32 weights)
  prefetch_lines(reinterpret_cast<uintptr_t>(w) + static_cast<size_t>(n) * row_bytes + g * share, share);
  const size_t at = static_cast<size_t>(n) * groups + static_cast<size_t>(g) * C;
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(scales) + at * sizeof(float)), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(biases) + at * sizeof(float)), _MM_HINT_T0);
}

// Sixteen weights of one output feature as their integers `q` in floats (`dequant16`'s order).
template <int bits>
MLXRT_AVX2 static inline void levels16(const uint8_t* row, int k, __m256& lo, __m256& hi) {
  if constexpr (bits == 4) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  } else {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k + 8))));
  }
}

// A lone row's input for 4-bit weights, in place of its `deinterleave`d form (evens `e`, then odds
// `o`, of each sixteen): `e - o / 16`, then `o / 16`. With eight bytes' low nibbles `lo` and the
// bytes whole `b = lo + 16 * hi`, `e * lo + o * hi = (e - o / 16) * lo + (o / 16) * b`: the high
// nibbles need no shift (`levels16_bytes`). (`o / 16` is exact; `e - o / 16` one rounding.)
MLXRT_AVX2 static void byte_form(float* x, int k) {
  const __m256 sixteenth = _mm256_set1_ps(1.0f / 16.0f);
  for (int kk = 0; kk < k; kk += 16) {
    const __m256 odd = _mm256_mul_ps(_mm256_loadu_ps(x + kk + 8), sixteenth);
    _mm256_storeu_ps(x + kk, _mm256_sub_ps(_mm256_loadu_ps(x + kk), odd));
    _mm256_storeu_ps(x + kk + 8, odd);
  }
}

// Sixteen 4-bit weights of one output feature for an input in `byte_form`, packed in the eight bytes
// at `at`: `lo` their low nibbles, `hi` the bytes whole, as floats.
MLXRT_AVX2 static inline void levels16_bytes(const uint8_t* at, __m256& lo, __m256& hi) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF)));
  hi = _mm256_cvtepi32_ps(bytes);
}

// Sixteen weights of one output feature as floats, starting at weight `k` of its packed row:
// `lo` and `hi` hold weights (for 4 bits) 0, 2, ..., 14 and 1, 3, ..., 15, (for 8 bits) 0-7 and 8-15.
template <int bits>
MLXRT_AVX2 static inline void dequant16(const uint8_t* row, int k, __m256 scale, __m256 bias, __m256& lo, __m256& hi) {
  levels16<bits>(row, k, lo, hi);
  lo = _mm256_fmadd_ps(lo, scale, bias);
  hi = _mm256_fmadd_ps(hi, scale, bias);
}

// `R` (2-8) rows of `x` (reordered for 4 bits) times `C` output features [n, n + C): each feature's
// sixteen weights dequantized once and multiplied into the R rows' accumulators. R * C
// independent accumulators keep the FMA units busy (their latency is ~4 cycles, two per cycle).
template <int bits, int R, int C>
MLXRT_AVX2 static void qmm_tile(const float* x, int k_total, const uint8_t* w, size_t row_bytes, const float* scales, const float* biases, int group,
                                 float* out, size_t ldo, int n) {
  __m256 acc[R][C];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
  const int groups = k_total / group;
  for (int g = 0; g < groups; g++) {
    // (No prefetch here, unlike a lone row's `qmv_tile`: several rows' compute per byte keeps the
    // hardware's prefetchers ahead, and the prefetch loop cost GCC the accumulators' registers,
    // each stored every sixteen weights: SmolLM2-shaped products streamed from memory on two
    // cores, 2 / 4 / 8 / 16 rows 10.8 / 16.5 / 30.7 / 60.9 -> 9.6 / 13.5 / 23.4 / 44.6 ms.)
    __m256 scale[C], bias[C];
    for (int c = 0; c < C; c++) {
      scale[c] = _mm256_set1_ps(scales[static_cast<size_t>(n + c) * groups + g]);
      bias[c] = _mm256_set1_ps(biases[static_cast<size_t>(n + c) * groups + g]);
    }
    for (int k = g * group; k < (g + 1) * group; k += 16) {
      for (int c = 0; c < C; c++) {
        __m256 lo, hi;
        dequant16<bits>(w + static_cast<size_t>(n + c) * row_bytes, k, scale[c], bias[c], lo, hi);
        for (int r = 0; r < R; r++) {
          const float* xr = x + static_cast<size_t>(r) * k_total + k;
          acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), lo, acc[r][c]);
          acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), hi, acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) out[static_cast<size_t>(r) * ldo + n + c] = hsum8(acc[r][c]);
}

// The largest input copy made on the stack (floats: 64 KB, a lone row of up to 16,384 features),
// and its blocks' sums.
constexpr size_t kStackInputFloats = size_t{1} << 14;
constexpr int kStackSums = static_cast<int>(kStackInputFloats / 32);

// A lone row's input is followed by the sums of its blocks of 32 floats (`TileInput`), from
// which each group's `sum(x)` comes (the last row of 9, 17, ... rows as well).
constexpr int kSumBlock = 32;

// The sums of `x`'s blocks of `kSumBlock` floats (`k` a multiple of it) into `sums`.
MLXRT_AVX2 static void block_sums(const float* x, int k, float* sums) {
  for (int b = 0; b < k / kSumBlock; b++) {
    const float* block = x + b * kSumBlock;
    sums[b] = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(block), _mm256_loadu_ps(block + 8)),
                                  _mm256_add_ps(_mm256_loadu_ps(block + 16), _mm256_loadu_ps(block + 24))));
  }
}

// `sum(a[i] * b[i])` over `n` floats.
MLXRT_AVX2 static inline float dot_product(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum8(acc);
  for (; i < n; i++) sum += a[i] * b[i];
  return sum;
}

// One row times `C` output features [n, n + C) (AVX2): `sum(x * (scale * q + bias))` taken as
// each group's `scale * sum(x * q)`, plus the feature's biases dotted with the groups' `sum(x)`
// (MLX's Metal `qmv` sums it so; the same function, another rounding). A lone row's product is
// bound by its instructions, not by memory (8-bit weights, twice the bytes, streamed in the same
// time): sixteen 4-bit weights cost a load-and-widen, two integer ops, two conversions and two
// FMAs here in place of four FMAs, and a group one FMA in place of two. The 1B's 113 lone-row
// products a step, streamed from memory on two cores: 52.8 -> 37.3 ms (4 output features a tile;
// 2, 6 and 8 measured 44.3, 39.8, 39.4); SmolLM2-shaped in groups of 32: 9.2 -> 7.2 ms.
// For 4 bits, each byte's two weights are read as the byte whole and its low nibble, over the
// input in `byte_form`: one integer op fewer a sixteen weights (`levels16_bytes`). The groups are
// walked by pointers (each feature's packed row and scales, the input), a group's sixteens unrolled
// for its size (`qmv_groups`): the indexing by position had cost integer ops in the inner loop.
// From cache, a sixteen 4-bit weights of a feature: 3.0 -> 2.7 (byte form) -> 2.45 cycles.
template <int bits, int C, int G>
MLXRT_AVX2 static void qmv_groups(const float* x, int groups, const uint8_t* w, size_t row_bytes, const float* scales, const float* biases, int n,
                                   float (&sum)[C]) {
  constexpr int kStepBytes = 16 * bits / 8;  // (a sixteen weights' packed bytes)
  __m256 acc[C];
  for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
  const uint8_t* rows[C];
  const float* row_scales[C];
  for (int c = 0; c < C; c++) {
    rows[c] = w + static_cast<size_t>(n + c) * row_bytes;
    row_scales[c] = scales + static_cast<size_t>(n + c) * groups;
  }
  // (`prefetch_tile`'s lines, walked: the next tile's share of its weights a group, and the lines of
  // its scales and biases, C floats further each group.)
  constexpr int kShare = C * G * bits / 8;
  const char* ahead = reinterpret_cast<const char*>(w + static_cast<size_t>(n + C) * row_bytes);
  const float* ahead_scales = scales + static_cast<size_t>(n + C) * groups;
  const float* ahead_biases = biases + static_cast<size_t>(n + C) * groups;
  for (int g = 0; g < groups; g++, x += G, ahead += kShare, ahead_scales += C, ahead_biases += C) {
    for (int b = 0; b < kShare; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead_scales), _MM_HINT_T0);
    if (biases != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead_biases), _MM_HINT_T0);
    __m256 xq[C];  // (the group's sum(x * q) a feature)
    for (int c = 0; c < C; c++) xq[c] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int step = 0; step < G / 16; step++) {
      const __m256 x_lo = _mm256_load_ps(x + 16 * step), x_hi = _mm256_load_ps(x + 16 * step + 8);
      for (int c = 0; c < C; c++) {
        __m256 lo, hi;
        if constexpr (bits == 4) {
          levels16_bytes(rows[c] + kStepBytes * step, lo, hi);
        } else {
          levels16<bits>(rows[c] + kStepBytes * step, 0, lo, hi);
        }
        xq[c] = _mm256_fmadd_ps(x_lo, lo, xq[c]);
        xq[c] = _mm256_fmadd_ps(x_hi, hi, xq[c]);
      }
    }
    for (int c = 0; c < C; c++) {
      acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(*row_scales[c]++), xq[c], acc[c]);
      rows[c] += G * bits / 8;
    }
  }
  for (int c = 0; c < C; c++) sum[c] = hsum8(acc[c]);
}

// `bias_ratio` (where not 0): the biases are `bias_ratio * scales` exactly, `bias_ratio` a power of
// two (`engine.lanes`: GGUF's Q4_0 and Q8_0, `-8 d` and `-128 d`); the biases' term is then taken
// from the scales, which the tile has just read, and the biases are not read: the same value (a
// power of two's scaling is exact), and a Q8_0 output layer's bytes 40 -> 36 a 32 weights.
template <int bits, int C>
MLXRT_AVX2 static void qmv_tile(const float* x, int k_total, const uint8_t* w, size_t row_bytes, const float* scales, const float* biases,
                                 float bias_ratio, int group, float* out, int n) {
  const int groups = k_total / group;
  const float* sums = x + k_total;  // (the blocks' sums; larger groups add theirs up)
  float local[kStackSums];
  std::unique_ptr<float[]> heap;
  if (group != kSumBlock) {
    float* group_sums = groups <= kStackSums ? local : (heap.reset(new float[groups]), heap.get());
    const int per = group / kSumBlock;
    for (int g = 0; g < groups; g++) {
      float sum = 0.0f;
      for (int b = 0; b < per; b++) sum += sums[g * per + b];
      group_sums[g] = sum;
    }
    sums = group_sums;
  }
  float scaled[C];  // (each feature's sum over its groups of scale * sum(x * q))
  const float* read_biases = bias_ratio != 0.0f ? nullptr : biases;
  switch (group) {  // (32, 64 or 128: `check_quantized`)
    case 32: qmv_groups<bits, C, 32>(x, groups, w, row_bytes, scales, read_biases, n, scaled); break;
    case 64: qmv_groups<bits, C, 64>(x, groups, w, row_bytes, scales, read_biases, n, scaled); break;
    default: qmv_groups<bits, C, 128>(x, groups, w, row_bytes, scales, read_biases, n, scaled); break;
  }
  for (int c = 0; c < C; c++) {
    const size_t at = static_cast<size_t>(n + c) * groups;
    out[n + c] = scaled[c] + (read_biases != nullptr ? dot_product(biases + at, sums, groups) : bias_ratio * dot_product(scales + at, sums, groups));
  }
}

// Output features [n0, n1) of two to eight rows, C features at a time (then one at a time).
template <int bits, int R, int C>
static void qmm_rows(const float* x, int k, const uint8_t* w, size_t row_bytes, const float* scales, const float* biases, int group, float* out,
                     size_t ldo, int n0, int n1) {
  int n = n0;
  for (; n + C <= n1; n += C) qmm_tile<bits, R, C>(x, k, w, row_bytes, scales, biases, group, out, ldo, n);
  for (; n < n1; n++) qmm_tile<bits, R, 1>(x, k, w, row_bytes, scales, biases, group, out, ldo, n);
}

// Output features [n0, n1) of a lone row (AVX2), four at a time by `qmv_tile`.
template <int bits>
static void qmv_rows(const float* x, int k, const uint8_t* w, size_t row_bytes, const float* scales, const float* biases, float bias_ratio, int group,
                     float* out, int n0, int n1) {
  int n = n0;
  for (; n + 4 <= n1; n += 4) qmv_tile<bits, 4>(x, k, w, row_bytes, scales, biases, bias_ratio, group, out, n);
  for (; n < n1; n++) qmv_tile<bits, 1>(x, k, w, row_bytes, scales, biases, bias_ratio, group, out, n);
}

// The same with sixteen lanes (AVX-512, where the CPU has it): thirty-two weights a step, so for
// 4 bits the input is reordered in thirty-twos (`deinterleave<32>`). A 4-bit weight becomes its
// float by a table lookup: each group's sixteen values `scale * q + bias` (the same FMA, so the
// same floats) are one register, and `vpermps` picks from it by the low four bits of each lane, so
// sixteen weights cost one permute where a conversion and an FMA cost two (with the mask, three).
template <int bits>
MLXRT_AVX512 static inline void dequant32(const uint8_t* row, int k, __m512 scale, __m512 bias, __m512& lo, __m512& hi) {
  if constexpr (bits == 4) {  // (`scale`: the group's table; `bias` unused)
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
    lo = _mm512_permutexvar_ps(bytes, scale);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), scale);
  } else {
    lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)))), scale, bias);
    hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16)))), scale, bias);
  }
}

template <int bits, int R, int C>
MLXRT_AVX512 static void qmm_tile512(const float* x, int k_total, const uint8_t* w, size_t row_bytes, const float* scales, const float* biases, int group,
                                     float* out, size_t ldo, int n) {
  __m512 acc[R][C];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int groups = k_total / group;
  for (int g = 0; g < groups; g++) {
    prefetch_tile<C>(w, row_bytes, scales, biases, groups, n + C, g);
    __m512 scale[C], bias[C];
    for (int c = 0; c < C; c++) {
      scale[c] = _mm512_set1_ps(scales[static_cast<size_t>(n + c) * groups + g]);
      bias[c] = _mm512_set1_ps(biases[static_cast<size_t>(n + c) * groups + g]);
      if constexpr (bits == 4) scale[c] = _mm512_fmadd_ps(levels, scale[c], bias[c]);  // (the table)
    }
    for (int k = g * group; k < (g + 1) * group; k += 32) {
      if constexpr (R == 1) {  // (one row: its input in two registers, each feature's weights in turn)
        const __m512 x_lo = _mm512_load_ps(x + k), x_hi = _mm512_load_ps(x + k + 16);
        for (int c = 0; c < C; c++) {
          __m512 lo, hi;
          dequant32<bits>(w + static_cast<size_t>(n + c) * row_bytes, k, scale[c], bias[c], lo, hi);
          acc[0][c] = _mm512_fmadd_ps(x_lo, lo, acc[0][c]);
          acc[0][c] = _mm512_fmadd_ps(x_hi, hi, acc[0][c]);
        }
      } else {  // (the C features' weights first: each row's input is then read once for all)
        __m512 lo[C], hi[C];
        for (int c = 0; c < C; c++) dequant32<bits>(w + static_cast<size_t>(n + c) * row_bytes, k, scale[c], bias[c], lo[c], hi[c]);
        for (int r = 0; r < R; r++) {
          const float* xr = x + static_cast<size_t>(r) * k_total + k;
          const __m512 x_lo = _mm512_load_ps(xr), x_hi = _mm512_load_ps(xr + 16);
          for (int c = 0; c < C; c++) {
            acc[r][c] = _mm512_fmadd_ps(x_lo, lo[c], acc[r][c]);
            acc[r][c] = _mm512_fmadd_ps(x_hi, hi[c], acc[r][c]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) out[static_cast<size_t>(r) * ldo + n + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int bits, int R, int C>
static void qmm_rows512(const float* x, int k, const uint8_t* w, size_t row_bytes, const float* scales, const float* biases, int group, float* out,
                        size_t ldo, int n0, int n1) {
  int n = n0;
  for (; n + C <= n1; n += C) qmm_tile512<bits, R, C>(x, k, w, row_bytes, scales, biases, group, out, ldo, n);
  for (; n < n1; n++) qmm_tile512<bits, R, 1>(x, k, w, row_bytes, scales, biases, group, out, ldo, n);
}

// The rows of `x` eight at a time, with the tile shape each row count keeps busy (`wide`: AVX-512).
template <int bits, bool wide, int R, int C>
static void tile_rows(const float* x, int k, const uint8_t* w, size_t row_bytes, const float* scales, const float* biases, int group, float* out,
                      size_t ldo, int n0, int n1) {
  if constexpr (wide) {
    qmm_rows512<bits, R, C>(x, k, w, row_bytes, scales, biases, group, out, ldo, n0, n1);
  } else {
    qmm_rows<bits, R, C>(x, k, w, row_bytes, scales, biases, group, out, ldo, n0, n1);
  }
}

// (`bias_ratio`: `qmv_tile`'s, for a lone row on AVX2; 0 where the biases are to be read.)
template <int bits, bool wide>
static void qmm_small(const float* x, int rows, int k, const uint8_t* w, const float* scales, const float* biases, float bias_ratio, int group,
                      float* out, int n0, int n1, int ldo) {
  const size_t row_bytes = static_cast<size_t>(k) * bits / 8;
  // Five to eight rows take four 4-bit features a tile but two 8-bit ones: eight rows by four
  // features is all 32 registers in accumulators, and where the 4-bit tile's table lookups leave
  // the compiler room, the 8-bit conversions spill every accumulator to the stack at each group
  // (from cache, sixteen rows: 52 against 63 GFLOP/s on one core, the 4-bit tile's 82).
  constexpr int kWideC = bits == 8 ? 2 : 4;
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const float* xr = x + static_cast<size_t>(r0) * k;
    float* o = out + static_cast<size_t>(r0) * ldo;
    switch (std::min(8, rows - r0)) {
      case 1:
        if constexpr (wide) {
          tile_rows<bits, wide, 1, 8>(xr, k, w, row_bytes, scales, biases, group, o, ldo, n0, n1);
        } else {
          qmv_rows<bits>(xr, k, w, row_bytes, scales, biases, bias_ratio, group, o, n0, n1);
        }
        break;
      case 2: tile_rows<bits, wide, 2, 4>(xr, k, w, row_bytes, scales, biases, group, o, ldo, n0, n1); break;
      case 3: tile_rows<bits, wide, 3, wide ? 4 : 2>(xr, k, w, row_bytes, scales, biases, group, o, ldo, n0, n1); break;
      case 4: tile_rows<bits, wide, 4, wide ? 4 : 2>(xr, k, w, row_bytes, scales, biases, group, o, ldo, n0, n1); break;
      case 5: tile_rows<bits, wide, 5, wide ? kWideC : 1>(xr, k, w, row_bytes, scales, biases, group, o, ldo, n0, n1); break;
      case 6: tile_rows<bits, wide, 6, wide ? kWideC : 1>(xr, k, w, row_bytes, scales, biases, group, o, ldo, n0, n1); break;
      case 7: tile_rows<bits, wide, 7, wide ? kWideC : 1>(xr, k, w, row_bytes, scales, biases, group, o, ldo, n0, n1); break;
      default: tile_rows<bits, wide, 8, wide ? kWideC : 1>(xr, k, w, row_bytes, scales, biases, group, o, ldo, n0, n1); break;
    }
  }
}

static bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

// Whether the products use AVX-512: where the CPU has it, unless turned off (`set_avx512`, tests).
static std::atomic<bool> avx512_on{cpu_has_avx512()};

static bool has_avx512() { return avx512_on.load(std::memory_order_relaxed); }

// Turn the AVX-512 path on (where the CPU has it) or off; returns whether it is on.
bool set_avx512(bool on) {
  avx512_on.store(on && cpu_has_avx512());
  return has_avx512();
}

std::string quantized_isa() { return has_avx512() ? "avx512" : "avx2"; }

// Features [n0, n0 + count) dequantized to float32 rows of `k` (`scale * q + bias`, one FMA).
template <int bits>
MLXRT_AVX2 static void dequant_panel(const uint8_t* w, int k, const float* scales, const float* biases, int group, int n0, int count, float* panel) {
  const size_t row_bytes = static_cast<size_t>(k) * bits / 8;
  const int groups = k / group;
  for (int c = 0; c < count; c++) {
    const uint8_t* row = w + static_cast<size_t>(n0 + c) * row_bytes;
    float* dst = panel + static_cast<size_t>(c) * k;
    for (int g = 0; g < groups; g++) {
      const __m256 scale = _mm256_set1_ps(scales[static_cast<size_t>(n0 + c) * groups + g]);
      const __m256 bias = _mm256_set1_ps(biases[static_cast<size_t>(n0 + c) * groups + g]);
      for (int kk = g * group; kk < (g + 1) * group; kk += 16) {
        __m256 lo, hi;
        dequant16<bits>(row, kk, scale, bias, lo, hi);
        if constexpr (bits == 4) {  // back to the weights' order: 0, 1, 2, ... from evens and odds
          const __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi);
          _mm256_storeu_ps(dst + kk, _mm256_permute2f128_ps(a, b, 0x20));
          _mm256_storeu_ps(dst + kk + 8, _mm256_permute2f128_ps(a, b, 0x31));
        } else {
          _mm256_storeu_ps(dst + kk, lo);
          _mm256_storeu_ps(dst + kk + 8, hi);
        }
      }
    }
  }
}

// One helper thread that shares a product's output features with the calling (MLX) thread. The
// features are cut in chunks that either thread claims from one counter, so the calling thread
// never waits on a helper that has not started (descheduled, asleep, busy with another stream's
// product): it computes every chunk left itself, and waits only for the chunks the helper took.
// The caller claims chunks from the front and the helper from the back, so that each streams its
// share of the weights in order (chunks dealt alternately made both threads jump, and two threads
// streaming a 576x1536 4-bit product from memory ran 1.3x one where they run 1.85x from cache).
// A decode step makes ~200 products of 20-200 us, so the helper spins between them (yielding the
// core to any other runnable thread: the event loop, the client), and sleeps once they stop.
class Helper {
 public:
  static Helper& instance() {
    static Helper* helper = new Helper;  // (never destroyed: its thread waits on it until the process ends)
    return *helper;
  }
  // `work(i)` for each chunk i < `chunks`, on this thread and the helper; returns when all are
  // done. While another thread (another MLX stream's) has the helper, every chunk runs here.
  template <typename F>
  void share(int chunks, F&& work) {
    std::unique_lock<std::mutex> turn(busy_, std::try_to_lock);
    if (!turn.owns_lock() || chunks < 2 || static_cast<uint64_t>(chunks) > kFieldMask) {
      for (int i = 0; i < chunks; i++) work(i);
      return;
    }
    std::function<void(int)> job(std::forward<F>(work));
    const uint64_t tag = (tag_ = (tag_ + 1) & kFieldMask);
    job_ = &job;
    helped_.store(0, std::memory_order_relaxed);
    state_.store(tag << kTagShift | static_cast<uint64_t>(chunks) << kCountShift, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_one();
    }
    int here = 0, chunk;
    while (claim(tag, true, chunk)) {
      job(chunk);
      here++;
    }
    while (here + helped_.load(std::memory_order_acquire) < chunks) _mm_pause();
  }
  // The helper's OS thread id (`gettid`), once it has started.
  int thread_id() const {
    int tid;
    while ((tid = tid_.load(std::memory_order_acquire)) == 0) std::this_thread::yield();
    return tid;
  }

 private:
  // `state_`: the job's tag (which product), its chunk count, and the chunks claimed from the
  // front and from the back, in one word: a thread that reads a finished job's state reads that
  // job's count with it (a count kept apart could be the next job's: a chunk claimed twice).
  static constexpr int kTagShift = 48, kCountShift = 32, kFrontShift = 16;
  static constexpr uint64_t kFieldMask = (uint64_t{1} << 16) - 1;  // (each of the four fields, the tag's too)

  // The next chunk of job `tag` from the front (else the back), if it has one left (false once it
  // has none, or another job began).
  bool claim(uint64_t tag, bool front, int& chunk) {
    uint64_t state = state_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t from_back = state & kFieldMask, from_front = (state >> kFrontShift) & kFieldMask, count = (state >> kCountShift) & kFieldMask;
      if ((state >> kTagShift) != tag || from_front + from_back >= count) return false;
      const uint64_t next = state + (front ? uint64_t{1} << kFrontShift : 1);
      if (state_.compare_exchange_weak(state, next, std::memory_order_acq_rel, std::memory_order_acquire)) {
        chunk = static_cast<int>(front ? from_front : count - 1 - from_back);
        return true;
      }
    }
  }

  Helper() : thread_([this] { loop(); }) { thread_.detach(); }

  void loop() {
    tid_.store(static_cast<int>(syscall(SYS_gettid)), std::memory_order_release);
    uint64_t seen = 0;
    for (;;) {
      uint64_t tag = state_.load(std::memory_order_acquire) >> kTagShift;
      const auto idle_since = std::chrono::steady_clock::now();
      for (int spin = 0; tag == seen; spin++) {
        if (spin % 64 == 63) {
          // Other runnable threads on this core first; past the spinning time, sleep.
          if (std::chrono::steady_clock::now() - idle_since > kSpinTime) {
            std::unique_lock<std::mutex> lock(mutex_);
            sleeping_.store(true, std::memory_order_seq_cst);
            wake_.wait(lock, [&] { return (state_.load(std::memory_order_seq_cst) >> kTagShift) != seen; });
            sleeping_.store(false, std::memory_order_relaxed);
          } else {
            std::this_thread::yield();
          }
        } else {
          _mm_pause();
        }
        tag = state_.load(std::memory_order_acquire) >> kTagShift;
      }
      seen = tag;
      // (A claimed chunk's job is still `job_`: its caller waits for the chunk before returning.)
      int chunk;
      while (claim(tag, false, chunk)) {
        (*job_)(chunk);
        helped_.fetch_add(1, std::memory_order_release);
      }
    }
  }
  // How long the helper waits for the next product before sleeping: longer than the gaps
  // between a step's products, shorter than the gaps between a server's steps when it idles.
  static constexpr std::chrono::microseconds kSpinTime{2000};
  std::mutex busy_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> helped_{0};
  std::atomic<bool> sleeping_{false};
  std::atomic<int> tid_{0};
  uint64_t tag_ = 0;  // (the last job's tag: written under `busy_`)
  std::function<void(int)>* job_ = nullptr;
  std::thread thread_;
};

// Below this many weight bytes a product runs on the calling thread alone (publishing the chunks
// and waiting for the helper's cost about a microsecond). A lone row's products are shared too:
// with the weights prefetched and each thread streaming its end of them, SmolLM2 Q4's c1 step is
// 9.0-9.6 ms shared, 10.0 alone (before, sharing them measured worse: 19.1 against 15.7 ms).
constexpr size_t kSplitBytes = 32 * 1024;
// Output features per chunk (a multiple of eight: every tile stays whole), a few microseconds of
// work each: enough chunks that whichever thread is late finds the rest taken.
constexpr int kChunkFeatures = 64;

// Whether a product of `rows` inputs `k` wide goes through dequantized panels and BLAS (else tiles).
static bool panel_rows(int rows, int k) { return rows >= kPanelRows && (k < kWideK || rows > kWideTileRows); }

// The input as the tiles read it: copied (for 4 bits, reordered) to cache-line-aligned rows (`k` is
// a multiple of 32): the tiles read each row's floats once per feature tile, and reads straddling
// two lines cost the many-row tiles ~30% (an 8-row product here: 56 against 78 GFLOP/s on one
// core). (Up to `kStackInputFloats` in place, on the caller's stack: a step's ~200 lone-row products
// each allocated and freed theirs on the thread that runs the kernels.)
class TileInput {
 public:
  TileInput(const float* x, int rows, int k, int bits, bool wide) : data_(local_) {
    // (The tiles take the rows eight at a time: a last row alone, of 1, 9, 17, ... rows, goes to
    // `qmv_tile`, which reads its blocks' sums after it, and for 4 bits on AVX2 the row in `byte_form`.)
    const bool sums = rows % 8 == 1;
    const size_t need = static_cast<size_t>(rows) * k + (sums ? k / kSumBlock : 0);
    if (need > kStackInputFloats + kStackSums) {
      storage_.reset(new float[need + 16]);  // (not zeroed: all written)
      data_ = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage_.get()) + 63) & ~uintptr_t{63});
    }
    if (bits == 4) {
      deinterleave(x, data_, rows, k, wide ? 32 : 16);
    } else {
      std::memcpy(data_, x, static_cast<size_t>(rows) * k * sizeof(float));
    }
    if (sums) {
      float* last = data_ + static_cast<size_t>(rows - 1) * k;
      block_sums(last, k, data_ + static_cast<size_t>(rows) * k);  // (a reordering stays within its block)
      if (bits == 4 && !wide) byte_form(last, k);  // (`qmv_tile`'s: the AVX-512 tiles take a lone row as any)
    }
  }
  TileInput(const TileInput&) = delete;
  TileInput& operator=(const TileInput&) = delete;
  const float* data() const { return data_; }

 private:
  alignas(64) float local_[kStackInputFloats + kStackSums];
  std::unique_ptr<float[]> storage_;
  float* data_;
};

// How many chunks a product's features are shared in: one below `kSplitBytes` (or two chunks'
// worth of features), else `kChunkFeatures` each; `chunk_features` gives chunk `i`'s range.
static int feature_chunks(int n, int k, int bits) {
  const size_t bytes = static_cast<size_t>(n) * k * bits / 8;
  return bytes < kSplitBytes || n < 2 * kChunkFeatures ? 1 : (n + kChunkFeatures - 1) / kChunkFeatures;
}

static std::pair<int, int> chunk_features(int i, int chunks, int n) {
  return chunks == 1 ? std::pair{0, n} : std::pair{i * kChunkFeatures, std::min(n, (i + 1) * kChunkFeatures)};
}

// Features [n0, n1) of a product over a prepared input (`TileInput`).
template <int bits>
static void tile_features(const float* xs, int rows, int k, const uint8_t* w, const float* scales, const float* biases, float bias_ratio, int group,
                          float* out, int n0, int n1, int n, bool wide) {
  if (wide) {
    qmm_small<bits, true>(xs, rows, k, w, scales, biases, bias_ratio, group, out, n0, n1, n);
  } else {
    qmm_small<bits, false>(xs, rows, k, w, scales, biases, bias_ratio, group, out, n0, n1, n);
  }
}

template <int bits>
static void qmm_kernel(const float* x, int rows, int k, const uint32_t* w32, const float* scales, const float* biases, float bias_ratio, int group,
                       float* out, int n, bool helped) {
  const auto* w = reinterpret_cast<const uint8_t*>(w32);
  if (panel_rows(rows, k)) {
    std::vector<float> panel(static_cast<size_t>(kPanelFeatures) * k);
    for (int n0 = 0; n0 < n; n0 += kPanelFeatures) {
      const int count = std::min(kPanelFeatures, n - n0);
      dequant_panel<bits>(w, k, scales, biases, group, n0, count, panel.data());
      sgemm(kTrans, rows, count, k, x, k, panel.data(), k, out + n0, n);
    }
    return;
  }
  const bool wide = has_avx512();
  const TileInput input(x, rows, k, bits, wide);
  const int chunks = helped ? feature_chunks(n, k, bits) : 1;
  auto chunk = [&](int i) {
    const auto [n0, n1] = chunk_features(i, chunks, n);
    tile_features<bits>(input.data(), rows, k, w, scales, biases, bias_ratio, group, out, n0, n1, n, wide);
  };
  if (chunks == 1) {
    chunk(0);
  } else {
    Helper::instance().share(chunks, chunk);
  }
}

class QuantizedMatmul : public CpuPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group, int bits, bool helped, float bias_ratio)
      : CpuPrimitive(stream, "MlxrtQuantizedMatmul"), group_(group), bits_(bits), helped_(helped), bias_ratio_(bias_ratio) {}
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }
  void evaluate(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = allocate(inputs, outputs, false);
    const auto& x = inputs[0];
    const int k = x.shape(-1), n = inputs[1].shape(0);
    const int rows = static_cast<int>(x.size() / k);
    run(inputs, out,
        [x = x.data<float>(), w = inputs[1].data<uint32_t>(), s = inputs[2].data<float>(), b = inputs[3].data<float>(), o = out.data<float>(), rows, k, n,
         group = group_, bits = bits_, helped = helped_, ratio = bias_ratio_]() {
          if (bits == 4) {
            qmm_kernel<4>(x, rows, k, w, s, b, ratio, group, o, n, helped);
          } else {
            qmm_kernel<8>(x, rows, k, w, s, b, ratio, group, o, n, helped);
          }
        });
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    if (!CpuPrimitive::is_equivalent(other)) return false;
    const auto& o = static_cast<const QuantizedMatmul&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && helped_ == o.helped_ && bias_ratio_ == o.bias_ratio_;
  }

 private:
  int group_, bits_;
  bool helped_;
  float bias_ratio_;
};

// A product's `bias_ratio`: 0, or a power of two (`qmv_tile`).
static void check_bias_ratio(float bias_ratio) {
  int exponent = 0;
  if (bias_ratio != 0.0f && !(std::isfinite(bias_ratio) && std::fabs(std::frexp(bias_ratio, &exponent)) == 0.5f)) {
    throw std::invalid_argument("[mlxrt.native] quantized_matmul: bias_ratio must be 0 or a power of two");
  }
}

// Affine-quantized `w` uint32 [n, k * bits / 32] with float32 `scales` and `biases` [n, k / group]
// checked for an input `k` wide; returns `n`.
static int check_quantized(int k, const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  check_float32(scales, "quantized_matmul's scales");
  check_float32(biases, "quantized_matmul's biases");
  if (bits != 4 && bits != 8) throw std::invalid_argument("[mlxrt.native] quantized_matmul takes 4 or 8 bits");
  if (group_size != 32 && group_size != 64 && group_size != 128) throw std::invalid_argument("[mlxrt.native] quantized_matmul takes groups of 32, 64 or 128");
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument("[mlxrt.native] quantized_matmul: a 2-D uint32 weight");
  const int n = w.shape(0);
  if (k % group_size != 0 || static_cast<int64_t>(w.shape(1)) * 32 != static_cast<int64_t>(k) * bits || scales.ndim() != 2 || scales.shape(0) != n ||
      scales.shape(1) != k / group_size || biases.shape() != scales.shape()) {
    throw std::invalid_argument("[mlxrt.native] quantized_matmul: the input, weight, scales and biases do not match");
  }
  return n;
}

// `mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)` (affine mode) for
// float32 `x` [..., k] (`check_quantized`'s operands).
// `helped`: large products split their features with a helper thread (one more core).
// `bias_ratio`: 0, or a power of two the caller has found `biases` to be exactly `scales` times
// (`qmv_tile`: a lone row then takes the biases' term from the scales).
mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                           bool helped, float bias_ratio, mx::StreamOrDevice s) {
  check_float32(x, "quantized_matmul's input");
  check_bias_ratio(bias_ratio);
  if (x.ndim() < 1) throw std::invalid_argument("[mlxrt.native] quantized_matmul: an input of one or more dimensions");
  const int n = check_quantized(x.shape(-1), w, scales, biases, group_size, bits);
  auto stream = mx::to_stream(s);
  auto shape = x.shape();
  shape.back() = n;
  return mx::array(shape, mx::float32, std::make_shared<QuantizedMatmul>(stream, group_size, bits, helped, bias_ratio),
                   {x, w, scales, biases});
}
