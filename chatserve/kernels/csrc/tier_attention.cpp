// Paged attention and the K/V stores of every kernel tier (issues #30, 56), written once over
// csrc/vec.h: prefill, chunked prefill over cached keys, and decode in one kernel, with one
// reduction order per (query row, query head), over bf16 or 8-bit K/V caches. What differs per tier
// is the in-block layout of a bf16 cache and the instructions of two steps (vec.h's "attention
// micro-kernels"): AVX2 (8 lanes) and AVX512-VNNI (16) score and weight with fp32 FMA chains (the
// layout below); AVX512-BF16 with vdpbf16ps over bf16 pairs (K paired by dim, V by key, P rounded to
// bf16: see Bf16Pair), half the instructions.
//
// Why one kernel, one order: a row's result must not depend on how it is scheduled (issue 20). For
// every (row, head) the keys 0..pos are walked in tiles of kTile = 16 key positions (16j .. 16j + 15,
// through the block table; a tile may span several blocks of 8 or fewer keys), each tile one
// online-softmax step, with the same instructions whether the row is one decode token, one of a
// 1,000-token prompt, or one of several sequences sharing a cached prefix. Nothing is split over
// keys (no split-K): threads only divide query rows among themselves.
//
// How, without bf16 dot products: the cache is kept in this kernel's own layout inside each block
// (store_kv_paged_bf16 writes it; the engine's block operations, copy-on-write and zeroing, are
// layout-blind):
//   K as [KVH][D][block_size]: a tile's 16 keys of one dim are kTile / kLanes vectors (key i in
//     lane i % kLanes), so a tile's scores are an fp32 FMA chain over d = 0..D-1 of broadcast q[d]
//     times those vectors (q widened to fp32 once per item; no transpose, no horizontal sum);
//   V as [KVH][block_size][D]: acc = acc * corr, then acc += p_i * V_i for the tile's keys i in
//     key order (an FMA chain per dim). A key's row is read 2 * kLanes dims at a time as bf16 pairs
//     and widened by a shift and an and (vec.h load_bf16_even_odd: half the instructions of two
//     widening loads, which were as many as the FMAs), so the accumulators hold each such group as
//     [even dims][odd dims], put back in order once at the end. P stays fp32 (never rounded to bf16).
// Per tile and row: s = (q . k) * scale, masked to -inf past pos (partial tiles only: the mask of a
// full tile keeps every lane); m_new = max(m, max s); corr = e^(m - m_new) (e^-87 ~ 1e-38 on the
// first tile, where acc and l are still 0; one exp for all rows of a chunk, lane n = row n);
// p = e^(s - m_new), masked to 0 past pos; l = l * corr + p per lane (one FMA; the lanes are summed
// once, at the end, in vec.h's fixed tree); out = acc * (1 / l), rounded to bf16 (RNE).
// The q-vectors (row, head) sharing a KV head are processed in work items of up to kMaxItemRows;
// rows that read the same physical tile (a prompt's rows, the heads of one KV head, sequences of a
// group sharing a prefix) compute together: kChunk rows' scores share every K load, kPvRows rows'
// weighted sums share every V load; each row's own chains are the ones it has alone.
// 8-bit caches (the KV contract, issue 56): [blocks, block_size, KVH, D + 4] int8, one fp32 scale per
// token and KV head (amax / 127, round half to even: store_kv_paged_bf16 and store_kv_bf16 quantize,
// bit-exact with kernels/kv_quant.py). In a block's head region K is [D][block_size] quants then the
// block_size scales, V [block_size][D] then the scales. A tile's scores are the FMA chains above over
// the quants widened exactly, times k_scale * scale per key; the V step weights key i by p_i * v_scale_i
// (l sums p). AVX2 and AVX512-VNNI widen each quant to fp32 where the bf16 path widens a bf16 (no tier
// has an int8 x bf16 dot product), so the halved bytes are the gain. AVX512-BF16 widens a tile's quants
// once, for all the rows that read it, to bf16 pairs in the paired layout (exact: |q| <= 127) and runs
// the bf16 tile's vdpbf16ps steps on them (Int8Pair; P times v_scale, then rounded to bf16): int8 costs
// about what bf16 does there where rows share tiles (prefill, extend), less where bytes dominate (a
// decode batch). The arithmetic differs per tier (determinism is per tier), one fixed order per row.
// Speed (Zen 3, AVX2, SmolLM2's 9 x 3 heads of 64, benchmarks/kernels/bench_tier_attention.py): a 1,000-token
// causal prefill ~20 ms a layer on one core (~75% of the FMA peak; torch SDPA in fp32 ~25 ms),
// ~11-13 ms on two (SDPA ~14-17); decode at 4,000 keys ~0.18 ms on two (SDPA ~0.35). Scoring two tiles at once for a decode's few rows was
// tried: AVX2's 16 registers spill, no gain. Built with -ffp-contract=off (kernels/build.py): no
// multiply fuses with an add unless written as cs::fma.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using cs::VF;
using cs::kLanes;

constexpr int64_t kTile = 16;                    // key positions per online-softmax step (part of the arithmetic)
constexpr int kTV = kTile / kLanes;              // vectors per tile: 2 (AVX2), 1 (AVX512)
constexpr int kMaxItemRows = 48;                 // q-vectors per work item
constexpr int kChunk = 12 / kTV;                 // rows scored together: 12 accumulators (AVX2 has 16 registers)
constexpr int kPvRows = kLanes == 8 ? 2 : 4;     // rows whose weighted sums share V loads
constexpr int64_t kMaxHeadDim = 256;
static_assert(kTile % kLanes == 0, "a tile is whole vectors");
static_assert(kChunk <= kLanes, "a chunk's corrections are one vector");

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
  const uint16_t* q;  // bf16 bits
  int64_t q_row_stride;
  const void* k;  // bf16 bits (uint16_t) or int8 quants with their scales (KV contract)
  const void* v;
  uint16_t* out;
  const int64_t* tables;
  int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  float softcap;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2), before the mask
};

