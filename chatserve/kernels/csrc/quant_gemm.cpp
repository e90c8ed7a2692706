// Quantized matmul for CPUs with AVX512-BF16: y[m, n] = x[m, :] . W[n, :] (+ bias[n]) over weights kept
// in GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) or our weight-only int8 per output channel,
// repacked once at load into the layout below (issue #21).
//
// Why one rule makes this correct and batch-invariant for free: every weight is de-quantised in
// registers to EXACTLY the bf16 value the engine's de-quantising path uses (gguf's numpy
// `dequantize` in fp32, then round-to-nearest-even to bf16), and fed to vdpbf16ps in exactly the
// order of bf16_gemm.cpp's tile(): each output element is one fp32 chain over k pairs
// 0 .. K/2-1, then + bias, then bf16 RNE. So quant_linear(x) has the bits of
// bf16_gemm(x, bf16_gemm_pack(bf16(dequantize(raw)))) for every M, row position and thread split.
//
// Per format, the fp32 arithmetic mirrors numpy's and is exact where it says so (fp16 d has an 11-bit
// significand, so products with small integers fit fp32's 24 bits):
//   Q4_0  d * (q - 8)            computed as fma(q, d, -8d): q*d - 8d is exactly d*(q-8) (15 bits), exact
//   Q4_1  d * q + m              d*q exact (15 bits), so fma(q, d, m) rounds once, as numpy's add does
//   Q8_0  q * d                  exact (19 bits)
//   Q4_K  (d*sc) * q - dmin*mn   d*sc (17 bits), dmin*mn (17), (d*sc)*q (21) exact; fmsub rounds once, as the subtract
//   Q6_K  (d*sc) * (q - 32)      d*sc (<= 18 bits), times q-32 (<= 23 bits) exact
//   int8  scale * q              one rounding (fp32 scale), as the definition says
// then one vcvtne2ps2bf16 (RNE). No denormal arises (every nonzero weight is >= 2^-24 in magnitude).
//
// Packed layout: zmm columns of 16 outputs in groups of 4 (64 outputs; N is padded with zero weights),
// each group one contiguous stream [4 column headers][block 0 of its 4 columns][block 1 ...]... (blocks
// of the format along K; only int8 per channel has a header: 16 fp32 scales), and in each block the
// per-output scales first (16 values per scale kind: fp16 d as in the file, 6-bit/int8 sub-block scales
// as bytes) and then, per k pair p, the 16 outputs' (2p, 2p+1) weights:
//   4-bit (Q4_0, Q4_1, Q4_K): 16 bytes; byte l holds q[n_(l/2)][2p + l%2] in its low nibble and
//                             q[n_(8 + l/2)][2p + l%2] in its high nibble
//   8-bit (Q8_0, Q6_K as q-32, int8): 32 bytes; byte l < 16 holds q[n_(l/2)][2p + l%2], byte 16 + l
//                             holds q[n_(8 + l/2)][2p + l%2]
// so vpmovzxbd + vpermps against a float table [0..15] (4-bit; vpermps reads only an index's low 4
// bits, so it masks and converts in one instruction) or vpmovsxbd + vcvtdq2ps (8-bit), one fma or
// multiply per half with the lanes' scales and ONE
// vcvtne2ps2bf16(hi, lo) give exactly the [n0k0 n0k1 n1k0 ... n15k1] zmm that bf16_gemm reads: no
// permute per k pair. Q6_K is kept as int8 (8.6 bits a weight instead of 6.6): simpler, and a 4+2-bit
// split is left for later (see the notes of issue 21).
//
// Few rows (decode, up to 6): the weights are de-quantised in registers once per call and used for every row.
// Many rows (prefill): a cache block of columns is de-quantised into a thread-local bf16 buffer in
// the bf16_gemm register-tile layout and the same tile (a copy of bf16_gemm.cpp's) runs over all row
// blocks, so the de-quantisation is amortised over M.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q6_K = 14, QT_INT8_CHANNEL = 1000;
constexpr int kZmmCols = 16;     // outputs per zmm column
constexpr int kPairBf16 = 32;    // bf16 values per k pair of one zmm column (64 B)
constexpr int kMaxTileRows = 6;  // rows of a buffered register tile (24 accumulators at 4 columns)

