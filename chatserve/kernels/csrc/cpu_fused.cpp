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

// Lanes i < min(left, 16): the tail of a row whose width is not a multiple of 16.
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}
// min(left, 16) bf16 values widened (missing lanes 0); a full vector is the plain load.
__attribute__((always_inline)) inline __m512 load_part(const at::BFloat16* p, int64_t left) {
  if (left >= 16) return load16_bf16_as_fp32(p);
  const __m256i raw = _mm256_maskz_loadu_epi16(tail_mask(left), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
__attribute__((always_inline)) inline void store_part(at::BFloat16* p, __m512 v, int64_t left) {
  if (left >= 16) {
    store16_fp32_as_bf16(p, v);
  } else {
    _mm256_mask_storeu_epi16(p, tail_mask(left), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// tanh(x): Eigen's rational approximation (odd degree-13 over even degree-6 polynomial in x, the
// input clamped to +-7.9053; |x| < 4e-4 returns x), max relative error ~4e-7: the same steps as
// csrc/tier_fused.cpp's, and the same for every lane (tails included).
__attribute__((always_inline)) inline __m512 tanh_ps(__m512 a) {
  const __m512 x = _mm512_max_ps(_mm512_min_ps(a, _mm512_set1_ps(7.90531110763549805f)), _mm512_set1_ps(-7.90531110763549805f));
  const __m512 x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_fmadd_ps(x2, _mm512_set1_ps(-2.76076847742355e-16f), _mm512_set1_ps(2.00018790482477e-13f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(-8.60467152213735e-11f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(5.12229709037114e-08f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(1.48572235717979e-05f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(6.37261928875436e-04f));
  p = _mm512_fmadd_ps(x2, p, _mm512_set1_ps(4.89352455891786e-03f));
  p = _mm512_mul_ps(x, p);
  __m512 q = _mm512_fmadd_ps(x2, _mm512_set1_ps(1.19825839466702e-06f), _mm512_set1_ps(1.18534705686654e-04f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(2.26843463243900e-03f));
  q = _mm512_fmadd_ps(x2, q, _mm512_set1_ps(4.89352518554385e-03f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(a), _mm512_set1_ps(4e-4f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(tiny, _mm512_div_ps(p, q), a);
}

// gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), as torch's approximate="tanh"
__attribute__((always_inline)) inline __m512 gelu_tanh_ps(__m512 g) {
  const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(0.044715f));
  const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(cube, g, g));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(_mm512_set1_ps(1.0f), tanh_ps(inner)));
}

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

// The same with an fp32 weight (Gemma's 1 + w, kept in fp32 so it is not rounded to bf16).
void rms_norm_f32w_row(const at::BFloat16* row, const float* w, at::BFloat16* out, int64_t D, float eps) {
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
    store16_fp32_as_bf16(out + d, _mm512_mul_ps(_mm512_mul_ps(load16_bf16_as_fp32(row + d), rv), _mm512_loadu_ps(w + d)));
  for (int64_t d = Dv; d < D; ++d) out[d] = at::BFloat16(static_cast<float>(row[d]) * r * w[d]);
}

}  // namespace

// x [M, 2I] = [gate | up] -> silu(gate) * up, [M, I] (any I).
torch::Tensor silu_mul_bf16(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) % 2 == 0, "bf16 [M, 2I]");
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
        const __m512 g = load_part(gate + i, I - i);  // (a partial vector at the row's tail: any I)
        // silu(g) = g / (1 + e^-g); exp_ps wants x <= 0, so use e^-|g| and flip for g < 0
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));  // e^-|g| in (0, 1]
        const __m512 one = _mm512_set1_ps(1.0f);
        const __m512 sig_pos = _mm512_div_ps(one, _mm512_add_ps(one, e));         // sigmoid(|g|)
        const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 sig = _mm512_mask_sub_ps(sig_pos, neg, one, sig_pos);         // sigmoid(g)
        store_part(yp + m * I + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), load_part(up + i, I - i)), I - i);
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
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && num_heads >= 0 && x.size(1) >= num_heads * head_dim,
              "head_dim must be even and num_heads * head_dim fit in a row");
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
        for (int64_t i = 0; i < half; i += 16) {  // (a partial vector where half % 16 != 0)
          const int64_t left = half - i;
          const __m512 a = load_part(v + i, left);         // first half
          const __m512 b = load_part(v + half + i, left);  // second half
          // out[:half] = a cos - b sin; out[half:] = b cos + a sin (rotate_half = [-b, a])
          const __m512 lo = _mm512_fmsub_ps(a, load_part(ct + i, left), _mm512_mul_ps(b, load_part(st + i, left)));
          const __m512 hi = _mm512_fmadd_ps(b, load_part(ct + half + i, left), _mm512_mul_ps(a, load_part(st + half + i, left)));
          store_part(v + i, lo, left);
          store_part(v + half + i, hi, left);
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
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && w.dim() == 1 && w.size(0) == x.size(1),
              "x, residual [M, D]; w [D]");
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
      for (int64_t d = 0; d < D; d += 16)  // (a partial vector at the tail: any D)
        store_part(r + d, _mm512_add_ps(load_part(r + d, D - d), load_part(xr + d, D - d)), D - d);
      rms_norm_row(r, wp, yp + m * D, D, static_cast<float>(eps));
    }
  });
  return y;
}

// x [M, 2I] = [gate | up] -> gelu_tanh(gate) * up, [M, I] (any I): Gemma's GeGLU, rounded once.
torch::Tensor gelu_tanh_mul_bf16(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) % 2 == 0, "bf16 [M, 2I]");
  x = x.contiguous();
  const int64_t M = x.size(0), I = x.size(1) / 2;
  auto y = torch::empty({M, I}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const at::BFloat16* gate = xp + m * 2 * I;
      const at::BFloat16* up = gate + I;
      for (int64_t i = 0; i < I; i += 16)
        store_part(yp + m * I + i, _mm512_mul_ps(gelu_tanh_ps(load_part(gate + i, I - i)), load_part(up + i, I - i)), I - i);
    }
  });
  return y;
}

// RMSNorm of bf16 rows [M, D] (any D) with an fp32 weight [D] (Gemma's 1 + w), out bf16.
torch::Tensor rms_norm_f32w_bf16(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kFloat, "bf16 rows, fp32 weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "shape mismatch");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), D = x.size(1);
  auto y = torch::empty_like(x);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const float* wp = w.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_norm_f32w_row(xp + m * D, wp, yp + m * D, D, static_cast<float>(eps));
  });
  return y;
}

// x = tanh(x / cap) * cap, in place on fp32 logits (Gemma 2's final soft-cap): the same steps for
// every element (a masked vector at the tail), the work cut in whole vectors, so any thread split
// gives the same bits.
void softcap_f32_(torch::Tensor x, double cap) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "contiguous fp32");
  TORCH_CHECK(cap > 0, "cap must be positive");
  float* p = x.data_ptr<float>();
  const int64_t n = x.numel(), nvec = (n + 15) / 16;
  const float c = static_cast<float>(cap);
  at::parallel_for(0, nvec, 4096, [&](int64_t v0, int64_t v1) {
    const __m512 cv = _mm512_set1_ps(c);
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t i = v * 16;
      const __mmask16 m = tail_mask(n - i);
      const __m512 x16 = _mm512_maskz_loadu_ps(m, p + i);
      _mm512_mask_storeu_ps(p + i, m, _mm512_mul_ps(tanh_ps(_mm512_div_ps(x16, cv)), cv));
    }
  });
}
