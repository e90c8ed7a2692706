// bf16 matmul on Intel AMX tiles: y[m, n] = x[m, :] . W[n, :] (+ bias[n]), for any row count.
//
// Why: one AMX tile multiply (tdpbf16ps) does 16x16x32 multiply-adds, 16 times the work of
// the AVX512-BF16 vdpbf16ps that bounded our own kernel and oneDNN's small-M paths (~205
// GFLOP/s a core). With the weights packed once, at load time, into the tile layout the
// multiply expects, the decode matmuls become bound by memory bandwidth at every batch size
// we serve, and prefill by the tile unit. Numbers: BENCHMARKS.md ("AMX matmul").
//
// Part of the AVX512-BF16 tier's one extension: csrc/tier_kernels.cpp includes this file (in its own
// namespace) only under CHATSERVE_BF16, whose flags add -mamx-tile -mamx-bf16. The tile instructions
// run only where amx_available() (kernels/tiered.py checks the results before anything uses them).
//
// Packed weight layout, [NB][KB][16][32] bf16 (NB = ceil(N/16), KB = ceil(K/32), zero padded):
// block (nb, kb) is one 1 KiB B tile: row p holds, for the 16 output columns nb*16 + c, the
// pair of weights at k = kb*32 + 2p and 2p + 1 (the "VNNI" pairing tdpbf16ps reads).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kTileRows = 16;   // rows of x per A tile, and k pairs per B tile
constexpr int kTileK = 32;      // bf16 values of k per tile row
constexpr int kTileN = 16;      // output columns per B / C tile
constexpr int kBlockElems = kTileRows * kTileK;  // bf16 values per packed block (1 KiB)
constexpr int kMaxNT = 4;       // column blocks per pass over K (C tiles tmm0-3)
constexpr int kCStride = kMaxNT * kTileN;  // floats per row of the fp32 result buffer

// 16-row chunks per row block (prefill): 64 rows of x stay in L2 while a thread's weights pass.
// At M = 1000 over SmolLM2's weights: 32 / 64 / 256 / 1024 rows 218-245 / 208-215 / 221-229 / 251 ms.
constexpr int64_t kRowBlock = 4;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// `rows` rows in the C and A tiles of the one-chunk kernel (tmm0-4): fewer than 16 when x has fewer, so the A tile
// reads x in place and the multiplies skip the missing rows. B tiles (tmm5-7) are always full.
void configure_tiles(int rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;  // 16 fp32 (C) or 32 bf16 (A, B) per row
  }
  for (int t = 0; t <= 4; ++t) cfg.rows[t] = static_cast<uint8_t>(rows);
  _tile_loadconfig(&cfg);
}

// GCC's tile intrinsics paste their tile numbers into the assembly: they must be literals.
#define MUL_BLOCK(C, A, B, ptr) \
  do {                           \
    _tile_loadd(B, ptr, 64);     \
    _tile_dpbf16ps(C, A, B);     \
  } while (0)
// C tile (i, j) of a 32 x 64 fp32 result buffer
#define STORE_C(C, i, j, c) _tile_stored(C, (c) + (i) * kTileRows * kCStride + (j) * kTileN, kCStride * sizeof(float))

// One 16-row chunk of x times NT consecutive packed column blocks, over all of K.
// C tiles tmm0-3, A tmm4, B tiles rotating over tmm5-7. Used when x has at most 16 rows
// (decode: every weight block is loaded once and used once) and for an odd last chunk.
template <int NT>
void chunk_times_blocks(const at::BFloat16* a, int64_t a_stride_bytes, const at::BFloat16* w_blocks,
                        int64_t KB, float* c) {
  if (NT > 0) _tile_zero(0);
  if (NT > 1) _tile_zero(1);
  if (NT > 2) _tile_zero(2);
  if (NT > 3) _tile_zero(3);
  const int64_t col_stride = KB * kBlockElems;  // from one column block to the next
  for (int64_t kb = 0; kb < KB; ++kb) {
    const at::BFloat16* b = w_blocks + kb * kBlockElems;
    _tile_loadd(4, a + kb * kTileK, a_stride_bytes);
    if (NT > 0) MUL_BLOCK(0, 4, 5, b);
    if (NT > 1) MUL_BLOCK(1, 4, 6, b + col_stride);
    if (NT > 2) MUL_BLOCK(2, 4, 7, b + 2 * col_stride);
    if (NT > 3) MUL_BLOCK(3, 4, 5, b + 3 * col_stride);
  }
  if (NT > 0) STORE_C(0, 0, 0, c);
  if (NT > 1) STORE_C(1, 0, 1, c);
  if (NT > 2) STORE_C(2, 0, 2, c);
  if (NT > 3) STORE_C(3, 0, 3, c);
}

