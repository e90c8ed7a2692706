// Quantized matmul for CPUs with AVX512-VNNI: y[m, n] = x[m, :] . W[n, :] (+ bias[n]) over weights kept
// in GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) or our weight-only int8 per output channel,
// repacked once at load into the layout below (issue #21).
//
// Why int8 activations and vpdpbusd, not de-quantising to bf16 for vdpbf16ps: decoding one stream is
// one pass over the weights, and de-quantising each weight to bf16 in registers costs ~9 vector
// instructions per 32 weights (load, widen, 2 table lookups, shift, 2 fma, convert, dot): measured,
// that kernel ran at ~21 GB/s of Q4_1 weights on one core, compute-bound, below the memory's rate.
// Here each row of x is quantised once per call to int8 in blocks of 32 (as llama.cpp's Q8 does), and
// one vpdpbusd multiplies 16 outputs x 4 k of unsigned weight quants by 4 int8 activations: ~1.5
// instructions per 32 weights for the 4-bit formats, plus 4 per sub-block of 16 outputs for the scales.
// Measured in benchmarks/kernels/bench_quant.py (BENCHMARKS.md).
//
// The arithmetic, per output n and per sub-block j of the weight (32 values; 16 for Q6_K), in order
// over the sub-blocks, one fp32 accumulator per output:
//   weights   w = S[n,j] * u + B[n,j], u an unsigned integer quant (4 bits, 6 bits in a byte, or 8 bits)
//   x block   dx = max|x| / 127 over its 32 values, xq = round-to-nearest-even(x * 127 / max|x|) in [-127, 127]
//   integer   isum = sum u * xq (vpdpbusd, exact), xsum = sum xq
//   offset    formats whose B is an integer multiple of S (B = -o S: Q4_0 o = 8, Q8_0 and int8 o = 128,
//             Q6_K o = 32) subtract in integers: acc = fma(float(isum - o * xsum), S * dx, acc), so the
//             signed product is exact before any rounding; Q4_1 / Q4_K (a float minimum):
//             acc = fma(float(isum), S * dx, acc); acc = fma(B, dx * xsum, acc)
// then + bias, bf16 round-to-nearest-even. Nothing in an output's arithmetic depends on M, on the
// row's position in the batch, on the tile or on the thread split: the path is batch-invariant (the
// determinism requirement), and prefill and decode give the same bits for the same row.
// The weights S * u + B are exactly gguf's de-quantised values (quant_rows / quant_dequantize read
// them back exactly, rounded to bf16); the error against the fp32 product is the activations' int8
// rounding (tests/kernels/test_quant_gemm.py states and checks the tolerance).
//
// Packed layout: zmm columns of 16 outputs in groups of 4 (64 outputs; N is padded with zero weights),
// each group one contiguous stream [4 column headers][block 0 of its 4 columns][block 1 ...]... (blocks
// of the format along K; only int8 per channel has a header: 16 fp32 scales). In each block the
// per-output scales come first (16 values per scale kind: fp16 d as in the file, 6-bit/int8 sub-block
// scales as bytes), then per sub-block its quants in chunks of 64 bytes, lane i (bytes 4i..4i+3) for
// output i:
//   4-bit (Q4_0, Q4_1, Q4_K): a chunk holds 8 k: byte 4i+j = u[k0+j] | u[k0+4+j] << 4
//   8-bit (Q8_0 and int8 as q+128): a chunk holds 4 k: byte 4i+j = u[k0+j]
//   6-bit (Q6_K, u = q in 0..63, sub-blocks of 16): the low 4 bits as two 4-bit chunks, then one
//            64-byte plane of the high 2 bits: byte 4i+j holds those of k = j + 4g at bits 2g, 2g+1
//            (6.56 bits a weight, as in the file)
// so a chunk is one vpdpbusd per 4 k against a broadcast of 4 activation bytes (4-bit: after one
// and / shift-and-and; 6-bit: and the high bits shifted into place, or'ed in).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q6_K = 14, QT_INT8_CHANNEL = 1000;
constexpr int kZmmCols = 16;   // outputs per zmm column
constexpr int kChunk = 64;     // bytes of quants per vpdpbusd operand (16 outputs x 4 bytes)
constexpr int kXBlock = 32;    // activation values per int8 scale

#ifndef QGEMM_PF_BYTES
#define QGEMM_PF_BYTES 8192
#endif
#ifndef QGEMM_ROW_BLOCK
#define QGEMM_ROW_BLOCK 256
#endif
#ifndef QGEMM_SPLIT_ROWS_MIN
#define QGEMM_SPLIT_ROWS_MIN 64
#endif
#ifndef QGEMM_SPLIT_COLS_MIN
#define QGEMM_SPLIT_COLS_MIN 32
#endif

// The prefetch distance, settable for measurement (benchmarks/kernels/bench_quant.py --prefetch): cold weights
// stream at the memory's latency-bound rate unless enough bytes are in flight.
int64_t g_pf_bytes = QGEMM_PF_BYTES;

