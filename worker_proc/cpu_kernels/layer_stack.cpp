// A small step (a few token rows: decodes) from token ids to logits in one call from Python:
// embedding, the decoder layers, final norm and LM head. Each op is one of loom's kernels, as in
// the Python model (worker_proc/models/llama.py), but the ~10 ops of each of 30 layers no longer
// pay a Python call and dispatch each: at batch 1 that glue costs as much as a quarter of the
// step (and every Python op after the weights streamed through the caches runs cold). Where every
// op has a team form (bfloat16, packed weights) a step runs its layers in one parallel region
// (team.h): decode steps of 1 / 4 / 16 / 64 rows 3.1 / 3.6 / 2.4 / 2.0% faster,
// the offline workload's mixed steps 1.5% (AMD Zen 4, 2 threads, interleaved in one process).

#include <pybind11/functional.h>
#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/ones.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "team.h"

namespace {

// A linear's weights in the form its Python module keeps them: [w] or [w, packed] dense (packed
// gated for an MLP's [gate; up]),
// [packed, out_features] float16, [q, scale] int8, [q, scale, min] or [q, scale, min, panels]
// int4; plus an optional bias.
struct LinearWeights {
  std::vector<at::Tensor> tensors;
  std::optional<at::Tensor> bias;
  int64_t half_out = 0;  // float16: output features

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    if (half_out)
      y = linear_half(x, tensors[0], half_out);
    else if (tensors[0].is_floating_point())
      y = linear_dense(x, tensors[0], tensors.size() > 1 ? std::optional<at::Tensor>(tensors[1]) : std::nullopt);
    else if (tensors.size() == 2)
      y = linear_int8(x, tensors[0], tensors[1]);
    else
      y = linear_int4(x, tensors[0], tensors[1], tensors[2],
                      tensors.size() > 3 ? std::optional<at::Tensor>(tensors[3]) : std::nullopt);
    if (bias) y.add_(*bias);
    return y;
  }

  // an MLP's [gate; up] packed gated (pack_dense_bf16): the call returns silu(gate) * up
  bool gated() const { return !half_out && tensors.size() == 2 && tensors[1].dim() == 6; }

  // bfloat16 weights packed for linear_packed_bf16: what the one-region step takes
  bool packed_bf16() const {
    return !half_out && tensors.size() == 2 && tensors[0].scalar_type() == at::kBFloat16 &&
           tensors[1].numel() > 0 && tensors[1].scalar_type() == at::kBFloat16;
  }
  const at::Tensor& packed() const { return tensors[1]; }