// Up to this many rows (measured: 5-6 rows in registers beat the buffer by 1.3-1.9x; 8 rows in two
// 4-row tiles lost to it), weights are de-quantised in registers: register tiles of 4 zmm columns and up
// to QGEMM_TILE_ROWS rows (accumulators and the 4 columns' scales fill the 32 zmm registers; at 4 rows some
// scales live in L1 as memory operands of the fma), more
// rows as further row tiles over the same columns (their weights hot in L1, de-quantised again).
// Above, into the buffer (each weight once per call, then read from L2 by every row block).
#ifndef QGEMM_REG_ROWS
#define QGEMM_REG_ROWS 6
#endif
#ifndef QGEMM_TILE_ROWS
#define QGEMM_TILE_ROWS 6
#endif
// bytes ahead of the current sub-block that each column's stream prefetches
#ifndef QGEMM_PF_BYTES
#define QGEMM_PF_BYTES 8192
#endif
#ifndef QGEMM_ROW_BLOCK
#define QGEMM_ROW_BLOCK 96
#endif
#ifndef QGEMM_COL_BLOCK_BYTES
#define QGEMM_COL_BLOCK_BYTES (448 * 1024)
#endif
#ifndef QGEMM_SPLIT_ROWS_MIN
#define QGEMM_SPLIT_ROWS_MIN 64
#endif
#ifndef QGEMM_SPLIT_COLS_MIN
#define QGEMM_SPLIT_COLS_MIN 32
#endif

typedef int32_t __attribute__((may_alias, aligned(2))) pair_t;  // two adjacent bf16 of x

// The prefetch distance, settable for measurement (scripts/bench_quant.py --prefetch): cold weights
// stream at the memory's latency-bound rate unless enough bytes are in flight.
int64_t g_pf_bytes = QGEMM_PF_BYTES;

// ---- formats: where the scales and quants of a block lie, and the fp32 arithmetic of a weight ----

__attribute__((always_inline)) inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((always_inline)) inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
__attribute__((always_inline)) inline __m512 s8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Each format: kBlockK values per block along K, kSubs sub-blocks of kSubPairs k pairs (one scale
// each), kHeader bytes at the start of a column, kBlockBytes per block and column, kRawBytes per
// GGUF block (0: not a GGUF type), kNibbles (4-bit) or 8-bit quants; scales() gives the 16 outputs'
// S (and B) of a sub-block, weight() the fp32 weights from the float quants.
struct FQ4_0 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubPairs = 16;
  static constexpr int64_t kHeader = 0, kBlockBytes = 32 + 256, kRawBytes = 18;
  static constexpr bool kNibbles = true;
  static __attribute__((always_inline)) inline void scales(const uint8_t*, const uint8_t* blk, int, __m512& s, __m512& b) {
    s = half16(blk);
    b = _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int) { return blk + 32; }
  static __attribute__((always_inline)) inline __m512 weight(__m512 q, __m512 s, __m512 b) { return _mm512_fmadd_ps(q, s, b); }
};

struct FQ4_1 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubPairs = 16;
  static constexpr int64_t kHeader = 0, kBlockBytes = 64 + 256, kRawBytes = 20;
  static constexpr bool kNibbles = true;
  static __attribute__((always_inline)) inline void scales(const uint8_t*, const uint8_t* blk, int, __m512& s, __m512& b) {
    s = half16(blk);
    b = half16(blk + 32);
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int) { return blk + 64; }
  static __attribute__((always_inline)) inline __m512 weight(__m512 q, __m512 s, __m512 b) { return _mm512_fmadd_ps(q, s, b); }
};

struct FQ8_0 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubPairs = 16;
  static constexpr int64_t kHeader = 0, kBlockBytes = 32 + 512, kRawBytes = 34;
  static constexpr bool kNibbles = false;
  static __attribute__((always_inline)) inline void scales(const uint8_t*, const uint8_t* blk, int, __m512& s, __m512& b) {
    s = half16(blk);
    b = _mm512_setzero_ps();
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int) { return blk + 32; }
  static __attribute__((always_inline)) inline __m512 weight(__m512 q, __m512 s, __m512) { return _mm512_mul_ps(q, s); }
};

