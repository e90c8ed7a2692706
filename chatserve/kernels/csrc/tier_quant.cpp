// Quantized matmul of every kernel tier (issues #21, #30): y[m, n] = x[m, :] . W[n, :] (+ bias[n]) over
// weights kept in GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) or our int8 per output channel,
// written once over csrc/vec.h and compiled per tier (AVX2 with vpmaddubsw, AVX2 + AVX-VNNI, AVX512 +
// VNNI, which also serves AVX512-BF16). The lane count, the register budget (16 ymm on AVX2) and the
// integer dot product come from the tier; nothing ISA-specific is in this file.
//
// The arithmetic, per output n and per sub-block j of the weight (32 values; 16 for Q6_K), in order
// over the sub-blocks, one fp32 accumulator per output (the same steps on every tier):
//   weights   w = S[n,j] * u + B[n,j], u the integer quant
//   x block   dx = max|x| / 127 over its 32 values, xq = round-to-nearest-even(x * 127 / max|x|) in [-127, 127]
//   integer   isum = sum u * xq (exact: vec.h's dpbusd runs, see below), xsum = sum xq
//   scales    B = -o S (Q4_0 o = 8, Q6_K o = 32): acc = fma(float(isum - o * xsum), S * dx, acc);
//             B a float minimum (Q4_1, Q4_K): acc = fma(float(isum), S * dx, acc); acc = fma(B, dx * xsum, acc);
//             8-bit (Q8_0, int8; u = q signed, B = 0): acc = fma(float(isum), S * dx, acc)
// then + bias, bf16 round-to-nearest-even. The integer isum is the same whatever the tier computes it
// with, and nothing in an output's arithmetic depends on M, the row's position, the tile or the thread
// split (batch-invariant). Every step above is per output and the integer and activation steps are
// exact, so the tiers should even agree bit for bit (tested per tier only: tiers.py promises no more).
//
// Exact integers on plain AVX2: vpmaddubsw sums each PAIR of u8 x s8 products into int16, saturating.
// 4-bit u <= 15 and |xq| <= 127: a pair is <= 3810, so a whole sub-block (8 steps of 4 k) stays in
// int16 lanes (16 products <= 30480) and is widened once (vec.h dot_run / dot_run_end); 6-bit u <= 63:
// runs of 2 steps (32004); 8-bit weights are kept signed and multiplied by the sign trick, |q| <= 128
// as the unsigned operand and sign(xq, q) as the signed one (a pair <= 32512): runs of 1 step.
// With vpdpbusd (VNNI tiers) every run is one int32 accumulation, and 8-bit weights are stored as
// u = q + 128 and multiplied directly, with B = -128 S subtracted in integers as Q4_0's offset
// (kQ8Offset: no abs and sign steps, ~1.7x the sign trick's rate on Zen 4); isum - 128 xsum is the
// same integer sum q xq, so the bits are the sign trick's.
// The weights S * u + B are exactly gguf's de-quantised values (quant_rows / quant_dequantize read them
// back, rounded to bf16, bit for bit); the error against the fp32 product is the activations' int8
// rounding (tests/kernels/test_quant_gemm.py states the tolerance).
//
// Packed layout (L = cs::kLanes outputs per column: 8 on AVX2, 16 on AVX512; N padded with zero weights
// to groups of 4 columns): each group is one contiguous stream [4 column headers][block 0 of its 4
// columns][block 1 ...]..., so a decode tile of a group reads one sequential stream. Only int8 per
// channel has a header (L fp32 scales). In each block the per-output scales come first (L values per
// scale kind: fp16 d / dmin as in the file, 6-bit / int8 sub-block scales as bytes), then per sub-block
// its quants in chunks of 4L bytes, bytes 4i..4i+3 for output i (one dot operand):
//   4-bit (Q4_0, Q4_1, Q4_K): a chunk holds 8 k: byte 4i+j = u[k0+j] | u[k0+4+j] << 4
//   8-bit (Q8_0 and int8): a chunk holds 4 k: byte 4i+j = q[k0+j] as a signed byte, or q + 128 on VNNI tiers
//   6-bit (Q6_K, u = q in 0..63, sub-blocks of 16): the low 4 bits as two 4-bit chunks, then one plane of
//            4L bytes with the high 2 bits: byte 4i+j holds those of k = j + 4g at bits 2g, 2g+1
// Every format keeps the file's bytes per weight (Q4_K spreads its 12 bytes of scales to 16).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

