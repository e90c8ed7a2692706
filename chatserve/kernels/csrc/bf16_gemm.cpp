// Batch-invariant bf16 matmul for CPUs with AVX512-BF16: y[m, n] = x[m, :] . W[n, :] (+ bias[n]),
// one kernel for every row count, over weights packed once at load.
//
// Why: the result of a row must not depend on how many other rows share the call (issue #20): the
// last prompt token computed in a prefill of 1,000 rows and the same token decoded alone must give
// the same bits, or greedy output changes with batch composition and the prefix cache. The old
// path (csrc/bf16_gemv.cpp: dot products reduced horizontally, oneDNN above 128 rows) rounded a row
// differently at every M. Here each output element is ONE accumulation chain, the same for every M
// and every row position:
//
//     acc = 0;  for kp in 0 .. ceil(K/2)-1:  acc = vdpbf16ps(acc, W[n, 2kp:2kp+2], x[m, 2kp:2kp+2]);
//     y[m, n] = bf16_rne(acc + bias[n])
//
// in one fp32 lane of one zmm accumulator. Register tiles, row tiles, column tiles, cache blocks
// and the thread split only decide WHICH elements are computed together, never how one is: there
// is no split-K, no horizontal reduction, no second library above some M.
//
// Packed weight layout, [G][Kp][64][2] bf16 (G = ceil(N/64) groups of 64 outputs, Kp = ceil(K/2)
// k pairs, zero padded): for k pair kp, the 64 outputs of a group lie side by side, each as the
// pair (W[n, 2kp], W[n, 2kp+1]) that vdpbf16ps multiplies with a broadcast pair of x. One "zmm
// column" (16 outputs) takes 64 bytes, one cache line, per k pair; a group's 4 zmm columns are
// 256 contiguous bytes per k pair, so a register tile streams its weights as one sequential run.
//
// Register tiles: up to 6 rows x 4 zmm columns (24 accumulators, 4 weight registers, x pairs as
// embedded broadcasts): 24 vdpbf16ps per 4 weight loads and 6 broadcasts. With at most 3 rows
// (decode) 8 zmm columns, so there are still >= 8 independent chains to cover the latency while
// the weights stream from memory once for all rows (memory bound: prefetched ahead as
// bf16_gemv.cpp does). Numbers: BENCHMARKS.md ("Batch-invariant matmul").
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kZmmCols = 16;                    // outputs per zmm column
constexpr int kGroupZmm = 4;                    // zmm columns per packed group
constexpr int kGroupCols = kZmmCols * kGroupZmm;  // 64 outputs per group
constexpr int kPairElems = kGroupCols * 2;      // bf16 values per k pair of one group (256 B)
constexpr int kMaxTileRows = 6;                 // rows of a register tile (24 accumulators at 4 columns)
constexpr int kWideRows = 3;                    // up to this many rows, tiles are 8 zmm columns wide

// Cache blocks (for large M): the weights of a block of columns (<= GEMM_COL_BLOCK_BYTES) stay in L2
// while every block of GEMM_ROW_BLOCK rows passes them, and a row block's x (96 x K bf16, 110 KB at
// K = 576, 295 KB at 1536) stays in L2 while the column tiles of the block pass. So each weight comes
// from memory once per call and each row of x once per column block. Without the column blocks the
// weights of a 3072 x 576 projection (3.5 MB, past L2) streamed again for every 96 rows: M = 1000
// ran at ~190 GFLOP/s on one core instead of ~450.
#ifndef GEMM_ROW_BLOCK
#define GEMM_ROW_BLOCK 96
#endif
#ifndef GEMM_COL_BLOCK_BYTES
#define GEMM_COL_BLOCK_BYTES (448 * 1024)
#endif
// Threads split the zmm columns (the weights are read once in all, as decode needs), unless there
// are at least this many rows and too few columns for an even split (under GEMM_SPLIT_COLS_MIN zmm
// columns per thread: 576 or 960 outputs on 2 threads); then they split the rows (each reads all
// the weights; perfect balance for any N).
#ifndef GEMM_SPLIT_ROWS_MIN
#define GEMM_SPLIT_ROWS_MIN 64
#endif
#ifndef GEMM_SPLIT_COLS_MIN
#define GEMM_SPLIT_COLS_MIN 32
#endif
// The first row tile over a column tile streams its weights from memory: prefetch this many k
// pairs ahead (each k pair is one cache line per zmm column).
#ifndef GEMM_PF_PAIRS
#define GEMM_PF_PAIRS 24
#endif
#ifndef GEMM_PF_HINT
#define GEMM_PF_HINT _MM_HINT_T0
#endif