// block: d [16 fp16], dmin [16 fp16], sc [8 sub][16 u8], mn [8 sub][16 u8], quants [8 sub][16 pairs][16 B]
struct FQ4_K {
  static constexpr int kBlockK = 256, kSubs = 8, kSubPairs = 16;
  static constexpr int64_t kHeader = 0, kBlockBytes = 64 + 256 + 8 * 256, kRawBytes = 144;
  static constexpr bool kNibbles = true;
  static __attribute__((always_inline)) inline void scales(const uint8_t*, const uint8_t* blk, int sub, __m512& s, __m512& b) {
    s = _mm512_mul_ps(half16(blk), u8x16(blk + 64 + 16 * sub));
    b = _mm512_mul_ps(half16(blk + 32), u8x16(blk + 192 + 16 * sub));
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int sub) { return blk + 320 + 256 * sub; }
  static __attribute__((always_inline)) inline __m512 weight(__m512 q, __m512 s, __m512 b) { return _mm512_fmsub_ps(q, s, b); }
};

// block: d [16 fp16], sc [16 sub][16 i8], quants (q - 32 as int8) [16 sub][8 pairs][32 B]
struct FQ6_K {
  static constexpr int kBlockK = 256, kSubs = 16, kSubPairs = 8;
  static constexpr int64_t kHeader = 0, kBlockBytes = 32 + 256 + 16 * 256, kRawBytes = 210;
  static constexpr bool kNibbles = false;
  static __attribute__((always_inline)) inline void scales(const uint8_t*, const uint8_t* blk, int sub, __m512& s, __m512& b) {
    s = _mm512_mul_ps(half16(blk), s8x16(blk + 32 + 16 * sub));
    b = _mm512_setzero_ps();
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int sub) { return blk + 288 + 256 * sub; }
  static __attribute__((always_inline)) inline __m512 weight(__m512 q, __m512 s, __m512) { return _mm512_mul_ps(q, s); }
};

// column header: 16 fp32 scales; blocks of 32 values are only the loop's unit (no scales in them)
struct FInt8 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubPairs = 16;
  static constexpr int64_t kHeader = 64, kBlockBytes = 512, kRawBytes = 0;
  static constexpr bool kNibbles = false;
  static __attribute__((always_inline)) inline void scales(const uint8_t* col, const uint8_t*, int, __m512& s, __m512& b) {
    s = _mm512_loadu_ps(col);
    b = _mm512_setzero_ps();
  }
  static __attribute__((always_inline)) inline const uint8_t* quants(const uint8_t* blk, int) { return blk; }
  static __attribute__((always_inline)) inline __m512 weight(__m512 q, __m512 s, __m512) { return _mm512_mul_ps(q, s); }
};

template <class F>
constexpr int64_t pair_bytes() { return F::kNibbles ? 16 : 32; }

template <class F>
int64_t column_bytes(int64_t K) { return F::kHeader + (K / F::kBlockK) * F::kBlockBytes; }

// Columns lie in groups of 4 zmm columns (64 outputs), each group [4 headers][block 0 of its 4
// columns][block 1 of its 4 columns]...: a register tile of 4 columns reads ONE sequential stream and
// the next tile continues it (separate column streams started cold at every tile: 3x slower cold).
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

// The 16 outputs' values of a scale kind spread over the lanes of the low half (outputs 0-7, each
// twice: k even, k odd) and the high half (outputs 8-15).
struct Lanes {
  __m512 lo, hi;
};
__attribute__((always_inline)) inline Lanes spread(__m512 v) {
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_idx = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  return {_mm512_permutexvar_ps(lo_idx, v), _mm512_permutexvar_ps(hi_idx, v)};
}

struct SubScales {
  Lanes s, b;
};

template <class F>
__attribute__((always_inline)) inline SubScales sub_scales(const uint8_t* col, const uint8_t* blk, int sub) {
  __m512 s, b;
  F::scales(col, blk, sub, s, b);
  return {spread(s), spread(b)};
}

