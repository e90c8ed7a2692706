// Paged decode attention for bf16 KV caches on AVX-512 CPUs: one query token per sequence over
// the tokens its block table names, grouped-query aware.
//
// Why: the torch path copies every sequence's blocks into a dense [B, KVH, L, D] tensor
// (index_select), then runs SDPA with a padding mask: two passes over the KV and a copy. Here
// each (sequence, KV head) reads its K/V rows once, in place, for all the query heads that share
// them. Softmax in fp32 (exact max subtraction, two passes over the scores), output rounded to
// bf16 once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using chatserve_simd::exp_ps;
using chatserve_simd::load16_bf16_as_fp32;
using chatserve_simd::reduce16;

constexpr int kMaxRep = 16;   // query heads per KV head
constexpr int kMaxHeadDim = 256;

struct Shapes {
  int64_t num_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks;
};

inline __m512bh load_bf16x32(const at::BFloat16* p, int64_t remaining) {
  if (remaining >= 32) return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << remaining) - 1), reinterpret_cast<const void*>(p));
}

// One (sequence, KV head): scores for its REP query heads, softmax, weighted sum of V.
// Returns false if the block table names a block outside the pool (nothing is read then).
template <int REP>
bool attend_one(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                const int64_t* table, int64_t len, int64_t g, float scale, const Shapes& s,
                at::BFloat16* out, std::vector<float>& scores) {
  const int64_t D = s.head_dim, bs = s.block_size;
  const int64_t row_stride = s.num_kv_heads * D;  // elements between consecutive tokens of a block
  const int64_t nblocks = (len + bs - 1) / bs;
  for (int64_t b = 0; b < nblocks; ++b)
    if (table[b] < 0 || table[b] >= s.num_blocks) return false;
  scores.resize(static_cast<size_t>(REP * len));
  const __m512 scale_v = _mm512_set1_ps(scale);

  // 1. scores[h * len + t] = (q_h . k_t) * scale, 16 tokens of a block at a time (bf16 pair dot
  //    products into fp32, reduced together); a block's rows past `len` are read but not kept.
  for (int64_t b = 0; b < nblocks; ++b) {
    const at::BFloat16* kb = k_cache + table[b] * bs * row_stride + g * D;
    const int64_t valid = std::min(bs, len - b * bs);
    int64_t t0 = 0;
    for (; t0 < valid && t0 + 16 <= bs; t0 += 16) {
      const int64_t cnt = std::min<int64_t>(16, valid - t0);
      _Pragma("GCC unroll 16") for (int h = 0; h < REP; ++h) {
        const at::BFloat16* qh = q + (g * REP + h) * D;
        __m512 acc[16];
        _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32) {
          const __m512bh qv = load_bf16x32(qh + d, D - d);
          _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], load_bf16x32(kb + (t0 + j) * row_stride + d, D - d), qv);
        }
        _mm512_mask_storeu_ps(scores.data() + h * len + b * bs + t0, (__mmask16)((1u << cnt) - 1),
                              _mm512_mul_ps(reduce16(acc), scale_v));
      }
    }
    for (int64_t t = t0; t < valid; ++t) {  // blocks of fewer than 16 rows
      _Pragma("GCC unroll 16") for (int h = 0; h < REP; ++h) {
        const at::BFloat16* qh = q + (g * REP + h) * D;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 32)
          acc = _mm512_dpbf16_ps(acc, load_bf16x32(kb + t * row_stride + d, D - d), load_bf16x32(qh + d, D - d));
        scores[h * len + b * bs + t] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
  }

  // 2. softmax per head, in place; keep 1 / sum
  float inv_sum[REP];
  _Pragma("GCC unroll 16") for (int h = 0; h < REP; ++h) {
    float* sc = scores.data() + h * len;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + t));
    float m = _mm512_reduce_max_ps(mx);
    for (; t < len; ++t) m = std::max(m, sc[t]);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (t = 0; t < len; t += 16) {
      const __mmask16 mask = len - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - t)) - 1);
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sc + t), mv));
      _mm512_mask_storeu_ps(sc + t, mask, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
    }
    inv_sum[h] = 1.0f / _mm512_reduce_add_ps(sum);
  }

  // 3. out_h = sum_t p[h, t] v_t, 16 dims at a time for all REP heads
  for (int64_t c = 0; c < D; c += 16) {
    __m512 acc[REP];
    _Pragma("GCC unroll 16") for (int h = 0; h < REP; ++h) acc[h] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblocks; ++b) {
      const at::BFloat16* vb = v_cache + table[b] * bs * row_stride + g * D + c;
      const int64_t valid = std::min(bs, len - b * bs);
      const float* p = scores.data() + b * bs;
      for (int64_t t = 0; t < valid; ++t) {
        const __m512 vc = load16_bf16_as_fp32(vb + t * row_stride);
        _Pragma("GCC unroll 16") for (int h = 0; h < REP; ++h) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * len + t]), vc, acc[h]);
      }
    }
    _Pragma("GCC unroll 16") for (int h = 0; h < REP; ++h) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[h], _mm512_set1_ps(inv_sum[h])));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g * REP + h) * D + c), (__m256i)r);
    }
  }
  return true;
}

