// Fused elementwise ops of a decoder layer, for bf16 activations on AVX-512 CPUs.
//
// Why: at decode batch sizes each torch elementwise op is a few microseconds of work behind tens
// of microseconds of dispatch and OpenMP wake-up, and a layer made five of them (rotary: neg, cat,
// mul, addcmul; MLP: silu, mul). One pass each here, computed in fp32 and rounded to bf16 once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <cmath>

namespace {

using chatserve_simd::exp_ps;
using chatserve_simd::load16_bf16_as_fp32;
using chatserve_simd::store16_fp32_as_bf16;

// Rows run serially below this many (an OpenMP region costs more than the work).
constexpr int64_t kSerialRows = 64;

// out = row / rms(row) * w, in fp32 with one rounding at the end (any D; 16 at a time, then a tail).
void rms_norm_row(const at::BFloat16* row, const at::BFloat16* w, at::BFloat16* out, int64_t D, float eps) {
  const int64_t Dv = D - D % 16;
  __m512 ss = _mm512_setzero_ps();
  for (int64_t d = 0; d < Dv; d += 16) {
    const __m512 v = load16_bf16_as_fp32(row + d);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  float sum = _mm512_reduce_add_ps(ss);
  for (int64_t d = Dv; d < D; ++d) sum += static_cast<float>(row[d]) * static_cast<float>(row[d]);
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t d = 0; d < Dv; d += 16)
    store16_fp32_as_bf16(out + d, _mm512_mul_ps(_mm512_mul_ps(load16_bf16_as_fp32(row + d), rv), load16_bf16_as_fp32(w + d)));
  for (int64_t d = Dv; d < D; ++d) out[d] = at::BFloat16(static_cast<float>(row[d]) * r * static_cast<float>(w[d]));
}

}  // namespace

// x [M, 2I] = [gate | up] -> silu(gate) * up, [M, I].
torch::Tensor silu_mul_bf16(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) % 32 == 0, "bf16 [M, 2I], I % 16 == 0");
  x = x.contiguous();
  const int64_t M = x.size(0), I = x.size(1) / 2;
  auto y = torch::empty({M, I}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const at::BFloat16* gate = xp + m * 2 * I;
      const at::BFloat16* up = gate + I;
      for (int64_t i = 0; i < I; i += 16) {
        const __m512 g = load16_bf16_as_fp32(gate + i);
        // silu(g) = g / (1 + e^-g); exp_ps wants x <= 0, so use e^-|g| and flip for g < 0
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));  // e^-|g| in (0, 1]
        const __m512 one = _mm512_set1_ps(1.0f);
        const __m512 sig_pos = _mm512_div_ps(one, _mm512_add_ps(one, e));         // sigmoid(|g|)
        const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 sig = _mm512_mask_sub_ps(sig_pos, neg, one, sig_pos);         // sigmoid(g)
        store16_fp32_as_bf16(yp + m * I + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), load16_bf16_as_fp32(up + i)));
      }
    }
  });
  return y;
}

// Rotate-half rotary embedding, in place, on the first `num_heads` heads of each row of `x`
// ([T, >= num_heads * D], rows may be strided, e.g. the q|k part of a fused qkv projection).
// cos, sin: bf16 [T, D] (or [T, 1, D]) for each row's position, as the torch path rounds them.
void rope_inplace_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, "bf16 [T, W] with unit column stride");
  TORCH_CHECK(head_dim % 32 == 0 && x.size(1) >= num_heads * head_dim, "head_dim must be a multiple of 32");
  const int64_t T = x.size(0), D = head_dim, half = D / 2;
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16, "bf16 cos/sin");
  auto c = cos.reshape({T, D}).contiguous();
  auto s = sin.reshape({T, D}).contiguous();
  at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const int64_t row_stride = x.stride(0);
  const at::BFloat16* cp = c.data_ptr<at::BFloat16>();
  const at::BFloat16* sp = s.data_ptr<at::BFloat16>();
  at::parallel_for(0, T, kSerialRows, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const at::BFloat16* ct = cp + t * D;
      const at::BFloat16* st = sp + t * D;
      for (int64_t h = 0; h < num_heads; ++h) {
        at::BFloat16* v = xp + t * row_stride + h * D;
        for (int64_t i = 0; i < half; i += 16) {
          const __m512 a = load16_bf16_as_fp32(v + i);         // first half
          const __m512 b = load16_bf16_as_fp32(v + half + i);  // second half
          // out[:half] = a cos - b sin; out[half:] = b cos + a sin (rotate_half = [-b, a])
          const __m512 lo = _mm512_fmsub_ps(a, load16_bf16_as_fp32(ct + i), _mm512_mul_ps(b, load16_bf16_as_fp32(st + i)));
          const __m512 hi = _mm512_fmadd_ps(b, load16_bf16_as_fp32(ct + half + i), _mm512_mul_ps(a, load16_bf16_as_fp32(st + half + i)));
          store16_fp32_as_bf16(v + i, lo);
          store16_fp32_as_bf16(v + half + i, hi);
        }
      }
    }
  });
}

// RMSNorm over the last dim of a bf16 [M, D] tensor.
// Why: torch's fused rms_norm costs 50-100 us a call on small batches here (an OpenMP region per
// call); a decode step makes 61 of them.
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
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_norm_row(xp + m * D, wp, yp + m * D, D, static_cast<float>(eps));
  });
  return y;
}

// The residual stream's add and the next RMSNorm: residual += x (rounded to bf16, as torch's add
// does), returns rmsnorm(residual) * w. Saves the separate add op and its pass.
torch::Tensor add_rms_norm_bf16(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && residual.scalar_type() == at::kBFloat16 &&
                  w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && w.dim() == 1 && w.size(0) == x.size(1) &&
                  x.size(1) % 16 == 0, "x, residual [M, D] with D % 16 == 0; w [D]");
  TORCH_CHECK(residual.is_contiguous(), "residual is updated in place and must be contiguous");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), D = x.size(1);
  auto y = torch::empty_like(x);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  at::BFloat16* rp = residual.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      at::BFloat16* r = rp + m * D;
      const at::BFloat16* xr = xp + m * D;
      for (int64_t d = 0; d < D; d += 16)
        store16_fp32_as_bf16(r + d, _mm512_add_ps(load16_bf16_as_fp32(r + d), load16_bf16_as_fp32(xr + d)));
      rms_norm_row(r, wp, yp + m * D, D, static_cast<float>(eps));
    }
  });
  return y;
}