using cs::VF;
using cs::VI;

constexpr int64_t QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q6_K = 14, QT_INT8_CHANNEL = 1000;
constexpr int kCols = cs::kLanes;   // outputs per column: one fp32 accumulator vector
constexpr int kChunk = cs::kBytes;  // bytes of quants per dot operand (kCols outputs x 4 bytes)
constexpr int kXBlock = 32;         // activation values per int8 scale
constexpr int kGroup = 4;           // columns per group: one contiguous stream

#ifndef TQ_PF_BYTES
// 512, not 8192 (issue 57): on an AMD EPYC (Zen 4, 2 threads) a 1B model's Q4_0 sweep read
// 15.8 GiB/s on one thread at 8192 bytes ahead and 18.1-20.0 at 128-512 (25.2 -> 27.9 on two);
// end to end, 1B decode 38.3 -> 42.8 tok/s (medians of 5 alternated runs). The hardware prefetchers
// carry the stream; a far software prefetch only evicts lines the tile still has to read.
#define TQ_PF_BYTES 512
#endif
#ifndef TQ_ROW_BLOCK
#define TQ_ROW_BLOCK 256
#endif
#ifndef TQ_TILE_ROWS
#define TQ_TILE_ROWS 4  // prefill tile: rows x columns sharing each unpacked weight vector
#endif
#ifndef TQ_TILE_COLS
#define TQ_TILE_COLS 2
#endif
#ifndef TQ_SPLIT_ROWS_MIN
#define TQ_SPLIT_ROWS_MIN 64
#endif
#ifndef TQ_SPLIT_OUTPUTS_MIN
#define TQ_SPLIT_OUTPUTS_MIN 512  // outputs per thread below which many rows are split by rows
#endif
constexpr int kTileRows = TQ_TILE_ROWS, kTileCols = TQ_TILE_COLS;
static_assert(kTileRows >= 1 && kTileRows <= 8 && kTileCols >= 1 && kTileCols <= kGroup && kGroup % kTileCols == 0,
              "tiles: 1-8 rows, columns dividing a group");

// The prefetch distance, settable for measurement (quant_prefetch_bytes): cold weights stream at
// the memory's latency-bound rate unless enough bytes are in flight.
int64_t g_pf_bytes = TQ_PF_BYTES;

CS_INLINE VF f16s(const uint8_t* p) { return cs::load_f16(reinterpret_cast<const uint16_t*>(p)); }
CS_INLINE VF u8s(const uint8_t* p) { return cs::load_u8(p); }
CS_INLINE VF s8s(const uint8_t* p) { return cs::load_s8(reinterpret_cast<const int8_t*>(p)); }

// 8-bit quants are stored as q + kQ8Offset: 128 where the tier's dot product is a true vpdpbusd (no
// int16 pairs to saturate: 255 * 127 * 2 would), 0 (signed, the sign trick) on plain AVX2.
constexpr int kQ8Offset = cs::kDotRunWide ? 128 : 0;

// ---- formats: where the scales and quants of a block lie, and S, B of a sub-block ----
// Each format: kBlockK values per block along K, kSubs sub-blocks of kSubK values (one S, B each),
// kHeader bytes at the start of a column, kBlockBytes per block and column, kRawBytes per GGUF block
// (0: not a GGUF type), kBits of a quant (4, 6: nibble + plane, 8: signed byte), kOffset o > 0 when
// B = -o S (subtracted in integers), kMin when B is a float of its own, kRunSteps the dot steps an
// int16 run may take (the bound in the header); scales() gives the kCols outputs' S and B of a sub-block.
struct FQ4_0 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubK = 32, kBits = 4, kOffset = 8, kRunSteps = 8;
  static constexpr bool kMin = false;
  static constexpr int64_t kHeader = 0, kBlockBytes = 18 * kCols, kRawBytes = 18;
  static CS_INLINE void scales(const uint8_t*, const uint8_t* blk, int, VF& s, VF& b) {
    s = f16s(blk);
    b = cs::mul(s, cs::set1(-8.0f));
  }
  static CS_INLINE const uint8_t* quants(const uint8_t* blk, int) { return blk + 2 * kCols; }
};