// The bf16 weights of k pair `q` (its quant bytes) of one zmm column: [n0k0 n0k1 n1k0 ... n15k1].
template <class F>
__attribute__((always_inline)) inline __m512bh decode(const uint8_t* q, const SubScales& sc) {
  __m512 lo, hi;
  if constexpr (F::kNibbles) {
    // vpermps reads only the low 4 bits of each index: one instruction masks and converts a nibble
    const __m512 table = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    lo = _mm512_permutexvar_ps(v, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  } else {
    lo = s8x16(q);
    hi = s8x16(q + 16);
  }
  return _mm512_cvtne2ps_pbh(F::weight(hi, sc.s.hi, sc.b.hi), F::weight(lo, sc.s.lo, sc.b.lo));
}

// De-quantise block bl of zmm column c into dst [Kp][32] bf16 (bf16_gemm's zmm-column layout).
template <class F>
__attribute__((always_inline)) inline void decode_block(const Layout<F>& L, int64_t c, int64_t bl, uint16_t* dst) {
  const uint8_t* col = L.header(c);
  const uint8_t* blk = L.block(c, bl);
  int64_t kp = bl * (F::kBlockK / 2);
  for (int sub = 0; sub < F::kSubs; ++sub) {
    const SubScales sc = sub_scales<F>(col, blk, sub);
    const uint8_t* q = F::quants(blk, sub);
    for (int pp = 0; pp < F::kSubPairs; ++pp, ++kp)
      _mm512_storeu_si512(dst + kp * kPairBf16, (__m512i)decode<F>(q + pp * pair_bytes<F>(), sc));
  }
}

// De-quantise k pairs of one zmm column into dst [Kp][32] bf16 (bf16_gemm's zmm-column layout).
template <class F>
void decode_column(const Layout<F>& L, int64_t c, int64_t K, uint16_t* dst) {
  const int64_t blocks = K / F::kBlockK;
  const uint8_t* col = L.header(c);
  int64_t kp = 0;
  for (int64_t bl = 0; bl < blocks; ++bl) {
    const uint8_t* blk = L.block(c, bl);
    for (int sub = 0; sub < F::kSubs; ++sub) {
      const SubScales sc = sub_scales<F>(col, blk, sub);
      const uint8_t* q = F::quants(blk, sub);
      for (int pp = 0; pp < F::kSubPairs; ++pp, ++kp)
        _mm512_storeu_si512(dst + kp * kPairBf16, (__m512i)decode<F>(q + pp * pair_bytes<F>(), sc));
    }
  }
}

struct QProblem {
  const uint16_t* x;  // [M, lda] rows
  int64_t lda;
  const uint8_t* w;   // packed columns
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

// + bias, bf16 RNE, masked store: bf16_gemm's epilogue
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

// Few rows: MR rows x NZ zmm columns over all of K, the weights de-quantised in registers once for
// all MR rows. Each accumulator is the same chain over k pairs 0 .. K/2-1 as bf16_gemm's tile().
template <class F, int MR, int NZ>
void reg_tile(const QProblem& p, int64_t m0, int64_t c0) {
  const Layout<F> L{p.w, p.group_bytes};
  const uint8_t* col[NZ];
#pragma GCC unroll 8
  for (int j = 0; j < NZ; ++j) col[j] = L.header(c0 + j);
  const uint16_t* xp[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) xp[m] = p.x + (m0 + m) * p.lda;
  __m512 acc[MR][NZ];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NZ; ++j) acc[m][j] = _mm512_setzero_ps();

  const int64_t blocks = p.K / F::kBlockK;
  constexpr int64_t sub_bytes = F::kSubPairs * pair_bytes<F>();
  const int64_t pf = g_pf_bytes;
  int64_t kp = 0;
  for (int64_t bl = 0; bl < blocks; ++bl) {
    for (int sub = 0; sub < F::kSubs; ++sub) {
      SubScales sc[NZ];
      const uint8_t* q[NZ];
#pragma GCC unroll 8
      for (int j = 0; j < NZ; ++j) {
        const uint8_t* blk = L.block(c0 + j, bl);
        sc[j] = sub_scales<F>(col[j], blk, sub);
        q[j] = F::quants(blk, sub);
#pragma GCC unroll 8
        for (int64_t o = 0; o < sub_bytes; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(q[j] + o + pf), _MM_HINT_T0);
      }
      for (int pp = 0; pp < F::kSubPairs; ++pp, ++kp) {
        __m512bh xb[MR];
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m)
          xb[m] = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const pair_t*>(xp[m] + 2 * kp));
#pragma GCC unroll 8
        for (int j = 0; j < NZ; ++j) {
          const __m512bh wv = decode<F>(q[j] + pp * pair_bytes<F>(), sc[j]);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv, xb[m]);
        }
      }
    }
  }
  store_tile<MR, NZ>(p, m0, c0, acc);
}

