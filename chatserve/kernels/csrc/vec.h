// The thin vector type the tiered CPU kernels are written over (issue #30): one kernel source per
// operation, compiled once per ISA tier with that tier's flags and one CHATSERVE_TIER_* macro.
//
// Why our own and not Highway or vLLM's cpu_types_x86.hpp: the kernels need ~40 operations, most
// of them one intrinsic, and they need to control exactly which instructions a reduction uses (a
// fused multiply-add is one rounding, a multiply and an add are two: the batch-invariance promise
// is about the order AND the kind of every floating-point step). A header of one-line wrappers
// keeps that visible; a NEON/SVE tier later is one more section here.
//
// Tiers (kernels/tiers.py sets the macro and the compiler flags):
//   CHATSERVE_TIER_AVX2         8 fp32 lanes (ymm), FMA, F16C; int8 dot via vpmaddubsw + vpmaddwd,
//                               or AVX-VNNI's vpdpbusd when CHATSERVE_VNNI is also defined
//   CHATSERVE_TIER_AVX512       16 fp32 lanes (zmm), AVX512F/BW/VL/DQ + AVX512-VNNI (vpdpbusd)
//   CHATSERVE_BF16              with CHATSERVE_TIER_AVX512 only (the avx512_bf16 tier): adds the bf16-pair
//                               operations below (vdpbf16ps), which a kernel may use as its micro-kernel step
//
// Contract every tier keeps (kernels rely on it for bit-identical results within a tier):
//   - fma(a, b, c) is a single fused multiply-add (one rounding); mul/add round once each.
//   - hsum() adds lanes in one fixed tree (halves, then quarters, ...), the same for every call.
//   - exp() gives the same bits on every tier (one polynomial; relative error ~1e-7 for x <= 0).
//   - store_bf16() rounds to nearest even (NaN -> quiet NaN), as torch's float -> bfloat16.
//   - dpbusd(acc, u, s): acc[i] += sum_{j<4} u8[4i+j] * s8[4i+j], exact on every tier PROVIDED each
//     pair sum u0*s0 + u1*s1 fits int16 (|.| <= 32767): the AVX2 emulation saturates there. Callers
//     keep the unsigned operand <= 128 (4-bit and 6-bit quants, |q8|) so the product is exact.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if !defined(CHATSERVE_TIER_AVX2) && !defined(CHATSERVE_TIER_AVX512)
#error "define CHATSERVE_TIER_AVX2 or CHATSERVE_TIER_AVX512 (kernels/tiers.py does)"
#endif

#define CS_INLINE __attribute__((always_inline)) inline