  // What a float32 step's one region takes: float32 weights with pack_dense_f32's panels
  // [N / width, K, width], int8 ones in pack_int8_panels' form, int4 ones with panels.
  bool packed_f32() const {
    return !half_out && tensors.size() == 2 && tensors[0].scalar_type() == at::kFloat &&
           tensors[1].dim() == 3 && tensors[1].numel() > 0 && tensors[1].scalar_type() == at::kFloat;
  }
  bool int8_panels() const { return tensors.size() == 2 && tensors[0].dim() == 3 && !tensors[0].is_floating_point(); }
  bool int4_panels() const { return tensors.size() == 4 && tensors[3].numel() > 0; }
  bool in_f32_region(int64_t rows) const {
    return (packed_f32() && f32_panels_team_takes(rows, out_features())) || int8_panels() ||
           (int4_panels() && rows >= int4_panel_rows());
  }
  int64_t out_features() const { return int8_panels() ? tensors[1].numel() : tensors[0].size(0); }
  // Blocks a team shares (claims reset to these): the integer or float32 panels, or the packed
  // bfloat16 blocks.
  int64_t team_blocks() const { return (int8_panels() ? tensors[0] : int4_panels() ? tensors[3] : packed()).size(0); }
  // int8 or int4 panels that a bfloat16 step of `rows` rows runs on AMX tiles
  bool on_amx_panels(int64_t rows) const {
    const int64_t from = amx_panel_rows();
    return from && rows >= from && (int8_panels() || int4_panels()) && amx_panels_take(panels(), out_features());
  }
  const at::Tensor& panels() const { return int8_panels() ? tensors[0] : tensors[3]; }
  // int8 or int4 panels that a bfloat16 step of `rows` rows runs on the integer GEMM's products,
  // as float32 steps do (x quantized per 32): where AMX tiles do not take them. In the region
  // rather than op by op (AMD Zen 5, interleaved in one process): int4 decode steps of 1 / 4 / 32
  // rows 1.09x / 1.11x / 1.16x, int8 1.10x / 1.08x / 1.05x, 128 rows 1.02-1.03x.
  bool on_integer_panels(int64_t rows) const {
    return !on_amx_panels(rows) && (int8_panels() || (int4_panels() && rows >= int4_panel_rows()));
  }
  // What a bfloat16 step's one region takes: packed bfloat16 weights (the MLP's packed gated), or
  // int8 / int4 panels on AMX tiles (gated: an MLP's [gate; up], giving silu(gate) * up) or on the
  // integer GEMM (gated: [gate | up], silu_mul apart)
  bool in_bf16_region(int64_t rows, bool gated) const {
    return (packed_bf16() && gated == this->gated()) || on_amx_panels(rows) || on_integer_panels(rows);
  }
  // y's columns and the team's blocks in a bfloat16 region of `rows` rows
  int64_t bf16_cols(bool gated, int64_t rows) const {
    if (packed_bf16()) return packed_bf16_cols(packed());
    return gated && !on_integer_panels(rows) ? out_features() / 2 : out_features();
  }
  int64_t bf16_blocks(bool gated, int64_t rows) const {
    if (packed_bf16()) return packed().size(0);
    return on_integer_panels(rows) ? team_blocks() : amx_panel_blocks(out_features(), gated);
  }
  // y [rows, out_features] = x [rows, k] @ W.T as a team form (in_f32_region(rows); bfloat16:
  // on_integer_panels(rows))
  template <typename T>
  void team(const T* x, int64_t rows, int64_t k, T* y, const IntegerScratch& scratch, loom::BlockClaims& claims) const {
    if (int8_panels())
      linear_int8_panels_team(x, rows, k, tensors[0], tensors[1].data_ptr<float>(), out_features(), scratch, y, claims);
    else if (int4_panels())
      linear_int4_panels_team(x, rows, k, tensors[3], out_features(), scratch, y, claims);
    else if constexpr (std::is_same_v<T, float>)
      linear_f32_panels_team(x, rows, k, packed().data_ptr<float>(), y, out_features(), claims);
    else
      TORCH_CHECK(false, "float32 panels take float32 x");
  }
};

using LinearSpec = std::tuple<std::vector<at::Tensor>, std::optional<at::Tensor>>;

LinearWeights from_spec(const LinearSpec& spec) {
  const auto& [tensors, bias] = spec;
  TORCH_CHECK(!tensors.empty() && tensors.size() <= 4,
              "a linear is [w], [w, packed], [packed, out_features], [q, scale] or [q, scale, min(, panels)]");
  const bool half = tensors[0].scalar_type() == at::kHalf && tensors[0].dim() == 4;
  return {tensors, bias, half ? tensors.at(1).item<int64_t>() : 0};
}

struct Layer {
  at::Tensor input_norm, post_norm;
  LinearWeights qkv, o, gate_up, down;
  at::Tensor q_norm, k_norm;  // per-head RMSNorms of q and k (Qwen3), undefined where the model has none
};

at::Tensor as_i64(const at::Tensor& v) { return v.to(at::kLong).contiguous(); }