// Many rows: bf16_gemm.cpp's tile() (copied, not shared, so that file's build hash stays put) over
// de-quantised columns in a buffer: column j's k pair kp at w[j] + kp * 32.
template <int MR, int NZ>
void buf_tile(const QProblem& p, const uint16_t* const* w, int64_t m0, int64_t c0) {
  const int64_t kps = p.K / 2;
  const uint16_t* xp[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) xp[m] = p.x + (m0 + m) * p.lda;
  __m512 acc[MR][NZ];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NZ; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kps; ++kp) {
    __m512bh wv[NZ];
#pragma GCC unroll 8
    for (int j = 0; j < NZ; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + kp * kPairBf16);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const pair_t*>(xp[m] + 2 * kp));
#pragma GCC unroll 8
      for (int j = 0; j < NZ; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
    }
  }
  store_tile<MR, NZ>(p, m0, c0, acc);
}

template <class F>
using RegFn = void (*)(const QProblem&, int64_t, int64_t);
using BufFn = void (*)(const QProblem&, const uint16_t* const*, int64_t, int64_t);

template <class F, int MR>
RegFn<F> reg_fn_cols(int nz) {
  switch (nz) {
    case 1: return &reg_tile<F, MR, 1>;
    case 2: return &reg_tile<F, MR, 2>;
    case 3: return &reg_tile<F, MR, 3>;
    default: return &reg_tile<F, MR, 4>;
  }
}

template <class F>
RegFn<F> reg_fn(int mr, int nz) {
  static_assert(QGEMM_TILE_ROWS == 6, "register tiles are instantiated for 1-6 rows x 1-4 columns");
  TORCH_CHECK(mr >= 1 && mr <= QGEMM_TILE_ROWS && nz >= 1 && nz <= 4, "quant_gemm: no register tile of ", mr, " rows x ",
              nz, " columns");
  switch (mr) {
    case 1: return reg_fn_cols<F, 1>(nz);
    case 2: return reg_fn_cols<F, 2>(nz);
    case 3: return reg_fn_cols<F, 3>(nz);
    case 4: return reg_fn_cols<F, 4>(nz);
    case 5: return reg_fn_cols<F, 5>(nz);
    default: return reg_fn_cols<F, 6>(nz);
  }
}

#define QGEMM_TILE_CASE(MR, NZ) \
  case (MR) * 16 + (NZ):        \
    return &buf_tile<MR, NZ>;

BufFn buf_fn(int mr, int nz) {
  switch (mr * 16 + nz) {
    QGEMM_TILE_CASE(1, 1) QGEMM_TILE_CASE(1, 2) QGEMM_TILE_CASE(1, 3) QGEMM_TILE_CASE(1, 4)
    QGEMM_TILE_CASE(2, 1) QGEMM_TILE_CASE(2, 2) QGEMM_TILE_CASE(2, 3) QGEMM_TILE_CASE(2, 4)
    QGEMM_TILE_CASE(3, 1) QGEMM_TILE_CASE(3, 2) QGEMM_TILE_CASE(3, 3) QGEMM_TILE_CASE(3, 4)
    QGEMM_TILE_CASE(4, 1) QGEMM_TILE_CASE(4, 2) QGEMM_TILE_CASE(4, 3) QGEMM_TILE_CASE(4, 4)
    QGEMM_TILE_CASE(5, 1) QGEMM_TILE_CASE(5, 2) QGEMM_TILE_CASE(5, 3) QGEMM_TILE_CASE(5, 4)
    QGEMM_TILE_CASE(6, 1) QGEMM_TILE_CASE(6, 2) QGEMM_TILE_CASE(6, 3) QGEMM_TILE_CASE(6, 4)
    default: TORCH_CHECK(false, "quant_gemm: no buffered tile of ", mr, " rows x ", nz, " columns");
  }
}
#undef QGEMM_TILE_CASE

