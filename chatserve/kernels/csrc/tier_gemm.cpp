// Batch-invariant bf16 matmul (issues #20, #30): y[m, n] = x[m, :] . W[n, :] (+ bias[n]), one kernel
// for every row count, over weights packed once at load. Written over csrc/vec.h and compiled per
// kernel tier (AVX2: 8 fp32 lanes; AVX512: 16; AVX512-BF16: 16 with vdpbf16ps as the step).
//
// Why: a row's result must not depend on how many other rows share the call, where the row is in
// it, or how the threads split the work: the last prompt token of a 1,000-row prefill and the same
// token decoded alone give the same bits. Each output element is ONE accumulation chain in one fp32
// lane, in k order, whose step is the tier's micro-kernel (`tile_step`, the only per-tier arithmetic):
//
//     fma tiers:     acc = 0;  for k in 0 .. K-1:      acc = fma(x[m, k], W[n, k], acc)
//     AVX512-BF16:   acc = 0;  for kp in 0 .. K/2-1:   acc = vdpbf16ps(acc, W[n, 2kp:2kp+2], x[m, 2kp:2kp+2])
//     then           y[m, n] = bf16_rne(acc + bias[n])   (no bias: bf16_rne(acc))
//
// Register tiles, cache blocks and the thread split only decide WHICH elements are computed
// together, never how one is: no split-K, no horizontal sum, no second path.
//
// Memory traffic stays at 2 bytes a weight: the weights stay bf16. The packed layout is
// [G][S][kStepK * P] bf16: P = 2 * kLanes outputs per panel (16 on AVX2, 32 on AVX512), G = ceil(N / P),
// S = ceil(K / kStepK) steps of kStepK k (1, or 2 with BF16), zero padded. One step of a panel:
//
//   fma tiers (kStepK 1): 32-bit word i holds (W[gP + i, k], W[gP + kLanes + i, k]), so one load, one
//     shift and one and widen 2 * kLanes weights (cs::load_bf16_even_odd): the even halves are
//     outputs gP .. gP+kLanes-1, the odd halves the next kLanes;
//   AVX512-BF16 (kStepK 2): word c holds (W[gP + c, 2s], W[gP + c, 2s + 1]), outputs in order: the
//     first vector of pairs is outputs gP .. gP+kLanes-1, the second the next kLanes, each multiplied
//     by a broadcast pair of x (cs::dpbf16).
//
// A panel is S * kStepK * P * 2 contiguous bytes, read front to back by every tile over it. On the fma
// tiers x rows are widened to fp32 once per call (a scratch [M, K]), so a tile broadcasts x[m, k]
// straight from memory; with BF16 x is read in place as bf16 pairs (an odd K: a copy with a zero column).
//
// Register tiles (a classic sgemm micro-kernel): up to 6 rows x 1 panel on AVX2 (12 accumulators,
// 2 widened weight vectors, 1 broadcast of the 16 ymm registers): 12 fma per weight load and 6
// broadcasts. AVX512 (32 registers) takes 2 panels (24 accumulators, as the AVX512-BF16 kernel did). With few rows (decode) tiles are wider (1 row x
// 4 panels, 2 x 3, 3 x 2) so there are still >= 8 independent chains to cover the fma latency while
// the weights stream from memory once for all rows, prefetched ahead. Measured: benchmarks/kernels/bench_tier_gemm.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

constexpr int kPanel = 2 * cs::kLanes;  // outputs per packed panel
#if defined(CHATSERVE_BF16)
constexpr int kStepK = 2;  // k per micro-kernel step: a bf16 pair (vdpbf16ps)
using XElem = uint16_t;    // x as the tile reads it: bf16, in place
#else
constexpr int kStepK = 1;  // one fma per k
using XElem = float;       // x widened to fp32 once per call
#endif
constexpr int kStepElems = kStepK * kPanel;  // packed bf16 values per step of one panel
constexpr int kMaxTileRows = 6;         // rows of a register tile
constexpr int kMaxPanels = 4;           // panels of the widest tile