namespace cs {

#if defined(CHATSERVE_TIER_AVX512)
constexpr int kLanes = 16;    // fp32 / int32 lanes of one vector
struct VF { __m512 v; };      // fp32 x kLanes
struct VI { __m512i v; };     // int32 x kLanes (or 4 x kLanes bytes)
#else
constexpr int kLanes = 8;
struct VF { __m256 v; };
struct VI { __m256i v; };
#endif
constexpr int kBytes = kLanes * 4;  // bytes of one vector

// ------------------------------------------------------------------ fp32 vectors
#if defined(CHATSERVE_TIER_AVX512)
CS_INLINE VF zero() { return {_mm512_setzero_ps()}; }
CS_INLINE VF set1(float x) { return {_mm512_set1_ps(x)}; }
CS_INLINE VF load(const float* p) { return {_mm512_loadu_ps(p)}; }
CS_INLINE void store(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
CS_INLINE VF add(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
CS_INLINE VF sub(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
CS_INLINE VF mul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
CS_INLINE VF div(VF a, VF b) { return {_mm512_div_ps(a.v, b.v)}; }
CS_INLINE VF fma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, one rounding
CS_INLINE VF max(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }
CS_INLINE VF min(VF a, VF b) { return {_mm512_min_ps(a.v, b.v)}; }
CS_INLINE VF abs(VF a) { return {_mm512_abs_ps(a.v)}; }
CS_INLINE VF sqrt(VF a) { return {_mm512_sqrt_ps(a.v)}; }
CS_INLINE VF broadcast(const float* p) { return {_mm512_set1_ps(*p)}; }
// lanes i < n of a, the others `fill` (masking a tile's keys past a row's position)
CS_INLINE VF keep_first(VF a, int n, float fill) {
  const __mmask16 m = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n < 0 ? 0 : n)) - 1u);
  return {_mm512_mask_blend_ps(m, _mm512_set1_ps(fill), a.v)};
}
// a where a < b lane-wise select: (x < y) ? a : b
CS_INLINE VF select_lt(VF x, VF y, VF a, VF b) { return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.v, y.v, _CMP_LT_OQ), b.v, a.v)}; }
// kLanes bf16 (raw uint16) widened exactly to fp32
CS_INLINE VF load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
// kLanes IEEE half (raw uint16) widened exactly to fp32
CS_INLINE VF load_f16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
// kLanes bytes widened to fp32 (unsigned / signed)
CS_INLINE VF load_u8(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))}; }
CS_INLINE VF load_s8(const int8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))}; }
// kLanes fp32 rounded to bf16 bits (nearest even; NaN -> 0x7FC0): the integer steps on every AVX512
// tier. With CHATSERVE_BF16, vcvtneps2bf16 (one instruction) where it gives the same bits: it rounds
// to nearest even too, but flushes fp32 denormals to a signed zero and keeps a NaN's sign and
// payload, so a vector holding either (vfpclassps: QNaN, SNaN, denormal) takes the integer steps.
CS_INLINE __m256i to_bf16_bits(VF a) {
#if defined(CHATSERVE_BF16)
  if (_mm512_fpclass_ps_mask(a.v, 0x01 | 0x20 | 0x80) == 0) return (__m256i)_mm512_cvtneps_pbh(a.v);
#endif
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
CS_INLINE void store_bf16(uint16_t* p, VF a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(a)); }
// The first n (< kLanes) lanes: masked loads and stores (lanes past n read as 0, memory past n untouched).
CS_INLINE __mmask16 first_lanes(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
CS_INLINE VF load_bf16_n(const uint16_t* p, int n) {
  const __m256i raw = _mm256_maskz_loadu_epi16(first_lanes(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
CS_INLINE void store_bf16_n(uint16_t* p, VF a, int n) { _mm256_mask_storeu_epi16(p, first_lanes(n), to_bf16_bits(a)); }
// store_bf16(p, a) and store_bf16(p + kLanes, b), the same bits. With CHATSERVE_BF16: one
// vcvtne2ps2bf16 and one 64-byte store for both where neither holds a NaN or a denormal (one
// kortest over both vectors' vfpclassps masks): the check costs half as much per value.
CS_INLINE void store_bf16_x2(uint16_t* p, VF a, VF b) {
#if defined(CHATSERVE_BF16)
  const __mmask16 ka = _mm512_fpclass_ps_mask(a.v, 0x01 | 0x20 | 0x80), kb = _mm512_fpclass_ps_mask(b.v, 0x01 | 0x20 | 0x80);
  if (_kortestz_mask16_u8(ka, kb)) {
    _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(b.v, a.v));  // (low half from the second operand)
    return;
  }
#endif
  store_bf16(p, a);
  store_bf16(p + kLanes, b);
}
// 2 * kLanes bf16 widened exactly, the even-indexed to `even` and the odd-indexed to `odd`: one load,
// one shift and one and (no shuffle), for a packed layout that puts two outputs in each 32-bit word.
CS_INLINE void load_bf16_even_odd(const uint16_t* p, VF& even, VF& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = {_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16))};
  odd = {_mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
}
CS_INLINE VF fmsub(VF a, VF b, VF c) { return {_mm512_fmsub_ps(a.v, b.v, c.v)}; }  // a * b - c, one rounding
// Lanes summed in one fixed tree: 16 -> 8 -> 4 -> 2 -> 1.
CS_INLINE float hsum(VF x) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(x.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
CS_INLINE float hmax(VF x) { return _mm512_reduce_max_ps(x.v); }  // max is exact: any order
CS_INLINE VF round_nearest(VF a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 2^n for integral-valued n in [-126, 127]
CS_INLINE VF exp2_int(VF n) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
// p * 2^n for integral-valued n in [-126, 127]: mul(p, exp2_int(n))'s bits in one instruction
CS_INLINE VF times_exp2_int(VF p, VF n) { return {_mm512_scalef_ps(p.v, n.v)}; }
// (x < y) ? a - b : src, lane-wise (one masked subtract)
CS_INLINE VF sub_where_lt(VF x, VF y, VF a, VF b, VF src) {
  return {_mm512_mask_sub_ps(src.v, _mm512_cmp_ps_mask(x.v, y.v, _CMP_LT_OQ), a.v, b.v)};
}
#else
CS_INLINE VF zero() { return {_mm256_setzero_ps()}; }
CS_INLINE VF set1(float x) { return {_mm256_set1_ps(x)}; }
CS_INLINE VF load(const float* p) { return {_mm256_loadu_ps(p)}; }
CS_INLINE void store(float* p, VF a) { _mm256_storeu_ps(p, a.v); }
CS_INLINE VF add(VF a, VF b) { return {_mm256_add_ps(a.v, b.v)}; }
CS_INLINE VF sub(VF a, VF b) { return {_mm256_sub_ps(a.v, b.v)}; }
CS_INLINE VF mul(VF a, VF b) { return {_mm256_mul_ps(a.v, b.v)}; }
CS_INLINE VF div(VF a, VF b) { return {_mm256_div_ps(a.v, b.v)}; }
CS_INLINE VF fma(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
CS_INLINE VF max(VF a, VF b) { return {_mm256_max_ps(a.v, b.v)}; }
CS_INLINE VF min(VF a, VF b) { return {_mm256_min_ps(a.v, b.v)}; }
CS_INLINE VF abs(VF a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
CS_INLINE VF sqrt(VF a) { return {_mm256_sqrt_ps(a.v)}; }
CS_INLINE VF broadcast(const float* p) { return {_mm256_broadcast_ss(p)}; }
CS_INLINE VF keep_first(VF a, int n, float fill) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx));
  return {_mm256_blendv_ps(_mm256_set1_ps(fill), a.v, keep)};
}
CS_INLINE VF select_lt(VF x, VF y, VF a, VF b) { return {_mm256_blendv_ps(b.v, a.v, _mm256_cmp_ps(x.v, y.v, _CMP_LT_OQ))}; }
CS_INLINE VF load_bf16(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
}
CS_INLINE VF load_f16(const uint16_t* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
CS_INLINE VF load_u8(const uint8_t* p) { return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))}; }
CS_INLINE VF load_s8(const int8_t* p) { return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))}; }
CS_INLINE void store_bf16(uint16_t* p, VF a) {
  const __m256i bits = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q)));
  // 8 x int32 (each < 2^16) -> 8 x uint16: packus works per 128-bit half, so pack the halves
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
CS_INLINE void store_bf16_x2(uint16_t* p, VF a, VF b) {
  store_bf16(p, a);
  store_bf16(p + kLanes, b);
}
CS_INLINE void load_bf16_even_odd(const uint16_t* p, VF& even, VF& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
}
CS_INLINE VF fmsub(VF a, VF b, VF c) { return {_mm256_fmsub_ps(a.v, b.v, c.v)}; }
CS_INLINE float hsum(VF x) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(x.v), _mm256_extractf128_ps(x.v, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
CS_INLINE float hmax(VF x) {
  const __m128 b = _mm_max_ps(_mm256_castps256_ps128(x.v), _mm256_extractf128_ps(x.v, 1));
  const __m128 c = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(c, _mm_shuffle_ps(c, c, 1)));
}
CS_INLINE VF round_nearest(VF a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
CS_INLINE VF exp2_int(VF n) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23))};
}
CS_INLINE VF times_exp2_int(VF p, VF n) { return mul(p, exp2_int(n)); }
CS_INLINE VF sub_where_lt(VF x, VF y, VF a, VF b, VF src) { return select_lt(x, y, sub(a, b), src); }
#endif

