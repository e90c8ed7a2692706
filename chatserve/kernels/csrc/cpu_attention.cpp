// Paged attention for bf16 KV caches on AVX512-BF16 CPUs: prefill, chunked prefill over cached
// keys, and decode in one kernel, with one reduction order per query row.
//
// Why one kernel: a row's result must not depend on how it is scheduled (issue 20: the same
// request gave different greedy text alone, from the prefix cache and in a batch). So for every
// (query row, query head) the arithmetic is fixed by the row's own data: its keys 0..pos are
// walked in tiles of 16 key positions (16j .. 16j + 15, through the block table), each tile an
// online-softmax step (scores, running max, rescale, weighted sum of V), in the same order and with
// the same instructions whether the row is one decode token, one of a 1,000-token prompt, or one
// of several sequences sharing a cached prefix. Nothing is split over keys (no split-K), so threads
// only ever divide query rows among themselves.
//
// How: the cache is kept in this kernel's own layout inside each block (store_kv_paged_bf16 writes
// it; every block-level operation of the engine, copy-on-write and zeroing, is layout-blind): K as
// [KVH][D/2][block_size] bf16 pairs, so a tile's keys for dims (2c, 2c+1) are one 16-lane vector (key
// i in lane i: a score is a chain of vdpbf16ps over head_dim in order, with no transpose), and V as
// [KVH][block_size/2][D] pairs of consecutive keys (the weighted sum is a chain of vdpbf16ps over
// the tile's key pairs, P rounded to bf16 as SDPA does). The q-vectors (row, head) that share a KV
// head are processed in work items of up to kMaxItemRows; rows that read the same physical tile
// compute their scores together (each tile read once for all of them: long prefills, and shared
// prefixes, which is what cascade attention was for). Each row's own chain is the same as if it
// were alone. The softmax has no branch and no store-to-load round trip: the running sum is kept
// per lane (summed once at the end), the corrections of a chunk's rows are one exp, and P stays in
// registers (a scalar store read back as a broadcast stalled store forwarding: PV ran at a third of
// the dot-product rate; 1,000-token prefill per layer 12.4 -> 6.6 ms on one core). Built with
// -ffp-contract=off: no multiply may fuse with an add differently in one
// inlined context than in another.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace {

using chatserve_simd::exp_ps;

// q rows are read as bf16 pairs; a row starts at an even element, so 2-byte alignment is all we know.
typedef int32_t __attribute__((aligned(2), may_alias)) pair_t;

constexpr int64_t kTile = 16;        // key positions per online-softmax step (fixed: part of the arithmetic)
constexpr int kMaxItemRows = 48;     // q-vectors per work item (sharing each tile's K/V copies)
constexpr int kChunk = 8;            // q-vectors whose scores are computed together in registers
constexpr int64_t kMaxHeadDim = 256;

struct QVec {
  int64_t t;     // row of q / out
  int64_t head;  // query head
  int64_t seq;   // sequence (row of the block tables)
  int64_t pos;   // position: keys lo..pos are attended
  int64_t lo;    // first attended key: 0, or pos - window + 1 for a sliding-window layer
};

struct Item {
  int64_t begin, end;  // range of the group's q-vectors
  int64_t kv_head;
  int64_t group;
  double cost;
};

struct Ctx {
  const at::BFloat16* q;
  int64_t q_row_stride;
  const at::BFloat16* k;
  const at::BFloat16* v;
  at::BFloat16* out;
  const int64_t* tables;
  int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  float softcap;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2), before the mask
};

// Per thread: a tile's K gathered from blocks smaller than a tile, and the rows' running state.
struct Scratch {
  alignas(64) int32_t kt[kMaxHeadDim / 2 * kTile];  // [D/2][16 keys]: bf16 pair (dims 2c, 2c+1) of key i
  alignas(64) float acc[kMaxItemRows * kMaxHeadDim];
  alignas(64) float lv[kMaxItemRows * kTile];  // per row: the running sum of e, lane by lane
  float m[kMaxItemRows];
};

// tanh(x) = 1 - 2 / (e^2x + 1): e^2x overflows to inf for large x (giving 1) and clamps at e^-87
// for very negative x (giving -1); lane by lane, the same steps for every row.
inline __m512 tanh_ps(__m512 x) {
  const __m512 e = exp_ps(_mm512_add_ps(x, x));
  return _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
}