// tanh(x) = 1 - 2 / (e^2x + 1): e^2x saturates for large x (giving 1) and clamps at e^-87 for very
// negative x (giving -1); lane by lane, the same steps for every row.
CS_INLINE VF tanh(VF x) {
  return cs::sub(cs::set1(1.0f), cs::div(cs::set1(2.0f), cs::add(cs::exp(cs::add(x, x)), cs::set1(1.0f))));
}

// lane i of a tile's vector v holds key key0 + v * kLanes + i
alignas(64) constexpr float kLaneIndex[kTile] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// Per thread: the item's rows (q in fp32, running state), a chunk's P, a gathered K tile.
struct Scratch {
  alignas(64) float q[kMaxItemRows * kMaxHeadDim];
  alignas(64) float acc[kMaxItemRows * kMaxHeadDim];
  alignas(64) float lv[kMaxItemRows * kTile];  // per row: the running sum of p, lane by lane
  alignas(64) float p[kChunk * kTile];         // the chunk's P, read back as broadcasts by the V step
  alignas(64) uint16_t kt[kMaxHeadDim * kTile];  // [D][16 keys]: a tile's K from blocks of < kLanes keys
  alignas(64) float ks[kTile];                   // int8: the tile's K scales (key i in lane i), V scales
  alignas(64) float vs[kTile];
  alignas(64) int32_t kw[kMaxHeadDim / 2 * kTile];  // AVX512-BF16, int8: a tile's K quants as bf16 pairs [D/2][16 keys]
  alignas(64) int32_t vw[kTile / 2 * kMaxHeadDim];  // and its V as key pairs [8][D]
  float m[kMaxItemRows];
};

// The cache's element type: bf16 bits, or int8 quants (the KV contract: per token and head, an fp32
// scale amax / 127, dequantized value q * scale). kRow: a (slot, head) row's elements in the cache
// tensor's last dim; a block's head region holds block_size such rows in this kernel's layout:
//   bf16: K [D][block_size], V [block_size][D];
//   int8: K [D][block_size] quants then [block_size] fp32 scales; V [block_size][D] then the scales.
template <typename E>
constexpr bool kInt8 = std::is_same_v<E, int8_t>;
// The AVX512-BF16 tier's bf16 layout (vec.h's attention micro-kernels, cs::kBf16Dot): K as
// [D/2][block_size] bf16 pairs (dims 2c, 2c + 1 of key i in 32-bit word c * block_size + i), V as
// [block_size/2][D] pairs of consecutive keys (keys 2j, 2j + 1 of dim d in word j * D + d): a score
// is a vdpbf16ps chain over the pairs of head_dim, P.V one over the tile's 8 key pairs.
struct Bf16Pair { int32_t bits; };
// The AVX512-BF16 tier's int8 arithmetic: the cache's bytes as everywhere (the int8 layout below), a
// tile's quants widened once to bf16 pairs in the thread's scratch (exact: |q| <= 127; kw, vw) for
// all the rows that read the tile, in Bf16Pair's layout, then scored and weighted with vdpbf16ps
// like a bf16 tile, the per-key scales applied as on the other tiers (scores times k_scale; P times
// v_scale before P is rounded to bf16).
struct Int8Pair { int32_t bits; };
template <typename E>
constexpr bool kPairs = std::is_same_v<E, Bf16Pair> || std::is_same_v<E, Int8Pair>;
// per-key scales (an 8-bit cache, read as quants or as widened pairs)
template <typename E>
constexpr bool kScaled = std::is_same_v<E, int8_t> || std::is_same_v<E, Int8Pair>;
// A bf16 cache's layout on this tier, and how an int8 one is read
using Bf16Layout = std::conditional_t<cs::kBf16Dot, Bf16Pair, uint16_t>;
using Int8Layout = std::conditional_t<cs::kBf16Dot, Int8Pair, int8_t>;
template <typename E>
constexpr int64_t row_elems(int64_t D) { return kInt8<E> ? D + 4 : D; }

CS_INLINE float scale_at(const int8_t* p) { float f; std::memcpy(&f, p, sizeof f); return f; }

// Where one tile's K and V are: dim d of keys v * kLanes .. at k[v] + d * k_stride; key i's V row at
// v[i]. int8: key i's scales in lane i of ks / vs (into the block where a tile lies in one block,
// else gathered into the thread's scratch).
template <typename E>
struct Tile {
  const E* k[kTV];
  int64_t k_stride;
  const E* v[kTile];
  const float* ks;
  const float* vs;
};

// The physical blocks a q-vector at `pos` reads for the tile at key0 (one, or 16 / block_size when
// blocks are smaller than a tile): the tile's identity. Keys past the row's last block read its last
// block again (finite data, masked out).
inline int tile_blocks(const Ctx& c, const int64_t* table, int64_t pos, int64_t key0, int64_t* blocks) {
  const int64_t bs = c.block_size, last = pos / bs;
  const int n = bs >= kTile ? 1 : static_cast<int>(kTile / bs);
  for (int i = 0; i < n; ++i) blocks[i] = table[std::min(key0 / bs + i, last)];
  return n;
}

