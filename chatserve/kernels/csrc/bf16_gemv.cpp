// Small-batch bf16 matmul for CPUs with AVX512-BF16: y[m, n] = x[m, :] . W[n, :] (+ bias[n]).
//
// Why: decoding reads every weight once per token, so it is bound by memory
// bandwidth. oneDNN's AMX path reaches ~13 GB/s at M = 1 on the dev box; a
// plain streaming dot product with vdpbf16ps, rows split across threads,
// reads the weights at close to the machine's bandwidth.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cstring>

namespace {

using chatserve_simd::reduce16;

// Up to 8 rows: prefetch the weight row GEMV_PF_ROWS rows ahead into L2. Over SmolLM2's weights at
// M = 1 (cold caches): 4 rows ahead into L1 12.2 ms, 16 ahead into L2 7.1-9.2 ms (up to ~38 GB/s).
#ifndef GEMV_PF_ROWS
#define GEMV_PF_ROWS 16
#endif
#ifndef GEMV_PF_HINT
#define GEMV_PF_HINT _MM_HINT_T1
#endif
#ifndef PF_AHEAD
#define PF_AHEAD 8
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#ifndef GEMM_MB
#define GEMM_MB 4
#endif

__attribute__((always_inline)) inline __m512bh load_bf16(const at::BFloat16* p, int64_t remaining) {
  if (remaining >= 32) {
    return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
  }
  __mmask32 mask = (remaining <= 0) ? 0 : (__mmask32)((1ull << remaining) - 1);
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, reinterpret_cast<const void*>(p));
}

// R weight rows at a time give R*M independent accumulator chains, hiding the
// latency of vdpbf16ps; each weight vector is loaded once and used for all M rows of x.
template <int M, int R>
void gemv_rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
               at::BFloat16* y, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) xv[m] = load_bf16(x + m * K + k, K - k);
      for (int r = 0; r < R; ++r) {
        const at::BFloat16* wrow = w + (n + r) * K;
        _mm_prefetch(reinterpret_cast<const char*>(wrow + k + GEMV_PF_ROWS * K), GEMV_PF_HINT);
        __m512bh wv = load_bf16(wrow + k, K - k);
        for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float b = bias ? static_cast<float>(bias[n + r]) : 0.0f;
      for (int m = 0; m < M; ++m) y[m * N + n + r] = at::BFloat16(_mm512_reduce_add_ps(acc[r][m]) + b);
    }
  }
  for (; n < n1; ++n) {  // leftover rows
    const at::BFloat16* wrow = w + n * K;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh wv = load_bf16(wrow + k, K - k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], wv, load_bf16(x + m * K + k, K - k));
    }
    float b = bias ? static_cast<float>(bias[n]) : 0.0f;
    for (int m = 0; m < M; ++m) y[m * N + n] = at::BFloat16(_mm512_reduce_add_ps(acc[m]) + b);
  }
}


// Batches of 9-64 rows (decode of many sequences): the same dot-product scheme, tiled so that a
// block of R weight rows stays in L1 while every group of MB input rows streams past it; weights
// are still read from memory once per call. A full tile has R * MB = 16 accumulators, reduced
// together by reduce16.
// PREFETCH: the first pass over a weight block also pulls the block PF_AHEAD blocks ahead into L2
// (measured at M = 16/32/64 over SmolLM2's weights: 1 block ahead into L1 20.4/29.9/49.8 ms,
// 8 ahead into L2 16.3/28.4/48.5 ms), so the weight stream overlaps with the compute.
template <int MB, int R, bool PREFETCH>
inline void tile_full(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y,
                      int64_t m0, int64_t n, int64_t N, int64_t K) {
  static_assert(MB * R == 16, "a full tile has 16 accumulators");
  __m512 acc[R * MB];
  _Pragma("GCC unroll 16") for (int i = 0; i < R * MB; ++i) acc[i] = _mm512_setzero_ps();
  const at::BFloat16* xs = x + m0 * K;
  const at::BFloat16* ws = w + n * K;
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[R];
    _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) wv[r] = load_bf16(ws + r * K + k, K - k);
    if (PREFETCH) {
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(ws + (PF_AHEAD * R + r) * K + k), PF_HINT);
    }
    _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m) {
      __m512bh xv = load_bf16(xs + m * K + k, K - k);
      _Pragma("GCC unroll 16") for (int r = 0; r < R; ++r) acc[m * R + r] = _mm512_dpbf16_ps(acc[m * R + r], wv[r], xv);
    }
  }
  // reduce16 leaves output (m, r) in lane m * R + r: each group of R lanes is R adjacent outputs of
  // one row of y, so bias, rounding and stores are vector ops.
  __m512 res = reduce16(acc);
  if (bias) {
    alignas(64) float bv[16];
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) bv[i] = static_cast<float>(bias[n + i % R]);
    res = _mm512_add_ps(res, _mm512_load_ps(bv));
  }
  alignas(32) at::BFloat16 packed[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(packed), (__m256i)_mm512_cvtneps_pbh(res));
  _Pragma("GCC unroll 16") for (int m = 0; m < MB; ++m)
    std::memcpy(y + (m0 + m) * N + n, packed + m * R, R * sizeof(at::BFloat16));
}