// Where one tile's K and V are: K pairs for dims (2c, 2c+1) of the 16 keys at kt + c * kt_stride,
// V pairs of keys (2i, 2i + 1) at vp[i] (D dwords each).
struct Tile {
  const int32_t* kt;
  int64_t kt_stride;
  const int32_t* vp[kTile / 2];
};

// Sum of 16 lanes in a fixed tree (halves, then quarters, ...): the same order for every row.
inline float hsum16(__m512 x) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  const __m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));
  return _mm_cvtss_f32(d);
}

// The physical blocks a q-vector at `pos` reads for the tile at key0 (one, or 16 / block_size when
// blocks are smaller than a tile): the tile's identity. Lanes past the row's last block read its
// last block again (finite data, masked out).
inline int tile_blocks(const Ctx& c, const int64_t* table, int64_t pos, int64_t key0, int64_t* blocks) {
  const int64_t bs = c.block_size, last = pos / bs;
  const int n = bs >= kTile ? 1 : static_cast<int>(kTile / bs);
  for (int i = 0; i < n; ++i) blocks[i] = table[std::min(key0 / bs + i, last)];
  return n;
}

// dwords per block and KV head of either cache: block_size * D / 2
inline Tile locate_tile(const Ctx& c, const int64_t* blocks, int64_t key0, int64_t kv_head, Scratch& s) {
  const int64_t bs = c.block_size, D = c.head_dim, pairs = D / 2;
  const int64_t block_dw = bs * c.num_kv_heads * pairs, head_dw = bs * pairs;
  const int32_t* kc = reinterpret_cast<const int32_t*>(c.k);
  const int32_t* vc = reinterpret_cast<const int32_t*>(c.v);
  Tile t;
  if (bs >= kTile) {
    const int64_t off = key0 % bs;
    t.kt = kc + blocks[0] * block_dw + kv_head * head_dw + off;
    t.kt_stride = bs;
    for (int i = 0; i < kTile / 2; ++i) t.vp[i] = vc + blocks[0] * block_dw + kv_head * head_dw + (off / 2 + i) * D;
    return t;
  }
  // blocks of 2, 4 or 8 keys: gather the tile's K lanes from its blocks
  const int nb = static_cast<int>(kTile / bs);
  for (int b = 0; b < nb; ++b) {
    const int32_t* src = kc + blocks[b] * block_dw + kv_head * head_dw;
    for (int64_t p = 0; p < pairs; ++p) std::memcpy(s.kt + p * kTile + b * bs, src + p * bs, bs * sizeof(int32_t));
  }
  t.kt = s.kt;
  t.kt_stride = kTile;
  for (int i = 0; i < kTile / 2; ++i) {
    const int64_t key = 2 * i;
    t.vp[i] = vc + blocks[key / bs] * block_dw + kv_head * head_dw + ((key % bs) / 2) * D;
  }
  return t;
}

// scores of N q-vectors against the tile's 16 keys: one vdpbf16ps chain over head_dim each.
template <int N>
inline void tile_scores(const Tile& t, const pair_t* const* q, int64_t pairs, __m512* s) {
  _Pragma("GCC unroll 8") for (int n = 0; n < N; ++n) s[n] = _mm512_setzero_ps();
  for (int64_t c = 0; c < pairs; ++c) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(t.kt + c * t.kt_stride));
    _Pragma("GCC unroll 8") for (int n = 0; n < N; ++n) s[n] = _mm512_dpbf16_ps(s[n], k, (__m512bh)_mm512_set1_epi32(q[n][c]));
  }
}

