// Fused elementwise ops of a decoder layer for bf16 activations, written once over csrc/vec.h and
// compiled per kernel tier (issue #30; since issue 56 the AVX512-BF16 tier too, whose hand-written
// copy these replaced with the same functions, semantics and bits).
//
// Why: at decode batch sizes each torch elementwise op is a few microseconds of work behind tens of
// microseconds of dispatch and OpenMP wake-up; one pass each here, computed in fp32 and rounded to
// bf16 once (store_bf16: round to nearest even, as torch rounds).
//
// How: kLanes values at a time, then one partial vector for any tail (load_bf16_n: the missing
// lanes read as 0, which add nothing to a sum of squares), so every width is accepted. The full
// vectors run in a loop of their own with the tail after it (not a width test in every step): the
// same operations in the same order, so the same bits, in a loop the compiler keeps tight. A row's
// reductions run in one fixed order (one fma chain over the lanes' columns, then hsum's fixed
// tree) and rows never interact, so a row's bits do not depend on the other rows of the call or on
// how the rows are split over threads.
//
// huge_page_zeros and release_free_memory are not ISA-specific; they are here so a tiered build
// offers everything the engine takes from the AVX512-BF16 extension besides the matmul and attention.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <malloc.h>
#include <sys/mman.h>

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {

// Rows run serially below this many (an OpenMP region costs more than the work).
constexpr int64_t kSerialRows = 64;

using bf16 = uint16_t;  // raw bf16 bits: vec.h loads and stores them

const bf16* bits(const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr<at::BFloat16>()); }
bf16* mutable_bits(torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>()); }

// n = min(kLanes, left) values of p widened (a partial vector at a row's tail).
CS_INLINE cs::VF load_part(const bf16* p, int64_t left) {
  return left >= cs::kLanes ? cs::load_bf16(p) : cs::load_bf16_n(p, static_cast<int>(left));
}
CS_INLINE void store_part(bf16* p, cs::VF v, int64_t left) {
  if (left >= cs::kLanes) {
    cs::store_bf16(p, v);
  } else {
    cs::store_bf16_n(p, v, static_cast<int>(left));
  }
}

// out[0, n) = full(i) for each full vector at i (two at a time: store_bf16_x2), then part(i, left)
// for a partial tail: every value by the same steps wherever it sits, so the same bits as one vector
// at a time.
template <class Full, class Part>
CS_INLINE void store_row(bf16* out, int64_t n, Full full, Part part) {
  const int64_t nv = n - n % cs::kLanes;
  int64_t i = 0;
  for (; i + 2 * cs::kLanes <= nv; i += 2 * cs::kLanes) cs::store_bf16_x2(out + i, full(i), full(i + cs::kLanes));
  if (i < nv) cs::store_bf16(out + i, full(i));
  if (nv < n) cs::store_bf16_n(out + nv, part(nv, static_cast<int>(n - nv)), static_cast<int>(n - nv));
}

// out = row / rms(row) * w: the sum of squares as one fma chain per lane over the row's vectors
// (the tail vector last), the lanes added in hsum's tree; then (v * r) * w, rounded once.
void rms_norm_row(const bf16* row, const bf16* w, bf16* out, int64_t D, float eps) {
  const int64_t Dv = D - D % cs::kLanes;  // full vectors; then one partial one if D % kLanes
  const int tail = static_cast<int>(D - Dv);
  cs::VF ss = cs::zero();
  for (int64_t d = 0; d < Dv; d += cs::kLanes) {
    const cs::VF v = cs::load_bf16(row + d);
    ss = cs::fma(v, v, ss);
  }
  if (tail) {
    const cs::VF v = cs::load_bf16_n(row + Dv, tail);
    ss = cs::fma(v, v, ss);
  }
  const float r = 1.0f / std::sqrt(cs::hsum(ss) / static_cast<float>(D) + eps);
  const cs::VF rv = cs::set1(r);
  store_row(out, D, [&](int64_t d) { return cs::mul(cs::mul(cs::load_bf16(row + d), rv), cs::load_bf16(w + d)); },
            [&](int64_t d, int n) { return cs::mul(cs::mul(cs::load_bf16_n(row + d, n), rv), cs::load_bf16_n(w + d, n)); });
}