// Leftover rows of x (fewer than MB) against R weight rows.
template <int R>
inline void tile_rest(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y,
                      int64_t m0, int64_t mcount, int64_t n, int64_t N, int64_t K) {
  for (int64_t m = m0; m < m0 + mcount; ++m) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh xv = load_bf16(x + m * K + k, K - k);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], load_bf16(w + (n + r) * K + k, K - k), xv);
    }
    for (int r = 0; r < R; ++r) {
      float b = bias ? static_cast<float>(bias[n + r]) : 0.0f;
      y[m * N + n + r] = at::BFloat16(_mm512_reduce_add_ps(acc[r]) + b);
    }
  }
}

template <int MB, int R>
void gemm_rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y,
               int64_t M, int64_t n0, int64_t n1, int64_t N, int64_t K) {
  const int64_t mfull = M - M % MB;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    int64_t m = 0;
    if (mfull > 0 && n + (PF_AHEAD + 1) * R <= n1) {
      tile_full<MB, R, true>(x, w, bias, y, 0, n, N, K);
      m = MB;
    }
    for (; m < mfull; m += MB) tile_full<MB, R, false>(x, w, bias, y, m, n, N, K);
    if (mfull < M) tile_rest<R>(x, w, bias, y, mfull, M - mfull, n, N, K);
  }
  for (; n < n1; ++n) tile_rest<1>(x, w, bias, y, 0, M, n, N, K);
}

template <int M>
void run(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias, at::BFloat16* y,
         int64_t N, int64_t K) {
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { gemv_rows<M, R>(x, w, bias, y, n0, n1, N, K); });
}

}  // namespace

torch::Tensor bf16_gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  TORCH_CHECK(M >= 1, "x has no rows");
  auto y = torch::empty({M, N}, x.options());
  const at::BFloat16* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    bp = b.data_ptr<at::BFloat16>();
  }
  auto xp = x.data_ptr<at::BFloat16>();
  auto wp = w.data_ptr<at::BFloat16>();
  auto yp = y.data_ptr<at::BFloat16>();
  switch (M) {
    case 1: run<1>(xp, wp, bp, yp, N, K); break;
    case 2: run<2>(xp, wp, bp, yp, N, K); break;
    case 3: run<3>(xp, wp, bp, yp, N, K); break;
    case 4: run<4>(xp, wp, bp, yp, N, K); break;
    case 5: run<5>(xp, wp, bp, yp, N, K); break;
    case 6: run<6>(xp, wp, bp, yp, N, K); break;
    case 7: run<7>(xp, wp, bp, yp, N, K); break;
    case 8: run<8>(xp, wp, bp, yp, N, K); break;
    default:
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { gemm_rows<GEMM_MB, 16 / GEMM_MB>(xp, wp, bp, yp, M, n0, n1, N, K); });
      break;
  }
  return y;
}