__attribute__((always_inline)) inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((always_inline)) inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
__attribute__((always_inline)) inline __m512 s8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// ---- formats: where the scales and quants of a block lie, and S, B of a sub-block ----
// Each format: kBlockK values per block along K, kSubs sub-blocks of kSubK values (one S, B each),
// kHeader bytes at the start of a column, kBlockBytes per block and column, kRawBytes per GGUF block
// (0: not a GGUF type), kNibbles (4-bit, or 6-bit with kHighBits) or 8-bit quants, kOffset o > 0 when B = -o * S (the integer
// path) or 0 when B is a float of its own; scales() gives the 16 outputs' S and B of a sub-block.
struct FQ4_0 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubK = 32, kOffset = 8;
  static constexpr int64_t kHeader = 0, kBlockBytes = 32 + 256, kRawBytes = 18;
  static constexpr bool kNibbles = true, kHighBits = false;
  static __attribute__((always_inline)) inline void scales(const uint8_t*, const uint8_t* blk, int, __m512& s, __m512& b) {
    s = half16(blk);
    b = _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int) { return blk + 32; }
};

struct FQ4_1 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubK = 32, kOffset = 0;
  static constexpr int64_t kHeader = 0, kBlockBytes = 64 + 256, kRawBytes = 20;
  static constexpr bool kNibbles = true, kHighBits = false;
  static __attribute__((always_inline)) inline void scales(const uint8_t*, const uint8_t* blk, int, __m512& s, __m512& b) {
    s = half16(blk);
    b = half16(blk + 32);
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int) { return blk + 64; }
};

struct FQ8_0 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubK = 32, kOffset = 128;
  static constexpr int64_t kHeader = 0, kBlockBytes = 32 + 512, kRawBytes = 34;
  static constexpr bool kNibbles = false, kHighBits = false;
  static __attribute__((always_inline)) inline void scales(const uint8_t*, const uint8_t* blk, int, __m512& s, __m512& b) {
    s = half16(blk);
    b = _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int) { return blk + 32; }
};

// block: d [16 fp16], dmin [16 fp16], sc [8 sub][16 u8], mn [8 sub][16 u8], quants [8 sub][4 chunks][64 B]
struct FQ4_K {
  static constexpr int kBlockK = 256, kSubs = 8, kSubK = 32, kOffset = 0;
  static constexpr int64_t kHeader = 0, kBlockBytes = 64 + 256 + 8 * 256, kRawBytes = 144;
  static constexpr bool kNibbles = true, kHighBits = false;
  static __attribute__((always_inline)) inline void scales(const uint8_t*, const uint8_t* blk, int sub, __m512& s, __m512& b) {
    s = _mm512_mul_ps(half16(blk), u8x16(blk + 64 + 16 * sub));
    // gguf: (d * sc) * q - dmin * m; B = -(dmin * m) (exact: 11 + 6 bits)
    b = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(half16(blk + 32), u8x16(blk + 192 + 16 * sub)));
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int sub) { return blk + 320 + 256 * sub; }
};

// block: d [16 fp16], sc [16 sub][16 i8], quants (q in 0..63) [16 sub][2 low-4-bit chunks + 1 high-2-bit plane][64 B]
struct FQ6_K {
  static constexpr int kBlockK = 256, kSubs = 16, kSubK = 16, kOffset = 32;
  static constexpr int64_t kHeader = 0, kBlockBytes = 32 + 256 + 16 * 192, kRawBytes = 210;
  static constexpr bool kNibbles = true, kHighBits = true;
  static __attribute__((always_inline)) inline void scales(const uint8_t*, const uint8_t* blk, int sub, __m512& s, __m512& b) {
    s = _mm512_mul_ps(half16(blk), s8x16(blk + 32 + 16 * sub));
    b = _mm512_mul_ps(s, _mm512_set1_ps(-32.0f));
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int sub) { return blk + 288 + 192 * sub; }
};

// column header: 16 fp32 scales; blocks of 32 values (q + 128 as bytes) carry no scales
struct FInt8 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubK = 32, kOffset = 128;
  static constexpr int64_t kHeader = 64, kBlockBytes = 512, kRawBytes = 0;
  static constexpr bool kNibbles = false, kHighBits = false;
  static __attribute__((always_inline)) inline void scales(const uint8_t* col, const uint8_t*, int, __m512& s, __m512& b) {
    s = _mm512_loadu_ps(col);
    b = _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int) { return blk; }
};

template <class F>
constexpr int sub_chunks() { return F::kSubK / (F::kNibbles ? 8 : 4); }

template <class F>
int64_t column_bytes(int64_t K) { return F::kHeader + (K / F::kBlockK) * F::kBlockBytes; }

// Columns lie in groups of 4 zmm columns (64 outputs), each group [4 headers][block 0 of its 4
// columns][block 1 of its 4 columns]...: a tile of 4 columns reads ONE sequential stream and the
// next tile continues it (separate column streams started cold at every tile: 3x slower cold).
constexpr int kGroupZmm = 4;

template <class F>
struct Layout {
  const uint8_t* w;
  int64_t group_bytes;  // 4 * column_bytes
  const uint8_t* header(int64_t c) const { return w + (c / kGroupZmm) * group_bytes + (c % kGroupZmm) * F::kHeader; }
  const uint8_t* block(int64_t c, int64_t bl) const {
    return w + (c / kGroupZmm) * group_bytes + kGroupZmm * F::kHeader + (bl * kGroupZmm + c % kGroupZmm) * F::kBlockBytes;
  }
};