template <typename E>
inline Tile<E> locate_tile(const Ctx& c, Scratch& st, const int64_t* blocks, int64_t key0, int64_t kv_head) {
  const int64_t bs = c.block_size, D = c.head_dim, head = bs * row_elems<E>(D), block = c.num_kv_heads * head;
  const E* kc = static_cast<const E*>(c.k);
  const E* vc = static_cast<const E*>(c.v);
  E* kt = reinterpret_cast<E*>(st.kt);
  // key i of the tile: its block's (K or V) head base, and its slot in the block. Blocks of 16 or
  // more keys hold the whole tile (keys off .. off + 15); smaller ones are 2, 4 or 8 keys, a power
  // of two (masks and shifts: a tile's 16 runtime divisions were a decode step's largest cost).
  const bool whole = bs >= kTile;
  const int64_t off = whole ? key0 % bs : 0, shift = whole ? 0 : __builtin_ctzll(static_cast<uint64_t>(bs));
  auto base = [&](const E* cache, int64_t i) { return cache + blocks[whole ? 0 : i >> shift] * block + kv_head * head; };
  auto slot = [&](int64_t i) { return whole ? off + i : (i & (bs - 1)); };
  Tile<E> t;
#if defined(CHATSERVE_BF16)
  if constexpr (std::is_same_v<E, Int8Pair>) {  // the quants' tile, widened to bf16 pairs once
    const Tile<int8_t> q = locate_tile<int8_t>(c, st, blocks, key0, kv_head);
    for (int64_t p = 0; p < D / 2; ++p)
      cs::store_pairs(st.kw + p * kTile, cs::s8_pairs(q.k[0] + 2 * p * q.k_stride, q.k[0] + (2 * p + 1) * q.k_stride));
    for (int j = 0; j < kTile / 2; ++j)
      for (int64_t d = 0; d < D; d += kLanes) cs::store_pairs(st.vw + j * D + d, cs::s8_pairs(q.v[2 * j] + d, q.v[2 * j + 1] + d));
    t.k[0] = reinterpret_cast<const E*>(st.kw);
    t.k_stride = kTile;
    for (int j = 0; j < kTile / 2; ++j) t.v[j] = reinterpret_cast<const E*>(st.vw) + j * D;
    t.ks = q.ks;
    t.vs = q.vs;
    return t;
  } else
#endif
  if constexpr (kPairs<E>) {  // in 32-bit words: a head's region is bs * D / 2 of them
    const int64_t pairs = D / 2, head_w = bs * pairs, block_w = c.num_kv_heads * head_w;
    auto pair_base = [&](const E* cache, int64_t i) { return cache + blocks[whole ? 0 : i >> shift] * block_w + kv_head * head_w; };
    for (int i = 0; i < kTile / 2; ++i) t.v[i] = pair_base(vc, 2 * i) + slot(2 * i) / 2 * D;
    t.ks = t.vs = nullptr;
    if (bs >= kTile) {
      t.k[0] = pair_base(kc, 0) + slot(0);
      t.k_stride = bs;
      return t;
    }
    for (int64_t b = 0; b < kTile / bs; ++b) {  // blocks of 2, 4 or 8 keys: gather the tile's K lanes
      const E* src = pair_base(kc, b * bs);
      for (int64_t p = 0; p < pairs; ++p) std::memcpy(kt + p * kTile + b * bs, src + p * bs, bs * sizeof(E));
    }
    t.k[0] = kt;
    t.k_stride = kTile;
    return t;
  }
  for (int i = 0; i < kTile; ++i) t.v[i] = base(vc, i) + slot(i) * D;
  if constexpr (kInt8<E>) {
    if (bs >= kTile) {  // the tile's scales are 16 consecutive floats of its block
      t.ks = reinterpret_cast<const float*>(base(kc, 0) + D * bs) + slot(0);
      t.vs = reinterpret_cast<const float*>(base(vc, 0) + D * bs) + slot(0);
    } else {
      for (int i = 0; i < kTile; ++i) {
        st.ks[i] = scale_at(base(kc, i) + D * bs + slot(i) * 4);
        st.vs[i] = scale_at(base(vc, i) + D * bs + slot(i) * 4);
      }
      t.ks = st.ks;
      t.vs = st.vs;
    }
  } else {
    t.ks = t.vs = nullptr;
  }
  if (bs >= kLanes) {  // each vector of keys lies in one block
    for (int v = 0; v < kTV; ++v) t.k[v] = base(kc, v * kLanes) + slot(v * kLanes);
    t.k_stride = bs;
    return t;
  }
  for (int64_t b = 0; b < kTile / bs; ++b) {  // smaller blocks: gather the tile's K lanes
    const E* src = base(kc, b * bs);
    for (int64_t d = 0; d < D; ++d) std::memcpy(kt + d * kTile + b * bs, src + d * bs, bs * sizeof(E));
  }
  for (int v = 0; v < kTV; ++v) t.k[v] = kt + v * kLanes;
  t.k_stride = kTile;
  return t;
}

// kLanes keys' values of one dim widened exactly to fp32 (bf16 bits, or int8 quants before their scale)
CS_INLINE VF load_keys(const uint16_t* p) { return cs::load_bf16(p); }
CS_INLINE VF load_keys(const int8_t* p) { return cs::load_s8(p); }

#if defined(CHATSERVE_BF16)
// Scores of N rows against the tile's 16 keys in the paired layout: per row one vdpbf16ps chain over
// head_dim's pairs, q read as bf16 pairs straight from the query row.
template <int N, typename E>
CS_INLINE void pair_scores(const Tile<E>& t, const uint16_t* const* q, int64_t D, VF (&s)[N][kTV]) {
  _Pragma("GCC unroll 16") for (int n = 0; n < N; ++n) s[n][0] = cs::zero();
  for (int64_t c = 0; c < D / 2; ++c) {
    const cs::VB k = cs::load_bf16_pairs(reinterpret_cast<const uint16_t*>(t.k[0] + c * t.k_stride));
    _Pragma("GCC unroll 16") for (int n = 0; n < N; ++n) s[n][0] = cs::dpbf16(s[n][0], k, cs::broadcast_bf16_pair(q[n] + 2 * c));
  }
}