typedef int32_t __attribute__((may_alias, aligned(2))) pair_t;  // two adjacent bf16 of x

struct Problem {
  const uint16_t* x;  // [M, lda] rows, K (even) values used per row
  int64_t lda;
  const uint16_t* w;  // packed [G][Kp][64][2]
  int64_t kp;         // k pairs
  const uint16_t* bias;  // [N] or nullptr
  uint16_t* y;           // [M, N]
  int64_t n;
};

__attribute__((always_inline)) inline __mmask16 column_mask(int64_t first, int64_t n) {
  const int64_t left = n - first;
  return left >= kZmmCols ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

// MR rows (m0 ..) x NZ zmm columns (c0 ..) over all of K: the only place that does arithmetic.
template <int MR, int NZ, bool PF>
void tile(const Problem& p, int64_t m0, int64_t c0) {
  const int64_t group_stride = p.kp * kPairElems;
  const uint16_t* wp[NZ];
#pragma GCC unroll 8
  for (int j = 0; j < NZ; ++j) {
    const int64_t c = c0 + j;
    wp[j] = p.w + (c / kGroupZmm) * group_stride + (c % kGroupZmm) * (kZmmCols * 2);
  }
  const uint16_t* xp[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) xp[m] = p.x + (m0 + m) * p.lda;
  __m512 acc[MR][NZ];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int j = 0; j < NZ; ++j) acc[m][j] = _mm512_setzero_ps();

  for (int64_t kp = 0; kp < p.kp; ++kp) {
    const int64_t off = kp * kPairElems;
    __m512bh wv[NZ];
#pragma GCC unroll 8
    for (int j = 0; j < NZ; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp[j] + off);
    if (PF) {
#pragma GCC unroll 8
      for (int j = 0; j < NZ; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wp[j] + off + GEMM_PF_PAIRS * kPairElems), GEMM_PF_HINT);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const pair_t*>(xp[m] + 2 * kp));
#pragma GCC unroll 8
      for (int j = 0; j < NZ; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
    }
  }

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
      // acc + 0 for no bias: the same bits as acc (-0 aside, which a bias-free path never changes)
      const __m512 v = p.bias != nullptr ? _mm512_add_ps(acc[m][j], b) : acc[m][j];
      _mm256_mask_storeu_epi16(p.y + (m0 + m) * p.n + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

using TileFn = void (*)(const Problem&, int64_t, int64_t);

#define GEMM_TILE_CASE(MR, NZ) \
  case (MR) * 16 + (NZ):       \
    return pf ? &tile<MR, NZ, true> : &tile<MR, NZ, false>;

TileFn tile_fn(int mr, int nz, bool pf) {
  switch (mr * 16 + nz) {
    GEMM_TILE_CASE(1, 1) GEMM_TILE_CASE(1, 2) GEMM_TILE_CASE(1, 3) GEMM_TILE_CASE(1, 4)
    GEMM_TILE_CASE(1, 5) GEMM_TILE_CASE(1, 6) GEMM_TILE_CASE(1, 7) GEMM_TILE_CASE(1, 8)
    GEMM_TILE_CASE(2, 1) GEMM_TILE_CASE(2, 2) GEMM_TILE_CASE(2, 3) GEMM_TILE_CASE(2, 4)
    GEMM_TILE_CASE(2, 5) GEMM_TILE_CASE(2, 6) GEMM_TILE_CASE(2, 7) GEMM_TILE_CASE(2, 8)
    GEMM_TILE_CASE(3, 1) GEMM_TILE_CASE(3, 2) GEMM_TILE_CASE(3, 3) GEMM_TILE_CASE(3, 4)
    GEMM_TILE_CASE(3, 5) GEMM_TILE_CASE(3, 6) GEMM_TILE_CASE(3, 7) GEMM_TILE_CASE(3, 8)
    GEMM_TILE_CASE(4, 1) GEMM_TILE_CASE(4, 2) GEMM_TILE_CASE(4, 3) GEMM_TILE_CASE(4, 4)
    GEMM_TILE_CASE(5, 1) GEMM_TILE_CASE(5, 2) GEMM_TILE_CASE(5, 3) GEMM_TILE_CASE(5, 4)
    GEMM_TILE_CASE(6, 1) GEMM_TILE_CASE(6, 2) GEMM_TILE_CASE(6, 3) GEMM_TILE_CASE(6, 4)
    default: TORCH_CHECK(false, "bf16_gemm: no register tile of ", mr, " rows x ", nz, " columns");
  }
}
#undef GEMM_TILE_CASE

// Rows [r0, r1) x zmm columns [c0, c1): cache blocks of columns and rows, column tiles, row tiles.
// Only the grouping of elements into tiles depends on the sizes here.
void run_block(const Problem& p, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  const int64_t zmm_bytes = p.kp * kZmmCols * 2 * static_cast<int64_t>(sizeof(uint16_t));  // one zmm column's weights
  const int64_t col_block = std::max<int64_t>(kGroupZmm, GEMM_COL_BLOCK_BYTES / zmm_bytes / kGroupZmm * kGroupZmm);
  for (int64_t cb = c0; cb < c1; cb += col_block) {
    const int64_t cb_end = std::min<int64_t>(c1, cb + col_block);
    for (int64_t mb = r0; mb < r1; mb += GEMM_ROW_BLOCK) {
      const int64_t rows = std::min<int64_t>(GEMM_ROW_BLOCK, r1 - mb);
      const int64_t tiles = (rows + kMaxTileRows - 1) / kMaxTileRows;
      const int64_t base = rows / tiles, extra = rows % tiles;  // rows spread evenly over the tiles
      const int width = rows <= kWideRows ? 2 * kGroupZmm : kGroupZmm;
      for (int64_t c = cb; c < cb_end; c += width) {
        const int nz = static_cast<int>(std::min<int64_t>(width, cb_end - c));
        int64_t m = mb;
        for (int64_t t = 0; t < tiles; ++t) {
          const int mr = static_cast<int>(base + (t < extra ? 1 : 0));
          tile_fn(mr, nz, t == 0 && mb == r0)(p, m, c);  // prefetch where the weights come from memory
          m += mr;
        }
      }
    }
  }
}

void check_packed(const torch::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kGroupCols &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be the contiguous bf16 [ceil(N/64), ceil(K/2), 64, 2] tensor of bf16_gemm_pack");
}

}  // namespace