// One online-softmax step of NR rows over a tile, the part that reads V: each row's accumulators
// (NV vectors of 16 dims from dim d) are rescaled by the row's correction and then take the tile's
// key pairs in pair order (P pair * V pair, vdpbf16ps). The NR rows share every V load; each row's
// chain is the same as if it were alone.
template <int NR, int NV>
inline void pv_rows(float* const* acc, const __m512* corr, const __m512i* p, const Tile& t, int64_t d) {
  __m512 a[NR][NV];
  _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r) {
    const __m512 cv = corr[r];
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d + j * 16), cv);
  }
  _Pragma("GCC unroll 8") for (int i = 0; i < kTile / 2; ++i) {
    __m512bh w[NR];
    _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r) w[r] = (__m512bh)_mm512_permutexvar_epi32(_mm512_set1_epi32(i), p[r]);
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(t.vp[i] + d + j * 16));
      _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r) a[r][j] = _mm512_dpbf16_ps(a[r][j], v, w[r]);
    }
  }
  _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r)
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc[r] + d + j * 16, a[r][j]);
}

template <int NR>
inline void pv_all_dims(const Ctx& c, float* const* acc, const __m512* corr, const __m512i* p, const Tile& t) {
  int64_t d = 0;
  for (; d + 64 <= c.head_dim; d += 64) pv_rows<NR, 4>(acc, corr, p, t, d);
  if (d < c.head_dim) pv_rows<NR, 2>(acc, corr, p, t, d);  // head_dim is a multiple of 32
}

// N rows (q-vectors reading the same tile) take one online-softmax step over it: scores (K read
// once for all), then per row, with no branch: the new running max m, the correction
// c = e^(m_old - m_new) (exactly 1 when the max stays, 0 on the first tile; one exp for all rows,
// lane by lane), e = e^(score - m) on the row's valid keys, the row's per-lane running sum
// l = l * c + e (summed over lanes once, at the end), and acc = acc * c + P V.
template <int N>
void scores_and_steps(const Ctx& c, Scratch& st, const Tile& t, const QVec* qv, const int* rows, int64_t key0) {
  const pair_t* q[N];
  for (int n = 0; n < N; ++n)
    q[n] = reinterpret_cast<const pair_t*>(c.q + qv[rows[n]].t * c.q_row_stride + qv[rows[n]].head * c.head_dim);
  __m512 s[N];
  tile_scores<N>(t, q, c.head_dim / 2, s);
  __m512 diff = _mm512_setzero_ps();  // lane n: row n's m_old - m_new
  float m_new[N];
  __mmask16 mask[N];
  _Pragma("GCC unroll 8") for (int n = 0; n < N; ++n) {
    const int r = rows[n];
    const int64_t valid = qv[r].pos - key0 + 1;  // >= 1
    mask[n] = valid >= kTile ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
    const int64_t below = qv[r].lo - key0;  // lanes before a sliding window's first key (< kTile)
    if (below > 0) mask[n] = (__mmask16)(mask[n] & (0xFFFFu << below));
    __m512 scaled = _mm512_mul_ps(s[n], _mm512_set1_ps(c.scale));
    if (c.softcap > 0.0f)
      scaled = _mm512_mul_ps(tanh_ps(_mm512_div_ps(scaled, _mm512_set1_ps(c.softcap))), _mm512_set1_ps(c.softcap));
    s[n] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), mask[n], scaled);
    const float m_old = st.m[r];
    m_new[n] = std::max(m_old, _mm512_reduce_max_ps(s[n]));
    diff = _mm512_mask_mov_ps(diff, (__mmask16)(1u << n), _mm512_set1_ps(m_old - m_new[n]));  // -inf on the first tile, 0 when the max stays
    st.m[r] = m_new[n];
  }
  const __m512 corr_all = exp_ps(diff);
  __m512 corr[N];  // row n's correction in every lane
  _Pragma("GCC unroll 8") for (int n = 0; n < N; ++n) corr[n] = _mm512_permutexvar_ps(_mm512_set1_epi32(n), corr_all);
  __m512i p[N];  // row n's P as bf16 pairs of keys (2i, 2i + 1) in dword i
  float* acc[N];
  _Pragma("GCC unroll 8") for (int n = 0; n < N; ++n) {
    const int r = rows[n];
    const __m512 e = _mm512_maskz_mov_ps(mask[n], exp_ps(_mm512_sub_ps(s[n], _mm512_set1_ps(m_new[n]))));
    float* lv = st.lv + r * kTile;
    _mm512_store_ps(lv, _mm512_add_ps(_mm512_mul_ps(_mm512_load_ps(lv), corr[n]), e));
    p[n] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(e));
    acc[n] = st.acc + r * c.head_dim;
  }
  constexpr int kFull = N / 4 * 4;
  for (int n = 0; n < kFull; n += 4) pv_all_dims<4>(c, acc + n, corr + n, p + n, t);
  if constexpr (N % 4 != 0) pv_all_dims<N % 4>(c, acc + kFull, corr + kFull, p + kFull, t);
}