// Rows [r0, r1) x zmm columns [c0, c1). Only which elements are computed together depends on the
// sizes here, never how one is.
template <class F>
void run_block(const QProblem& p, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t rows_all = r1 - r0;
  if (rows_all <= QGEMM_REG_ROWS) {
    const int64_t tiles = (rows_all + QGEMM_TILE_ROWS - 1) / QGEMM_TILE_ROWS;
    const int64_t base = rows_all / tiles, extra = rows_all % tiles;  // rows spread evenly over the tiles
    for (int64_t c = c0; c < c1; c += 4) {
      const int nz = static_cast<int>(std::min<int64_t>(4, c1 - c));
      int64_t m = r0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int mr = static_cast<int>(base + (t < extra ? 1 : 0));
        reg_fn<F>(mr, nz)(p, m, c);
        m += mr;
      }
    }
    return;
  }
  const int64_t kps = p.K / 2;
  const int64_t zmm_bytes = kps * kPairBf16 * 2;
  const int64_t col_block = std::max<int64_t>(4, QGEMM_COL_BLOCK_BYTES / zmm_bytes / 4 * 4);
  std::vector<uint16_t> buf(static_cast<size_t>(std::min<int64_t>(col_block, c1 - c0) * kps * kPairBf16));
  for (int64_t cb = c0; cb < c1; cb += col_block) {
    const int64_t cb_end = std::min<int64_t>(c1, cb + col_block);
    // in memory order (block by block across a group's columns), prefetched ahead: one stream
    const Layout<F> L{p.w, p.group_bytes};
    const int64_t blocks = p.K / F::kBlockK;
    for (int64_t g0 = cb; g0 < cb_end; g0 += kGroupZmm) {
      const int64_t g1 = std::min<int64_t>(cb_end, g0 + kGroupZmm);
      for (int64_t bl = 0; bl < blocks; ++bl)
        for (int64_t c = g0; c < g1; ++c) {
          const uint8_t* blk = L.block(c, bl);
          for (int64_t o = 0; o < F::kBlockBytes; o += 64)
            _mm_prefetch(reinterpret_cast<const char*>(blk + o + g_pf_bytes), _MM_HINT_T0);
          decode_block<F>(L, c, bl, buf.data() + (c - cb) * kps * kPairBf16);
        }
    }
    for (int64_t mb = r0; mb < r1; mb += QGEMM_ROW_BLOCK) {
      const int64_t rows = std::min<int64_t>(QGEMM_ROW_BLOCK, r1 - mb);
      const int64_t tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
      const int64_t base = rows / tiles, extra = rows % tiles;
      for (int64_t c = cb; c < cb_end; c += 4) {
        const int nz = static_cast<int>(std::min<int64_t>(4, cb_end - c));
        const uint16_t* w[4];
        for (int j = 0; j < nz; ++j) w[j] = buf.data() + (c - cb + j) * kps * kPairBf16;
        int64_t m = mb;
        for (int64_t t = 0; t < tiles; ++t) {
          const int mr = static_cast<int>(base + (t < extra ? 1 : 0));
          buf_fn(mr, nz)(p, w, m, c);
          m += mr;
        }
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

// where the quant of output i (0-15 in the column) at k pair pp, element e (0/1) of a sub-block goes
inline void put_nibble(uint8_t* q, int i, int pp, int e, uint8_t v) {
  q[pp * 16 + (i % 8) * 2 + e] |= static_cast<uint8_t>((v & 0xF) << (i >= 8 ? 4 : 0));
}
inline void put_byte(uint8_t* q, int i, int pp, int e, int8_t v) {
  q[pp * 32 + (i >= 8 ? 16 : 0) + (i % 8) * 2 + e] = static_cast<uint8_t>(v);
}

// raw: one GGUF block of output i; blk: the column's packed block (zeroed before the first output)
void repack_q4_0(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  for (int k = 0; k < 32; ++k) {
    const uint8_t v = k < 16 ? (raw[2 + k] & 0xF) : (raw[2 + k - 16] >> 4);
    put_nibble(blk + 32, i, k / 2, k % 2, v);
  }
}
void repack_q4_1(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  std::memcpy(blk + 32 + 2 * i, raw + 2, 2);
  for (int k = 0; k < 32; ++k) {
    const uint8_t v = k < 16 ? (raw[4 + k] & 0xF) : (raw[4 + k - 16] >> 4);
    put_nibble(blk + 64, i, k / 2, k % 2, v);
  }
}
void repack_q8_0(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  for (int k = 0; k < 32; ++k) put_byte(blk + 32, i, k / 2, k % 2, static_cast<int8_t>(raw[2 + k]));
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
    const uint8_t v = (j % 2) ? (byte >> 4) : (byte & 0xF);
    put_nibble(blk + 320 + 256 * j, i, l / 2, l % 2, v);
  }
}
// gguf Q6_K: ql [128], qh [64], scales [16 int8], d (fp16). Value k: chunk t = k / 32, l = k % 32;
// low 4 bits: ql[(t / 4) * 64 + (t % 2) * 32 + l] nibble (t / 2) % 2; high 2 bits: qh[(t / 4) * 32 + l]
// >> 2 (t % 4); q - 32 in int8. Sub-block of 16 values: k / 16.
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
    const int sub = k / 16, kk = k % 16;
    put_byte(blk + 288 + 256 * sub, i, kk / 2, kk % 2, static_cast<int8_t>((lo | (hi << 4)) - 32));
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
      std::memset(dst + g * gb, 0, gb);  // padding outputs: zero scales and quants, weight 0 (never stored)
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
              put_byte(const_cast<uint8_t*>(L.block(c, bl)), i, k / 2, k % 2, src[n * K + bl * 32 + k]);
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
  QProblem p{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M == 1 ? K : x.stride(0),
             packed.data_ptr<uint8_t>(), group_bytes, K, bp, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N};
  const int64_t C = zmm_columns(N);
  int64_t threads = at::get_num_threads();
  if (M * N * K < (int64_t(1) << 18)) threads = 1;
  const bool split_rows = M >= QGEMM_SPLIT_ROWS_MIN && C < QGEMM_SPLIT_COLS_MIN * threads;
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, split_rows ? M : zmm_groups(N)));
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