// [N, K] bf16 -> the packed [G, Kp, 64, 2] layout described at the top, into `out` when given (a
// view of the weight arena), in one pass with no temporaries.
torch::Tensor bf16_gemm_pack(torch::Tensor w, c10::optional<torch::Tensor> out_opt) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "bf16_gemm_pack takes a bf16 [N, K] matrix");
  TORCH_CHECK(w.size(0) > 0 && w.size(1) > 0, "bf16_gemm_pack: empty weight ", w.sizes());
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t G = (N + kGroupCols - 1) / kGroupCols, Kp = (K + 1) / 2;
  torch::Tensor out;
  if (out_opt.has_value() && out_opt->defined()) {
    out = *out_opt;
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() &&
                    out.sizes() == torch::IntArrayRef({G, Kp, kGroupCols, 2}),
                "out must be a contiguous bf16 [", G, ", ", Kp, ", 64, 2] tensor");
  } else {
    out = torch::empty({G, Kp, kGroupCols, 2}, w.options());
  }
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t kp = 0; kp < Kp; ++kp) {
        uint16_t* row = dst + (g * Kp + kp) * kPairElems;
        for (int col = 0; col < kGroupCols; ++col)
          for (int e = 0; e < 2; ++e) {
            const int64_t n = g * kGroupCols + col, k = 2 * kp + e;
            row[2 * col + e] = (n < N && k < K) ? src[n * K + k] : 0;
          }
      }
  });
  return out;
}