// Attention for the tokens in logit_rows alone: each one a row of one token (a decode's shape)
// that sees its request's slots up to its own position; q rows in logit_rows' order.
std::shared_ptr<const PagedAttentionPlan> plan_logit_rows(int64_t num_tokens, int64_t num_heads,
                                                          const at::Tensor& logit_rows, const at::Tensor& kv,
                                                          const at::Tensor& req_to_token, const at::Tensor& req_idx,
                                                          const at::Tensor& token_starts,
                                                          const at::Tensor& extend_lens,
                                                          const at::Tensor& seq_lens, double scale) {
  const at::Tensor reqs = as_i64(req_idx), starts = as_i64(token_starts), lens = as_i64(extend_lens),
                      seqs = as_i64(seq_lens), tokens = as_i64(logit_rows);
  std::vector<int64_t> row_of_token(num_tokens, -1);
  for (int64_t r = 0; r < reqs.numel(); ++r)
    for (int64_t j = 0; j < lens.data_ptr<int64_t>()[r]; ++j) row_of_token.at(starts.data_ptr<int64_t>()[r] + j) = r;
  const int64_t n = tokens.numel();
  at::Tensor sub_reqs = at::empty({n}, at::kLong), sub_seqs = at::empty({n}, at::kLong);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t token = tokens.data_ptr<int64_t>()[i], r = row_of_token.at(token);
    TORCH_CHECK(r >= 0, "a logit row outside every request's tokens");
    sub_reqs.data_ptr<int64_t>()[i] = reqs.data_ptr<int64_t>()[r];
    // the request's cached tokens before this step's, then its own up to this one
    sub_seqs.data_ptr<int64_t>()[i] =
        seqs.data_ptr<int64_t>()[r] - lens.data_ptr<int64_t>()[r] + token - starts.data_ptr<int64_t>()[r] + 1;
  }
  return plan_paged_attention(n, num_heads, kv, req_to_token, sub_reqs, at::arange(n),
                              at::ones({n}, at::kLong), sub_seqs, scale);
}

}  // namespace

