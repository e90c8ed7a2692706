// Batch-invariant bf16 matmul for CPUs without a bf16 dot product (issue #30): y[m, n] = x[m, :] .
// W[n, :] (+ bias[n]), one kernel for every row count, over weights packed once at load. Written
// over csrc/vec.h and compiled per kernel tier (AVX2: 8 fp32 lanes; AVX512 without BF16: 16).
//
// Why: as csrc/bf16_gemm.cpp (the AVX512-BF16 version, issue #20), a row's result must not depend on
// how many other rows share the call, where the row is in it, or how the threads split the work:
// the last prompt token of a 1,000-row prefill and the same token decoded alone give the same bits.
// Each output element is ONE fused multiply-add chain in one fp32 lane, k in order:
//
//     acc = 0;  for k in 0 .. K-1:  acc = fma(x[m, k], W[n, k], acc);   y[m, n] = bf16_rne(acc + bias[n])
//
// (no bias: bf16_rne(acc)). Register tiles, cache blocks and the thread split only decide WHICH
// elements are computed together, never how one is: no split-K, no horizontal sum, no second path.
//
// Memory traffic stays at 2 bytes a weight: the weights stay bf16 and are widened in registers. The
// packed layout makes that one load, one shift and one and per 2 * kLanes weights (cs::load_bf16_even_odd):
//
//     [G][K][P] bf16, P = 2 * kLanes outputs per panel (16 on AVX2, 32 on AVX512), G = ceil(N / P),
//     zero padded; for k, 32-bit word i of panel g holds (W[gP + i, k], W[gP + kLanes + i, k])
//
// so the even halves are outputs gP .. gP+kLanes-1 and the odd halves the next kLanes, in order. A
// panel is K * P * 2 contiguous bytes, read front to back by every tile over it. x rows are widened
// to fp32 once per call (a scratch [M, K]), so a tile broadcasts x[m, k] straight from memory.
//
// Register tiles (a classic sgemm micro-kernel): up to 6 rows x 1 panel on AVX2 (12 accumulators,
// 2 widened weight vectors, 1 broadcast of the 16 ymm registers): 12 fma per weight load and 6
// broadcasts. AVX512 (32 registers) takes 2 panels. With few rows (decode) tiles are wider (1 row x
// 4 panels, 2 x 3, 3 x 2) so there are still >= 8 independent chains to cover the fma latency while
// the weights stream from memory once for all rows, prefetched ahead. Measured: benchmarks/kernels/bench_tier_gemm.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

constexpr int kPanel = 2 * cs::kLanes;  // outputs per packed panel
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
#define GEMM_COL_BLOCK_BYTES (256 * 1024)
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
// The first row tile over a column tile streams its weights from memory: prefetch this many k ahead
// in each panel (one cache line holds 64 / (2 P) k of a panel: 2 on AVX2, 1 on AVX512).
#ifndef GEMM_PF_K
#define GEMM_PF_K 32
#endif
constexpr int kKPerLine = 64 / (kPanel * 2) > 0 ? 64 / (kPanel * 2) : 1;

struct Problem {
  const float* x;        // [M, K] fp32, x widened
  const uint16_t* w;     // packed [G][K][P]
  int64_t k;
  const uint16_t* bias;  // [N] or nullptr
  uint16_t* y;           // [M, N]
  int64_t n;
};

// One k of a tile: NP panels' weights widened, each row's x broadcast, 2 * NP fma per row.
template <int MR, int NP>
CS_INLINE void tile_step(cs::VF (&acc)[MR][2 * NP], const uint16_t* const (&wp)[NP], const float* const (&xp)[MR],
                         int64_t k) {
  cs::VF even[NP], odd[NP];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) cs::load_bf16_even_odd(wp[j] + k * kPanel, even[j], odd[j]);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const cs::VF xb = cs::broadcast(xp[m] + k);
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      acc[m][2 * j] = cs::fma(xb, even[j], acc[m][2 * j]);
      acc[m][2 * j + 1] = cs::fma(xb, odd[j], acc[m][2 * j + 1]);
    }
  }
}

// MR rows (m0 ..) x NP panels (g0 ..) over all of K: the only place that does arithmetic.
template <int MR, int NP, bool PF>
void tile(const Problem& p, int64_t m0, int64_t g0) {
  const int64_t K = p.k;
  const uint16_t* wp[NP];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) wp[j] = p.w + (g0 + j) * K * kPanel;
  const float* xp[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) xp[m] = p.x + (m0 + m) * K;
  cs::VF acc[MR][2 * NP];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NP; ++j) acc[m][j] = cs::zero();

  int64_t k = 0;
  if (PF) {
    for (; k + kKPerLine <= K; k += kKPerLine) {  // one prefetch per cache line of each panel
#pragma GCC unroll 8
      for (int j = 0; j < NP; ++j) cs::prefetch(wp[j] + (k + GEMM_PF_K) * kPanel);
#pragma GCC unroll 2
      for (int u = 0; u < kKPerLine; ++u) tile_step<MR, NP>(acc, wp, xp, k + u);
    }
  }