// A call with the format as a type: fn(FQ4_0{}) etc.
template <class Fn>
auto dispatch(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case QT_Q4_0: return fn(FQ4_0{});
    case QT_Q4_1: return fn(FQ4_1{});
    case QT_Q8_0: return fn(FQ8_0{});
    case QT_Q4_K: return fn(FQ4_K{});
    case QT_Q6_K: return fn(FQ6_K{});
    case QT_INT8_CHANNEL: return fn(FInt8{});
    default: TORCH_CHECK(false, "qtype ", qtype, " is not supported (supported: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, "
                         "Q6_K = 14, int8 per channel = 1000)");
  }
}

// u of output i (0-15 in its column) at k (within the sub-block) from a sub-block's quants
template <class F>
inline int quant_at(const uint8_t* q, int i, int k) {
  if constexpr (F::kNibbles) {
    const uint8_t byte = q[(k / 8) * kChunk + 4 * i + (k % 8) % 4];
    const int low = (k % 8) < 4 ? (byte & 0xF) : (byte >> 4);
    if constexpr (F::kHighBits) return low | (((q[sub_chunks<F>() * kChunk + 4 * i + k % 4] >> (2 * (k / 4))) & 3) << 4);
    return low;
  } else {
    return q[(k / 4) * kChunk + 4 * i + k % 4];
  }
}

// The weights of output i (0-15) of zmm column c, de-quantised: dst [K] bf16, exactly bf16(S * u + B)
// (one fma, rounded once: gguf's value; see the formats' notes).
template <class F>
void decode_output(const Layout<F>& L, int64_t c, int i, int64_t K, uint16_t* dst) {
  const uint8_t* col = L.header(c);
  alignas(64) float s[16], b[16];
  alignas(64) float u[16];
  for (int64_t bl = 0; bl < K / F::kBlockK; ++bl) {
    const uint8_t* blk = L.block(c, bl);
    for (int sub = 0; sub < F::kSubs; ++sub) {
      __m512 sv, bv;
      F::scales(col, blk, sub, sv, bv);
      _mm512_store_ps(s, sv);
      _mm512_store_ps(b, bv);
      const uint8_t* q = F::quants(blk, sub);
      for (int k0 = 0; k0 < F::kSubK; k0 += 16) {
        for (int t = 0; t < 16; ++t) u[t] = static_cast<float>(quant_at<F>(q, i, k0 + t));
        const __m512 w = _mm512_fmadd_ps(_mm512_load_ps(u), _mm512_set1_ps(s[i]), _mm512_set1_ps(b[i]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + bl * F::kBlockK + sub * F::kSubK + k0), (__m256i)_mm512_cvtneps_pbh(w));
      }
    }
  }
}

// ---- activations: rows of x quantised to int8 in blocks of 32 ----

struct XQuant {
  std::vector<int8_t> q;     // [M][K]
  std::vector<float> dx;     // [M][K / 32]
  std::vector<int32_t> s16;  // [M][K / 16]: sum of q over 16 values
  int64_t K = 0;
  const int8_t* row(int64_t m) const { return q.data() + m * K; }
  float scale(int64_t m, int64_t k) const { return dx[m * (K / kXBlock) + k / kXBlock]; }
  // sum of q over the kSubK values from k
  int32_t sum(int64_t m, int64_t k, int n) const {
    const int32_t* s = s16.data() + m * (K / 16) + k / 16;
    return n == 16 ? s[0] : s[0] + s[1];
  }
};

// bf16 row -> int8 blocks of 32: dx = max|x| / 127 (fp32), q = rne(x * (127 / max|x|)); all-zero: 0
void quantize_row(const uint16_t* x, int64_t K, int8_t* q, float* dx, int32_t* s16) {
  const __m512 c127 = _mm512_set1_ps(127.0f);
  for (int64_t b = 0; b < K / kXBlock; ++b) {
    const __m256i raw0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * kXBlock));
    const __m256i raw1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + b * kXBlock + 16));
    const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw0), 16));
    const __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw1), 16));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
    float d = 0.0f;
    if (amax > 0.0f) {
      d = amax / 127.0f;
      const __m512 id = _mm512_div_ps(c127, _mm512_set1_ps(amax));
      q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      // |x| * 127 / amax <= 127 up to one rounding: clamp so that no value escapes the int8 range
      q0 = _mm512_max_epi32(_mm512_min_epi32(q0, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      q1 = _mm512_max_epi32(_mm512_min_epi32(q1, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kXBlock), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kXBlock + 16), _mm512_cvtepi32_epi8(q1));
    dx[b] = d;
    s16[2 * b] = _mm512_reduce_add_epi32(q0);
    s16[2 * b + 1] = _mm512_reduce_add_epi32(q1);
  }
}

void quantize_rows(const uint16_t* x, int64_t lda, int64_t M, int64_t K, bool parallel, XQuant& out) {
  out.K = K;
  out.q.resize(static_cast<size_t>(M * K));
  out.dx.resize(static_cast<size_t>(M * (K / kXBlock)));
  out.s16.resize(static_cast<size_t>(M * (K / 16)));
  auto body = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * lda, K, out.q.data() + m * K, out.dx.data() + m * (K / kXBlock), out.s16.data() + m * (K / 16));
  };
  if (parallel) at::parallel_for(0, M, 16, body);
  else body(0, M);
}