// The V part of one step for NR rows, NV vectors of dims from d, in the paired layout: acc = acc *
// corr, then the tile's key pairs in order, acc += P pair . V pair (vdpbf16ps; P as bf16 pairs, row
// r's in p[r], kept in registers). The rows share every V load.
template <int NR, int NV, typename E>
CS_INLINE void pair_pv_block(float* const* acc, const VF* corr, const cs::VB* p, const Tile<E>& t, int64_t d) {
  VF a[NR][NV];
  _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r)
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) a[r][j] = cs::mul(cs::load(acc[r] + d + j * kLanes), corr[r]);
  _Pragma("GCC unroll 8") for (int i = 0; i < kTile / 2; ++i) {
    cs::VB w[NR];
    _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r) w[r] = cs::broadcast_pair_lane(p[r], i);
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) {
      const cs::VB v = cs::load_bf16_pairs(reinterpret_cast<const uint16_t*>(t.v[i] + d + j * kLanes));
      _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r) a[r][j] = cs::dpbf16(a[r][j], v, w[r]);
    }
  }
  _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r)
    _Pragma("GCC unroll 4") for (int j = 0; j < NV; ++j) cs::store(acc[r] + d + j * kLanes, a[r][j]);
}

template <int NR, typename E>
CS_INLINE void pair_pv(int64_t D, float* const* acc, const VF* corr, const cs::VB* p, const Tile<E>& t) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= D; d += 4 * kLanes) pair_pv_block<NR, 4>(acc, corr, p, t, d);
  if (d < D) pair_pv_block<NR, 2>(acc, corr, p, t, d);  // head_dim is a multiple of 32
}
#endif

// Scores of N rows against the tile's keys: per row and vector, one FMA chain over d = 0..D-1.
// int8: the sums of q . k_q, scaled per key later (softmax_pv).
template <int N, typename E>
CS_INLINE void tile_scores(const Tile<E>& t, const float* const* q, int64_t D, VF (&s)[N][kTV]) {
  _Pragma("GCC unroll 16") for (int n = 0; n < N; ++n)
    _Pragma("GCC unroll 2") for (int v = 0; v < kTV; ++v) s[n][v] = cs::zero();
  for (int64_t d = 0; d < D; ++d) {
    VF k[kTV];
    _Pragma("GCC unroll 2") for (int v = 0; v < kTV; ++v) k[v] = load_keys(t.k[v] + d * t.k_stride);
    _Pragma("GCC unroll 16") for (int n = 0; n < N; ++n) {
      const VF qd = cs::broadcast(q[n] + d);
      _Pragma("GCC unroll 2") for (int v = 0; v < kTV; ++v) s[n][v] = cs::fma(qd, k[v], s[n][v]);
    }
  }
}

// The V part of one step for NR rows and NG groups of 2 * kLanes dims from d: acc = acc * corr,
// then the tile's keys in order, acc += p_i * V_i. A group's dims are read as one vector of bf16
// pairs and widened by a shift and an and (load_bf16_even_odd: no shuffle), so the row's
// accumulators hold a group as [its even dims][its odd dims] (put back in order at the end). The
// rows share every V load. int8: p arrives multiplied by each key's V scale; a group is two vectors of
// kLanes quants widened in order (the accumulators hold the dims in order).
template <int NR, int NG, typename E>
CS_INLINE void pv_block(float* const* acc, const VF* corr, const float* p, const Tile<E>& t, int64_t d) {
  VF a[NR][2 * NG];
  _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r)
    _Pragma("GCC unroll 8") for (int j = 0; j < 2 * NG; ++j) a[r][j] = cs::mul(cs::load(acc[r] + d + j * kLanes), corr[r]);
  _Pragma("GCC unroll 16") for (int i = 0; i < kTile; ++i) {
    VF w[NR];
    _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r) w[r] = cs::broadcast(p + r * kTile + i);
    _Pragma("GCC unroll 8") for (int g = 0; g < NG; ++g) {
      VF even, odd;  // int8: the group's first and second kLanes dims
      if constexpr (kInt8<E>) {
        even = cs::load_s8(t.v[i] + d + g * 2 * kLanes);
        odd = cs::load_s8(t.v[i] + d + g * 2 * kLanes + kLanes);
      } else {
        cs::load_bf16_even_odd(t.v[i] + d + g * 2 * kLanes, even, odd);
      }
      _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r) {
        a[r][2 * g] = cs::fma(w[r], even, a[r][2 * g]);
        a[r][2 * g + 1] = cs::fma(w[r], odd, a[r][2 * g + 1]);
      }
    }
  }
  _Pragma("GCC unroll 4") for (int r = 0; r < NR; ++r)
    _Pragma("GCC unroll 8") for (int j = 0; j < 2 * NG; ++j) cs::store(acc[r] + d + j * kLanes, a[r][j]);
}

// Dims d.. of NR rows in blocks of NG groups, then NG / 2, ..., 1 (head_dim is a multiple of 32).
template <int NR, int NG, typename E>
CS_INLINE void pv_span(int64_t D, float* const* acc, const VF* corr, const float* p, const Tile<E>& t, int64_t d) {
  for (; d + NG * 2 * kLanes <= D; d += NG * 2 * kLanes) pv_block<NR, NG>(acc, corr, p, t, d);
  if constexpr (NG > 1) {
    if (d < D) pv_span<NR, NG / 2>(D, acc, corr, p, t, d);
  }
}

// Accumulators per pass: about half the registers (8 of AVX2's 16, 16 of AVX512's 32), so a
// decode's lone row still has 8 independent chains.
template <int NR, typename E>
CS_INLINE void pv_rows(int64_t D, float* const* acc, const VF* corr, const float* p, const Tile<E>& t) {
  constexpr int kAcc = kLanes == 8 ? 8 : 16, kGroups = kAcc / (2 * NR) > 1 ? kAcc / (2 * NR) : 1;
  pv_span<NR, kGroups>(D, acc, corr, p, t, 0);
}

