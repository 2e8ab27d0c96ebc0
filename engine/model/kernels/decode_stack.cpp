// The decoder layers of a small decode batch as one call: every layer's RMSNorm, quantized
// products, rotary embedding, paged attention, SwiGLU and residual adds, run back to back in C++.
//
// A batch-1 step from Python is about 40 torch calls a layer (views, splits, the ops, their
// wrappers): 8-9 ms of a 30 ms step on one thread of an AMD EPYC went to dispatch and the Python
// between the kernels. Here the same kernels are called directly (ops.h), so a step pays one
// call. Each layer computes exactly what engine.model.llama's attention_block and mlp_block
// compute with the CPU kernels, op for op and in the same order, so the hidden states and the
// pages written are the same bits either way.
//
// The weights are given once (a DecodeStack holds them); each call of the decode_stack op passes
// the step's tensors and every layer's pages.
//
// A mixture-of-experts layer (a router given by add_router) computes what engine.model.moe's
// SparseMoE computes for one row, op for op: the router's product, softmax, top k (renormalised
// where asked), then each chosen expert in id order scaled by its weight, the parts summed. A stack
// with such layers serves one-row steps only (the Python side says so).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/div.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "ops.h"

namespace {

// One product in engine.model.quantized_linear.PackedWeight's layout.
struct Product {
  at::Tensor packed, scale;
  std::optional<at::Tensor> offset, bias;
  int64_t bits, group_size, rows;

  at::Tensor operator()(const at::Tensor& x) const {
    return TANDEM_OPS::matmul(x, packed, scale, offset, bits, group_size, rows, bias);
  }
};

constexpr size_t kProducts = 4;  // qkv, o, gate_up, down, in that order

// A mixture of experts' router: its weight [experts, hidden] (the model's dtype, fp32 here).
struct Router {
  at::Tensor weight;
  int64_t top_k;
  bool normalize;
};

struct Layer {
  at::Tensor input_norm, post_norm;
  std::vector<Product> products;  // qkv, o, then gate_up and down, or each expert's gate_up and down
  std::optional<Router> router;