struct QProblem {
  const XQuant* xq;
  const uint8_t* w;     // packed columns
  int64_t group_bytes;  // bytes per group of 4 zmm columns
  int64_t K;
  const uint16_t* bias;  // [N] or nullptr
  uint16_t* y;           // [M, N]
  int64_t n;
};

__attribute__((always_inline)) inline __mmask16 column_mask(int64_t first, int64_t n) {
  const int64_t left = n - first;
  return left >= kZmmCols ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

// + bias, bf16 RNE, masked store
template <int MR, int NZ>
__attribute__((always_inline)) inline void store_tile(const QProblem& p, int64_t m0, int64_t c0, __m512 (&acc)[MR][NZ]) {
#pragma GCC unroll 8
  for (int j = 0; j < NZ; ++j) {
    const int64_t n0 = (c0 + j) * kZmmCols;
    const __mmask16 mask = column_mask(n0, p.n);
    __m512 b = _mm512_setzero_ps();
    if (p.bias != nullptr) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, p.bias + n0);
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 v = p.bias != nullptr ? _mm512_add_ps(acc[m][j], b) : acc[m][j];
      _mm256_mask_storeu_epi16(p.y + (m0 + m) * p.n + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// the plane's 2-bit group g (bits 2g, 2g+1 of each byte) moved to bits 4-5 (the caller masks)
__attribute__((always_inline)) inline __m512i high_bits(__m512i h, int g) {
  switch (g) {
    case 0: return _mm512_slli_epi16(h, 4);
    case 1: return _mm512_slli_epi16(h, 2);
    case 2: return h;
    default: return _mm512_srli_epi16(h, 2);
  }
}

__attribute__((always_inline)) inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MR rows x NZ zmm columns over all of K: each chunk of weight quants is loaded (and its nibbles
// split) once for the MR rows. The per-output arithmetic is the header's, whatever MR and NZ are.
template <class F, int MR, int NZ>
void tile(const QProblem& p, int64_t m0, int64_t c0) {
  const Layout<F> L{p.w, p.group_bytes};
  const XQuant& X = *p.xq;
  const uint8_t* col[NZ];
#pragma GCC unroll 8
  for (int j = 0; j < NZ; ++j) col[j] = L.header(c0 + j);
  const int8_t* xr[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) xr[m] = X.row(m0 + m);
  __m512 acc[MR][NZ];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NZ; ++j) acc[m][j] = _mm512_setzero_ps();

  const int64_t blocks = p.K / F::kBlockK;
  constexpr int chunks = sub_chunks<F>();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i bits45 = _mm512_set1_epi8(0x30);
  const int64_t pf = g_pf_bytes;
  for (int64_t bl = 0; bl < blocks; ++bl) {
    const uint8_t* blk[NZ];
#pragma GCC unroll 8
    for (int j = 0; j < NZ; ++j) blk[j] = L.block(c0 + j, bl);
    for (int sub = 0; sub < F::kSubs; ++sub) {
      const int64_t k0 = bl * F::kBlockK + sub * F::kSubK;
      const uint8_t* q[NZ];
#pragma GCC unroll 8
      for (int j = 0; j < NZ; ++j) {
        q[j] = F::quants(blk[j], sub);
#pragma GCC unroll 8
        for (int o = 0; o < (chunks + (F::kHighBits ? 1 : 0)) * kChunk; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(q[j] + o + pf), _MM_HINT_T0);
      }
      __m512i isum[MR][NZ];
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
        for (int j = 0; j < NZ; ++j) isum[m][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < chunks; ++c) {
        if constexpr (F::kNibbles) {
          __m512i lo[NZ], hi[NZ];
#pragma GCC unroll 8
          for (int j = 0; j < NZ; ++j) {
            const __m512i v = _mm512_loadu_si512(q[j] + c * kChunk);
            lo[j] = _mm512_and_si512(v, low4);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            if constexpr (F::kHighBits) {  // bits 4-5 from the plane: groups 2c (k 8c..8c+3) and 2c+1
              const __m512i h = _mm512_loadu_si512(q[j] + chunks * kChunk);
              lo[j] = _mm512_or_si512(lo[j], _mm512_and_si512(high_bits(h, 2 * c), bits45));
              hi[j] = _mm512_or_si512(hi[j], _mm512_and_si512(high_bits(h, 2 * c + 1), bits45));
            }
          }
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const __m512i xl = bcast4(xr[m] + k0 + 8 * c);
            const __m512i xh = bcast4(xr[m] + k0 + 8 * c + 4);
#pragma GCC unroll 8
            for (int j = 0; j < NZ; ++j) {
              isum[m][j] = _mm512_dpbusd_epi32(isum[m][j], lo[j], xl);
              isum[m][j] = _mm512_dpbusd_epi32(isum[m][j], hi[j], xh);
            }
          }
        } else {
          __m512i w[NZ];
#pragma GCC unroll 8
          for (int j = 0; j < NZ; ++j) w[j] = _mm512_loadu_si512(q[j] + c * kChunk);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const __m512i xb = bcast4(xr[m] + k0 + 4 * c);
#pragma GCC unroll 8
            for (int j = 0; j < NZ; ++j) isum[m][j] = _mm512_dpbusd_epi32(isum[m][j], w[j], xb);
          }
        }
      }
      __m512 s[NZ], b[NZ];
#pragma GCC unroll 8
      for (int j = 0; j < NZ; ++j) F::scales(col[j], blk[j], sub, s[j], b[j]);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const float dx = X.scale(m0 + m, k0);
        const int32_t xs = X.sum(m0 + m, k0, F::kSubK);
        const __m512 dxv = _mm512_set1_ps(dx);
        if constexpr (F::kOffset != 0) {
          const __m512i off = _mm512_set1_epi32(F::kOffset * xs);
#pragma GCC unroll 8
          for (int j = 0; j < NZ; ++j) {
            const __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[m][j], off));
            acc[m][j] = _mm512_fmadd_ps(t, _mm512_mul_ps(s[j], dxv), acc[m][j]);
          }
        } else {
          const __m512 xsv = _mm512_set1_ps(dx * static_cast<float>(xs));
#pragma GCC unroll 8
          for (int j = 0; j < NZ; ++j) {
            const __m512 t = _mm512_cvtepi32_ps(isum[m][j]);
            acc[m][j] = _mm512_fmadd_ps(t, _mm512_mul_ps(s[j], dxv), acc[m][j]);
            acc[m][j] = _mm512_fmadd_ps(b[j], xsv, acc[m][j]);
          }
        }
      }
    }
  }
  store_tile<MR, NZ>(p, m0, c0, acc);
}