// ------------------------------------------------------------------ bf16 pairs (CHATSERVE_BF16 only)
// What only the AVX512-BF16 tier has, as micro-kernel operations (its native fp32 -> bf16 rounding
// is inside store_bf16 above, where it gives the integer steps' bits).
#if defined(CHATSERVE_BF16)
#if !defined(CHATSERVE_TIER_AVX512)
#error "CHATSERVE_BF16 needs CHATSERVE_TIER_AVX512 (the avx512_bf16 tier in kernels/tiers.py)"
#endif
struct VB { __m512bh v; };  // kLanes pairs of bf16 (2 * kLanes values; pair i is values 2i, 2i + 1)
CS_INLINE VB load_bf16_pairs(const uint16_t* p) { return {(__m512bh)_mm512_loadu_si512(p)}; }
// the pair (p[0], p[1]) in every lane
CS_INLINE VB broadcast_bf16_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return {(__m512bh)_mm512_set1_epi32(v)};
}
// acc[i] + a[2i] b[2i] + a[2i+1] b[2i+1] (vdpbf16ps): the products are exact in fp32, the two adds
// round to nearest even, denormal inputs read as zero and a denormal result is flushed to zero (the
// instruction ignores MXCSR). One step of this tier's bf16 dot products; its bits are the tier's own.
CS_INLINE VF dpbf16(VF acc, VB a, VB b) { return {_mm512_dpbf16_ps(acc.v, a.v, b.v)}; }
#endif