// Panels of a tile of `rows` rows: enough accumulators to cover the fma latency, within the registers.
constexpr int tile_panels(int rows) {
#if defined(CHATSERVE_TIER_AVX512)
  return rows <= 3 ? 4 : 2;  // 32 zmm: 6 x 2 panels is 24 accumulators
#else
  return rows == 1 ? 4 : rows == 2 ? 3 : rows == 3 ? 2 : 1;  // 16 ymm: at most 12 accumulators
#endif
}

// Cache blocks (for large M): the weights of a block of panels (<= GEMM_COL_BLOCK_BYTES) stay in L2
// while every block of rows passes them, and a row block's widened x (<= GEMM_ROW_BLOCK_BYTES of fp32,
// at most GEMM_ROW_BLOCK rows) stays in L2 while the block's column tiles pass it. So each weight
// comes from memory once per call, each row of x once per column block.
#ifndef GEMM_ROW_BLOCK
#define GEMM_ROW_BLOCK 96
#endif
#ifndef GEMM_ROW_BLOCK_BYTES
#define GEMM_ROW_BLOCK_BYTES (192 * 1024)
#endif
#ifndef GEMM_COL_BLOCK_BYTES
#if defined(CHATSERVE_BF16)
#define GEMM_COL_BLOCK_BYTES (448 * 1024)  // the AVX512-BF16 tier's own, measured on Zen 4 (M = 1000: ~190 -> ~450 GFLOP/s a core)
#else
#define GEMM_COL_BLOCK_BYTES (256 * 1024)
#endif
#endif
// Threads split the panels (the weights are read once in all, as decode needs), unless there are at
// least GEMM_SPLIT_ROWS_MIN rows and fewer than GEMM_SPLIT_COLS_MIN panels per thread; then they split
// the rows (each reads all the weights; even for any N).
#ifndef GEMM_SPLIT_ROWS_MIN
#define GEMM_SPLIT_ROWS_MIN 64
#endif
#ifndef GEMM_SPLIT_COLS_MIN
#define GEMM_SPLIT_COLS_MIN 32
#endif
// The first row tile over a column tile streams its weights from memory: prefetch this many steps
// ahead in each panel (a step of a panel is kStepElems * 2 bytes: half a cache line on AVX2, one on
// AVX512, two with BF16).
#ifndef GEMM_PF_STEPS
#if defined(CHATSERVE_BF16)
#define GEMM_PF_STEPS 24
#else
#define GEMM_PF_STEPS 32
#endif
#endif
constexpr int kStepBytes = kStepElems * static_cast<int>(sizeof(uint16_t));
constexpr int kStepsPerLine = kStepBytes >= 64 ? 1 : 64 / kStepBytes;
constexpr int kLinesPerStep = kStepBytes <= 64 ? 1 : kStepBytes / 64;

struct Problem {
  const XElem* x;        // [M, ldx]: x widened (fp32) or in place (bf16)
  int64_t ldx;
  const uint16_t* w;     // packed [G][S][kStepElems]
  int64_t steps;         // S = ceil(K / kStepK)
  const uint16_t* bias;  // [N] or nullptr
  uint16_t* y;           // [M, N]
  int64_t n;
};

// One step of a tile, the tier's micro-kernel: NP panels' weights loaded once, each row's x
// broadcast, 2 * NP accumulator updates per row.
template <int MR, int NP>
CS_INLINE void tile_step(cs::VF (&acc)[MR][2 * NP], const uint16_t* const (&wp)[NP], const XElem* const (&xp)[MR],
                         int64_t s) {
#if defined(CHATSERVE_BF16)
  cs::VB lo[NP], hi[NP];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) {
    lo[j] = cs::load_bf16_pairs(wp[j] + s * kStepElems);
    hi[j] = cs::load_bf16_pairs(wp[j] + s * kStepElems + 2 * cs::kLanes);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const cs::VB xb = cs::broadcast_bf16_pair(xp[m] + 2 * s);
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      acc[m][2 * j] = cs::dpbf16(acc[m][2 * j], lo[j], xb);
      acc[m][2 * j + 1] = cs::dpbf16(acc[m][2 * j + 1], hi[j], xb);
    }
  }