// out = row / rms(row) * w with an fp32 weight (Gemma's 1 + w, kept in fp32 so it is not rounded to
// bf16): the sum of squares as rms_norm_row's, then (v * r) * w, rounded to bf16 once.
void rms_norm_f32w_row(const bf16* row, const float* w, bf16* out, int64_t D, float eps) {
  const int64_t Dv = D - D % cs::kLanes;
  const int tail = static_cast<int>(D - Dv);
  cs::VF ss = cs::zero();
  for (int64_t d = 0; d < Dv; d += cs::kLanes) {
    const cs::VF v = cs::load_bf16(row + d);
    ss = cs::fma(v, v, ss);
  }
  if (tail) {
    const cs::VF v = cs::load_bf16_n(row + Dv, tail);
    ss = cs::fma(v, v, ss);
  }
  const float r = 1.0f / std::sqrt(cs::hsum(ss) / static_cast<float>(D) + eps);
  const cs::VF rv = cs::set1(r);
  store_row(out, D, [&](int64_t d) { return cs::mul(cs::mul(cs::load_bf16(row + d), rv), cs::load(w + d)); },
            [&](int64_t d, int n) { return cs::mul(cs::mul(cs::load_bf16_n(row + d, n), rv), cs::load_n(w + d, n)); });
}

// tanh(x): Eigen's rational approximation (odd degree-13 over even degree-6 polynomial in x, the
// input clamped to +-7.9053; |x| < 4e-4 returns x), max relative error ~4e-7. Only mul, fma, div
// and compares: every lane of every call (tails included) takes the same steps, so an element's
// result never depends on where it sits in a row, a batch or a thread's share.
CS_INLINE cs::VF tanh_vf(cs::VF a) {
  const cs::VF x = cs::max(cs::min(a, cs::set1(7.90531110763549805f)), cs::set1(-7.90531110763549805f));
  const cs::VF x2 = cs::mul(x, x);
  cs::VF p = cs::fma(x2, cs::set1(-2.76076847742355e-16f), cs::set1(2.00018790482477e-13f));
  p = cs::fma(x2, p, cs::set1(-8.60467152213735e-11f));
  p = cs::fma(x2, p, cs::set1(5.12229709037114e-08f));
  p = cs::fma(x2, p, cs::set1(1.48572235717979e-05f));
  p = cs::fma(x2, p, cs::set1(6.37261928875436e-04f));
  p = cs::fma(x2, p, cs::set1(4.89352455891786e-03f));
  p = cs::mul(x, p);
  cs::VF q = cs::fma(x2, cs::set1(1.19825839466702e-06f), cs::set1(1.18534705686654e-04f));
  q = cs::fma(x2, q, cs::set1(2.26843463243900e-03f));
  q = cs::fma(x2, q, cs::set1(4.89352518554385e-03f));
  return cs::select_lt(cs::abs(a), cs::set1(4e-4f), a, cs::div(p, q));
}

// silu(g) * u = g / (1 + e^-g) * u, rounded by the caller. exp wants x <= 0, so e^-|g| and the
// sigmoid flipped (1 - s) for g < 0, as a masked subtract.
CS_INLINE cs::VF silu_times(cs::VF g, cs::VF u) {
  const cs::VF one = cs::set1(1.0f);
  const cs::VF e = cs::exp(cs::sub(cs::zero(), cs::abs(g)));             // e^-|g| in (0, 1]
  const cs::VF sig_pos = cs::div(one, cs::add(one, e));                  // sigmoid(|g|)
  const cs::VF sig = cs::sub_where_lt(g, cs::zero(), one, sig_pos, sig_pos);  // sigmoid(g)
  return cs::mul(cs::mul(g, sig), u);
}

// gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), as torch's approximate="tanh"
CS_INLINE cs::VF gelu_tanh(cs::VF g) {
  const cs::VF inner = cs::mul(cs::set1(0.7978845608028654f), cs::fma(cs::mul(cs::mul(g, g), cs::set1(0.044715f)), g, g));
  return cs::mul(cs::mul(cs::set1(0.5f), g), cs::add(cs::set1(1.0f), tanh_vf(inner)));
}

}  // namespace

// RMSNorm over the last dim of a bf16 [M, D] tensor (any D).
torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "shape mismatch");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), D = x.size(1);
  auto y = torch::empty_like(x);
  const bf16* xp = bits(x);
  const bf16* wp = bits(w);
  bf16* yp = mutable_bits(y);
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_norm_row(xp + m * D, wp, yp + m * D, D, static_cast<float>(eps));
  });
  return y;
}