class LayerStack {
 public:
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps) {}

  void set_head(at::Tensor embedding, at::Tensor final_norm, const LinearSpec& lm_head) {
    embedding_ = embedding;
    final_norm_ = final_norm;
    lm_head_ = from_spec(lm_head);
  }

  // One tensor-parallel rank's shard: its embedding rows are vocabulary ids [vocab_start,
  // vocab_start + vocab_rows), and all_reduce sums a tensor over the ranks in place (the
  // embedding lookup, o_proj's and down_proj's partial sums). The logits stay this rank's rows.
  void set_tensor_parallel(int64_t vocab_start, int64_t vocab_rows, std::function<void(at::Tensor)> all_reduce) {
    vocab_start_ = vocab_start;
    vocab_rows_ = vocab_rows;
    all_reduce_ = std::move(all_reduce);
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, const LinearSpec& qkv, const LinearSpec& o,
                 const LinearSpec& gate_up, const LinearSpec& down, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    layers_.push_back({input_norm, post_norm, from_spec(qkv), from_spec(o), from_spec(gate_up), from_spec(down),
                       q_norm.value_or(at::Tensor()), k_norm.value_or(at::Tensor())});
  }

  // Logits (the model dtype) of the token rows in logit_rows. Writes each layer's K/V to its pool
  // tensor at out_cache_loc and attends as worker_proc/attention.py's PagedKernelAttention.
  at::Tensor forward(at::Tensor input_ids, at::Tensor logit_rows, at::Tensor positions,
                     at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& kv,
                     at::Tensor out_cache_loc, at::Tensor req_to_token, at::Tensor req_idx,
                     at::Tensor token_starts, at::Tensor extend_lens, at::Tensor seq_lens, double scale) {
    TORCH_CHECK(kv.size() == layers_.size(), "one KV tensor per layer expected");
    TORCH_CHECK(embedding_.defined(), "set_head first");
    at::Tensor x = embed(input_ids);
    const int64_t t = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    at::Tensor residual;
    const auto attention = plan_paged_attention(t, num_heads_, kv[0], req_to_token, req_idx, token_starts, extend_lens,
                                                seq_lens, scale);
    // Of the last layer, rows without logits (prompt tokens before a chunk's last) need only the
    // K and V that later steps attend to: the logit rows alone go on through its attention,
    // o_proj and MLP (a prompt-sized step: ~3% of its linears' work).
    const int64_t n_logits = logit_rows.size(0);
    const bool narrow_last = n_logits < t;
    const auto last_attention = narrow_last ? plan_logit_rows(t, num_heads_, logit_rows, kv[0], req_to_token, req_idx,
                                                              token_starts, extend_lens, seq_lens, scale)
                                            : attention;
    // the layers up to the last (and the last too where every row has logits) in one region
    size_t first = 0;
    const std::vector<int64_t> chunks = row_chunks(t);
    if (one_region && runs_in_one_region(x, chunks, positions, cos, sin, kv, out_cache_loc)) {
      first = narrow_last ? layers_.size() - 1 : layers_.size();
      if (chunks.size() == 2)
        run_in_one_region(first, x, residual, positions, cos, sin, kv, out_cache_loc, *attention);
      else
        run_in_row_chunks(first, chunks, x, residual, positions, cos, sin, kv, out_cache_loc, req_to_token, req_idx,
                          token_starts, extend_lens, seq_lens, scale);
    }
    for (size_t i = first; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      at::Tensor h;
      if (i == 0) {
        residual = x;
        h = rms_norm(x, layer.input_norm, eps_);
      } else {
        h = add_rms_norm(x, residual, layer.input_norm, eps_);
      }
      at::Tensor qkv = layer.qkv(h);
      if (layer.q_norm.defined()) {  // (before the rotation, as the Python model's)
        norm_heads(qkv, 0, num_heads_, layer.q_norm);
        norm_heads(qkv, q_size, num_kv_heads_, layer.k_norm);
      }
      rope_(qkv, positions, cos, sin, num_heads_ + num_kv_heads_, head_dim_);
      store_kv(kv[i], out_cache_loc, qkv.narrow(1, q_size, kv_size), qkv.narrow(1, q_size + kv_size, kv_size));
      int64_t rows = t;
      const bool last = i + 1 == layers_.size();
      if (last && narrow_last) {
        qkv = qkv.index_select(0, logit_rows);
        residual = residual.index_select(0, logit_rows);
        rows = n_logits;
      }
      at::Tensor attn = run_paged_attention(last ? *last_attention : *attention,
                                            qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_}), kv[i]);
      h = add_rms_norm(reduced(layer.o(attn.view({rows, q_size}))), residual, layer.post_norm, eps_);
      x = reduced(layer.down(layer.gate_up.gated() ? layer.gate_up(h) : silu_mul(layer.gate_up(h))));
    }
    if (narrow_last) return lm_head_(add_rms_norm(x, residual, final_norm_, eps_));
    return lm_head_(add_rms_norm(x.index_select(0, logit_rows), residual.index_select(0, logit_rows), final_norm_, eps_));
  }

  // Whether steps may run their layers in one parallel region (else one per op; for A/B runs),
  // and how many have.
  bool one_region = true;
  int64_t one_region_steps = 0;
  // Steps of more token rows run the region over chunks of about this many, each through every
  // layer before the next (a prompt's later chunk attends to the K/V its earlier ones stored): the
  // activations between ops then stay in the caches instead of going through memory (a 32,768-row
  // prefill 1.13-1.31x on the AMX Xeon; chunks of 1,024-3,072 rows all gained there).
  int64_t region_rows = 1536;

 private:
  // A layer's additions to the plain Llama layer, which the region takes as QkvExtras: a qkv bias
  // and q / k norms in the activations' dtype (no other linear's bias).
  bool extras_in_region(const Layer& layer, at::ScalarType type) const {
    const auto fits = [type](const at::Tensor& w, int64_t n) {
      return w.scalar_type() == type && w.is_contiguous() && w.numel() == n;
    };
    if (layer.o.bias || layer.gate_up.bias || layer.down.bias) return false;
    if (layer.qkv.bias && !fits(*layer.qkv.bias, (num_heads_ + 2 * num_kv_heads_) * head_dim_)) return false;
    return !layer.q_norm.defined() || (fits(layer.q_norm, head_dim_) && fits(layer.k_norm, head_dim_));
  }

  // One parallel region for the layers of a step (team.h) where every op has a team form, one
  // process: bfloat16 activations with bfloat16 or int8 pools, the weights all packed bfloat16 (the
  // MLP's gated) or, from amx_panel_rows() rows, int8 / int4 panels on AMX tiles; or float32
  // activations (weights on float32, int8 or int4 panels) with float32, float16 or int8 pools;
  // Qwen2's qkv bias and Qwen3's q / k norms added before RoPE (AMD Zen 5, SmolLM2-shaped models,
  // region vs op by op in one process: Qwen3 bfloat16 decode steps of 1 / 32 rows 1.09x / 1.07x,
  // Qwen2 1.01x / 1.03x; Qwen2 int8 1.15x / 1.07x, int4 1.12x / 1.07x).
  // (every chunk's rows: the smallest decides which kernels take them)
  bool runs_in_one_region(const at::Tensor& x, const std::vector<int64_t>& chunks, const at::Tensor& positions,
                          const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& kv,
                          const at::Tensor& out_cache_loc) const {
    int64_t t = x.size(0);
    for (size_t c = 1; c < chunks.size(); ++c) t = std::min(t, chunks[c] - chunks[c - 1]);
    for (const Layer& layer : layers_)
      if (!extras_in_region(layer, x.scalar_type())) return false;
    if (all_reduce_ || t == 0 || !positions.is_contiguous() || positions.scalar_type() != at::kLong ||
        cos.scalar_type() != at::kFloat || sin.scalar_type() != at::kFloat || !cos.is_contiguous() ||
        !sin.is_contiguous() || cos.size(1) != head_dim_ || sin.size(1) != head_dim_ || !out_cache_loc.is_contiguous())
      return false;
    for (const at::Tensor& pool : kv)
      if (pool.scalar_type() != kv[0].scalar_type() || !pool.is_contiguous() || pool.sizes() != kv[0].sizes())
        return false;
    const auto pool_type = kv[0].scalar_type();
    if (x.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
      if (x.size(1) % 16 || head_dim_ % 32 || (pool_type != at::kBFloat16 && pool_type != at::kChar)) return false;
      // (every layer's MLP gives silu(gate) * up in its linear, or every one [gate | up]: one buffer
      // layout for the step)
      const bool silu_apart = layers_[0].gate_up.on_integer_panels(t);
      for (const Layer& layer : layers_)
        if (!layer.qkv.in_bf16_region(t, false) || !layer.o.in_bf16_region(t, false) ||
            !layer.gate_up.in_bf16_region(t, true) || !layer.down.in_bf16_region(t, false) ||
            layer.gate_up.on_integer_panels(t) != silu_apart ||
            layer.input_norm.scalar_type() != at::kBFloat16 || layer.post_norm.scalar_type() != at::kBFloat16)
          return false;
      return true;
#else
      return false;
#endif
    }
    if (x.scalar_type() != at::kFloat || (pool_type != at::kFloat && pool_type != at::kHalf && pool_type != at::kChar))
      return false;
    for (const Layer& layer : layers_) {
      for (const LinearWeights* w : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
        if (!w->in_f32_region(t)) return false;
      if (layer.input_norm.scalar_type() != at::kFloat || layer.post_norm.scalar_type() != at::kFloat) return false;
    }
    return true;
  }

  // Where the region's row chunks of a step of t rows start, then t: as many as region_rows asks,
  // of even sizes, on multiples of 16 rows (the AMX tiles' height).
  std::vector<int64_t> row_chunks(int64_t t) const {
    const int64_t n = std::max<int64_t>(1, (t + region_rows - 1) / std::max<int64_t>(region_rows, 1));
    std::vector<int64_t> starts;
    for (int64_t k = 0; k < n; ++k) starts.push_back(k == 0 ? 0 : t * k / n / 16 * 16);
    starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
    starts.push_back(t);
    return starts;
  }

  // run_in_one_region over row chunks (row_chunks): each chunk's share of the step's batch rows (a
  // row cut by a chunk's end keeps its tokens up to there) with its own attention plan.
  void run_in_row_chunks(size_t count, const std::vector<int64_t>& chunks, at::Tensor& x, at::Tensor& residual,
                         const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                         const std::vector<at::Tensor>& kv, const at::Tensor& out_cache_loc,
                         const at::Tensor& req_to_token, const at::Tensor& req_idx, const at::Tensor& token_starts,
                         const at::Tensor& extend_lens, const at::Tensor& seq_lens, double scale) {
    const at::Tensor reqs = as_i64(req_idx), starts = as_i64(token_starts), lens = as_i64(extend_lens),
                     seqs = as_i64(seq_lens);
    const int64_t rows = reqs.numel();
    const int64_t *reqp = reqs.data_ptr<int64_t>(), *startp = starts.data_ptr<int64_t>(),
                  *lenp = lens.data_ptr<int64_t>(), *seqp = seqs.data_ptr<int64_t>();
    residual = x;  // the embedding rows: each chunk's region updates its rows in place
    at::Tensor out = at::empty_like(x);
    for (size_t c = 0; c + 1 < chunks.size(); ++c) {
      const int64_t t0 = chunks[c], t1 = chunks[c + 1], n = t1 - t0;
      std::vector<int64_t> sub_reqs, sub_starts, sub_lens, sub_seqs;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t s = startp[r], e = s + lenp[r], from = std::max(s, t0), to = std::min(e, t1);
        if (from >= to) continue;
        sub_reqs.push_back(reqp[r]);
        sub_starts.push_back(from - t0);
        sub_lens.push_back(to - from);
        sub_seqs.push_back(seqp[r] - (e - to));  // the row's tokens after this chunk are not cached yet
      }
      const auto tensor = [](const std::vector<int64_t>& v) {
        return at::from_blob(const_cast<int64_t*>(v.data()), {static_cast<int64_t>(v.size())}, at::kLong).clone();
      };
      const auto plan = plan_paged_attention(n, num_heads_, kv[0], req_to_token, tensor(sub_reqs), tensor(sub_starts),
                                             tensor(sub_lens), tensor(sub_seqs), scale);
      at::Tensor chunk = x.narrow(0, t0, n), chunk_residual;
      run_in_one_region(count, chunk, chunk_residual, positions.narrow(0, t0, n), cos, sin, kv,
                        out_cache_loc.narrow(0, t0, n), *plan);
      out.narrow(0, t0, n).copy_(chunk);
    }
    x = out;
  }

  void run_in_one_region(size_t count, at::Tensor& x, at::Tensor& residual, const at::Tensor& positions,
                         const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& kv,
                         const at::Tensor& out_cache_loc, const PagedAttentionPlan& attention) {
    if (count == 0) return;
    const auto pool_type = kv[0].scalar_type();
    if (x.scalar_type() == at::kFloat && pool_type == at::kHalf)
      run_region<float, at::Half>(count, x, residual, positions, cos, sin, kv, out_cache_loc, attention);
    else if (x.scalar_type() == at::kFloat && pool_type == at::kChar)
      run_region<float, int8_t>(count, x, residual, positions, cos, sin, kv, out_cache_loc, attention);
    else if (x.scalar_type() == at::kFloat)
      run_region<float, float>(count, x, residual, positions, cos, sin, kv, out_cache_loc, attention);
#if defined(__AVX512BF16__)
    else if (pool_type == at::kChar)
      run_region<at::BFloat16, int8_t>(count, x, residual, positions, cos, sin, kv, out_cache_loc, attention);
    else
      run_region<at::BFloat16, at::BFloat16>(count, x, residual, positions, cos, sin, kv, out_cache_loc, attention);
#endif
  }

  // Layers [0, count) of a step, each op's team form parted by barriers; leaves x and residual
  // as the op-by-op loop does.
  template <typename T, typename KV>
  void run_region(size_t count, at::Tensor& x, at::Tensor& residual, const at::Tensor& positions, const at::Tensor& cos,
                  const at::Tensor& sin, const std::vector<at::Tensor>& kv, const at::Tensor& out_cache_loc,
                  const PagedAttentionPlan& attention) {
    ++one_region_steps;
    constexpr bool bf16 = std::is_same_v<T, at::BFloat16>;
    const int64_t t = x.size(0), hidden = x.size(1), q_size = num_heads_ * head_dim_;
    // (bfloat16 on packed weights or AMX tiles: the MLP's gated [gate; up] gives silu(gate) * up;
    // float32, and bfloat16 on the integer GEMM: [gate | up], then silu_mul)
    const bool silu_apart = !bf16 || layers_[0].gate_up.on_integer_panels(t);
    const auto cols = [t](const LinearWeights& w, bool gated = false) {
      if constexpr (bf16) return w.bf16_cols(gated, t);
      else return w.out_features();
    };
    const int64_t qkv_cols = cols(layers_[0].qkv), gate_up_cols = cols(layers_[0].gate_up, true);
    const int64_t inter = silu_apart ? gate_up_cols / 2 : gate_up_cols;
    const auto empty = [&](int64_t n) { return at::empty({t, n}, x.options()); };
    residual = x;
    at::Tensor h = empty(hidden), qkv = empty(qkv_cols), attn = empty(q_size), proj = empty(hidden), mid = empty(inter);
    at::Tensor gate_up = silu_apart ? empty(gate_up_cols) : mid;
    const std::unique_ptr<float[]> partials(new float[paged_attention_partial_floats(attention)]);
    const at::Tensor slots = out_cache_loc.to(at::kLong).contiguous();
    TORCH_CHECK(slots.numel() == t, "out_cache_loc: one pool slot per row expected");
    for (int64_t r = 0; r < t; ++r)
      TORCH_CHECK(slots.data_ptr<int64_t>()[r] >= 0 && slots.data_ptr<int64_t>()[r] < kv[0].size(0),
                  "out_cache_loc: slot out of the pool");
    const int threads = at::get_num_threads();
    std::vector<loom::BlockClaims> claims(4 * count);
    std::vector<KV*> pools(count);
    std::vector<QkvExtras<T>> extras(count);
    for (size_t i = 0; i < count; ++i) {
      const Layer& layer = layers_[i];
      const auto data = [](const at::Tensor& w) { return w.defined() ? w.data_ptr<T>() : nullptr; };
      extras[i] = {layer.qkv.bias ? layer.qkv.bias->data_ptr<T>() : nullptr, data(layer.q_norm), data(layer.k_norm),
                   static_cast<float>(eps_)};
      TORCH_CHECK(cols(layer.qkv) == qkv_cols && cols(layer.gate_up, true) == gate_up_cols, "layers of one shape expected");
      const LinearWeights* linears[] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
      for (int j = 0; j < 4; ++j)
        claims[4 * i + j].reset(bf16 ? linears[j]->bf16_blocks(j == 2, t) : linears[j]->team_blocks(), threads);
      pools[i] = kv[i].data_ptr<KV>();
    }
    T *xp = x.data_ptr<T>(), *hp = h.data_ptr<T>(), *qkvp = qkv.data_ptr<T>(), *attnp = attn.data_ptr<T>(),
      *projp = proj.data_ptr<T>(), *midp = mid.data_ptr<T>(), *gate_upp = gate_up.data_ptr<T>();
    const int64_t *pos = positions.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
    const float *cosp = cos.data_ptr<float>(), *sinp = sin.data_ptr<float>();
    // (bfloat16: one row without AMX streams the unpacked weights, as linear_dense does: faster there)
    const bool one_row = bf16 && t == 1 && !amx_bf16();
    // x quantized for the integer panels (float32 steps, bfloat16 ones on the integer GEMM), sized
    // for the widest input
    bool quantizes_x = !bf16;
    for (size_t i = 0; i < count && !quantizes_x; ++i)
      for (const LinearWeights* w : {&layers_[i].qkv, &layers_[i].o, &layers_[i].gate_up, &layers_[i].down})
        quantizes_x = quantizes_x || w->on_integer_panels(t);
    const int64_t widest = std::max({hidden, q_size, inter});
    const auto buffer = [&](int64_t n, at::ScalarType type) {
      return at::empty({quantizes_x ? n : 0}, x.options().dtype(type));
    };
    const at::Tensor codes = buffer(t * widest, at::kChar), scales = buffer(2 * t * widest / 32, at::kFloat),
                     offsets = buffer(t * widest / 32, at::kInt);
    const IntegerScratch scratch{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), offsets.data_ptr<int32_t>()};
    // (k: the linear's inputs)
    // (gated: the MLP's [gate; up])
    const auto linear = [&](const LinearWeights& weights, const T* in, int64_t k, T* out, loom::BlockClaims& claims,
                            bool gated = false) {
      const at::Tensor& w = weights.tensors[0];
      if constexpr (bf16) {
        if (weights.on_integer_panels(t))
          weights.team(in, t, k, out, scratch, claims);
        else if (!weights.packed_bf16())  // int8 / int4 panels on AMX (in_bf16_region)
          linear_panels_amx_team(in, t, k, weights.panels(), weights.out_features(),
                                 weights.int8_panels() ? weights.tensors[1].data_ptr<float>() : nullptr,
                                 gated, out, claims);
        else if (!one_row)
          linear_packed_bf16_team(in, t, weights.packed(), out, claims);
        else if (weights.gated())
          gated_row_bf16_team(in, w.data_ptr<T>(), w.size(0) / 2, w.size(1), out);
        else
          linear_row_bf16_team(in, w.data_ptr<T>(), w.size(0), w.size(1), out);
      } else {
        weights.team(in, t, k, out, scratch, claims);
      }
    };