// The whole bf16 [N, K] matrix the packed weight stands for (the values the matmul multiplies).
torch::Tensor quant_dequantize(torch::Tensor packed, int64_t qtype, int64_t N, int64_t K) {
  check_packed(packed, qtype, N, K, "quant dequantize");
  auto out = torch::empty({N, K}, torch::dtype(torch::kBFloat16));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  dispatch(qtype, [&](auto f) {
    using F = decltype(f);
    const Layout<F> L{src, kGroupZmm * column_bytes<F>(K)};
    const int64_t kps = K / 2;
    at::parallel_for(0, zmm_columns(N), 1, [&](int64_t c0, int64_t c1) {
      std::vector<uint16_t> buf(static_cast<size_t>(kps * kPairBf16));
      for (int64_t c = c0; c < c1; ++c) {
        decode_column<F>(L, c, K, buf.data());
        for (int i = 0; i < kZmmCols && c * kZmmCols + i < N; ++i) {
          uint32_t* row = reinterpret_cast<uint32_t*>(dst + (c * kZmmCols + i) * K);
          const uint32_t* pairs = reinterpret_cast<const uint32_t*>(buf.data());
          for (int64_t kp = 0; kp < kps; ++kp) row[kp] = pairs[kp * kZmmCols + i];
        }
      }
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
    const int64_t kps = K / 2;
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<uint16_t> buf(static_cast<size_t>(kps * kPairBf16));
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t c = idp[t] / kZmmCols, i = idp[t] % kZmmCols;
        decode_column<F>(L, c, K, buf.data());
        uint32_t* row = reinterpret_cast<uint32_t*>(dst + t * K);
        const uint32_t* pairs = reinterpret_cast<const uint32_t*>(buf.data());
        for (int64_t kp = 0; kp < kps; ++kp) row[kp] = pairs[kp * kZmmCols + i];
      }
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