// kernels/csrc/amx_gemm.cpp
bool amx_available();
torch::Tensor huge_page_zeros(int64_t numel);
void release_free_memory();
torch::Tensor amx_pack_weight(torch::Tensor w, c10::optional<torch::Tensor> out);
torch::Tensor amx_packed_rows(torch::Tensor packed, torch::Tensor ids, int64_t N, int64_t K);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N);

// kernels/csrc/bf16_gemm.cpp
torch::Tensor bf16_gemm_pack(torch::Tensor w, c10::optional<torch::Tensor> out);
torch::Tensor bf16_gemm_rows(torch::Tensor packed, torch::Tensor ids, int64_t N, int64_t K);
torch::Tensor bf16_gemm(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N);
double bf16_dot_peak_gflops(int64_t iterations);

// kernels/csrc/cpu_attention.cpp
torch::Tensor paged_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor start_pos,
                                   torch::Tensor seq_order, torch::Tensor group_start, double scale,
                                   int64_t window, double softcap);
void store_kv_bf16(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping);
void store_kv_paged_bf16(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor slot_mapping);

// kernels/csrc/cpu_fused.cpp
torch::Tensor silu_mul_bf16(torch::Tensor x);
void rope_inplace_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim);
torch::Tensor add_rms_norm_bf16(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor gelu_tanh_mul_bf16(torch::Tensor x);
torch::Tensor rms_norm_f32w_bf16(torch::Tensor x, torch::Tensor w, double eps);
void softcap_f32_(torch::Tensor x, double cap);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_available", &amx_available, "whether this process may use AMX tiles");
  m.def("amx_pack_weight", &amx_pack_weight, "bf16 [N, K] -> AMX tile layout [NB, KB, 16, 32]",
        py::arg("w"), py::arg("out") = py::none());
  m.def("release_free_memory", &release_free_memory, "malloc_trim: return freed heap pages to the OS");
  m.def("huge_page_zeros", &huge_page_zeros, "zeroed bf16 memory advised for transparent huge pages");
  m.def("amx_packed_rows", &amx_packed_rows, "rows of the matrix behind an AMX-packed weight");
  m.def("amx_linear", &amx_linear, "bf16 x W^T (+ bias) over an AMX-packed weight");
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu(gate) * up of a bf16 [M, 2I] gate|up tensor");
  m.def("rope_inplace_bf16", &rope_inplace_bf16, "rotate-half rotary embedding, in place");
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, "residual += x, then RMSNorm of the residual");
  m.def("store_kv_bf16", &store_kv_bf16, "new tokens' K/V rows into their paged-cache slots");
  m.def("store_kv_paged_bf16", &store_kv_paged_bf16, "new tokens' K/V into their slots, in paged_attention_bf16's layout");
  m.def("paged_attention_bf16", &paged_attention_bf16, "prefill, extend and decode attention over a bf16 paged KV cache",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("start_pos"), py::arg("seq_order"), py::arg("group_start"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
  m.def("bf16_gemv", &bf16_gemv, "small-batch bf16 x W^T");
  m.def("bf16_gemm_pack", &bf16_gemm_pack, "bf16 [N, K] -> the batch-invariant matmul's layout [G, Kp, 64, 2]",
        py::arg("w"), py::arg("out") = py::none());
  m.def("bf16_gemm_rows", &bf16_gemm_rows, "rows of the matrix behind a bf16_gemm-packed weight");
  m.def("bf16_gemm", &bf16_gemm, "batch-invariant bf16 x W^T (+ bias) over a bf16_gemm-packed weight");
  m.def("bf16_dot_peak_gflops", &bf16_dot_peak_gflops, "register-only vdpbf16ps GFLOP/s on all threads");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm of bf16 rows");
  m.def("gelu_tanh_mul_bf16", &gelu_tanh_mul_bf16, "gelu_tanh(gate) * up of a bf16 [M, 2I] gate|up tensor");
  m.def("rms_norm_f32w_bf16", &rms_norm_f32w_bf16, "RMSNorm of bf16 rows with an fp32 weight");
  m.def("softcap_f32_", &softcap_f32_, "x = tanh(x / cap) * cap in place on fp32");
}