// N rows take one online-softmax step over a tile whose scores s are computed (see the header).
// int8: a score is (q . k_q) * (k_scale * scale); P's sum l takes p, the V step p * v_scale (0 for
// masked keys, whose slots may hold any scale bits).
template <int N, typename E>
CS_INLINE void softmax_pv(const Ctx& c, Scratch& st, const Tile<E>& t, VF (&s)[N][kTV], const QVec* qv, const int* rows,
                          int64_t key0) {
  const int64_t D = c.head_dim;
  VF key_scale[kTV], v_scale[kTV];
  if constexpr (kScaled<E>) {
    for (int v = 0; v < kTV; ++v) {
      key_scale[v] = cs::mul(cs::load(t.ks + v * kLanes), cs::set1(c.scale));
      v_scale[v] = cs::load(t.vs + v * kLanes);
    }
  }
  // per row: scores scaled and masked past pos (partial tiles only: on a full tile the mask keeps
  // every lane, the same bits), the new running max, and m_old - m_new into lane n of one vector
  const VF scale = cs::set1(c.scale);
  VF diff = cs::zero();  // lane n: row n's m_old - m_new (lanes past N: the last row's; unused)
  const VF lanes = cs::load(kLaneIndex);
  float m_new[N];
  int valid[N], below[N];
  _Pragma("GCC unroll 16") for (int n = 0; n < N; ++n) {
    const int r = rows[n];
    valid[n] = static_cast<int>(std::min<int64_t>(qv[r].pos - key0 + 1, kTile));  // >= 1
    below[n] = static_cast<int>(qv[r].lo - key0);  // lanes before a sliding window's first key (< kTile)
    VF top = cs::set1(-INFINITY);
    for (int v = 0; v < kTV; ++v) {
      s[n][v] = cs::mul(s[n][v], kScaled<E> ? key_scale[v] : scale);
      if (c.softcap > 0.0f) s[n][v] = cs::mul(tanh(cs::div(s[n][v], cs::set1(c.softcap))), cs::set1(c.softcap));
      if (valid[n] < kTile) s[n][v] = cs::keep_first(s[n][v], valid[n] - v * kLanes, -INFINITY);
      if (below[n] > 0)
        s[n][v] = cs::select_lt(cs::load(kLaneIndex + v * kLanes), cs::set1(static_cast<float>(below[n])), cs::set1(-INFINITY), s[n][v]);
      top = cs::max(top, s[n][v]);
    }
    const float m_old = st.m[r];
    m_new[n] = std::max(m_old, cs::hmax(top));
    st.m[r] = m_new[n];
    // -inf on the first tile, 0 while the max stays; in registers (scalar stores read back as a
    // vector miss store forwarding: a stall a step)
    diff = cs::select_lt(lanes, cs::set1(static_cast<float>(n)), diff, cs::set1(m_old - m_new[n]));
  }
  const VF corr_all = cs::exp(diff);  // every row's correction in one exp, lane by lane
  alignas(64) float corr_lanes[kLanes];
  if constexpr (!kPairs<E>) cs::store(corr_lanes, corr_all);
  VF corr[N];
  float* acc[N];
#if defined(CHATSERVE_BF16)
  cs::VB pp[N];  // the paired layout: row n's P as bf16 pairs
#endif
  _Pragma("GCC unroll 16") for (int n = 0; n < N; ++n) {
    const int r = rows[n];
    if constexpr (kPairs<E>) {
#if defined(CHATSERVE_BF16)
      corr[n] = cs::broadcast_lane(corr_all, n);
#endif
    } else {
      corr[n] = cs::broadcast(corr_lanes + n);
    }
    float* lv = st.lv + r * kTile;
    float* p = st.p + n * kTile;
    for (int v = 0; v < kTV; ++v) {
      VF e = cs::exp(cs::sub(s[n][v], cs::set1(m_new[n])));
      VF w = kScaled<E> ? cs::mul(e, v_scale[v]) : e;  // the V step's weights
      if (valid[n] < kTile) {
        e = cs::keep_first(e, valid[n] - v * kLanes, 0.0f);
        w = cs::keep_first(w, valid[n] - v * kLanes, 0.0f);
      }
      if (below[n] > 0) {
        const VF lane = cs::load(kLaneIndex + v * kLanes), first = cs::set1(static_cast<float>(below[n]));
        e = cs::select_lt(lane, first, cs::zero(), e);
        w = cs::select_lt(lane, first, cs::zero(), w);
      }
      if constexpr (kPairs<E>) {
#if defined(CHATSERVE_BF16)
        pp[n] = cs::to_bf16_pairs(w);
#endif
      } else {
        cs::store(p + v * kLanes, w);
      }
      cs::store(lv + v * kLanes, cs::fma(cs::load(lv + v * kLanes), corr[n], e));
    }
    acc[n] = st.acc + r * D;
  }
  constexpr int kFull = N / kPvRows * kPvRows;
  if constexpr (kPairs<E>) {
#if defined(CHATSERVE_BF16)
    for (int n = 0; n < kFull; n += kPvRows) pair_pv<kPvRows>(D, acc + n, corr + n, pp + n, t);
    if constexpr (N % kPvRows != 0) pair_pv<N % kPvRows>(D, acc + kFull, corr + kFull, pp + kFull, t);
#endif
    return;
  } else {
    for (int n = 0; n < kFull; n += kPvRows) pv_rows<kPvRows>(D, acc + n, corr + n, st.p + n * kTile, t);
    if constexpr (N % kPvRows != 0) pv_rows<N % kPvRows>(D, acc + kFull, corr + kFull, st.p + kFull * kTile, t);
  }
}