template <class F>
using TileFn = void (*)(const QProblem&, int64_t, int64_t);

// Tiles: 1-2 rows x up to 4 columns (decode: one stream over a group), 3-4 rows x up to 2 columns
// (accumulators, integer sums and the split nibbles within the 32 zmm registers).
template <class F>
TileFn<F> tile_fn(int mr, int nz) {
  switch (mr * 8 + nz) {
    case 1 * 8 + 1: return &tile<F, 1, 1>;
    case 1 * 8 + 2: return &tile<F, 1, 2>;
    case 1 * 8 + 3: return &tile<F, 1, 3>;
    case 1 * 8 + 4: return &tile<F, 1, 4>;
    case 2 * 8 + 1: return &tile<F, 2, 1>;
    case 2 * 8 + 2: return &tile<F, 2, 2>;
    case 2 * 8 + 3: return &tile<F, 2, 3>;
    case 2 * 8 + 4: return &tile<F, 2, 4>;
    case 3 * 8 + 1: return &tile<F, 3, 1>;
    case 3 * 8 + 2: return &tile<F, 3, 2>;
    case 4 * 8 + 1: return &tile<F, 4, 1>;
    case 4 * 8 + 2: return &tile<F, 4, 2>;
    default: TORCH_CHECK(false, "quant_gemm: no tile of ", mr, " rows x ", nz, " columns");
  }
}

// Rows [r0, r1) x zmm columns [c0, c1). Which elements are computed together depends on the sizes
// here, never how one is.
template <class F>
void run_block(const QProblem& p, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t rows_all = r1 - r0;
  if (rows_all <= 2) {
    for (int64_t c = c0; c < c1; c += 4) tile_fn<F>(static_cast<int>(rows_all), static_cast<int>(std::min<int64_t>(4, c1 - c)))(p, r0, c);
    return;
  }
  // row blocks (their int8 rows stay in L2), then column pairs (their quants stay in L1/L2 while the
  // row tiles of the block pass over them)
  for (int64_t mb = r0; mb < r1; mb += QGEMM_ROW_BLOCK) {
    const int64_t rows = std::min<int64_t>(QGEMM_ROW_BLOCK, r1 - mb);
    const int64_t tiles = (rows + 3) / 4;
    const int64_t base = rows / tiles, extra = rows % tiles;  // rows spread evenly over the tiles
    for (int64_t c = c0; c < c1; c += 2) {
      const int nz = static_cast<int>(std::min<int64_t>(2, c1 - c));
      int64_t m = mb;
      for (int64_t t = 0; t < tiles; ++t) {
        const int mr = static_cast<int>(base + (t < extra ? 1 : 0));
        tile_fn<F>(mr, nz)(p, m, c);
        m += mr;
      }
    }
  }
}

int64_t zmm_columns(int64_t N) { return (N + kZmmCols - 1) / kZmmCols; }
int64_t zmm_groups(int64_t N) { return (zmm_columns(N) + kGroupZmm - 1) / kGroupZmm; }

template <class F>
void check_shape(int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(N >= 1, what, ": N must be >= 1, got ", N);
  TORCH_CHECK(K >= F::kBlockK && K % F::kBlockK == 0, what, ": K = ", K, " must be a positive multiple of the format's block (",
              F::kBlockK, " values)");
}

template <class F>
int64_t nbytes(int64_t N, int64_t K) {
  check_shape<F>(N, K, "quant packed_nbytes");
  return zmm_groups(N) * kGroupZmm * column_bytes<F>(K);
}

void check_packed(const torch::Tensor& packed, int64_t qtype, int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous(), what,
              ": packed must be the contiguous uint8 1-D tensor of quant pack, got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t want = dispatch(qtype, [&](auto f) { return nbytes<decltype(f)>(N, K); });
  TORCH_CHECK(packed.numel() == want, what, ": packed has ", packed.numel(), " bytes; qtype ", qtype, " with N = ", N,
              ", K = ", K, " packs into ", want);
}