void run_rows(const Ctx& c, Scratch& st, const Tile& t, const QVec* qv, const int* rows, int n, int64_t key0) {
  for (int i = 0; i < n; i += kChunk) {
    switch (std::min(kChunk, n - i)) {
      case 1: scores_and_steps<1>(c, st, t, qv, rows + i, key0); break;
      case 2: scores_and_steps<2>(c, st, t, qv, rows + i, key0); break;
      case 3: scores_and_steps<3>(c, st, t, qv, rows + i, key0); break;
      case 4: scores_and_steps<4>(c, st, t, qv, rows + i, key0); break;
      case 5: scores_and_steps<5>(c, st, t, qv, rows + i, key0); break;
      case 6: scores_and_steps<6>(c, st, t, qv, rows + i, key0); break;
      case 7: scores_and_steps<7>(c, st, t, qv, rows + i, key0); break;
      default: scores_and_steps<8>(c, st, t, qv, rows + i, key0); break;
    }
  }
}

void run_item(const Ctx& c, Scratch& st, const QVec* qv, int64_t n, int64_t kv_head) {
  const int64_t D = c.head_dim;
  int64_t max_pos = 0, min_lo = INT64_MAX;
  for (int64_t r = 0; r < n; ++r) {
    st.m[r] = -INFINITY;
    _mm512_store_ps(st.lv + r * kTile, _mm512_setzero_ps());
    std::memset(st.acc + r * D, 0, D * sizeof(float));
    max_pos = std::max(max_pos, qv[r].pos);
    min_lo = std::min(min_lo, qv[r].lo);
  }
  int rows[kMaxItemRows];
  int64_t cur[kTile], blocks[kTile];
  Tile tile{};
  const bool whole_blocks = c.block_size >= kTile;  // a tile lies in one block: same sequence, same tile
  // a row's tiles: those holding a key of lo..pos, in order (tile 16j covers keys 16j .. 16j + 15)
  for (int64_t key0 = min_lo / kTile * kTile; key0 <= max_pos; key0 += kTile) {
    int ncur = 0, nrows = 0;
    int64_t cur_seq = -1;
    for (int64_t r = 0; r < n; ++r) {
      if (qv[r].pos < key0 || qv[r].lo >= key0 + kTile) continue;
      if (!(whole_blocks && qv[r].seq == cur_seq)) {
        const int nb = tile_blocks(c, c.tables + qv[r].seq * c.max_blocks, qv[r].pos, key0, blocks);
        if (nb != ncur || !std::equal(blocks, blocks + nb, cur)) {  // another physical tile: other K/V
          if (nrows) run_rows(c, st, tile, qv, rows, nrows, key0);
          nrows = 0;
          ncur = nb;
          std::copy(blocks, blocks + nb, cur);
          tile = locate_tile(c, cur, key0, kv_head, st);
        }
        cur_seq = qv[r].seq;
      }
      rows[nrows++] = static_cast<int>(r);
    }
    if (nrows) run_rows(c, st, tile, qv, rows, nrows, key0);
  }
  for (int64_t r = 0; r < n; ++r) {  // out = acc / l, l summed over its lanes in a fixed tree
    const __m512 inv = _mm512_set1_ps(1.0f / hsum16(_mm512_load_ps(st.lv + r * kTile)));
    const float* acc = st.acc + r * D;
    at::BFloat16* o = c.out + (qv[r].t * c.num_heads + qv[r].head) * D;
    for (int64_t d = 0; d < D; d += 16) chatserve_simd::store16_fp32_as_bf16(o + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), inv));
  }
}

}  // namespace