// N rows reading the same tile: their scores (K read once for all), then their steps.
template <int N, typename E>
__attribute__((noinline)) void step(const Ctx& c, Scratch& st, const Tile<E>& t, const QVec* qv, const int* rows, int64_t key0) {
  VF s[N][kTV];
  if constexpr (kPairs<E>) {
#if defined(CHATSERVE_BF16)
    const uint16_t* q[N];
    for (int n = 0; n < N; ++n) q[n] = c.q + qv[rows[n]].t * c.q_row_stride + qv[rows[n]].head * c.head_dim;
    pair_scores<N>(t, q, c.head_dim, s);
#endif
  } else {
    const float* q[N];
    for (int n = 0; n < N; ++n) q[n] = st.q + rows[n] * c.head_dim;
    tile_scores<N>(t, q, c.head_dim, s);
  }
  softmax_pv<N>(c, st, t, s, qv, rows, key0);
}

// n rows (n <= N) in one step of up to N rows
template <int N, typename E>
void step_rows(const Ctx& c, Scratch& st, const Tile<E>& t, const QVec* qv, const int* rows, int n, int64_t key0) {
  if constexpr (N > 1) {
    if (n < N) return step_rows<N - 1, E>(c, st, t, qv, rows, n, key0);
  }
  step<N, E>(c, st, t, qv, rows, key0);
}

// Rows scored together: kChunk, or 8 in the paired layout, whose P (one register a row) stays in
// registers beside the V step's 16 accumulators (12 spilled them: AVX512 has 32).
template <typename E>
constexpr int kChunkOf = kPairs<E> ? 8 : kChunk;

template <typename E>
void run_rows(const Ctx& c, Scratch& st, const Tile<E>& t, const QVec* qv, const int* rows, int n, int64_t key0) {
  constexpr int chunk = kChunkOf<E>;
  for (int i = 0; i < n; i += chunk) step_rows<chunk, E>(c, st, t, qv, rows + i, std::min(chunk, n - i), key0);
}

template <typename E>
void run_item(const Ctx& c, Scratch& st, const QVec* qv, int64_t n, int64_t kv_head) {
  const int64_t D = c.head_dim;
  int64_t max_pos = 0, min_lo = INT64_MAX;
  for (int64_t r = 0; r < n; ++r) {
    [[maybe_unused]] const uint16_t* q = c.q + qv[r].t * c.q_row_stride + qv[r].head * D;
    if constexpr (!kPairs<E>)  // the paired layout reads q in place as bf16 pairs
      for (int64_t d = 0; d < D; d += kLanes) cs::store(st.q + r * D + d, cs::load_bf16(q + d));
    std::memset(st.acc + r * D, 0, D * sizeof(float));
    std::memset(st.lv + r * kTile, 0, kTile * sizeof(float));
    st.m[r] = -INFINITY;
    max_pos = std::max(max_pos, qv[r].pos);
    min_lo = std::min(min_lo, qv[r].lo);
  }
  int rows[kMaxItemRows];
  int64_t cur[kTile], blocks[kTile];
  Tile<E> tile{};
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
          tile = locate_tile<E>(c, st, cur, key0, kv_head);
        }
        cur_seq = qv[r].seq;
      }
      rows[nrows++] = static_cast<int>(r);
    }
    if (nrows) run_rows(c, st, tile, qv, rows, nrows, key0);
  }
  for (int64_t r = 0; r < n; ++r) {  // out = acc / l, l's lanes summed in vec.h's fixed tree
    VF l = cs::load(st.lv + r * kTile);
    for (int v = 1; v < kTV; ++v) l = cs::add(l, cs::load(st.lv + r * kTile + v * kLanes));
    const VF inv = cs::set1(1.0f / cs::hsum(l));
    const float* acc = st.acc + r * D;
    uint16_t* o = c.out + (qv[r].t * c.num_heads + qv[r].head) * D;
    alignas(64) float row[kMaxHeadDim];
    if constexpr (kInt8<E> || kPairs<E>) {
      for (int64_t d = 0; d < D; d += kLanes) cs::store_bf16(o + d, cs::mul(cs::load(acc + d), inv));  // in order
      continue;
    }
    for (int64_t g = 0; g < D; g += 2 * kLanes)  // a group's [even dims][odd dims] back in order
      for (int i = 0; i < kLanes; ++i) {
        row[g + 2 * i] = acc[g + i];
        row[g + 2 * i + 1] = acc[g + kLanes + i];
      }
    for (int64_t d = 0; d < D; d += kLanes) cs::store_bf16(o + d, cs::mul(cs::load(row + d), inv));
  }
}

const uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* mutable_bits(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// The caches' element type: bf16 ([.., D]) or int8 ([.., D + 4]: a row's quants, then its fp32 scale).
bool int8_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t head_dim) {
  const auto kt = k_cache.scalar_type();
  TORCH_CHECK((kt == at::kBFloat16 || kt == at::kChar) && v_cache.scalar_type() == kt,
              "K/V caches must both be bf16 or both int8");
  const bool int8 = kt == at::kChar;
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "shape mismatch");
  TORCH_CHECK(k_cache.size(3) == head_dim + (int8 ? 4 : 0),
              int8 ? "an int8 cache's rows must be head_dim + 4 bytes (quants, then the fp32 scale)"
                   : "K/V rows do not match the cache's heads");
  return int8;
}