torch::Tensor packed_out(c10::optional<torch::Tensor> out_opt, int64_t bytes, const char* what) {
  if (out_opt.has_value() && out_opt->defined()) {
    const torch::Tensor& out = *out_opt;
    TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 1 && out.numel() == bytes, what,
                ": out must be a contiguous uint8 tensor of ", bytes, " bytes, got ", out.scalar_type(), " ", out.sizes());
    return out;
  }
  return torch::empty({bytes}, torch::dtype(torch::kUInt8));
}

// ---- repacking GGUF blocks (one output row's block at a time) into a zmm column's block ----

// where the quant u of output i (0-15 in the column) at k (within its sub-block) goes
inline void put_nibble(uint8_t* q, int i, int k, uint8_t u) {
  q[(k / 8) * kChunk + 4 * i + (k % 8) % 4] |= static_cast<uint8_t>((u & 0xF) << ((k % 8) < 4 ? 0 : 4));
}
inline void put_byte(uint8_t* q, int i, int k, uint8_t u) { q[(k / 4) * kChunk + 4 * i + k % 4] = u; }

// raw: one GGUF block of output i; blk: the column's packed block (zeroed before the first output)
void repack_q4_0(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  for (int k = 0; k < 32; ++k) put_nibble(blk + 32, i, k, k < 16 ? (raw[2 + k] & 0xF) : (raw[2 + k - 16] >> 4));
}
void repack_q4_1(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  std::memcpy(blk + 32 + 2 * i, raw + 2, 2);
  for (int k = 0; k < 32; ++k) put_nibble(blk + 64, i, k, k < 16 ? (raw[4 + k] & 0xF) : (raw[4 + k - 16] >> 4));
}
void repack_q8_0(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  for (int k = 0; k < 32; ++k) put_byte(blk + 32, i, k, static_cast<uint8_t>(raw[2 + k] ^ 0x80));  // q + 128
}
// gguf Q4_K: d, dmin (fp16), 12 bytes of 6-bit scales/mins (gguf.quants.Q4_K.get_scale_min), 128 bytes:
// chunk c of 32 bytes holds sub-block 2c in its low nibbles and 2c + 1 in its high nibbles
void repack_q4_k(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  std::memcpy(blk + 32 + 2 * i, raw + 2, 2);
  const uint8_t* s = raw + 4;
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, mn;
    if (j < 4) {
      sc = s[j] & 0x3F;
      mn = s[4 + j] & 0x3F;
    } else {
      sc = static_cast<uint8_t>((s[8 + j - 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30));
      mn = static_cast<uint8_t>((s[8 + j - 4] >> 4) | ((s[4 + j - 4] >> 2) & 0x30));
    }
    blk[64 + 16 * j + i] = sc;
    blk[192 + 16 * j + i] = mn;
  }
  const uint8_t* qs = raw + 16;
  for (int k = 0; k < 256; ++k) {
    const int j = k / 32, l = k % 32;
    const uint8_t byte = qs[(j / 2) * 32 + l];
    put_nibble(blk + 320 + 256 * j, i, l, (j % 2) ? (byte >> 4) : (byte & 0xF));
  }
}
// gguf Q6_K: ql [128], qh [64], scales [16 int8], d (fp16). Value k: chunk t = k / 32, l = k % 32;
// low 4 bits: ql[(t / 4) * 64 + (t % 2) * 32 + l] nibble (t / 2) % 2; high 2 bits: qh[(t / 4) * 32 + l]
// >> 2 (t % 4); u = q in 0..63 (the weight is d * sc * (q - 32)), its low 4 bits as a nibble and its
// high 2 in the sub-block's plane. Sub-block of 16 values: k / 16.
void repack_q6_k(const uint8_t* raw, uint8_t* blk, int i) {
  const uint8_t* ql = raw;
  const uint8_t* qh = raw + 128;
  const uint8_t* sc = raw + 192;
  std::memcpy(blk + 2 * i, raw + 208, 2);
  for (int j = 0; j < 16; ++j) blk[32 + 16 * j + i] = sc[j];
  for (int k = 0; k < 256; ++k) {
    const int t = k / 32, l = k % 32;
    const uint8_t lb = ql[(t / 4) * 64 + (t % 2) * 32 + l];
    const int lo = ((t / 2) % 2) ? (lb >> 4) : (lb & 0xF);
    const int hi = (qh[(t / 4) * 32 + l] >> (2 * (t % 4))) & 3;
    uint8_t* q = blk + 288 + 192 * (k / 16);
    const int kk = k % 16;
    put_nibble(q, i, kk, static_cast<uint8_t>(lo));
    q[2 * kChunk + 4 * i + kk % 4] |= static_cast<uint8_t>(hi << (2 * (kk / 4)));
  }
}