#else
  cs::VF even[NP], odd[NP];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) cs::load_bf16_even_odd(wp[j] + s * kStepElems, even[j], odd[j]);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const cs::VF xb = cs::broadcast(xp[m] + s);
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      acc[m][2 * j] = cs::fma(xb, even[j], acc[m][2 * j]);
      acc[m][2 * j + 1] = cs::fma(xb, odd[j], acc[m][2 * j + 1]);
    }
  }
#endif
}

// MR rows (m0 ..) x NP panels (g0 ..) over all of K: the only place that does arithmetic.
template <int MR, int NP, bool PF>
void tile(const Problem& p, int64_t m0, int64_t g0) {
  const int64_t S = p.steps;
  const uint16_t* wp[NP];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) wp[j] = p.w + (g0 + j) * S * kStepElems;
  const XElem* xp[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) xp[m] = p.x + (m0 + m) * p.ldx;
  cs::VF acc[MR][2 * NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NP; ++j) acc[m][j] = cs::zero();

  int64_t s = 0;
  if (PF) {
    for (; s + kStepsPerLine <= S; s += kStepsPerLine) {  // one prefetch per cache line of each panel
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j)
#pragma GCC unroll 2
        for (int l = 0; l < kLinesPerStep; ++l) cs::prefetch(wp[j] + (s + GEMM_PF_STEPS) * kStepElems + l * 32);
#pragma GCC unroll 2
      for (int u = 0; u < kStepsPerLine; ++u) tile_step<MR, NP>(acc, wp, xp, s + u);
    }
  }
#pragma GCC unroll 2
  for (; s < S; ++s) tile_step<MR, NP>(acc, wp, xp, s);

#pragma GCC unroll 8
  for (int j = 0; j < 2 * NP; ++j) {
    const int64_t n0 = (g0 + j / 2) * kPanel + (j % 2) * cs::kLanes;  // even half, then odd half
    const int64_t left = p.n - n0;
    if (left <= 0) break;  // the zero padding of a ragged last panel
    const int cnt = left >= cs::kLanes ? cs::kLanes : static_cast<int>(left);
    cs::VF b = cs::zero();
    if (p.bias != nullptr) b = cnt == cs::kLanes ? cs::load_bf16(p.bias + n0) : cs::load_bf16_n(p.bias + n0, cnt);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      // no bias: acc itself (acc + 0 would turn a -0 into +0)
      const cs::VF v = p.bias != nullptr ? cs::add(acc[m][j], b) : acc[m][j];
      uint16_t* out = p.y + (m0 + m) * p.n + n0;
      if (cnt == cs::kLanes) {
        cs::store_bf16(out, v);
      } else {
        cs::store_bf16_n(out, v, cnt);
      }
    }
  }
}

using TileFn = void (*)(const Problem&, int64_t, int64_t);

// tile<MR, NP, PF> for every MR <= kMaxTileRows and NP <= tile_panels(MR), looked up by (MR, NP, PF).
template <int MR, int NP>
constexpr TileFn tile_entry(bool pf) {
  if constexpr (NP <= tile_panels(MR)) {
    return pf ? &tile<MR, NP, true> : &tile<MR, NP, false>;
  } else {
    return nullptr;
  }
}

template <int MR, int... NPs>
constexpr std::array<TileFn, 2 * kMaxPanels> tile_row(std::integer_sequence<int, NPs...>) {
  return {tile_entry<MR, NPs + 1>(false)..., tile_entry<MR, NPs + 1>(true)...};
}

template <int... MRs>
constexpr std::array<std::array<TileFn, 2 * kMaxPanels>, kMaxTileRows> tile_table(std::integer_sequence<int, MRs...>) {
  return {tile_row<MRs + 1>(std::make_integer_sequence<int, kMaxPanels>{})...};
}

constexpr auto kTiles = tile_table(std::make_integer_sequence<int, kMaxTileRows>{});

