// Every tiered kernel family in one extension per tier (issue #30), plus the decoder-layer runner.
//
// Why one extension: each family source alone costs ~40 s of parsing torch/extension.h on a 2-core
// box before any of its own code compiles; four of them were most of a cold start. Here the headers
// are parsed once and each family is included in its own namespace (their private helpers share
// names), so this file is the families' sources, unchanged, compiled together. Each family still
// builds alone (its PYBIND11_MODULE is on unless CS_TIER_COMBINED), which the compile-only checks of
// tiers a CPU cannot run use.
//
// Why a layer runner: a decode step of a small model is dominated by what happens between kernels.
// SmolLM2-135M has 30 layers of ~10 kernel calls each; from Python each call costs a few
// microseconds of binding, tensor views and attribute lookups, ~4 ms a step on a 2-core Zen 3, as
// long as all the matmuls of the step together. `LayerStack` holds every layer's weights once and
// runs the whole stack for one step in C++ with the GIL released, calling the same functions the
// Python layers call, with the same arguments, in the same order: the bits are the Python path's
// (tests/kernels/test_layer_stack.py compares them), so greedy output and determinism are unchanged by
// which path a step takes. The model uses it for steps without a between-layers abort check
// (decode-only steps); prefill chunks keep the Python path, where that check runs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <malloc.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vec.h"

#define CS_TIER_COMBINED 1

namespace cs_fused {
#include "tier_fused.cpp"
}  // namespace cs_fused
namespace cs_gemm {
#include "tier_gemm.cpp"
}  // namespace cs_gemm
namespace cs_attention {
#include "tier_attention.cpp"
}  // namespace cs_attention
namespace cs_quant {
#include "tier_quant.cpp"
}  // namespace cs_quant
#if defined(CHATSERVE_BF16)
// The AMX tile matmul (the AVX512-BF16 tier only; its instructions run only where amx_available()).
namespace cs_amx {
#include "amx_gemm.cpp"
}  // namespace cs_amx
#endif

namespace cs_layers {

constexpr int64_t kBf16Panels = -1;  // a segment of bf16 rows in the batch-invariant matmul's panels

// Rows [start, start + n) of a projection: GGUF / int8 blocks (tier_quant) or bf16 panels (tier_gemm).
struct Segment {
  int64_t start, n, qtype;
  torch::Tensor packed;
};

// y = x W^T (+ b), W in row segments, as layers/quantized_linear.py applies it: one segment alone,
// else each segment with its slice of the bias, concatenated along the outputs.
struct Projection {
  std::vector<Segment> segments;
  c10::optional<torch::Tensor> bias;
  int64_t in_features = 0;

  torch::Tensor run_segment(const Segment& s, const torch::Tensor& x, const c10::optional<torch::Tensor>& b) const {
    if (s.qtype == kBf16Panels) return cs_gemm::gemm(x, s.packed, b, s.n);
    return cs_quant::quant_linear(x, s.packed, s.qtype, s.n, in_features, b);
  }