#pragma GCC unroll 2
  for (; k < K; ++k) tile_step<MR, NP>(acc, wp, xp, k);

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
  const int64_t panel_bytes = p.k * kPanel * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t col_block = std::max<int64_t>(kMaxPanels, GEMM_COL_BLOCK_BYTES / panel_bytes / kMaxPanels * kMaxPanels);
  const int64_t fit = GEMM_ROW_BLOCK_BYTES / (p.k * static_cast<int64_t>(sizeof(float)));
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

// Position of output column c (0 .. P-1) within a panel's k row (see the layout at the top).
CS_INLINE int64_t panel_slot(int64_t c) { return c < cs::kLanes ? 2 * c : 2 * (c - cs::kLanes) + 1; }

std::vector<int64_t> packed_shape(int64_t N, int64_t K) { return {(N + kPanel - 1) / kPanel, K, kPanel}; }

void check_packed(const torch::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(2) == kPanel &&
                  packed.is_contiguous(),
              "packed must be the contiguous bf16 [ceil(N/", kPanel, "), K, ", kPanel, "] tensor of gemm_pack");
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
                "out must be a contiguous bf16 [", G, ", ", K, ", ", kPanel, "] tensor");
  } else {
    out = torch::empty(shape, w.options());
  }
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t k = 0; k < K; ++k) {
        uint16_t* row = dst + (g * K + k) * kPanel;
        for (int64_t c = 0; c < kPanel; ++c) {
          const int64_t n = g * kPanel + c;
          row[panel_slot(c)] = n < N ? src[n * K + k] : 0;
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
  const int64_t G = packed.size(0), T = ids.size(0);
  TORCH_CHECK(K == packed.size(1), "K = ", K, " does not match the packed weight (", packed.size(1), ")");
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
      const uint16_t* base = src + (idp[t] / kPanel) * K * kPanel + panel_slot(idp[t] % kPanel);
      for (int64_t k = 0; k < K; ++k) dst[t * K + k] = base[k * kPanel];
    }
  });
  return out;
}

torch::Tensor gemm(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gemm: x must be bf16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "gemm: x must be 2-D [M, K], got ", x.dim(), " dimensions");
  check_packed(packed);
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0);
  TORCH_CHECK(K == packed.size(1), "gemm: x has ", K, " columns; the packed weight was made for ", packed.size(1));
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

  // x widened to fp32 once (exact), rows contiguous: every tile broadcasts from here.
  auto xf = torch::empty({M, K}, x.options().dtype(at::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t lda = M == 1 ? K : x.stride(0);
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
  Problem p{xfp, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), K, bp,
            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N};
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

// GFLOP/s of fp32 fma on registers only (no memory operands), on every thread at once: the ceiling
// the matmul is measured against. 12 independent accumulators per thread cover the latency (2 fma
// units x 4 cycles on the cores we know); different starting values keep the compiler from merging them.
double fma_peak_gflops(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "iterations must be positive");
  constexpr int kAcc = 12;
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads * cs::kLanes, 0.0f);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      cs::VF acc[kAcc];
      for (int i = 0; i < kAcc; ++i) acc[i] = cs::set1(static_cast<float>(i));
      const cs::VF a = cs::set1(0.999f), b = cs::set1(1e-3f);
      for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
        for (int i = 0; i < kAcc; ++i) acc[i] = cs::fma(acc[i], a, b);
      }
      cs::VF s = acc[0];
      for (int i = 1; i < kAcc; ++i) s = cs::add(s, acc[i]);
      cs::store(sink.data() + t * cs::kLanes, s);
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float keep = sink[0];
  (void)keep;
  return static_cast<double>(threads) * iterations * kAcc * cs::kLanes * 2 / seconds / 1e9;
}

// The family's functions, registered on `m`: by its own module, or by tier_kernels.cpp's (all families in one).
inline void register_gemm(py::module& m) {
  m.def("gemm_pack", &gemm_pack, "bf16 [N, K] -> the batch-invariant matmul's panels [ceil(N/P), K, P]",
        py::arg("w"), py::arg("out") = py::none());
  m.def("gemm_packed_shape", &gemm_packed_shape, "shape of gemm_pack's result for an [N, K] weight");
  m.def("gemm_rows", &gemm_rows, "rows of the matrix behind a gemm_pack-packed weight");
  m.def("gemm", &gemm, "batch-invariant bf16 x W^T (+ bias) over a gemm_pack-packed weight");
  m.def("fma_peak_gflops", &fma_peak_gflops, "register-only fp32 fma GFLOP/s on all threads");
}

#ifndef CS_TIER_COMBINED
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { register_gemm(m); }
#endif