CS_INLINE TileFn tile_fn(int mr, int np, bool pf) { return kTiles[mr - 1][(pf ? kMaxPanels : 0) + np - 1]; }

// Rows [r0, r1) x panels [c0, c1): cache blocks of panels and rows, column tiles, row tiles. Only
// the grouping of elements into tiles depends on the sizes here.
void run_block(const Problem& p, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t panel_bytes = p.steps * kStepBytes;
  const int64_t col_block = std::max<int64_t>(kMaxPanels, GEMM_COL_BLOCK_BYTES / panel_bytes / kMaxPanels * kMaxPanels);
  const int64_t fit = GEMM_ROW_BLOCK_BYTES / (p.steps * kStepK * static_cast<int64_t>(sizeof(XElem)));
  const int64_t row_block = std::clamp<int64_t>(fit / kMaxTileRows * kMaxTileRows, kMaxTileRows, GEMM_ROW_BLOCK);
  for (int64_t cb = c0; cb < c1; cb += col_block) {
    const int64_t cb_end = std::min<int64_t>(c1, cb + col_block);
    for (int64_t mb = r0; mb < r1; mb += row_block) {
      const int64_t rows = std::min<int64_t>(row_block, r1 - mb);
      const int64_t tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
      const int64_t base = rows / tiles, extra = rows % tiles;  // rows spread evenly over the tiles
      const int width = tile_panels(static_cast<int>(base + (extra > 0 ? 1 : 0)));
      for (int64_t c = cb; c < cb_end; c += width) {
        const int np = static_cast<int>(std::min<int64_t>(width, cb_end - c));
        int64_t m = mb;
        for (int64_t t = 0; t < tiles; ++t) {
          const int mr = static_cast<int>(base + (t < extra ? 1 : 0));
          tile_fn(mr, np, t == 0 && mb == r0)(p, m, c);  // prefetch where the weights come from memory
          m += mr;
        }
      }
    }
  }
}

// Position of W[gP + c, sK + e] (c in 0 .. P-1, e < kStepK) within its panel's step (the layout at the top).
CS_INLINE int64_t panel_slot(int64_t c, int64_t e) {
#if defined(CHATSERVE_BF16)
  return 2 * c + e;
#else
  (void)e;
  return c < cs::kLanes ? 2 * c : 2 * (c - cs::kLanes) + 1;
#endif
}

CS_INLINE int64_t steps_of(int64_t K) { return (K + kStepK - 1) / kStepK; }

std::vector<int64_t> packed_shape(int64_t N, int64_t K) { return {(N + kPanel - 1) / kPanel, steps_of(K), kStepElems}; }

void check_packed(const torch::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(2) == kStepElems &&
                  packed.is_contiguous(),
              "packed must be the contiguous bf16 [ceil(N/", kPanel, "), ceil(K/", kStepK, "), ", kStepElems,
              "] tensor of gemm_pack");
}

// K of x (or asked of gemm_rows) against the packed weight's steps; `what` names the operand.
void check_k(int64_t K, const torch::Tensor& packed, const char* what) {
  const int64_t S = packed.size(1);
  TORCH_CHECK(K >= 1 && steps_of(K) == S, what, " has ", K, " columns; the packed weight was made for ",
              kStepK == 1 ? std::to_string(S) : std::to_string(kStepK * S - 1) + " or " + std::to_string(kStepK * S));
}

void check_n(int64_t N, int64_t G) {
  TORCH_CHECK(N > (G - 1) * kPanel && N <= G * kPanel, "N = ", N, " does not match the packed weight (", G,
              " panels of ", kPanel, ")");
}

}  // namespace

// The packed tensor's shape for an [N, K] weight, in bf16 elements (to preallocate gemm_pack's out).
std::vector<int64_t> gemm_packed_shape(int64_t N, int64_t K) {
  TORCH_CHECK(N > 0 && K > 0, "gemm_packed_shape: N and K must be positive");
  return packed_shape(N, K);
}