// A hint that the cache line at p is read soon (SSE, the same on every tier; no fault if unmapped).
CS_INLINE void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// Partial loads and stores through a stack buffer (tails: n < kLanes values; lanes past n are 0).
CS_INLINE VF load_n(const float* p, int n) {
  alignas(64) float buf[kLanes] = {};
  std::memcpy(buf, p, sizeof(float) * n);
  return load(buf);
}
CS_INLINE void store_n(float* p, VF a, int n) {
  alignas(64) float buf[kLanes];
  store(buf, a);
  std::memcpy(p, buf, sizeof(float) * n);
}
#if !defined(CHATSERVE_TIER_AVX512)  // (AVX512: masked, in its section)
CS_INLINE VF load_bf16_n(const uint16_t* p, int n) {
  alignas(64) uint16_t buf[kLanes] = {};
  std::memcpy(buf, p, sizeof(uint16_t) * n);
  return load_bf16(buf);
}
CS_INLINE void store_bf16_n(uint16_t* p, VF a, int n) {
  alignas(64) uint16_t buf[kLanes];
  store_bf16(buf, a);
  std::memcpy(p, buf, sizeof(uint16_t) * n);
}
#endif

// e^x for the x <= 0 of a max-subtracted softmax (and silu's e^-|x|): 2^n * 2^f with
// n = round(x log2 e), |f| <= 1/2, 2^f from a degree-6 Taylor series of e^(f ln 2) (rel. error ~1e-7).
// x is clamped to [-87, 88.37626] so n stays in [-126, 127]: 2^n is a normal float on every tier, and
// a large positive x (tier_attention.cpp's tanh passes 2x) gives ~2.4e38, not the wrapped exponent
// bits that n >= 129 would make. AVX512 multiplies by 2^n with vscalefps (one instruction), the
// others build 2^n from exponent bits: p * 2^n is one correctly rounded product either way, so the
// bits are the same on every tier (checked for every fp32 x <= 1 and a sweep of larger x).
CS_INLINE VF exp(VF x) {
  x = min(max(x, set1(-87.0f)), set1(88.3762626647949f));
  const VF y = mul(x, set1(1.4426950408889634f));
  const VF n = round_nearest(y);
  const VF z = mul(sub(y, n), set1(0.6931471805599453f));
  VF p = set1(1.0f / 720.0f);
  p = fma(p, z, set1(1.0f / 120.0f));
  p = fma(p, z, set1(1.0f / 24.0f));
  p = fma(p, z, set1(1.0f / 6.0f));
  p = fma(p, z, set1(0.5f));
  p = fma(p, z, set1(1.0f));
  p = fma(p, z, set1(1.0f));
  return times_exp2_int(p, n);
}