// q [T, H, D] (rows may be strided, heads contiguous); k_cache, v_cache [num_blocks, block_size, KVH, D]
// in the layout store_kv_paged_bf16 writes;
// block_tables [S, max_blocks] int64; query_start [S + 1] int64 (sequence s owns rows
// query_start[s] .. query_start[s + 1] - 1 of q, at positions start_pos[s], start_pos[s] + 1, ...;
// their K/V already stored); groups: seq_order [S] lists the sequences group by group,
// group_start [G + 1] where each group begins in it (a group's rows are processed together:
// sequences sharing cached blocks read them once). Returns [T, H, D].
// window > 0: a row at pos attends to keys pos - window + 1 .. pos only (HF's sliding window);
// blocks wholly before a sequence's first row's window are never read, so their table entries may
// be any value. softcap > 0: the scaled scores are soft-capped, softcap * tanh(score / softcap).
torch::Tensor paged_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor start_pos,
                                   torch::Tensor seq_order, torch::Tensor group_start, double scale,
                                   int64_t window, double softcap) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "shape mismatch");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  for (const auto* t : {&block_tables, &query_start, &start_pos, &seq_order, &group_start})
    TORCH_CHECK(t->scalar_type() == at::kLong, "block tables, query_start, start_pos and groups must be int64");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2), bs = k_cache.size(1), NB = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == D && D % 32 == 0 && D <= kMaxHeadDim, "head_dim must be a multiple of 32, at most 256");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(bs >= 2 && (bs % kTile == 0 || kTile % bs == 0), "block_size must be 2, 4, 8 or a multiple of 16");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: none)");
  if (q.stride(2) != 1 || q.stride(1) != D) q = q.contiguous();
  block_tables = block_tables.contiguous();
  query_start = query_start.contiguous();
  start_pos = start_pos.contiguous();
  seq_order = seq_order.contiguous();
  group_start = group_start.contiguous();
  TORCH_CHECK(block_tables.dim() == 2, "block_tables must be [S, max_blocks]");
  const int64_t S = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK(query_start.numel() == S + 1 && start_pos.numel() == S && seq_order.numel() == S,
              "query_start [S + 1], start_pos [S] and seq_order [S] must match the block tables");
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* sp = start_pos.data_ptr<int64_t>();
  const int64_t* tb = block_tables.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[S] == T, "query_start must run from 0 to the number of rows");
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(qs[s + 1] >= qs[s] && sp[s] >= 0, "query_start must not decrease; start_pos must be >= 0");
    if (qs[s + 1] == qs[s]) continue;
    const int64_t last = sp[s] + qs[s + 1] - qs[s] - 1;
    TORCH_CHECK(last < max_blocks * bs, "context length outside the block table");
    const int64_t first = window > 0 ? std::max<int64_t>(0, sp[s] - window + 1) : 0;  // the first row's first key
    for (int64_t b = first / kTile * kTile / bs; b <= last / bs; ++b)
      TORCH_CHECK(tb[s * max_blocks + b] >= 0 && tb[s * max_blocks + b] < NB, "block table names a block outside the KV pool");
  }
  const int64_t G = group_start.numel() - 1;
  const int64_t* order = seq_order.data_ptr<int64_t>();
  const int64_t* gs = group_start.data_ptr<int64_t>();
  TORCH_CHECK(G >= 0 && gs[0] == 0 && gs[G] == S, "group_start must run from 0 to the number of sequences");
  std::vector<char> seen(S, 0);
  for (int64_t i = 0; i < S; ++i) {
    TORCH_CHECK(order[i] >= 0 && order[i] < S && !seen[order[i]], "seq_order must list every sequence once");
    seen[order[i]] = 1;
  }

  auto out = torch::empty({T, H, D}, q.options());
  const int64_t rep = H / KVH;
  // q-vectors per group (the same for every KV head: head = kv_head * rep + k)
  std::vector<std::vector<QVec>> group_qv(G);
  int64_t total = 0;
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(gs[g + 1] >= gs[g], "group_start must not decrease");
    for (int64_t i = gs[g]; i < gs[g + 1]; ++i) {
      const int64_t s = order[i];
      for (int64_t t = qs[s]; t < qs[s + 1]; ++t)
        for (int64_t k = 0; k < rep; ++k) {
          const int64_t pos = sp[s] + t - qs[s];
          group_qv[g].push_back({t, k, s, pos, window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0});
        }
    }
    total += static_cast<int64_t>(group_qv[g].size());
  }
  if (total == 0) return out;
  const int threads = std::max(1, at::get_num_threads());
  // Item size: up to kMaxItemRows, smaller when that would leave threads idle (work per row is unchanged).
  const int64_t want_items = 4 * threads;
  const int64_t rows_per_item = std::clamp<int64_t>((total * KVH + want_items - 1) / want_items, 1, kMaxItemRows);
  std::vector<Item> items;
  for (int64_t g = 0; g < G; ++g) {
    const auto& list = group_qv[g];
    for (int64_t b = 0; b < static_cast<int64_t>(list.size()); b += rows_per_item) {
      const int64_t e = std::min<int64_t>(b + rows_per_item, list.size());
      double cost = 0, max_pos = 0;
      for (int64_t i = b; i < e; ++i) {
        cost += static_cast<double>(list[i].pos / kTile - list[i].lo / kTile + 1);
        max_pos = std::max<double>(max_pos, list[i].pos);
      }
      cost += 8.0 * (max_pos / kTile + 1);  // the tiles' K/V copies
      for (int64_t h = 0; h < KVH; ++h) items.push_back({b, e, h, g, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const Ctx ctx{q.data_ptr<at::BFloat16>(), q.stride(0), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                out.data_ptr<at::BFloat16>(), tb, max_blocks, H, KVH, D, bs, static_cast<float>(scale),
                static_cast<float>(softcap)};
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto st = std::make_unique<Scratch>();
    std::vector<QVec> local(kMaxItemRows);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const auto& list = group_qv[it.group];
      const int64_t n = it.end - it.begin;
      for (int64_t r = 0; r < n; ++r) {
        local[r] = list[it.begin + r];
        local[r].head += it.kv_head * rep;
      }
      run_item(ctx, *st, local.data(), n, it.kv_head);
    }
  });
  return out;
}