// [N, K] bf16 -> the packed [G, K, P] layout described at the top, into `out` when given (a view of
// the weight arena), in one pass with no temporaries.
torch::Tensor gemm_pack(torch::Tensor w, c10::optional<torch::Tensor> out_opt) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "gemm_pack takes a bf16 [N, K] matrix");
  TORCH_CHECK(w.size(0) > 0 && w.size(1) > 0, "gemm_pack: empty weight ", w.sizes());
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const std::vector<int64_t> shape = packed_shape(N, K);
  const int64_t G = shape[0];
  torch::Tensor out;
  if (out_opt.has_value() && out_opt->defined()) {
    out = *out_opt;
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.sizes() == torch::IntArrayRef(shape),
                "out must be a contiguous bf16 [", G, ", ", shape[1], ", ", kStepElems, "] tensor");
  } else {
    out = torch::empty(shape, w.options());
  }
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t s = 0; s < shape[1]; ++s) {
        uint16_t* row = dst + (g * shape[1] + s) * kStepElems;
        for (int64_t c = 0; c < kPanel; ++c)
          for (int64_t e = 0; e < kStepK; ++e) {
            const int64_t n = g * kPanel + c, k = s * kStepK + e;
            row[panel_slot(c, e)] = n < N && k < K ? src[n * K + k] : 0;
          }
      }
  });
  return out;
}

// Rows `ids` of the [N, K] matrix a packed weight was made from, bit for bit: a tied embedding
// looks tokens up in the lm_head's packed copy instead of keeping a second one.
torch::Tensor gemm_rows(torch::Tensor packed, torch::Tensor ids, int64_t N, int64_t K) {
  check_packed(packed);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be int64 [T]");
  const int64_t G = packed.size(0), T = ids.size(0), S = packed.size(1);
  check_k(K, packed, "gemm_rows: the weight");
  check_n(N, G);
  ids = ids.contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "row id ", idp[t], " out of range for ", N, " rows");
  auto out = torch::empty({T, K}, packed.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* base = src + (idp[t] / kPanel) * S * kStepElems + panel_slot(idp[t] % kPanel, 0);
      for (int64_t k = 0; k < K; ++k) dst[t * K + k] = base[(k / kStepK) * kStepElems + k % kStepK];
    }
  });
  return out;
}

torch::Tensor gemm(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemm: x must be bf16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "gemm: x must be 2-D [M, K], got ", x.dim(), " dimensions");
  check_packed(packed);
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0);
  check_k(K, packed, "gemm: x");
  check_n(N, G);
  TORCH_CHECK(M == 0 || x.stride(1) == 1 || K == 1, "gemm: x must have unit stride along K (rows of a row-major "
              "matrix), got strides ", x.strides());
  const uint16_t* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = *bias;
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.dim() == 1 && b.numel() == N, "gemm: bias must be bf16 [", N,
                "], got ", b.scalar_type(), " ", b.sizes());
    b = b.contiguous();
    bp = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;

  const int64_t C = G;  // panels
  int64_t threads = at::get_num_threads();
  if (M * N * K < (int64_t(1) << 18)) threads = 1;  // a tiny product: not worth waking a thread
  const bool split_rows = M >= GEMM_SPLIT_ROWS_MIN && C < GEMM_SPLIT_COLS_MIN * threads;
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, split_rows ? M : C));

  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t lda = M == 1 ? K : x.stride(0);
#if defined(CHATSERVE_BF16)
  // x read in place as bf16 pairs; an odd K: a copy with a zero column (the packed weight has one there too)
  torch::Tensor xs;
  if (K % 2 == 1) {
    xs = torch::zeros({M, K + 1}, x.options());
    xs.narrow(1, 0, K).copy_(x);
  }
  Problem p{K % 2 == 1 ? reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>()) : xp, K % 2 == 1 ? K + 1 : lda,
            reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), steps_of(K), bp,
            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N};
  auto widen = [](int64_t, int64_t) {};