struct FQ4_1 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubK = 32, kBits = 4, kOffset = 0, kRunSteps = 8;
  static constexpr bool kMin = true;
  static constexpr int64_t kHeader = 0, kBlockBytes = 20 * kCols, kRawBytes = 20;
  static CS_INLINE void scales(const uint8_t*, const uint8_t* blk, int, VF& s, VF& b) {
    s = f16s(blk);
    b = f16s(blk + 2 * kCols);
  }
  static CS_INLINE const uint8_t* quants(const uint8_t* blk, int) { return blk + 4 * kCols; }
};

struct FQ8_0 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubK = 32, kBits = 8, kOffset = kQ8Offset, kRunSteps = 1;
  static constexpr bool kMin = false;
  static constexpr int64_t kHeader = 0, kBlockBytes = 34 * kCols, kRawBytes = 34;
  static CS_INLINE void scales(const uint8_t*, const uint8_t* blk, int, VF& s, VF& b) {
    s = f16s(blk);
    b = cs::zero();
  }
  static CS_INLINE const uint8_t* quants(const uint8_t* blk, int) { return blk + 2 * kCols; }
};

// block: d [L fp16], dmin [L fp16], sc [8 sub][L u8], mn [8 sub][L u8], quants [8 sub][4 chunks][4L B]
struct FQ4_K {
  static constexpr int kBlockK = 256, kSubs = 8, kSubK = 32, kBits = 4, kOffset = 0, kRunSteps = 8;
  static constexpr bool kMin = true;
  static constexpr int64_t kHeader = 0, kBlockBytes = 148 * kCols, kRawBytes = 144;
  static CS_INLINE void scales(const uint8_t*, const uint8_t* blk, int sub, VF& s, VF& b) {
    s = cs::mul(f16s(blk), u8s(blk + 4 * kCols + kCols * sub));
    // gguf: (d * sc) * q - dmin * m; B = -(dmin * m) (exact: 11 + 6 bits)
    b = cs::sub(cs::zero(), cs::mul(f16s(blk + 2 * kCols), u8s(blk + 12 * kCols + kCols * sub)));
  }
  static CS_INLINE const uint8_t* quants(const uint8_t* blk, int sub) { return blk + 20 * kCols + 16 * kCols * sub; }
};

// block: d [L fp16], sc [16 sub][L i8], quants (q in 0..63) [16 sub][2 low-4-bit chunks + 1 high-2-bit plane][4L B]
struct FQ6_K {
  static constexpr int kBlockK = 256, kSubs = 16, kSubK = 16, kBits = 6, kOffset = 32, kRunSteps = 2;
  static constexpr bool kMin = false;
  static constexpr int64_t kHeader = 0, kBlockBytes = 210 * kCols, kRawBytes = 210;
  static CS_INLINE void scales(const uint8_t*, const uint8_t* blk, int sub, VF& s, VF& b) {
    s = cs::mul(f16s(blk), s8s(blk + 2 * kCols + kCols * sub));
    b = cs::mul(s, cs::set1(-32.0f));
  }
  static CS_INLINE const uint8_t* quants(const uint8_t* blk, int sub) { return blk + 18 * kCols + 12 * kCols * sub; }
};

// column header: kCols fp32 scales; blocks of 32 values (q as signed bytes) carry no scales
struct FInt8 {
  static constexpr int kBlockK = 32, kSubs = 1, kSubK = 32, kBits = 8, kOffset = kQ8Offset, kRunSteps = 1;
  static constexpr bool kMin = false;
  static constexpr int64_t kHeader = 4 * kCols, kBlockBytes = 32 * kCols, kRawBytes = 0;
  static CS_INLINE void scales(const uint8_t* col, const uint8_t*, int, VF& s, VF& b) {
    s = cs::load(reinterpret_cast<const float*>(col));
    b = cs::zero();
  }
  static CS_INLINE const uint8_t* quants(const uint8_t* blk, int) { return blk; }
};

// dot operands (chunks) of a sub-block: 8 k per 4-bit chunk, 4 k per byte chunk (Q6_K's plane not counted)
template <class F>
constexpr int sub_chunks() { return F::kSubK / (F::kBits == 8 ? 4 : 8); }

template <class F>
int64_t column_bytes(int64_t K) { return F::kHeader + (K / F::kBlockK) * F::kBlockBytes; }

int64_t columns(int64_t N) { return (N + kCols - 1) / kCols; }
int64_t groups(int64_t N) { return (columns(N) + kGroup - 1) / kGroup; }