using AttendFn = bool (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, const int64_t*, int64_t,
                          int64_t, float, const Shapes&, at::BFloat16*, std::vector<float>&);

template <int... R>
AttendFn pick(int rep, std::integer_sequence<int, R...>) {
  AttendFn fns[] = {&attend_one<R + 1>...};
  return fns[rep - 1];
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks]
// int64; context_lens [B] int64 (the new token included). Returns [B, H, D].
torch::Tensor paged_decode_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "shape mismatch");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const Shapes s{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), k_cache.size(0), block_tables.size(1)};
  const int64_t B = q.size(0);
  TORCH_CHECK(k_cache.size(3) == s.head_dim && s.head_dim % 16 == 0 && s.head_dim <= kMaxHeadDim, "head_dim");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0 && s.num_heads / s.num_kv_heads <= kMaxRep, "heads");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "batch size mismatch");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= s.max_blocks * s.block_size, "context length outside the block table");

  auto out = torch::empty_like(q);
  const at::BFloat16* qp = q.data_ptr<at::BFloat16>();
  const at::BFloat16* kp = k_cache.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = v_cache.data_ptr<at::BFloat16>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const AttendFn attend = pick(static_cast<int>(s.num_heads / s.num_kv_heads), std::make_integer_sequence<int, kMaxRep>{});
  std::atomic<bool> bad_block{false};
  at::parallel_for(0, B * s.num_kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / s.num_kv_heads, g = i % s.num_kv_heads;
      if (!attend(qp + b * s.num_heads * s.head_dim, kp, vp, tp + b * s.max_blocks, lens[b], g,
                      static_cast<float>(scale), s, op + b * s.num_heads * s.head_dim, scores))
        bad_block = true;
    }
  });
  TORCH_CHECK(!bad_block.load(), "block table names a block outside the KV pool");
  return out;
}

// Each new token's K and V rows into its slot of the paged caches (slot -1: skip). k, v [T, KVH, D]
// may be views into the fused qkv projection (rows strided, heads contiguous). Why: torch's
// index_copy_ on those views cost ~100 us a layer at decode batch 32; this is a few row copies.
void store_kv_bf16(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping) {
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "shape mismatch");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0),
              "slot_mapping must be int64 [T]");
  const int64_t T = k.size(0), width = k.size(1) * k.size(2);
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == width, "K/V rows do not match the cache's heads");
  auto row_major = [&](torch::Tensor& t) {
    if (t.stride(2) != 1 || t.stride(1) != t.size(2)) t = t.contiguous();
  };
  row_major(k);
  row_major(v);
  slot_mapping = slot_mapping.contiguous();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "slot ", slots[t], " outside the KV pool");
  const at::BFloat16* kp = k.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = v.data_ptr<at::BFloat16>();
  at::BFloat16* kc = k_cache.data_ptr<at::BFloat16>();
  at::BFloat16* vc = v_cache.data_ptr<at::BFloat16>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(kc + slots[t] * width, kp + t * ks, width * sizeof(at::BFloat16));
    std::memcpy(vc + slots[t] * width, vp + t * vs, width * sizeof(at::BFloat16));
  }
}