// k, v [T, KVH, D] rows (strided views allowed, heads contiguous) against caches [blocks, block_size, KVH, D]
// (bf16) or [blocks, block_size, KVH, D + 4] (int8); returns whether the caches are int8
bool check_store_args(torch::Tensor& k, torch::Tensor& v, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      torch::Tensor& slot_mapping) {
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16, "K/V rows must be bf16");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "shape mismatch");
  const bool int8 = int8_caches(k_cache, v_cache, k.size(2));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0),
              "slot_mapping must be int64 [T]");
  TORCH_CHECK(k_cache.size(2) == k.size(1), "K/V rows do not match the cache's heads");
  TORCH_CHECK(!int8 || (k.size(2) % kLanes == 0 && k.size(2) <= kMaxHeadDim),
              "int8 caches need head_dim a multiple of ", kLanes, ", at most ", kMaxHeadDim);
  for (auto* t : {&k, &v})
    if (t->stride(2) != 1 || t->stride(1) != t->size(2)) *t = t->contiguous();
  slot_mapping = slot_mapping.contiguous();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "slot ", slots[t], " outside the KV pool");
  return int8;
}

// One row (a token's one KV head, D bf16 values) quantized as the KV contract says, bit-exact with
// the torch reference: scale = amax / 127 (fp32 division), q = clamp(round_half_even(x / scale), -127,
// 127) (fp32 division; the clamp before the rounding gives the same integers), all 0 where scale is 0.
// The D quants go to q[0..D) (D a multiple of kLanes); returns the scale.
float quantize_row(const uint16_t* x, int64_t D, int8_t* q) {
  VF top = cs::zero();
  for (int64_t d = 0; d < D; d += kLanes) top = cs::max(top, cs::abs(cs::load_bf16(x + d)));
  const float scale = cs::hmax(top) / 127.0f;  // max is exact in any order
  if (scale == 0.0f) {
    std::memset(q, 0, D);
    return scale;
  }
  const VF s = cs::set1(scale), lo = cs::set1(-127.0f), hi = cs::set1(127.0f);
  for (int64_t d = 0; d < D; d += kLanes) {
    const VF y = cs::min(cs::max(cs::div(cs::load_bf16(x + d), s), lo), hi);
    cs::store_i8(q + d, cs::to_int_rne(cs::round_nearest(y)));
  }
  return scale;
}

}  // namespace

// q [T, H, D] (rows may be strided, heads contiguous); k_cache, v_cache [num_blocks, block_size, KVH, D]
// in the layout store_kv_paged_bf16 writes; block_tables [S, max_blocks] int64; query_start [S + 1]
// int64 (sequence s owns rows query_start[s] .. query_start[s + 1] - 1 of q, at positions
// start_pos[s], start_pos[s] + 1, ...; their K/V already stored); groups: seq_order [S] lists the
// sequences group by group, group_start [G + 1] where each group begins in it (a group's rows are
// processed together: sequences sharing cached blocks read them once). Returns [T, H, D].
// window > 0: a row at pos attends to keys pos - window + 1 .. pos only (HF's sliding window);
// blocks wholly before a sequence's first row's window are never read, so their table entries may
// be any value. softcap > 0: the scaled scores are soft-capped, softcap * tanh(score / softcap).
torch::Tensor paged_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                   torch::Tensor block_tables, torch::Tensor query_start, torch::Tensor start_pos,
                                   torch::Tensor seq_order, torch::Tensor group_start, double scale,
                                   int64_t window, double softcap) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "q must be bf16");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "shape mismatch");
  TORCH_CHECK(q.size(2) % 32 == 0 && q.size(2) <= kMaxHeadDim, "head_dim must be a multiple of 32, at most 256");
  const bool int8 = int8_caches(k_cache, v_cache, q.size(2));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  for (const auto* t : {&block_tables, &query_start, &start_pos, &seq_order, &group_start})
    TORCH_CHECK(t->scalar_type() == at::kLong, "block tables, query_start, start_pos and groups must be int64");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2), bs = k_cache.size(1), NB = k_cache.size(0);
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
  int64_t rows_per_item = std::clamp<int64_t>((total * KVH + want_items - 1) / want_items, 1, kMaxItemRows);
  // in whole tokens where they fit: a token's heads of one KV head read the same tiles, and a
  // decode's few rows are latency-bound, so splitting them costs more than it spreads
  if (rep <= kMaxItemRows) rows_per_item = std::min(kMaxItemRows / rep * rep, (rows_per_item + rep - 1) / rep * rep);
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
      cost += 2.0 * (max_pos / kTile + 1);  // the tiles' walk (block lookups, a gather for small blocks)
      for (int64_t h = 0; h < KVH; ++h) items.push_back({b, e, h, g, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const Ctx ctx{bits(q), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), mutable_bits(out), tb, max_blocks, H, KVH,
                D, bs, static_cast<float>(scale), static_cast<float>(softcap)};
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // one scratch per thread for the thread's life: ~110 KB, which make_unique would zero (and
    // malloc would mmap and fault in) on every call: most of a decode step's attention time
    thread_local std::unique_ptr<Scratch> scratch(new Scratch);
    Scratch* st = scratch.get();
    QVec local[kMaxItemRows];
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const auto& list = group_qv[it.group];
      const int64_t n = it.end - it.begin;
      for (int64_t r = 0; r < n; ++r) {
        local[r] = list[it.begin + r];
        local[r].head += it.kv_head * rep;
      }
      if (int8)
        run_item<Int8Layout>(ctx, *st, local, n, it.kv_head);
      else
        run_item<Bf16Layout>(ctx, *st, local, n, it.kv_head);
    }
  });
  return out;
}

