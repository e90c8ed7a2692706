// Small-batch bf16 matmul for CPUs with AVX512-BF16: y[m, n] = x[m, :] . W[n, :] (+ bias[n]).
//
// Why: decoding reads every weight once per token, so it is bound by memory
// bandwidth. oneDNN's AMX path reaches ~13 GB/s at M = 1 on the dev box; a
// plain streaming dot product with vdpbf16ps, rows split across threads,
// reads the weights at close to the machine's bandwidth.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

namespace {

constexpr int kMaxM = 8;

inline __m512bh load_bf16(const at::BFloat16* p, int64_t remaining) {
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
        _mm_prefetch(reinterpret_cast<const char*>(wrow + k + 4 * K), _MM_HINT_T0);
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
  TORCH_CHECK(M >= 1 && M <= kMaxM, "M must be in [1, 8]");
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
    default: run<8>(xp, wp, bp, yp, N, K); break;
  }
  return y;
}

// RMSNorm over the last dim of a bf16 [M, D] tensor, computed in fp32 with one rounding at the end.
// Why: torch's fused rms_norm costs 50-100 us a call on small batches here (an OpenMP region per
// call); a decode step makes 61 of them. Rows run serially unless there are many.
torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "shape mismatch");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), D = x.size(1);
  auto y = torch::empty_like(x);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const at::BFloat16* row = xp + m * D;
      float ss = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        float v = static_cast<float>(row[d]);
        ss += v * v;
      }
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
      at::BFloat16* out = yp + m * D;
      for (int64_t d = 0; d < D; ++d) out[d] = at::BFloat16(static_cast<float>(row[d]) * r * static_cast<float>(wp[d]));
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_gemv", &bf16_gemv, "small-batch bf16 x W^T");
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm of bf16 rows");
}