// ------------------------------------------------------------------ integer vectors (int8 dot products)
#if defined(CHATSERVE_TIER_AVX512)
CS_INLINE VI izero() { return {_mm512_setzero_si512()}; }
CS_INLINE VI iload(const void* p) { return {_mm512_loadu_si512(p)}; }
CS_INLINE void istore(void* p, VI a) { _mm512_storeu_si512(p, a.v); }
CS_INLINE VI iset1(int32_t x) { return {_mm512_set1_epi32(x)}; }
CS_INLINE VI iset1_u8(uint8_t x) { return {_mm512_set1_epi8(static_cast<char>(x))}; }
CS_INLINE VI ibroadcast4(const void* p) { int32_t v; std::memcpy(&v, p, 4); return {_mm512_set1_epi32(v)}; }  // 4 bytes to every lane
CS_INLINE VI iadd(VI a, VI b) { return {_mm512_add_epi32(a.v, b.v)}; }
CS_INLINE VI isub(VI a, VI b) { return {_mm512_sub_epi32(a.v, b.v)}; }
CS_INLINE VI imul(VI a, VI b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
CS_INLINE VI iand(VI a, VI b) { return {_mm512_and_si512(a.v, b.v)}; }
CS_INLINE VI ior(VI a, VI b) { return {_mm512_or_si512(a.v, b.v)}; }
CS_INLINE VI isrl16(VI a, int n) { return {_mm512_srli_epi16(a.v, n)}; }  // per 16-bit lane (nibble unpacking)
CS_INLINE VI isll16(VI a, int n) { return {_mm512_slli_epi16(a.v, n)}; }
CS_INLINE VF to_float(VI a) { return {_mm512_cvtepi32_ps(a.v)}; }
CS_INLINE VI to_int_rne(VF a) { return {_mm512_cvtps_epi32(a.v)}; }  // round to nearest even (MXCSR default)
CS_INLINE VI dpbusd(VI acc, VI u, VI s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }
// kLanes int32 (each in [-128, 127]) -> kLanes int8, stored
CS_INLINE void store_i8(int8_t* p, VI a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.v)); }
// Signed x signed bytes by the sign trick (dpbusd(acc, abs8(w), sign8(x, w)) = sum w * x, exact):
// per byte |a| (-128 -> 0x80, read as the unsigned 128), and a * sign(b) (0 where b == 0; AVX512BW
// has no vpsignb: two masked moves).
CS_INLINE VI abs8(VI a) { return {_mm512_abs_epi8(a.v)}; }
CS_INLINE VI sign8(VI a, VI b) {
  const __m512i nonzero = _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(b.v, b.v), a.v);
  return {_mm512_mask_sub_epi8(nonzero, _mm512_movepi8_mask(b.v), _mm512_setzero_si512(), a.v)};
}
// A run of dpbusd steps widened once at its end (see the AVX2 section): vpdpbusd sums into int32
// lanes, so a run of any length is exact and dot_run_end is the identity.
constexpr bool kDotRunWide = true;
CS_INLINE VI dot_run(VI acc, VI u, VI s) { return dpbusd(acc, u, s); }
CS_INLINE VI dot_run_end(VI acc) { return acc; }
#else
CS_INLINE VI izero() { return {_mm256_setzero_si256()}; }
CS_INLINE VI iload(const void* p) { return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))}; }
CS_INLINE void istore(void* p, VI a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.v); }
CS_INLINE VI iset1(int32_t x) { return {_mm256_set1_epi32(x)}; }
CS_INLINE VI iset1_u8(uint8_t x) { return {_mm256_set1_epi8(static_cast<char>(x))}; }
CS_INLINE VI ibroadcast4(const void* p) { int32_t v; std::memcpy(&v, p, 4); return {_mm256_set1_epi32(v)}; }
CS_INLINE VI iadd(VI a, VI b) { return {_mm256_add_epi32(a.v, b.v)}; }
CS_INLINE VI isub(VI a, VI b) { return {_mm256_sub_epi32(a.v, b.v)}; }
CS_INLINE VI imul(VI a, VI b) { return {_mm256_mullo_epi32(a.v, b.v)}; }
CS_INLINE VI iand(VI a, VI b) { return {_mm256_and_si256(a.v, b.v)}; }
CS_INLINE VI ior(VI a, VI b) { return {_mm256_or_si256(a.v, b.v)}; }
CS_INLINE VI isrl16(VI a, int n) { return {_mm256_srli_epi16(a.v, n)}; }
CS_INLINE VI isll16(VI a, int n) { return {_mm256_slli_epi16(a.v, n)}; }
CS_INLINE VF to_float(VI a) { return {_mm256_cvtepi32_ps(a.v)}; }
CS_INLINE VI to_int_rne(VF a) { return {_mm256_cvtps_epi32(a.v)}; }
#if defined(CHATSERVE_VNNI)
CS_INLINE VI dpbusd(VI acc, VI u, VI s) { return {_mm256_dpbusd_avx_epi32(acc.v, u.v, s.v)}; }
#else
// vpmaddubsw (u8 x s8 -> pairs summed to int16, saturating) then vpmaddwd with ones (pairs of
// int16 -> int32): the same integer as vpdpbusd while every pair sum fits int16 (see the contract).
CS_INLINE VI dpbusd(VI acc, VI u, VI s) {
  const __m256i pairs = _mm256_maddubs_epi16(u.v, s.v);
  return {_mm256_add_epi32(acc.v, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))};
}
#endif
CS_INLINE void store_i8(int8_t* p, VI a) {
  const __m128i lo = _mm256_castsi256_si128(a.v), hi = _mm256_extracti128_si256(a.v, 1);
  const __m128i w16 = _mm_packs_epi32(lo, hi);  // 8 x int16, in order
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w16, w16));
}
CS_INLINE VI abs8(VI a) { return {_mm256_abs_epi8(a.v)}; }
CS_INLINE VI sign8(VI a, VI b) { return {_mm256_sign_epi8(a.v, b.v)}; }
#if defined(CHATSERVE_VNNI)
constexpr bool kDotRunWide = true;
CS_INLINE VI dot_run(VI acc, VI u, VI s) { return dpbusd(acc, u, s); }
CS_INLINE VI dot_run_end(VI acc) { return acc; }
#else
// A run of dpbusd steps from izero(), widened once by dot_run_end to the int32 dpbusd would give:
// here the running sums stay in int16 pairs (vpmaddubsw + vpaddw a step, one vpmaddwd a run: 2
// instructions a step, not 3). Exact PROVIDED each pair's running sum over the whole run fits int16
// (|.| <= 32767); the caller bounds the run length (4-bit u x |s| <= 127: 8 steps, 6-bit: 2, |q8|: 1).
constexpr bool kDotRunWide = false;
CS_INLINE VI dot_run(VI acc, VI u, VI s) { return {_mm256_add_epi16(acc.v, _mm256_maddubs_epi16(u.v, s.v))}; }
CS_INLINE VI dot_run_end(VI acc) { return {_mm256_madd_epi16(acc.v, _mm256_set1_epi16(1))}; }
#endif
#endif