// Two 16-row chunks times NT (1 or 2) column blocks: C(i, j) in tmm(2i + j), A_i in tmm(4 + i),
// B_j in tmm(6 + j). Each loaded tile feeds two multiplies, halving the traffic per multiply
// for prefill, where the same weights pass many chunks of rows.
template <int NT>
void chunk_pair_times_blocks(const at::BFloat16* a0, int64_t a0_stride, const at::BFloat16* a1, int64_t a1_stride,
                             const at::BFloat16* w_blocks, int64_t KB, float* c) {
  _tile_zero(0);
  _tile_zero(2);
  if (NT > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const int64_t col_stride = KB * kBlockElems;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const at::BFloat16* b = w_blocks + kb * kBlockElems;
    _tile_loadd(4, a0 + kb * kTileK, a0_stride);
    _tile_loadd(5, a1 + kb * kTileK, a1_stride);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (NT > 1) {
      _tile_loadd(7, b + col_stride, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  STORE_C(0, 0, 0, c);
  STORE_C(2, 1, 0, c);
  if (NT > 1) {
    STORE_C(1, 0, 1, c);
    STORE_C(3, 1, 1, c);
  }
}

// fp32 tile results (+ bias) -> bf16 output rows [m0, m0 + rows), columns [n0, n0 + cols).
void write_out(const float* c, int rows, const at::BFloat16* bias, at::BFloat16* y, int64_t m0, int64_t n0,
               int64_t cols, int64_t N) {
  for (int64_t j = 0; j * kTileN < cols; ++j) {
    const int64_t width = std::min<int64_t>(kTileN, cols - j * kTileN);
    const __mmask16 mask = (__mmask16)((1u << width) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr) {
      __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n0 + j * kTileN);
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int r = 0; r < rows; ++r) {
      __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * kCStride + j * kTileN), b);
      __m256i out = (__m256i)_mm512_cvtneps_pbh(v);
      _mm256_mask_storeu_epi16(y + (m0 + r) * N + n0 + j * kTileN, mask, out);
    }
  }
}

}  // namespace

// True once this process may use AMX tiles (Linux hands out the 8 KiB tile state on request).
bool amx_available() {
  static const bool ok = [] {
    __builtin_cpu_init();
    unsigned eax, ebx, ecx, edx;
    __asm__ __volatile__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool tile = (edx >> 24) & 1, bf16 = (edx >> 22) & 1;
    if (!tile || !bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// [N, K] bf16 -> the packed [NB, KB, 16, 32] layout described at the top, into `out` when given
// (a view of a shared arena). Written in one pass, with no temporaries: the tied embedding of a
// small model is a fifth of its weights.
torch::Tensor amx_pack_weight(torch::Tensor w, c10::optional<torch::Tensor> out_opt) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "amx_pack_weight takes a bf16 [N, K] matrix");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t NB = (N + kTileN - 1) / kTileN, KB = (K + kTileK - 1) / kTileK;
  torch::Tensor out;
  if (out_opt.has_value() && out_opt->defined()) {
    out = *out_opt;
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() &&
                    out.sizes() == torch::IntArrayRef({NB, KB, kTileRows, kTileK}),
                "out must be a contiguous bf16 [", NB, ", ", KB, ", 16, 32] tensor");
  } else {
    out = torch::empty({NB, KB, kTileRows, kTileK}, w.options());
  }
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, NB, 16, [&](int64_t nb0, int64_t nb1) {
    for (int64_t nb = nb0; nb < nb1; ++nb)
      for (int64_t kb = 0; kb < KB; ++kb) {
        uint16_t* block = dst + (nb * KB + kb) * kBlockElems;
        for (int p = 0; p < kTileRows; ++p)
          for (int col = 0; col < kTileN; ++col)
            for (int e = 0; e < 2; ++e) {
              const int64_t n = nb * kTileN + col, k = kb * kTileK + 2 * p + e;
              block[p * kTileK + 2 * col + e] = (n < N && k < K) ? src[n * K + k] : 0;
            }
      }
  });
  return out;
}