#else
  // x widened to fp32 once (exact), rows contiguous: every tile broadcasts from here.
  auto xf = torch::empty({M, K}, x.options().dtype(at::kFloat));
  float* xfp = xf.data_ptr<float>();
  auto widen = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const uint16_t* src = xp + m * lda;
      float* dst = xfp + m * K;
      int64_t k = 0;
      for (; k + cs::kLanes <= K; k += cs::kLanes) cs::store(dst + k, cs::load_bf16(src + k));
      if (k < K) cs::store_n(dst + k, cs::load_bf16_n(src + k, static_cast<int>(K - k)), static_cast<int>(K - k));
    }
  };
  Problem p{xfp, K, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), K, bp,
            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N};
#endif
  if (threads == 1) {
    widen(0, M);
    run_block(p, 0, M, 0, C);
    return y;
  }
  if (M >= GEMM_SPLIT_ROWS_MIN) {
    at::parallel_for(0, M, GEMM_SPLIT_ROWS_MIN, widen);
  } else {
    widen(0, M);
  }
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (split_rows) {
        run_block(p, M * t / threads, M * (t + 1) / threads, 0, C);
      } else {
        run_block(p, 0, M, C * t / threads, C * (t + 1) / threads);
      }
    }
  });
  return y;
}

// GFLOP/s of the micro-kernel's step (fp32 fma; vdpbf16ps with BF16) on registers only (no memory
// operands), on every thread at once: the ceiling the matmul is measured against. 12 independent
// accumulators per thread cover the latency (2 units x 4 cycles on the cores we know; 24 for
// vdpbf16ps); different starting values keep the compiler from merging them.
double dot_peak_gflops(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "iterations must be positive");
#if defined(CHATSERVE_BF16)
  constexpr int kAcc = 24;
  constexpr int kFlops = 4 * cs::kLanes;  // two multiply-adds per lane
#else
  constexpr int kAcc = 12;
  constexpr int kFlops = 2 * cs::kLanes;
#endif
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads * cs::kLanes, 0.0f);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      cs::VF acc[kAcc];
      for (int i = 0; i < kAcc; ++i) acc[i] = cs::set1(static_cast<float>(i));
#if defined(CHATSERVE_BF16)
      const uint16_t one_pair[2] = {0x3f80, 0x3f80}, small_pair[2] = {0x3c00, 0x3c00};
      cs::VB a = cs::broadcast_bf16_pair(one_pair), b = cs::broadcast_bf16_pair(small_pair);
      for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 24
        for (int i = 0; i < kAcc; ++i) acc[i] = cs::dpbf16(acc[i], a, b);
        __asm__ volatile("" : "+v"(a.v), "+v"(b.v));  // keep the operands in registers, the loop alive
      }
#else
      const cs::VF a = cs::set1(0.999f), b = cs::set1(1e-3f);
      for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
        for (int i = 0; i < kAcc; ++i) acc[i] = cs::fma(acc[i], a, b);
      }
#endif
      cs::VF s = acc[0];
      for (int i = 1; i < kAcc; ++i) s = cs::add(s, acc[i]);
      cs::store(sink.data() + t * cs::kLanes, s);
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float keep = sink[0];
  (void)keep;
  return static_cast<double>(threads) * iterations * kAcc * kFlops / seconds / 1e9;
}

// The family's functions, registered on `m`: by its own module, or by tier_kernels.cpp's (all families in one).
inline void register_gemm(py::module& m) {
  m.def("gemm_pack", &gemm_pack, "bf16 [N, K] -> the batch-invariant matmul's panels [ceil(N/P), ceil(K/kStepK), kStepK * P]",
        py::arg("w"), py::arg("out") = py::none());
  m.def("gemm_packed_shape", &gemm_packed_shape, "shape of gemm_pack's result for an [N, K] weight");
  m.def("gemm_rows", &gemm_rows, "rows of the matrix behind a gemm_pack-packed weight");
  m.def("gemm", &gemm, "batch-invariant bf16 x W^T (+ bias) over a gemm_pack-packed weight");
  m.def("dot_peak_gflops", &dot_peak_gflops, "register-only GFLOP/s of the matmul's step (fma or vdpbf16ps) on all threads");
}

#ifndef CS_TIER_COMBINED
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { register_gemm(m); }
#endif