// The residual stream's add and the next RMSNorm: residual += x (rounded to bf16, as torch's add
// does: the fp32 sum of two bf16 values, rounded to nearest even), returns rmsnorm(residual) * w.
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
  const bf16* xp = bits(x);
  const bf16* wp = bits(w);
  bf16* rp = mutable_bits(residual);
  bf16* yp = mutable_bits(y);
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      bf16* r = rp + m * D;
      const bf16* xr = xp + m * D;
      store_row(r, D, [&](int64_t d) { return cs::add(cs::load_bf16(r + d), cs::load_bf16(xr + d)); },
                [&](int64_t d, int n) { return cs::add(cs::load_bf16_n(r + d, n), cs::load_bf16_n(xr + d, n)); });
      rms_norm_row(r, wp, yp + m * D, D, static_cast<float>(eps));
    }
  });
  return y;
}

// x [M, 2I] = [gate | up] -> silu(gate) * up, [M, I] (any I).
torch::Tensor silu_mul_bf16(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) % 2 == 0, "bf16 [M, 2I]");
  x = x.contiguous();
  const int64_t M = x.size(0), I = x.size(1) / 2;
  auto y = torch::empty({M, I}, x.options());
  const bf16* xp = bits(x);
  bf16* yp = mutable_bits(y);
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const bf16* gate = xp + m * 2 * I;
      const bf16* up = gate + I;
      bf16* out = yp + m * I;
      store_row(out, I, [&](int64_t i) { return silu_times(cs::load_bf16(gate + i), cs::load_bf16(up + i)); },
                [&](int64_t i, int n) { return silu_times(cs::load_bf16_n(gate + i, n), cs::load_bf16_n(up + i, n)); });
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
  const bf16* xp = bits(x);
  bf16* yp = mutable_bits(y);
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const bf16* gate = xp + m * 2 * I;
      const bf16* up = gate + I;
      store_row(yp + m * I, I, [&](int64_t i) { return cs::mul(gelu_tanh(cs::load_bf16(gate + i)), cs::load_bf16(up + i)); },
                [&](int64_t i, int n) { return cs::mul(gelu_tanh(cs::load_bf16_n(gate + i, n)), cs::load_bf16_n(up + i, n)); });
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
  const bf16* xp = bits(x);
  const float* wp = w.data_ptr<float>();
  bf16* yp = mutable_bits(y);
  at::parallel_for(0, M, kSerialRows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) rms_norm_f32w_row(xp + m * D, wp, yp + m * D, D, static_cast<float>(eps));
  });
  return y;
}

// x = tanh(x / cap) * cap, in place on fp32 logits (Gemma 2's final soft-cap). Elementwise with the
// same steps for every element (the tail a partial vector), so any split of the work over threads
// gives the same bits; the work is cut in whole vectors.
void softcap_f32_(torch::Tensor x, double cap) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "contiguous fp32");
  TORCH_CHECK(cap > 0, "cap must be positive");
  float* p = x.data_ptr<float>();
  const int64_t n = x.numel(), nvec = (n + cs::kLanes - 1) / cs::kLanes;
  const float c = static_cast<float>(cap);
  at::parallel_for(0, nvec, 4096, [&](int64_t v0, int64_t v1) {
    const cs::VF cv = cs::set1(c);
    for (int64_t v = v0; v < v1; ++v) {
      const int64_t i = v * cs::kLanes, left = n - i;
      if (left >= cs::kLanes) {
        cs::store(p + i, cs::mul(tanh_vf(cs::div(cs::load(p + i), cv)), cv));
      } else {
        cs::store_n(p + i, cs::mul(tanh_vf(cs::div(cs::load_n(p + i, static_cast<int>(left)), cv)), cv), static_cast<int>(left));
      }
    }
  });
}