template <class F>
struct Layout {
  const uint8_t* w;
  int64_t group_bytes;  // kGroup * column_bytes
  const uint8_t* header(int64_t c) const { return w + (c / kGroup) * group_bytes + (c % kGroup) * F::kHeader; }
  const uint8_t* block(int64_t c, int64_t bl) const {
    return w + (c / kGroup) * group_bytes + kGroup * F::kHeader + (bl * kGroup + c % kGroup) * F::kBlockBytes;
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

// u of output i (0..kCols-1 in its column) at k (within the sub-block) from a sub-block's quants
template <class F>
int quant_at(const uint8_t* q, int i, int k) {
  if constexpr (F::kBits == 8) {
    const uint8_t byte = q[(k / 4) * kChunk + 4 * i + k % 4];
    return kQ8Offset != 0 ? static_cast<int>(byte) - kQ8Offset : static_cast<int>(static_cast<int8_t>(byte));
  } else {
    const uint8_t byte = q[(k / 8) * kChunk + 4 * i + (k % 8) % 4];
    const int low = (k % 8) < 4 ? (byte & 0xF) : (byte >> 4);
    if constexpr (F::kBits == 6) return low | (((q[sub_chunks<F>() * kChunk + 4 * i + k % 4] >> (2 * (k / 4))) & 3) << 4);
    return low;
  }
}

// The weights of output i of column c, de-quantised: dst [K] bf16, exactly bf16(S * u + B) (one fma,
// rounded once: gguf's value; for 8-bit B = 0, so the one rounding of S * q).
template <class F>
void decode_output(const Layout<F>& L, int64_t c, int i, int64_t K, uint16_t* dst) {
  const uint8_t* col = L.header(c);
  alignas(64) float s[kCols], b[kCols], u[kCols];
  for (int64_t bl = 0; bl < K / F::kBlockK; ++bl) {
    const uint8_t* blk = L.block(c, bl);
    for (int sub = 0; sub < F::kSubs; ++sub) {
      VF sv, bv;
      F::scales(col, blk, sub, sv, bv);
      cs::store(s, sv);
      cs::store(b, bv);
      const uint8_t* q = F::quants(blk, sub);
      for (int k0 = 0; k0 < F::kSubK; k0 += kCols) {
        for (int t = 0; t < kCols; ++t) u[t] = static_cast<float>(quant_at<F>(q, i, k0 + t));
        const VF w = cs::fma(cs::load(u), cs::set1(s[i]), cs::set1(b[i]));
        cs::store_bf16(dst + bl * F::kBlockK + sub * F::kSubK + k0, w);
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
  // sum of q over the n (16 or 32) values from k
  int32_t sum(int64_t m, int64_t k, int n) const {
    const int32_t* s = s16.data() + m * (K / 16) + k / 16;
    return n == 16 ? s[0] : s[0] + s[1];
  }
};

// bf16 row -> int8 blocks of 32: dx = max|x| / 127 (fp32), q = rne(x * (127 / max|x|)) clamped to
// [-127, 127] (clamping before or after rounding is the same: the bounds are integers); all-zero: 0.
void quantize_row(const uint16_t* x, int64_t K, int8_t* q, float* dx, int32_t* s16) {
  constexpr int V = kXBlock / kCols;  // vectors per block
  const VF lo = cs::set1(-127.0f), hi = cs::set1(127.0f);
  for (int64_t b = 0; b < K / kXBlock; ++b) {
    VF v[V];
    VF amaxv = cs::zero();
    for (int t = 0; t < V; ++t) {
      v[t] = cs::load_bf16(x + b * kXBlock + t * kCols);
      amaxv = cs::max(amaxv, cs::abs(v[t]));
    }
    const float amax = cs::hmax(amaxv);
    VF id = cs::zero();
    float d = 0.0f;
    if (amax > 0.0f) {
      d = amax / 127.0f;
      id = cs::div(hi, cs::set1(amax));
    }
    VF half = cs::zero();
    for (int t = 0; t < V; ++t) {
      const VF r = cs::round_nearest(cs::min(cs::max(cs::mul(v[t], id), lo), hi));
      cs::store_i8(q + b * kXBlock + t * kCols, cs::to_int_rne(r));
      half = cs::add(half, r);  // small integers: exact in any order
      if ((t + 1) * kCols % 16 == 0) {
        s16[(b * kXBlock + t * kCols) / 16] = static_cast<int32_t>(cs::hsum(half));
        half = cs::zero();
      }
    }
    dx[b] = d;
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
  int64_t group_bytes;  // bytes per group of kGroup columns
  int64_t K;
  const uint16_t* bias;  // [N] or nullptr
  uint16_t* y;           // [M, N]
  int64_t n;
};

// + bias, bf16 RNE, the last column's outputs past N left out
template <int MR, int NZ>
CS_INLINE void store_tile(const QProblem& p, int64_t m0, int64_t c0, VF (&acc)[MR][NZ]) {
#pragma GCC unroll 8
  for (int j = 0; j < NZ; ++j) {
    const int64_t n0 = (c0 + j) * kCols;
    const int left = static_cast<int>(std::min<int64_t>(kCols, p.n - n0));
    VF b = cs::zero();
    if (p.bias != nullptr) b = left == kCols ? cs::load_bf16(p.bias + n0) : cs::load_bf16_n(p.bias + n0, left);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const VF v = p.bias != nullptr ? cs::add(acc[m][j], b) : acc[m][j];
      uint16_t* dst = p.y + (m0 + m) * p.n + n0;
      if (left == kCols) cs::store_bf16(dst, v);
      else cs::store_bf16_n(dst, v, left);
    }
  }
}

// the plane's 2-bit group g (bits 2g, 2g+1 of each byte) moved to bits 4-5 (the caller masks)
CS_INLINE VI high_bits(VI h, int g) {
  switch (g) {
    case 0: return cs::isll16(h, 4);
    case 1: return cs::isll16(h, 2);
    case 2: return h;
    default: return cs::isrl16(h, 2);
  }
}

// The integer sums isum[m][j] = sum u * xq over one sub-block, for MR rows x NZ columns: each chunk of
// quants is loaded (and its nibbles split) once for the MR rows; runs of `run` chunks stay in int16
// lanes on plain AVX2 (the header's bound), one run on VNNI tiers.
template <class F, int MR, int NZ>
CS_INLINE void sub_block_sums(const uint8_t* const (&q)[NZ], const int8_t* const (&xr)[MR], int64_t k0, VI (&isum)[MR][NZ]) {
  constexpr int chunks = sub_chunks<F>();
  constexpr int per_chunk = F::kBits == 8 ? 1 : 2;  // dot steps per chunk
  constexpr int run = cs::kDotRunWide ? chunks : std::max(1, F::kRunSteps / per_chunk);
  static_assert(chunks % run == 0, "runs split a sub-block evenly");
  const VI low4 = cs::iset1_u8(0x0F), bits45 = cs::iset1_u8(0x30);
#pragma GCC unroll 8
  for (int r0 = 0; r0 < chunks; r0 += run) {
    VI part[MR][NZ];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < NZ; ++j) part[m][j] = cs::izero();
#pragma GCC unroll 8
    for (int c = r0; c < r0 + run; ++c) {
      if constexpr (F::kBits == 8 && kQ8Offset != 0) {  // u = q + 128 unsigned, xq signed (the offset below)
        VI u[NZ];
#pragma GCC unroll 8
        for (int j = 0; j < NZ; ++j) u[j] = cs::iload(q[j] + c * kChunk);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const VI xb = cs::ibroadcast4(xr[m] + k0 + 4 * c);
#pragma GCC unroll 8
          for (int j = 0; j < NZ; ++j) part[m][j] = cs::dot_run(part[m][j], u[j], xb);
        }
      } else if constexpr (F::kBits == 8) {  // sign trick: |q| unsigned, sign(xq, q) signed
        VI w[NZ], u[NZ];
#pragma GCC unroll 8
        for (int j = 0; j < NZ; ++j) {
          w[j] = cs::iload(q[j] + c * kChunk);
          u[j] = cs::abs8(w[j]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const VI xb = cs::ibroadcast4(xr[m] + k0 + 4 * c);
#pragma GCC unroll 8
          for (int j = 0; j < NZ; ++j) part[m][j] = cs::dot_run(part[m][j], u[j], cs::sign8(xb, w[j]));
        }
      } else {
        VI lo[NZ], hi[NZ];
#pragma GCC unroll 8
        for (int j = 0; j < NZ; ++j) {
          const VI v = cs::iload(q[j] + c * kChunk);
          lo[j] = cs::iand(v, low4);
          hi[j] = cs::iand(cs::isrl16(v, 4), low4);
          if constexpr (F::kBits == 6) {  // bits 4-5 from the plane: groups 2c (k 8c..8c+3) and 2c+1
            const VI h = cs::iload(q[j] + chunks * kChunk);
            lo[j] = cs::ior(lo[j], cs::iand(high_bits(h, 2 * c), bits45));
            hi[j] = cs::ior(hi[j], cs::iand(high_bits(h, 2 * c + 1), bits45));
          }
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const VI xl = cs::ibroadcast4(xr[m] + k0 + 8 * c);
          const VI xh = cs::ibroadcast4(xr[m] + k0 + 8 * c + 4);
#pragma GCC unroll 8
          for (int j = 0; j < NZ; ++j) {
            part[m][j] = cs::dot_run(part[m][j], lo[j], xl);
            part[m][j] = cs::dot_run(part[m][j], hi[j], xh);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < NZ; ++j) isum[m][j] = r0 == 0 ? cs::dot_run_end(part[m][j]) : cs::iadd(isum[m][j], cs::dot_run_end(part[m][j]));
  }
}

// MR rows x NZ columns (of one group) over all of K. The per-output arithmetic is the header's,
// whatever MR and NZ are.
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
  VF acc[MR][NZ];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NZ; ++j) acc[m][j] = cs::zero();

  const int64_t blocks = p.K / F::kBlockK;
  // decode tiles (1-2 rows) stream the weights: their NZ column blocks of a block are contiguous,
  // prefetched a sub-block's share at a time; larger tiles re-read weights already in cache
  constexpr bool kPrefetch = MR <= 2;
  constexpr int64_t kPfShare = NZ * F::kBlockBytes / F::kSubs;
  const int64_t pf = g_pf_bytes;
  for (int64_t bl = 0; bl < blocks; ++bl) {
    const uint8_t* blk[NZ];
#pragma GCC unroll 8
    for (int j = 0; j < NZ; ++j) blk[j] = L.block(c0 + j, bl);
    for (int sub = 0; sub < F::kSubs; ++sub) {
      const int64_t k0 = bl * F::kBlockK + sub * F::kSubK;
      if constexpr (kPrefetch) {
        const uint8_t* ahead = blk[0] + sub * kPfShare + pf;
#pragma GCC unroll 16
        for (int64_t o = 0; o < kPfShare; o += 64) __builtin_prefetch(ahead + o, 0, 3);
      }
      const uint8_t* q[NZ];
#pragma GCC unroll 8
      for (int j = 0; j < NZ; ++j) q[j] = F::quants(blk[j], sub);
      VI isum[MR][NZ];
      sub_block_sums<F, MR, NZ>(q, xr, k0, isum);
      VF s[NZ], b[NZ];
#pragma GCC unroll 8
      for (int j = 0; j < NZ; ++j) F::scales(col[j], blk[j], sub, s[j], b[j]);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const float dx = X.scale(m0 + m, k0);
        const VF dxv = cs::set1(dx);
        if constexpr (F::kOffset != 0) {
          const VI off = cs::iset1(F::kOffset * X.sum(m0 + m, k0, F::kSubK));
#pragma GCC unroll 8
          for (int j = 0; j < NZ; ++j)
            acc[m][j] = cs::fma(cs::to_float(cs::isub(isum[m][j], off)), cs::mul(s[j], dxv), acc[m][j]);
        } else if constexpr (F::kMin) {
          const VF xsv = cs::set1(dx * static_cast<float>(X.sum(m0 + m, k0, F::kSubK)));
#pragma GCC unroll 8
          for (int j = 0; j < NZ; ++j) {
            acc[m][j] = cs::fma(cs::to_float(isum[m][j]), cs::mul(s[j], dxv), acc[m][j]);
            acc[m][j] = cs::fma(b[j], xsv, acc[m][j]);
          }
        } else {
#pragma GCC unroll 8
          for (int j = 0; j < NZ; ++j) acc[m][j] = cs::fma(cs::to_float(isum[m][j]), cs::mul(s[j], dxv), acc[m][j]);
        }
      }
    }
  }
  store_tile<MR, NZ>(p, m0, c0, acc);
}

template <class F>
using TileFn = void (*)(const QProblem&, int64_t, int64_t);

constexpr int kMaxRows = std::max(2, kTileRows);

// Decode tiles: 1-2 rows x up to a group's 4 columns (one stream); prefill tiles: up to kTileRows
// rows x kTileCols columns (what the registers hold: 16 on AVX2). Only those are compiled.
template <class F, int MR, int NZ>
constexpr TileFn<F> tile_or_null() {
  if constexpr ((MR <= 2 && NZ <= kGroup) || (MR <= kTileRows && NZ <= kTileCols)) return &tile<F, MR, NZ>;
  else return nullptr;
}

template <class F, size_t... I>
TileFn<F> tile_from(int mr, int nz, std::index_sequence<I...>) {
  static constexpr TileFn<F> table[] = {tile_or_null<F, static_cast<int>(I) / kGroup + 1, static_cast<int>(I) % kGroup + 1>()...};
  const TileFn<F> fn = (mr >= 1 && mr <= kMaxRows && nz >= 1 && nz <= kGroup) ? table[(mr - 1) * kGroup + nz - 1] : nullptr;
  TORCH_CHECK(fn != nullptr, "tier_quant: no tile of ", mr, " rows x ", nz, " columns");
  return fn;
}

template <class F>
TileFn<F> tile_fn(int mr, int nz) { return tile_from<F>(mr, nz, std::make_index_sequence<kMaxRows * kGroup>{}); }

// Rows [r0, r1) x columns [c0, c1) (c0 at a group's start). Which elements are computed together
// depends on the sizes here, never how one is.
template <class F>
void run_block(const QProblem& p, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t rows_all = r1 - r0;
  if (rows_all <= 2) {
    for (int64_t c = c0; c < c1; c += kGroup)
      tile_fn<F>(static_cast<int>(rows_all), static_cast<int>(std::min<int64_t>(kGroup, c1 - c)))(p, r0, c);
    return;
  }
  // row blocks (their int8 rows stay in L2), then column tiles (their quants stay in L1 while the
  // row tiles of the block pass over them)
  for (int64_t mb = r0; mb < r1; mb += TQ_ROW_BLOCK) {
    const int64_t rows = std::min<int64_t>(TQ_ROW_BLOCK, r1 - mb);
    const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
    const int64_t base = rows / tiles, extra = rows % tiles;  // rows spread evenly over the tiles
    for (int64_t c = c0; c < c1; c += kTileCols) {
      const int nz = static_cast<int>(std::min<int64_t>(kTileCols, c1 - c));
      int64_t m = mb;
      for (int64_t t = 0; t < tiles; ++t) {
        const int mr = static_cast<int>(base + (t < extra ? 1 : 0));
        tile_fn<F>(mr, nz)(p, m, c);
        m += mr;
      }
    }
  }
}

template <class F>
void check_shape(int64_t N, int64_t K, const char* what) {
  TORCH_CHECK(N >= 1, what, ": N must be >= 1, got ", N);
  TORCH_CHECK(K >= F::kBlockK && K % F::kBlockK == 0, what, ": K = ", K, " must be a positive multiple of the format's block (",
              F::kBlockK, " values)");
}

template <class F>
int64_t nbytes(int64_t N, int64_t K) {
  check_shape<F>(N, K, "quant packed_nbytes");
  return groups(N) * kGroup * column_bytes<F>(K);
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

// ---- repacking GGUF blocks (one output row's block at a time) into a column's block ----

// where the quant u of output i (in the column) at k (within its sub-block) goes
void put_nibble(uint8_t* q, int i, int k, uint8_t u) {
  q[(k / 8) * kChunk + 4 * i + (k % 8) % 4] |= static_cast<uint8_t>((u & 0xF) << ((k % 8) < 4 ? 0 : 4));
}
void put_byte(uint8_t* q, int i, int k, uint8_t u) { q[(k / 4) * kChunk + 4 * i + k % 4] = u; }

// raw: one GGUF block of output i; blk: the column's packed block (zeroed before the first output)
void repack_q4_0(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  for (int k = 0; k < 32; ++k) put_nibble(blk + 2 * kCols, i, k, k < 16 ? (raw[2 + k] & 0xF) : (raw[2 + k - 16] >> 4));
}
void repack_q4_1(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  std::memcpy(blk + 2 * kCols + 2 * i, raw + 2, 2);
  for (int k = 0; k < 32; ++k) put_nibble(blk + 4 * kCols, i, k, k < 16 ? (raw[4 + k] & 0xF) : (raw[4 + k - 16] >> 4));
}
void repack_q8_0(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  for (int k = 0; k < 32; ++k) put_byte(blk + 2 * kCols, i, k, static_cast<uint8_t>(raw[2 + k] ^ kQ8Offset));  // q (+ 128 on VNNI tiers)
}
// gguf Q4_K: d, dmin (fp16), 12 bytes of 6-bit scales/mins (gguf.quants.Q4_K.get_scale_min), 128 bytes:
// chunk c of 32 bytes holds sub-block 2c in its low nibbles and 2c + 1 in its high nibbles
void repack_q4_k(const uint8_t* raw, uint8_t* blk, int i) {
  std::memcpy(blk + 2 * i, raw, 2);
  std::memcpy(blk + 2 * kCols + 2 * i, raw + 2, 2);
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
    blk[4 * kCols + kCols * j + i] = sc;
    blk[12 * kCols + kCols * j + i] = mn;
  }
  const uint8_t* qs = raw + 16;
  for (int k = 0; k < 256; ++k) {
    const int j = k / 32, l = k % 32;
    const uint8_t byte = qs[(j / 2) * 32 + l];
    put_nibble(blk + 20 * kCols + 16 * kCols * j, i, l, (j % 2) ? (byte >> 4) : (byte & 0xF));
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
  for (int j = 0; j < 16; ++j) blk[2 * kCols + kCols * j + i] = sc[j];
  for (int k = 0; k < 256; ++k) {
    const int t = k / 32, l = k % 32;
    const uint8_t lb = ql[(t / 4) * 64 + (t % 2) * 32 + l];
    const int lo = ((t / 2) % 2) ? (lb >> 4) : (lb & 0xF);
    const int hi = (qh[(t / 4) * 32 + l] >> (2 * (t % 4))) & 3;
    uint8_t* q = blk + 18 * kCols + 12 * kCols * (k / 16);
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
  const int64_t gb = kGroup * column_bytes<F>(K), blocks = K / F::kBlockK;
  const Layout<F> L{dst, gb};
  at::parallel_for(0, groups(N), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      std::memset(dst + g * gb, 0, gb);  // padding outputs: zero scales, weight 0 (never stored)
      for (int64_t c = g * kGroup; c < (g + 1) * kGroup; ++c)
        for (int64_t bl = 0; bl < blocks; ++bl)
          for (int i = 0; i < kCols; ++i) {
            const int64_t n = c * kCols + i;
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
  const int64_t gb = kGroup * column_bytes<FInt8>(K), blocks = K / 32;
  const Layout<FInt8> L{dst, gb};
  at::parallel_for(0, groups(N), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      std::memset(dst + g * gb, 0, gb);
      for (int64_t c = g * kGroup; c < (g + 1) * kGroup; ++c) {
        uint8_t* sc = const_cast<uint8_t*>(L.header(c));
        for (int i = 0; i < kCols; ++i) {
          const int64_t n = c * kCols + i;
          if (n >= N) continue;
          std::memcpy(sc + 4 * i, sp + n, 4);
          for (int64_t bl = 0; bl < blocks; ++bl)
            for (int k = 0; k < 32; ++k)
              put_byte(const_cast<uint8_t*>(L.block(c, bl)), i, k, static_cast<uint8_t>(static_cast<uint8_t>(src[n * K + bl * 32 + k]) ^ kQ8Offset));
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
  const int64_t group_bytes = dispatch(qtype, [&](auto f) { return kGroup * column_bytes<decltype(f)>(K); });
  const int64_t C = columns(N), G = groups(N);
  int64_t threads = at::get_num_threads();
  if (M * N * K < (int64_t(1) << 18)) threads = 1;
  const bool split_rows = M >= TQ_SPLIT_ROWS_MIN && N < TQ_SPLIT_OUTPUTS_MIN * threads;
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, split_rows ? M : G));
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
        if (split_rows) run_block<F>(p, M * t / threads, M * (t + 1) / threads, 0, C);
        else run_block<F>(p, 0, M, std::min(C, kGroup * (G * t / threads)), std::min(C, kGroup * (G * (t + 1) / threads)));
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
    const Layout<F> L{src, kGroup * column_bytes<F>(K)};
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) decode_output<F>(L, n / kCols, static_cast<int>(n % kCols), K, dst + n * K);
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
    const Layout<F> L{src, kGroup * column_bytes<F>(K)};
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) decode_output<F>(L, idp[t] / kCols, static_cast<int>(idp[t] % kCols), K, dst + t * K);
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

// The family's functions, registered on `m`: by its own module, or by tier_kernels.cpp's (all families in one).
inline void register_quant(py::module& m) {
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

#ifndef CS_TIER_COMBINED
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { register_quant(m); }
#endif