  torch::Tensor operator()(torch::Tensor x) const {
    if (x.stride(-1) != 1) x = x.contiguous();
    if (segments.size() == 1) return run_segment(segments[0], x, bias);
    std::vector<torch::Tensor> parts;
    parts.reserve(segments.size());
    for (const Segment& s : segments) {
      c10::optional<torch::Tensor> b;
      if (bias.has_value()) b = bias->narrow(0, s.start, s.n);
      parts.push_back(run_segment(s, x, b));
    }
    return torch::cat(parts, 1);
  }
};

Projection make_projection(const py::list& segments, c10::optional<torch::Tensor> bias, int64_t in_features) {
  Projection p;
  p.bias = std::move(bias);
  p.in_features = in_features;
  for (const auto& item : segments) {
    const auto t = item.cast<py::tuple>();
    TORCH_CHECK(t.size() == 4, "a segment is (start, rows, qtype or -1 for bf16 panels, packed)");
    p.segments.push_back({t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<torch::Tensor>()});
  }
  TORCH_CHECK(!p.segments.empty(), "a projection needs at least one segment");
  return p;
}

struct Layer {
  torch::Tensor input_norm, post_norm;  // RMSNorm weights, bf16 [hidden]
  Projection qkv, o, gate_up, down;
};

// The decoder layers of a Llama-family model (no q/k norms), weights as the Python layers packed them.
class LayerStack {
 public:
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                "heads must be a positive multiple of the KV heads");
  }

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, int64_t hidden, int64_t intermediate,
                 const py::list& qkv, c10::optional<torch::Tensor> qkv_bias, const py::list& o,
                 const py::list& gate_up, const py::list& down) {
    TORCH_CHECK(input_norm.scalar_type() == at::kBFloat16 && post_norm.scalar_type() == at::kBFloat16,
                "norm weights must be bf16");
    layers_.push_back({input_norm.contiguous(), post_norm.contiguous(), make_projection(qkv, std::move(qkv_bias), hidden),
                       make_projection(o, c10::nullopt, heads_ * head_dim_), make_projection(gate_up, c10::nullopt, hidden),
                       make_projection(down, c10::nullopt, intermediate)});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // h: the embeddings [T, hidden] (becomes the first residual, as in the Python path); cos, sin the
  // step's rotary tables; kv_cache [layers, 2, blocks, block_size, KVH, D]; the rest the paged
  // attention metadata (attention/cpu_backend.py). Returns (the last layer's MLP output, the residual).
  std::vector<torch::Tensor> forward(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache,
                                     torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor query_start,
                                     torch::Tensor start_pos, torch::Tensor seq_order, torch::Tensor group_start) const {
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == size() && kv_cache.size(1) == 2,
                "kv_cache must be [layers, 2, blocks, block_size, KVH, D] for this stack's ", size(), " layers");
    const int64_t T = h.size(0), H = heads_, KVH = kv_heads_, D = head_dim_;
    torch::Tensor residual;
    for (int64_t i = 0; i < size(); ++i) {
      const Layer& L = layers_[i];
      torch::Tensor x;
      if (i == 0) {
        residual = h;
        x = cs_fused::rms_norm_bf16(h, L.input_norm, eps_);
      } else {
        x = cs_fused::add_rms_norm_bf16(h, residual, L.input_norm, eps_);
      }
      torch::Tensor qkv = L.qkv(x);
      cs_fused::rope_inplace_bf16(qkv, cos, sin, H + KVH, D);
      const torch::Tensor heads = qkv.view({T, H + 2 * KVH, D});
      const torch::Tensor q = heads.narrow(1, 0, H), k = heads.narrow(1, H, KVH), v = heads.narrow(1, H + KVH, KVH);
      torch::Tensor k_cache = kv_cache.select(0, i).select(0, 0), v_cache = kv_cache.select(0, i).select(0, 1);
      cs_attention::store_kv_paged_bf16(k, v, k_cache, v_cache, slot_mapping);
      const torch::Tensor a = cs_attention::paged_attention_bf16(q, k_cache, v_cache, block_tables, query_start,
                                                                 start_pos, seq_order, group_start, scale_, 0, 0.0);
      const torch::Tensor o = L.o(a.view({T, H * D}));
      x = cs_fused::add_rms_norm_bf16(o, residual, L.post_norm, eps_);
      h = L.down(cs_fused::silu_mul_bf16(L.gate_up(x)));
    }
    return {h, residual};
  }

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

}  // namespace cs_layers

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  cs_fused::register_fused(m);
  cs_gemm::register_gemm(m);
  cs_attention::register_attention(m);
  cs_quant::register_quant(m);
#if defined(CHATSERVE_BF16)
  cs_amx::register_amx(m);
#endif
  m.attr("BF16_PANELS") = cs_layers::kBf16Panels;
  // module_local: every tier's extension defines cs_layers::LayerStack, and pybind11's type registry
  // is shared by the extensions of one process (a test session loads several tiers)
  py::class_<cs_layers::LayerStack>(m, "LayerStack", py::module_local(),
                                    "a Llama-family model's decoder layers, run in one call a step")
      .def(py::init<int64_t, int64_t, int64_t, double, double>(), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"))
      .def("add_layer", &cs_layers::LayerStack::add_layer, py::arg("input_norm"), py::arg("post_norm"), py::arg("hidden"),
           py::arg("intermediate"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"), py::arg("gate_up"), py::arg("down"))
      .def("__len__", &cs_layers::LayerStack::size)
      .def("forward", &cs_layers::LayerStack::forward, py::call_guard<py::gil_scoped_release>(),
           "one step through every layer: (the last MLP output, the residual stream)");
}