// Each new token's K and V into its slot, in paged_attention_bf16's layout within each block (a
// block's head region): bf16 K as [D][block_size] (a key's dims block_size apart), V as
// [block_size][D] (a key's row); int8 (the caches' dtype says which) the same for the quants, each
// followed by the region's [block_size] fp32 scales. k, v [T, KVH, D] may be views into the fused qkv
// projection (rows strided, heads contiguous).
void store_kv_paged_bf16(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor slot_mapping) {
  const bool int8 = check_store_args(k, v, k_cache, v_cache, slot_mapping);
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), bs = k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const uint16_t *kp = bits(k), *vp = bits(v);
  const int64_t ks = k.stride(0), vs = v.stride(0);
  if (int8) {
    const int64_t head = bs * (D + 4), block = KVH * head;
    int8_t *kc = k_cache.data_ptr<int8_t>(), *vc = v_cache.data_ptr<int8_t>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      alignas(64) int8_t row[kMaxHeadDim];
      for (int64_t t = t0; t < t1; ++t) {
        if (slots[t] < 0) continue;
        const int64_t b = slots[t] / bs, o = slots[t] % bs;
        for (int64_t h = 0; h < KVH; ++h) {
          int8_t* kh = kc + b * block + h * head;
          const float kscale = quantize_row(kp + t * ks + h * D, D, row);
          for (int64_t d = 0; d < D; ++d) kh[d * bs + o] = row[d];
          std::memcpy(kh + D * bs + o * 4, &kscale, 4);
          int8_t* vh = vc + b * block + h * head;
          const float vscale = quantize_row(vp + t * vs + h * D, D, vh + o * D);
          std::memcpy(vh + D * bs + o * 4, &vscale, 4);
        }
      }
    });
    return;
  }
  const int64_t block = bs * KVH * D;
  uint16_t *kc = mutable_bits(k_cache), *vc = mutable_bits(v_cache);
  if constexpr (cs::kBf16Dot) {  // the paired layout: K [D/2][bs] pairs, V [bs/2][D] key pairs
    TORCH_CHECK(bs % 2 == 0, "block_size must be even");
    at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        if (slots[t] < 0) continue;
        const int64_t b = slots[t] / bs, o = slots[t] % bs;
        for (int64_t h = 0; h < KVH; ++h) {
          uint16_t* kd = kc + b * block + h * D * bs + 2 * o;  // pair c of key o at word c * bs + o
          const uint16_t* krow = kp + t * ks + h * D;
          for (int64_t c = 0; c < D / 2; ++c) std::memcpy(kd + 2 * c * bs, krow + 2 * c, 2 * sizeof(uint16_t));
          uint16_t* vd = vc + b * block + h * D * bs + (o / 2) * 2 * D + o % 2;  // dim d of key o at word (o/2) * D + d
          const uint16_t* vrow = vp + t * vs + h * D;
          for (int64_t d = 0; d < D; ++d) vd[2 * d] = vrow[d];
        }
      }
    });
    return;
  }
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (slots[t] < 0) continue;
      const int64_t b = slots[t] / bs, o = slots[t] % bs;
      for (int64_t h = 0; h < KVH; ++h) {
        uint16_t* kd = kc + b * block + h * D * bs + o;
        const uint16_t* krow = kp + t * ks + h * D;
        for (int64_t d = 0; d < D; ++d) kd[d * bs] = krow[d];
        std::memcpy(vc + b * block + (h * bs + o) * D, vp + t * vs + h * D, D * sizeof(uint16_t));
      }
    }
  });
}

// Each new token's K and V rows into its slot of plain caches (slot -1: skip): bf16
// [blocks, block_size, KVH, D] rows copied, or int8 [blocks, block_size, KVH, D + 4] rows quantized
// (the KV contract's reference layout: D quants, then the row's fp32 scale). k, v [T, KVH, D] may be
// strided views. Why: torch's index_copy_ on those views cost ~100 us a layer at decode batch 32;
// this is a few row copies.
void store_kv_bf16(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor slot_mapping) {
  const bool int8 = check_store_args(k, v, k_cache, v_cache, slot_mapping);
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), width = KVH * D;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const uint16_t *kp = bits(k), *vp = bits(v);
  const int64_t ks = k.stride(0), vs = v.stride(0);
  if (int8) {
    int8_t *kc = k_cache.data_ptr<int8_t>(), *vc = v_cache.data_ptr<int8_t>();
    for (int64_t t = 0; t < T; ++t) {
      if (slots[t] < 0) continue;
      for (int64_t h = 0; h < KVH; ++h) {
        int8_t* kr = kc + (slots[t] * KVH + h) * (D + 4);
        int8_t* vr = vc + (slots[t] * KVH + h) * (D + 4);
        const float kscale = quantize_row(kp + t * ks + h * D, D, kr);
        const float vscale = quantize_row(vp + t * vs + h * D, D, vr);
        std::memcpy(kr + D, &kscale, 4);
        std::memcpy(vr + D, &vscale, 4);
      }
    }
    return;
  }
  uint16_t *kc = mutable_bits(k_cache), *vc = mutable_bits(v_cache);
  for (int64_t t = 0; t < T; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(kc + slots[t] * width, kp + t * ks, width * sizeof(uint16_t));
    std::memcpy(vc + slots[t] * width, vp + t * vs, width * sizeof(uint16_t));
  }
}

// The family's functions, registered on `m`: by its own module, or by tier_kernels.cpp's (all families in one).
inline void register_attention(py::module& m) {
  m.def("store_kv_bf16", &store_kv_bf16, "new tokens' K/V rows into their paged-cache slots");
  m.def("store_kv_paged_bf16", &store_kv_paged_bf16, "new tokens' K/V into their slots, in paged_attention_bf16's layout");
  m.def("paged_attention_bf16", &paged_attention_bf16, "prefill, extend and decode attention over a bf16 or int8 paged KV cache",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("start_pos"), py::arg("seq_order"), py::arg("group_start"), py::arg("scale"), py::arg("window") = 0,
        py::arg("softcap") = 0.0);
}

#ifndef CS_TIER_COMBINED
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { register_attention(m); }
#endif