// Rows `ids` of the [N, K] matrix a packed weight was made from, bit for bit: a tied embedding
// looks tokens up in the lm_head's packed copy instead of keeping a second one.
torch::Tensor bf16_gemm_rows(torch::Tensor packed, torch::Tensor ids, int64_t N, int64_t K) {
  check_packed(packed);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be int64 [T]");
  const int64_t G = packed.size(0), Kp = packed.size(1), T = ids.size(0);
  TORCH_CHECK(K >= 1 && (K + 1) / 2 == Kp, "K = ", K, " does not match the packed weight (", Kp, " k pairs)");
  TORCH_CHECK(N > (G - 1) * kGroupCols && N <= G * kGroupCols, "N = ", N, " does not match the packed weight");
  ids = ids.contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "row id ", idp[t], " out of range for ", N, " rows");
  auto out = torch::empty({T, K}, packed.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = idp[t] / kGroupCols, col = idp[t] % kGroupCols;
      const uint16_t* base = src + g * Kp * kPairElems + 2 * col;
      for (int64_t k = 0; k < K; ++k) dst[t * K + k] = base[(k / 2) * kPairElems + (k % 2)];
    }
  });
  return out;
}

torch::Tensor bf16_gemm(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bf16_gemm: x must be bf16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "bf16_gemm: x must be 2-D [M, K], got ", x.dim(), " dimensions");
  check_packed(packed);
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0), Kp = packed.size(1);
  TORCH_CHECK(K >= 1 && (K + 1) / 2 == Kp, "bf16_gemm: x has ", K, " columns; the packed weight was made for ",
              2 * Kp - 1, " or ", 2 * Kp);
  TORCH_CHECK(N > (G - 1) * kGroupCols && N <= G * kGroupCols, "bf16_gemm: N = ", N,
              " does not match the packed weight (", G, " groups of 64)");
  TORCH_CHECK(M == 0 || x.stride(1) == 1 || K == 1, "bf16_gemm: x must have unit stride along K (rows of a row-major "
              "matrix), got strides ", x.strides());
  TORCH_CHECK(M <= 1 || x.stride(0) >= K, "bf16_gemm: x rows overlap (row stride ", x.stride(0), " < K = ", K, ")");
  const uint16_t* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = *bias;
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.dim() == 1 && b.numel() == N, "bf16_gemm: bias must be bf16 [",
                N, "], got ", b.scalar_type(), " ", b.sizes());
    b = b.contiguous();
    bp = reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>());
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  // An odd K: the last k pair would read one value past each row, so x is copied with a zero column
  // (the packed weight has one there too). Every row gets the same treatment, whatever M.
  torch::Tensor xs = x;
  int64_t lda = M == 1 ? K : x.stride(0);
  if (K % 2 == 1) {
    xs = torch::zeros({M, K + 1}, x.options());
    xs.narrow(1, 0, K).copy_(x);
    lda = K + 1;
  }
  Problem p{reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>()), lda,
            reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), Kp, bp,
            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), N};
  const int64_t C = (N + kZmmCols - 1) / kZmmCols;  // zmm columns
  int64_t threads = at::get_num_threads();
  if (M * N * K < (int64_t(1) << 18)) threads = 1;  // a tiny product: not worth waking a thread
  const bool split_rows = M >= GEMM_SPLIT_ROWS_MIN && C < GEMM_SPLIT_COLS_MIN * threads;
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, split_rows ? M : C));
  if (threads == 1) {
    run_block(p, 0, M, 0, C);
    return y;
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

// GFLOP/s of vdpbf16ps on registers only (no memory operands), on every thread at once: the ceiling
// the matmul is measured against. 24 independent accumulators per thread cover the latency.
double bf16_dot_peak_gflops(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "iterations must be positive");
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads * 16, 0.0f);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      __m512 acc[24];
      for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
      __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3c003c00);
      for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 24
        for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(a), "+v"(b));  // keep the operands in registers, the loop alive
      }
      __m512 s = acc[0];
      for (int i = 1; i < 24; ++i) s = _mm512_add_ps(s, acc[i]);
      _mm512_storeu_ps(sink.data() + t * 16, s);
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float keep = sink[0];
  (void)keep;
  return static_cast<double>(threads) * iterations * 24 * 64 / seconds / 1e9;  // 32 multiply-adds per instruction
}