// Rows `ids` of the [N, K] matrix a packed weight was made from: a tied embedding table
// looks tokens up in the lm_head's packed copy instead of keeping a second one.
torch::Tensor amx_packed_rows(torch::Tensor packed, torch::Tensor ids, int64_t N, int64_t K) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == kTileRows &&
                  packed.size(3) == kTileK && packed.is_contiguous(),
              "packed must come from amx_pack_weight");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be int64 [T]");
  const int64_t NB = packed.size(0), KB = packed.size(1), T = ids.size(0);
  TORCH_CHECK(K > (KB - 1) * kTileK && K <= KB * kTileK, "K does not match the packed weight");
  TORCH_CHECK(N > (NB - 1) * kTileN && N <= NB * kTileN, "N does not match the packed weight");
  ids = ids.contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(idp[t] >= 0 && idp[t] < N, "row id ", idp[t], " out of range for ", N, " rows");
  auto out = torch::empty({T, K}, packed.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());  // k pairs
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb = idp[t] / kTileN, col = idp[t] % kTileN;
      for (int64_t kb = 0; kb < KB; ++kb) {
        const uint32_t* block = src + (nb * KB + kb) * (kBlockElems / 2);
        for (int p = 0; p < kTileRows; ++p) {
          const int64_t k = kb * kTileK + 2 * p;
          if (k >= K) break;
          uint32_t pair = block[p * kTileN + col];
          std::memcpy(dst + t * K + k, &pair, (k + 1 < K ? 2 : 1) * sizeof(uint16_t));
        }
      }
    }
  });
  return out;
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(amx_available(), "AMX tiles are not available on this CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(2) == kTileRows && packed.size(3) == kTileK,
              "x must be [M, K] and the weight packed by amx_pack_weight");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KB = packed.size(1);
  TORCH_CHECK(KB == (K + kTileK - 1) / kTileK, "x has ", K, " columns; the packed weight was made for ", KB * kTileK);
  TORCH_CHECK(N > (NB - 1) * kTileN && N <= NB * kTileN, "N does not match the packed weight");
  packed = packed.contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::BFloat16* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == N, "bias must be bf16 [N]");
    bp = b.data_ptr<at::BFloat16>();
  }
  // A tiles read full rows of 32 k, 16 rows at a time: with K a multiple of 32, x is read in place,
  // all of it when M <= 16 (the tiles are configured for M rows); otherwise the rows past the last
  // full chunk, and with other K every row, are read from a zero-padded copy.
  const int64_t Kp = KB * kTileK;
  x = x.contiguous();
  const bool in_place = K == Kp;
  const int tile_rows = (M < kTileRows && in_place) ? static_cast<int>(M) : kTileRows;
  const int64_t full_chunks = !in_place ? 0 : (M < kTileRows ? 1 : M / kTileRows);
  const int64_t rest_rows = std::max<int64_t>(0, M - full_chunks * kTileRows);
  const int64_t chunks = full_chunks + (rest_rows + kTileRows - 1) / kTileRows;
  std::vector<at::BFloat16> rest;  // the zero-padded copy
  if (rest_rows > 0) {
    rest.assign((chunks - full_chunks) * kTileRows * Kp, at::BFloat16(0.0f));
    const at::BFloat16* src = x.data_ptr<at::BFloat16>() + full_chunks * kTileRows * K;
    for (int64_t r = 0; r < rest_rows; ++r) std::memcpy(rest.data() + r * Kp, src + r * K, K * sizeof(at::BFloat16));
  }
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* rp = rest.data();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();

  auto a_ptr = [&](int64_t ch) { return ch < full_chunks ? xp + ch * kTileRows * K : rp + (ch - full_chunks) * kTileRows * Kp; };
  auto a_stride = [&](int64_t ch) { return (ch < full_chunks ? K : Kp) * static_cast<int64_t>(sizeof(at::BFloat16)); };

  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), NB));
  at::parallel_for(0, nthreads, 1, [&](int64_t t0, int64_t t1) {
    configure_tiles(tile_rows);
    alignas(64) float c[2 * kTileRows * kCStride];
    for (int64_t t = t0; t < t1; ++t) {
      // contiguous column blocks per thread, as even as the blocks allow
      const int64_t nb0 = NB * t / nthreads, nb1 = NB * (t + 1) / nthreads;
      const int group = chunks == 1 ? kMaxNT : 2;
      // rows in blocks of kRowBlock chunks so their x stays in L2 while all the thread's weights pass
      for (int64_t cb = 0; cb < chunks; cb += kRowBlock) {
        const int64_t cb_end = std::min<int64_t>(chunks, cb + kRowBlock);
        for (int64_t nb = nb0; nb < nb1; nb += group) {
          const int nt = static_cast<int>(std::min<int64_t>(group, nb1 - nb));
          const at::BFloat16* wblocks = wp + nb * KB * kBlockElems;
          const int64_t n0 = nb * kTileN;
          const int64_t cols = std::min<int64_t>(N, (nb + nt) * kTileN) - n0;
          int64_t ch = cb;
          for (; ch + 2 <= cb_end; ch += 2) {
            if (nt == 2) {
              chunk_pair_times_blocks<2>(a_ptr(ch), a_stride(ch), a_ptr(ch + 1), a_stride(ch + 1), wblocks, KB, c);
            } else {
              chunk_pair_times_blocks<1>(a_ptr(ch), a_stride(ch), a_ptr(ch + 1), a_stride(ch + 1), wblocks, KB, c);
            }
            const int rows = static_cast<int>(std::min<int64_t>(2 * kTileRows, M - ch * kTileRows));
            write_out(c, rows, bp, yp, ch * kTileRows, n0, cols, N);
          }
          if (ch < cb_end) {
            switch (nt) {
              case 4: chunk_times_blocks<4>(a_ptr(ch), a_stride(ch), wblocks, KB, c); break;
              case 3: chunk_times_blocks<3>(a_ptr(ch), a_stride(ch), wblocks, KB, c); break;
              case 2: chunk_times_blocks<2>(a_ptr(ch), a_stride(ch), wblocks, KB, c); break;
              default: chunk_times_blocks<1>(a_ptr(ch), a_stride(ch), wblocks, KB, c); break;
            }
            const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - ch * kTileRows));
            write_out(c, rows, bp, yp, ch * kTileRows, n0, cols, N);
          }
        }
      }
    }
    _tile_release();
  });
  return y;
}

// The family's functions, registered on tier_kernels.cpp's module (the AVX512-BF16 tier only).
inline void register_amx(py::module& m) {
  m.def("amx_available", &amx_available, "whether this process may use AMX tiles");
  m.def("amx_pack_weight", &amx_pack_weight, "bf16 [N, K] -> AMX tile layout [NB, KB, 16, 32]",
        py::arg("w"), py::arg("out") = py::none());
  m.def("amx_packed_rows", &amx_packed_rows, "rows of the matrix behind an AMX-packed weight");
  m.def("amx_linear", &amx_linear, "bf16 x W^T (+ bias) over an AMX-packed weight");
}