  size_t expected_products() const { return router ? 2 + 2 * static_cast<size_t>(router->weight.size(0)) : kProducts; }
};

// a + b for fp32 tensors alike: each sum rounded once, as torch's add rounds it.
at::Tensor residual(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor out = at::empty_like(a);
  const float* x = a.data_ptr<float>();
  const float* y = b.data_ptr<float>();
  float* z = out.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) z[i] = x[i] + y[i];
  return out;
}

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0,
                "heads must be a positive multiple of kv_heads");
  }

  // Appends a layer: its two norms' fp32 weights; its products follow by add_product.
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm) {
    TORCH_CHECK(layers_.empty() || complete(layers_.back()), "the previous layer lacks products");
    layers_.push_back({input_norm.contiguous(), post_norm.contiguous(), {}, std::nullopt});
  }

  // Makes the last layer's MLP a mixture of experts with this router (before any of its products).
  void add_router(const at::Tensor& weight, int64_t top_k, bool normalize) {
    TORCH_CHECK(!layers_.empty() && layers_.back().products.empty(), "add_router right after add_layer");
    TORCH_CHECK(weight.dim() == 2 && top_k > 0 && top_k <= weight.size(0), "a router of experts x hidden, top k");
    layers_.back().router = Router{weight.contiguous(), top_k, normalize};
  }

  // Appends the last layer's next product (qkv, o, gate_up, down in turn; with a router, each
  // expert's gate_up and down after o).
  void add_product(const at::Tensor& packed, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                   const std::optional<at::Tensor>& bias, int64_t bits, int64_t group_size, int64_t rows) {
    TORCH_CHECK(!layers_.empty() && layers_.back().products.size() < layers_.back().expected_products(),
                "add_layer before its products");
    layers_.back().products.push_back({packed, scale, offset, bias, bits, group_size, rows});
  }

  // hidden fp32 [B, hidden] through every layer; the step's K/V are written into each layer's pages.
  // Row b attends as a decode row over block_tables[b]'s first seq_lens[b] positions (the rows of a
  // speculative verification each over its own prefix). Returns the last layer's output (before the
  // final norm).
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens) const {
    TORCH_CHECK(!layers_.empty() && complete(layers_.back()), "the stack's layers are incomplete");
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "need ", layers_.size(),
                " key and value caches, got ", k_caches.size(), " and ", v_caches.size());
    TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "hidden must be float32 [B, hidden]");
    const int64_t batch = hidden.size(0), qk_heads = heads_ + kv_heads_;
    at::Tensor h = hidden.contiguous();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const at::Tensor qkv = layer.products[0](TANDEM_OPS::rms_norm(h, layer.input_norm, eps_));
      // Q and K rotate by the same angles, together, in place in the product's output.
      const at::Tensor qk = qkv.narrow(1, 0, qk_heads * head_dim_).view({batch, qk_heads, head_dim_});
      TANDEM_OPS::rotary_(qk, cos, sin);
      const at::Tensor v = qkv.narrow(1, qk_heads * head_dim_, kv_heads_ * head_dim_).view({batch, kv_heads_, head_dim_});
      const at::Tensor attended =
          TANDEM_OPS::decode_attention(qk.narrow(1, 0, heads_), qk.narrow(1, heads_, kv_heads_), v, k_caches[i],
                                       v_caches[i], slot_mapping, block_tables, seq_lens, scale_);
      h = residual(h, layer.products[1](attended.view({batch, heads_ * head_dim_})));
      const at::Tensor normed = TANDEM_OPS::rms_norm(h, layer.post_norm, eps_);
      if (layer.router) {
        h = residual(h, experts(layer, normed));
        continue;
      }
      h = residual(h, layer.products[3](TANDEM_OPS::silu_mul(layer.products[2](normed))));
    }
    return h;
  }

 private:
  static bool complete(const Layer& layer) { return layer.products.size() == layer.expected_products(); }

  // One row's mixture of experts, as SparseMoE._one_row computes it.
  static at::Tensor experts(const Layer& layer, const at::Tensor& x) {
    const Router& router = *layer.router;
    TORCH_CHECK(x.size(0) == 1, "a stack of mixture-of-experts layers serves one row, got ", x.size(0));
    const at::Tensor probs = at::softmax(at::linear(x, router.weight), -1);
    auto [top, ids] = at::topk(probs.select(0, 0), router.top_k);
    if (router.normalize) top = at::div(top, at::sum(top));
    const at::Tensor weights = top.to(x.scalar_type()).to(at::kDouble).contiguous();
    const at::Tensor chosen = ids.contiguous();
    std::vector<std::pair<int64_t, double>> picks;
    for (int64_t k = 0; k < router.top_k; ++k) {
      picks.emplace_back(chosen.data_ptr<int64_t>()[k], weights.data_ptr<double>()[k]);
    }
    std::sort(picks.begin(), picks.end());  // in expert order, as the grouped path adds them
    std::vector<at::Tensor> parts;
    for (const auto& [expert, weight] : picks) {
      const Product& gate_up = layer.products[2 + 2 * expert];
      const Product& down = layer.products[3 + 2 * expert];
      parts.push_back(at::mul(down(TANDEM_OPS::silu_mul(gate_up(x))), weight));
    }
    return parts.size() == 1 ? parts[0] : at::sum(at::stack(parts), 0);
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

// The stack's layers over a decode batch, as an op (so that profiles and dispatch see one op).
at::Tensor decode_stack(const c10::intrusive_ptr<DecodeStack>& stack, const at::Tensor& hidden, const at::Tensor& cos,
                        const at::Tensor& sin, const std::vector<at::Tensor>& k_caches,
                        const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  return stack->forward(hidden, cos, sin, k_caches, v_caches, slot_mapping, block_tables, seq_lens);
}

}  // namespace

#define TANDEM_STRING(x) #x
#define TANDEM_NAME(x) TANDEM_STRING(x)
#define TANDEM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
TANDEM_LIBRARY_FRAGMENT(TANDEM_OPS, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("add_router", &DecodeStack::add_router)
      .def("add_product", &DecodeStack::add_product);
  m.def("decode_stack(__torch__.torch.classes." TANDEM_NAME(TANDEM_OPS) ".DecodeStack stack, Tensor hidden, "
        "Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens) -> Tensor",
        &decode_stack);
}