// Each new token's K and V into its slot, in paged_attention_bf16's layout within each block: K as
// [KVH][D/2][block_size] bf16 pairs, V as [KVH][block_size/2][D][2] (consecutive keys paired).
// k, v [T, KVH, D] may be views into the fused qkv projection (rows strided, heads contiguous).
void store_kv_paged_bf16(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor slot_mapping) {
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "shape mismatch");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0),
              "slot_mapping must be int64 [T]");
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), bs = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == KVH && k_cache.size(3) == D, "K/V rows do not match the cache's heads");
  TORCH_CHECK(D % 2 == 0 && bs % 2 == 0, "head_dim and block_size must be even");
  auto row_major = [&](torch::Tensor& t) {
    if (t.stride(2) != 1 || t.stride(1) != t.size(2)) t = t.contiguous();
  };
  row_major(k);
  row_major(v);
  slot_mapping = slot_mapping.contiguous();
  const int64_t num_slots = k_cache.size(0) * bs;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "slot ", slots[t], " outside the KV pool");
  const int32_t* kp = reinterpret_cast<const int32_t*>(k.data_ptr<at::BFloat16>());
  const at::BFloat16* vp = v.data_ptr<at::BFloat16>();
  int32_t* kc = reinterpret_cast<int32_t*>(k_cache.data_ptr<at::BFloat16>());
  at::BFloat16* vc = v_cache.data_ptr<at::BFloat16>();
  const int64_t ks = k.stride(0) / 2, vs = v.stride(0), pairs = D / 2, block = bs * KVH * D;
  TORCH_CHECK(k.stride(0) % 2 == 0, "K rows must start at even elements");
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (slots[t] < 0) continue;
      const int64_t b = slots[t] / bs, o = slots[t] % bs;
      for (int64_t h = 0; h < KVH; ++h) {
        int32_t* kd = kc + (b * block) / 2 + h * pairs * bs + o;
        const int32_t* ks_row = kp + t * ks + h * pairs;
        for (int64_t c = 0; c < pairs; ++c) kd[c * bs] = ks_row[c];
        at::BFloat16* vd = vc + b * block + ((h * (bs / 2) + o / 2) * D) * 2 + o % 2;
        const at::BFloat16* vs_row = vp + t * vs + h * D;
        for (int64_t d = 0; d < D; ++d) vd[2 * d] = vs_row[d];
      }
    }
  });
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