#pragma omp parallel num_threads(threads)
    for (size_t i = 0; i < count; ++i) {
      const Layer& layer = layers_[i];
      // (layer 0 normalises the embedding rows, which are the residual; later ones add the MLP's output)
      rms_norm_team(i == 0 ? xp : projp, i == 0 ? nullptr : xp, layer.input_norm.data_ptr<T>(), hp, t, hidden, eps_);
      linear(layer.qkv, hp, hidden, qkvp, claims[4 * i]);
#pragma omp barrier
      rope_store_kv_team(qkvp, t, qkv_cols, pos, cosp, sinp, num_heads_, num_kv_heads_, head_dim_, pools[i], slot,
                         extras[i]);
      run_paged_attention_team(attention, qkvp, qkv_cols, pools[i], attnp, partials.get());
      linear(layer.o, attnp, q_size, projp, claims[4 * i + 1]);
#pragma omp barrier
      rms_norm_team(projp, xp, layer.post_norm.data_ptr<T>(), hp, t, hidden, eps_);
      linear(layer.gate_up, hp, hidden, gate_upp, claims[4 * i + 2], true);
#pragma omp barrier
      if (silu_apart) silu_mul_team(gate_upp, midp, t, inter);
      linear(layer.down, midp, inter, projp, claims[4 * i + 3]);
#pragma omp barrier
    }
    x = proj;
  }

  // RMSNorm over each of `heads` head rows of qkv's columns [start, start + heads * head_dim), in
  // place: the rows the Python model's q_norm / k_norm see ([t, heads, head_dim], contiguous).
  void norm_heads(at::Tensor& qkv, int64_t start, int64_t heads, const at::Tensor& weight) const {
    const int64_t t = qkv.size(0);
    at::Tensor part = qkv.narrow(1, start, heads * head_dim_);
    part.copy_(rms_norm(part.contiguous().view({t, heads, head_dim_}), weight, eps_).view({t, heads * head_dim_}));
  }

  at::Tensor reduced(at::Tensor t) const {
    if (all_reduce_) all_reduce_(t);
    return t;
  }

  at::Tensor embed(const at::Tensor& ids) const {
    if (!all_reduce_) return embedding_.index_select(0, ids);
    const at::Tensor local = ids.sub(vocab_start_);
    const at::Tensor outside = local.lt(0).logical_or(local.ge(vocab_rows_));
    at::Tensor x = embedding_.index_select(0, local.masked_fill(outside, 0));
    return reduced(x.masked_fill_(outside.unsqueeze(1), 0));
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  int64_t vocab_start_ = 0, vocab_rows_ = 0;
  std::function<void(at::Tensor)> all_reduce_;
  double eps_;
  std::vector<Layer> layers_;
  at::Tensor embedding_, final_norm_;
  LinearWeights lm_head_;
};

void bind_layer_stack(pybind11::module_& m) {
  pybind11::class_<LayerStack>(m, "LayerStack", pybind11::module_local())  // one per kernel build
      .def(pybind11::init<int64_t, int64_t, int64_t, double>())
      .def("set_head", &LayerStack::set_head)
      .def("add_layer", &LayerStack::add_layer, pybind11::arg("input_norm"), pybind11::arg("post_norm"),
           pybind11::arg("qkv"), pybind11::arg("o"), pybind11::arg("gate_up"), pybind11::arg("down"),
           pybind11::arg("q_norm") = pybind11::none(), pybind11::arg("k_norm") = pybind11::none())
      .def("set_tensor_parallel", &LayerStack::set_tensor_parallel)
      .def("forward", &LayerStack::forward)
      .def_readwrite("one_region", &LayerStack::one_region)
      .def_readonly("one_region_steps", &LayerStack::one_region_steps)
      .def_readwrite("region_rows", &LayerStack::region_rows);
}