// Rotate-half rotary embedding, in place, on the first `num_heads` heads of each row of `x`
// ([T, >= num_heads * D], rows may be strided, e.g. the q|k part of a fused qkv projection).
// cos, sin: bf16 [T, D] (or [T, 1, D]) for each row's position, as the torch path rounds them.
// Any even head_dim.
void rope_inplace_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1, "bf16 [T, W] with unit column stride");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && num_heads >= 0 && x.size(1) >= num_heads * head_dim,
              "head_dim must be even and num_heads * head_dim fit in a row");
  const int64_t T = x.size(0), D = head_dim, half = D / 2, half_v = half - half % cs::kLanes;
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16, "bf16 cos/sin");
  auto c = cos.reshape({T, D}).contiguous();
  auto s = sin.reshape({T, D}).contiguous();
  bf16* xp = mutable_bits(x);
  const int64_t row_stride = x.stride(0);
  const bf16* cp = bits(c);
  const bf16* sp = bits(s);
  at::parallel_for(0, T, kSerialRows, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const bf16* ct = cp + t * D;
      const bf16* st = sp + t * D;
      for (int64_t h = 0; h < num_heads; ++h) {
        bf16* v = xp + t * row_stride + h * D;
        // out[:half] = a cos - b sin; out[half:] = b cos + a sin (rotate_half = [-b, a]), a the
        // first half and b the second
        const auto lo = [&](int64_t i) {
          return cs::fmsub(cs::load_bf16(v + i), cs::load_bf16(ct + i), cs::mul(cs::load_bf16(v + half + i), cs::load_bf16(st + i)));
        };
        const auto hi = [&](int64_t i) {
          return cs::fma(cs::load_bf16(v + half + i), cs::load_bf16(ct + half + i), cs::mul(cs::load_bf16(v + i), cs::load_bf16(st + half + i)));
        };
        int64_t i = 0;
        for (; i + 2 * cs::kLanes <= half_v; i += 2 * cs::kLanes) {  // (all four results before either store)
          const cs::VF lo0 = lo(i), lo1 = lo(i + cs::kLanes), hi0 = hi(i), hi1 = hi(i + cs::kLanes);
          cs::store_bf16_x2(v + i, lo0, lo1);
          cs::store_bf16_x2(v + half + i, hi0, hi1);
        }
        if (i < half_v) {
          const cs::VF lo0 = lo(i), hi0 = hi(i);
          cs::store_bf16(v + i, lo0);
          cs::store_bf16(v + half + i, hi0);
        }
        if (half_v < half) {
          const int64_t i = half_v, left = half - half_v;
          const cs::VF a = load_part(v + i, left), b = load_part(v + half + i, left);
          store_part(v + i, cs::fmsub(a, load_part(ct + i, left), cs::mul(b, load_part(st + i, left))), left);
          store_part(v + half + i, cs::fma(b, load_part(ct + half + i, left), cs::mul(a, load_part(st + half + i, left))), left);
        }
      }
    }
  });
}

// A zero-filled bf16 tensor of `numel` values in its own mapping, 2 MiB aligned and advised for
// transparent huge pages (as csrc/amx_gemm.cpp's). Why: the decode matmuls stream every weight once
// per step, and with 4 KiB pages that stream takes a TLB miss every 4 KiB. Where the kernel offers
// no huge pages the advice is a no-op and this is plain anonymous memory.
torch::Tensor huge_page_zeros(int64_t numel) {
  TORCH_CHECK(numel > 0, "numel must be positive");
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t len = (static_cast<size_t>(numel) * sizeof(at::BFloat16) + kHuge - 1) / kHuge * kHuge;
  void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(raw != MAP_FAILED, "mmap of ", len, " bytes failed");
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
  if (aligned > start) munmap(raw, aligned - start);  // trim to the aligned range
  const size_t tail = (start + len + kHuge) - (aligned + len);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + len), tail);
  void* p = reinterpret_cast<void*>(aligned);
  madvise(p, len, MADV_HUGEPAGE);  // advice only: failure leaves ordinary pages
  return torch::from_blob(p, {numel}, [len](void* q) { munmap(q, len); }, torch::dtype(at::kBFloat16));
}

// Hands freed heap memory back to the OS (glibc keeps freed heap pages): called once the plain
// weights have been replaced by their packed copies in the arena.
void release_free_memory() { malloc_trim(0); }

// The family's functions, registered on `m`: by its own module, or by tier_kernels.cpp's (all families in one).
inline void register_fused(py::module& m) {
  m.def("rms_norm_bf16", &rms_norm_bf16, "RMSNorm of bf16 rows");
  m.def("add_rms_norm_bf16", &add_rms_norm_bf16, "residual += x, then RMSNorm of the residual");
  m.def("silu_mul_bf16", &silu_mul_bf16, "silu(gate) * up of a bf16 [M, 2I] gate|up tensor");
  m.def("rope_inplace_bf16", &rope_inplace_bf16, "rotate-half rotary embedding, in place");
  m.def("gelu_tanh_mul_bf16", &gelu_tanh_mul_bf16, "gelu_tanh(gate) * up of a bf16 [M, 2I] gate|up tensor");
  m.def("rms_norm_f32w_bf16", &rms_norm_f32w_bf16, "RMSNorm of bf16 rows with an fp32 weight");
  m.def("softcap_f32_", &softcap_f32_, "x = tanh(x / cap) * cap in place on fp32");
  m.def("huge_page_zeros", &huge_page_zeros, "zeroed bf16 memory advised for transparent huge pages");
  m.def("release_free_memory", &release_free_memory, "malloc_trim: return freed heap pages to the OS");
  m.def("lanes", [] { return cs::kLanes; }, "fp32 lanes of this build's vectors");
}

#ifndef CS_TIER_COMBINED
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { register_fused(m); }
#endif