template <class F>
void repack_block(const uint8_t* raw, uint8_t* blk, int i);
template <> void repack_block<FQ4_0>(const uint8_t* raw, uint8_t* blk, int i) { repack_q4_0(raw, blk, i); }
template <> void repack_block<FQ4_1>(const uint8_t* raw, uint8_t* blk, int i) { repack_q4_1(raw, blk, i); }
template <> void repack_block<FQ8_0>(const uint8_t* raw, uint8_t* blk, int i) { repack_q8_0(raw, blk, i); }
template <> void repack_block<FQ4_K>(const uint8_t* raw, uint8_t* blk, int i) { repack_q4_k(raw, blk, i); }
template <> void repack_block<FQ6_K>(const uint8_t* raw, uint8_t* blk, int i) { repack_q6_k(raw, blk, i); }
template <> void repack_block<FInt8>(const uint8_t*, uint8_t*, int) { TORCH_CHECK(false, "int8 per channel is packed by pack_int8"); }

template <class F>
void pack_gguf(const uint8_t* raw, int64_t row_bytes, int64_t N, int64_t K, uint8_t* dst) {
  const int64_t gb = kGroupZmm * column_bytes<F>(K), blocks = K / F::kBlockK;
  const Layout<F> L{dst, gb};
  at::parallel_for(0, zmm_groups(N), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      std::memset(dst + g * gb, 0, gb);  // padding outputs: zero scales, weight 0 (never stored)
      for (int64_t c = g * kGroupZmm; c < (g + 1) * kGroupZmm; ++c)
        for (int64_t bl = 0; bl < blocks; ++bl)
          for (int i = 0; i < kZmmCols; ++i) {
            const int64_t n = c * kZmmCols + i;
            if (n < N) repack_block<F>(raw + n * row_bytes + bl * F::kRawBytes, const_cast<uint8_t*>(L.block(c, bl)), i);
          }
    }
  });
}

}  // namespace
int64_t quant_packed_nbytes(int64_t qtype, int64_t N, int64_t K) {
  return dispatch(qtype, [&](auto f) { return nbytes<decltype(f)>(N, K); });
}

// raw: uint8 [N, row_bytes], the tensor's GGUF blocks exactly as in the file -> packed uint8 1-D
torch::Tensor quant_pack(torch::Tensor raw, int64_t qtype, int64_t N, int64_t K, c10::optional<torch::Tensor> out_opt) {
  TORCH_CHECK(qtype != QT_INT8_CHANNEL, "quant pack: int8 per channel weights are packed by pack_int8 (q, scale)");
  return dispatch(qtype, [&](auto f) {
    using F = decltype(f);
    check_shape<F>(N, K, "quant pack");
    const int64_t row_bytes = K / F::kBlockK * F::kRawBytes;
    TORCH_CHECK(raw.scalar_type() == at::kByte, "quant pack: raw must be uint8 GGUF blocks, got ", raw.scalar_type());
    TORCH_CHECK(raw.dim() == 2 && raw.size(0) == N && raw.size(1) == row_bytes, "quant pack: raw must be [N = ", N,
                ", row_bytes = ", row_bytes, "] for qtype ", qtype, " and K = ", K, ", got ", raw.sizes());
    raw = raw.contiguous();
    torch::Tensor out = packed_out(out_opt, nbytes<F>(N, K), "quant pack");
    pack_gguf<F>(raw.data_ptr<uint8_t>(), row_bytes, N, K, out.data_ptr<uint8_t>());
    return out;
  });
}

// q: int8 [N, K], scale: fp32 [N] -> packed uint8 1-D (qtype 1000: w = scale[n] * q[n, k], then bf16 RNE)
torch::Tensor quant_pack_int8(torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> out_opt) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2, "quant pack_int8: q must be int8 [N, K], got ", q.scalar_type(),
              " ", q.sizes());
  const int64_t N = q.size(0), K = q.size(1);
  check_shape<FInt8>(N, K, "quant pack_int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == N,
              "quant pack_int8: scale must be float32 [N = ", N, "], got ", scale.scalar_type(), " ", scale.sizes());
  q = q.contiguous();
  scale = scale.contiguous();
  torch::Tensor out = packed_out(out_opt, nbytes<FInt8>(N, K), "quant pack_int8");
  const int8_t* src = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t gb = kGroupZmm * column_bytes<FInt8>(K), blocks = K / 32;
  const Layout<FInt8> L{dst, gb};
  at::parallel_for(0, zmm_groups(N), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      std::memset(dst + g * gb, 0, gb);
      for (int64_t c = g * kGroupZmm; c < (g + 1) * kGroupZmm; ++c) {
        float* sc = reinterpret_cast<float*>(const_cast<uint8_t*>(L.header(c)));
        for (int i = 0; i < kZmmCols; ++i) {
          const int64_t n = c * kZmmCols + i;
          if (n >= N) continue;
          std::memcpy(sc + i, sp + n, 4);
          for (int64_t bl = 0; bl < blocks; ++bl)
            for (int k = 0; k < 32; ++k)
              put_byte(const_cast<uint8_t*>(L.block(c, bl)), i, k, static_cast<uint8_t>(src[n * K + bl * 32 + k] ^ 0x80));  // q + 128
        }
      }
    }
  });
  return out;
}