// ------------------------------------------------------------------ attention micro-kernels
// What only one tier has, behind the operations csrc/tier_attention.cpp's per-tile steps call. On
// AVX512-BF16 (CHATSERVE_BF16) a score is a vdpbf16ps chain over head_dim's bf16 pairs and P.V one
// over a tile's key pairs (P rounded to bf16, as SDPA's bf16 path does): half the instructions of
// the fp32 FMA chains the other tiers run, so that tier keeps its own in-block layout of a bf16
// cache (kBf16Dot says which the attention kernel uses).
#if defined(CHATSERVE_BF16)
constexpr bool kBf16Dot = true;
// kLanes fp32 rounded to bf16 (vcvtneps2bf16: nearest even; denormals flushed, unlike store_bf16,
// which is why this is only for P, e^(s - max) in [0, 1], where a flushed 1e-38 changes nothing),
// packed in order into the low kLanes / 2 pairs (pair i: values 2i, 2i + 1)
CS_INLINE VB to_bf16_pairs(VF a) { return {(__m512bh)_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(a.v))}; }
// pair i of a in every lane
CS_INLINE VB broadcast_pair_lane(VB a, int i) {
  return {(__m512bh)_mm512_permutexvar_epi32(_mm512_set1_epi32(i), (__m512i)a.v)};
}
// fp32 lane i of a in every lane (in registers: a vector store read back as a scalar broadcast can
// miss store forwarding)
CS_INLINE VF broadcast_lane(VF a, int i) { return {_mm512_permutexvar_ps(_mm512_set1_epi32(i), a.v)}; }
// kLanes pairs (lo[i], hi[i]) of int8 quants as bf16, exactly (|q| <= 127 has 7 significant bits):
// each widened to fp32, whose upper half is then its bf16; pair i's low half is lo[i]. How an 8-bit
// cache's tile is scored and weighted with vdpbf16ps (a quant's scale applies per key, after).
CS_INLINE VB s8_pairs(const int8_t* lo, const int8_t* hi) {
  const __m512i l = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)))));
  const __m512i h = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)))));
  return {(__m512bh)_mm512_mask_blend_epi16(static_cast<__mmask32>(0xAAAAAAAAu), _mm512_srli_epi32(l, 16), h)};
}
CS_INLINE void store_pairs(void* p, VB a) { _mm512_storeu_si512(p, (__m512i)a.v); }
#else
constexpr bool kBf16Dot = false;
#endif

}  // namespace cs