torch::Tensor quant_linear(torch::Tensor x, torch::Tensor packed, int64_t qtype, int64_t N, int64_t K,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "quant linear: x must be bf16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "quant linear: x must be 2-D [M, K], got ", x.dim(), " dimensions");
  TORCH_CHECK(x.size(1) == K, "quant linear: x has ", x.size(1), " columns; the weight has K = ", K);
  check_packed(packed, qtype, N, K, "quant linear");
  const int64_t M = x.size(0);
  TORCH_CHECK(M == 0 || x.stride(1) == 1, "quant linear: x must have unit stride along K, got strides ", x.strides());
  TORCH_CHECK(M <= 1 || x.stride(0) >= K, "quant linear: x rows overlap (row stride ", x.stride(0), " < K = ", K, ")");
  const uint16_t* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = *bias;
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.dim() == 1 && b.numel() == N, "quant linear: bias must be bf16 [", N,
                "], got ", b.scalar_type(), " ", b.sizes());
    b = b.contiguous();
    bp = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t group_bytes = dispatch(qtype, [&](auto f) { return kGroupZmm * column_bytes<decltype(f)>(K); });
  const int64_t C = zmm_columns(N);
  int64_t threads = at::get_num_threads();
  if (M * N * K < (int64_t(1) << 18)) threads = 1;
  const bool split_rows = M >= QGEMM_SPLIT_ROWS_MIN && C < QGEMM_SPLIT_COLS_MIN * threads;
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, split_rows ? M : zmm_groups(N)));
  // x quantised once for every tile and thread (a thread-local buffer: no allocation per decode call)
  thread_local XQuant xq;
  quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M == 1 ? K : x.stride(0), M, K,
                threads > 1 && M >= 64, xq);
  QProblem p{&xq, packed.data_ptr<uint8_t>(), group_bytes, K, bp, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N};
  dispatch(qtype, [&](auto f) {
    using F = decltype(f);
    if (threads == 1) {
      run_block<F>(p, 0, M, 0, C);
      return 0;
    }
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        if (split_rows) {
          run_block<F>(p, M * t / threads, M * (t + 1) / threads, 0, C);
        } else {
          const int64_t G = zmm_groups(N);  // whole groups per thread: each tile one stream
          run_block<F>(p, 0, M, std::min(C, kGroupZmm * (G * t / threads)), std::min(C, kGroupZmm * (G * (t + 1) / threads)));
        }
      }
    });
    return 0;
  });
  return y;
}

// The whole bf16 [N, K] matrix the packed weight stands for (gguf's de-quantised values, rounded to bf16).
torch::Tensor quant_dequantize(torch::Tensor packed, int64_t qtype, int64_t N, int64_t K) {
  check_packed(packed, qtype, N, K, "quant dequantize");
  auto out = torch::empty({N, K}, torch::dtype(torch::kBFloat16));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  dispatch(qtype, [&](auto f) {
    using F = decltype(f);
    const Layout<F> L{src, kGroupZmm * column_bytes<F>(K)};
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) decode_output<F>(L, n / kZmmCols, static_cast<int>(n % kZmmCols), K, dst + n * K);
    });
    return 0;
  });
  return out;
}

// Rows `ids` of the de-quantised matrix, bit for bit: a tied embedding looks tokens up in the
// lm_head's packed copy.
torch::Tensor quant_rows(torch::Tensor packed, int64_t qtype, torch::Tensor ids, int64_t N, int64_t K) {
  check_packed(packed, qtype, N, K, "quant rows");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "quant rows: ids must be int64 [T], got ", ids.scalar_type(),
              " ", ids.sizes());
  ids = ids.contiguous();
  const int64_t T = ids.size(0);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "quant rows: row id ", idp[t], " out of range for ", N, " rows");
  auto out = torch::empty({T, K}, torch::dtype(torch::kBFloat16));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  dispatch(qtype, [&](auto f) {
    using F = decltype(f);
    const Layout<F> L{src, kGroupZmm * column_bytes<F>(K)};
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        decode_output<F>(L, idp[t] / kZmmCols, static_cast<int>(idp[t] % kZmmCols), K, dst + t * K);
    });
    return 0;
  });
  return out;
}

// Sets the prefetch distance in bytes (0 keeps it); returns the one before.
int64_t quant_prefetch_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0 && bytes <= (int64_t(1) << 20), "quant prefetch bytes must be in [0, 1 MiB], got ", bytes);
  const int64_t before = g_pf_bytes;
  if (bytes > 0) g_pf_bytes = bytes;
  return before;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_prefetch_bytes", &quant_prefetch_bytes, "set (bytes > 0) and return the prefetch distance");
  m.def("quant_packed_nbytes", &quant_packed_nbytes, "bytes of the packed weight of qtype, N, K");
  m.def("quant_pack", &quant_pack, "GGUF blocks [N, row_bytes] -> packed", py::arg("raw"), py::arg("qtype"), py::arg("N"),
        py::arg("K"), py::arg("out") = py::none());
  m.def("quant_pack_int8", &quant_pack_int8, "int8 [N, K] + fp32 scale [N] -> packed", py::arg("q"), py::arg("scale"),
        py::arg("out") = py::none());
  m.def("quant_linear", &quant_linear, "x [M, K] bf16 . dequant(W)^T (+ bias) -> bf16 [M, N]", py::arg("x"),
        py::arg("packed"), py::arg("qtype"), py::arg("N"), py::arg("K"), py::arg("bias") = py::none());
  m.def("quant_dequantize", &quant_dequantize, "packed -> bf16 [N, K]");
  m.def("quant_rows", &quant_rows, "rows ids of the de-quantised matrix -> bf16 [T, K]");
}
