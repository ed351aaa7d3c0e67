// The native decode step: the dense layers of a Llama-family model, T = 1 new token per row, on
// the CPU, with every glue op (RMSNorm, RoPE, KV write, attention, SwiGLU, residual) a plain loop
// on fp32 rows and the weights behind the Kernel interface (llama2.c's forward(), in C++).
//
// Through torch ops the same step costs ~48 dispatcher ops per layer, ~8 us each from Python: on
// SmolLM2 that was half of the step (benchmarks/results/cpu_dense_profile.txt). Here only the
// weight kernels remain.
//
// Numerics follow runtime/cpu_decode.py's torch-op step: the residual stream, q, k, the KV cache
// and the attention output are rounded to the model's dtype where that step rounds them; norms,
// RoPE, softmax and SwiGLU compute in fp32.
//
// DeepSeek's multi-head latent attention layers (set_latent) run here too, in the absorbed decode
// form (DeepSeek-V2 §2.1, Appendix C), rounded where models/deepseek.LatentAttention and the layer's
// modules round: the step's result is theirs up to the kernels' own rounding.
#include "gemv.h"
#include "kernel.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

namespace tiered {
namespace {

// Kernels whose outputs are concatenated column-wise (a fused q/k/v kernel is a group of one).
// One kernel call, named for torch.profiler ("tiered::<kernel>") like an aten op would be.
inline void run_one(const Kernel& k, const float* x, int64_t B, float* y) {
  RECORD_FUNCTION("tiered::" + k.name(), std::vector<c10::IValue>());
  k.run_step(x, B, y);
}

struct Group {
  std::vector<KernelPtr> ks;
  int64_t in = 0, out = 0;

  explicit Group(std::vector<KernelPtr> kernels = {}) : ks(std::move(kernels)) {
    for (auto& k : ks) {
      TIERED_CHECK(in == 0 || k->in_features == in, "decode step: kernels of one group differ in input width");
      in = k->in_features;
      out += k->out_features;
    }
  }
  bool empty() const { return ks.empty(); }

  void run(const float* x, int64_t B, float* y, std::vector<float>& tmp) const {
    if (ks.size() == 1) return run_one(*ks[0], x, B, y);
    int64_t off = 0;
    for (auto& k : ks) {
      const int64_t n = k->out_features;
      tmp.resize(B * n);
      run_one(*k, x, B, tmp.data());
      for (int64_t b = 0; b < B; ++b) std::memcpy(y + b * out + off, tmp.data() + b * n, n * sizeof(float));
      off += n;
    }
  }
};

// How a MoE layer's router turns its logits into top_k experts and their weights (set_moe's `method`):
// models/moe.Router's softmax, or one of models/deepseek.DeepSeekRouter's topk_methods.
enum class Routing { kSoftmax, kGreedy, kGroupLimitedGreedy, kNoauxTc };

// A MoE layer's FFN run in the step (set_moe): its router's rule, then every routed expert of the
// layer, whose kernels stay bound to their resident weights, and its shared expert.
struct Moe {
  std::vector<float> router;  // [E, D] fp32 (the router's weights, widened exactly)
  int64_t top_k = 0;
  bool norm_topk = false;
  Routing method = Routing::kSoftmax;
  int64_t n_group = 1, topk_group = 1;  // group-limited methods: E / n_group experts a group, topk_group kept
  float scaling = 1.f;  // DeepSeek's routed_scaling_factor (every weight times it)
  std::vector<float> bias;  // [E] noaux_tc's e_score_correction_bias (the choice only), else empty
  std::vector<float> router_bias;  // [E] added to the logits (gpt-oss's biased router), else empty
  std::unique_ptr<gemv::Glu> glu;  // gpt-oss's biased clamped-GLU experts (gemv.h), else null: SwiGLU
  std::shared_ptr<gemv::BoundExperts> experts;
  // the rows an expert averages from which its experts take the AMX GEMM (gemv::moe_experts_amx; 0: never)
  int64_t amx_rows = 0;
  // the shared expert (Qwen-MoE's, DeepSeek's shared experts as one MLP) and its gate [D -> 1] (Qwen-MoE;
  // empty: added ungated, DeepSeek), all empty for none
  Group shared_gu, shared_down, shared_gate;
};

// A DeepSeek layer's multi-head latent attention run in the step (set_latent; models/deepseek.py).
struct Latent {
  Group q, q_a, q_b, kv_a;  // q_proj [H (n + r), D], or q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa
  std::vector<float> q_a_norm, kv_a_norm;  // [q_lora_rank] (or empty), [R]
  float q_a_eps = 1e-6f, kv_a_eps = 1e-6f;
  // the absorbed products: per head h, uk[h] W_UK^T (n -> R) and uv[h] W_UV (R -> v) (install_absorbed's
  // kernels); or, both empty, kv_b_proj's fp32 weight [H (n + v), R] read in place (kvb its data)
  std::vector<KernelPtr> uk, uv;
  at::Tensor kv_b;
  const float* kvb = nullptr;
  int64_t R = 0, n = 0, v = 0;
  float scale = 1.f;  // (n + r)^-0.5, times YaRN's mscale^2
  bool interleave = false;  // RoPE pairs (x0, x1), (x2, x3), ..: gathered evens-then-odds first
};

struct Layer {
  std::vector<float> in_norm, post_norm;
  float eps = 1e-6f;
  // Attention extras (set_qk): q/k RMSNorm weights (empty: none) over each head's hd elements
  // (Qwen3) or over the whole projection (OLMoE), their eps, and OLMoE's q/k/v clip (0: none).
  std::vector<float> q_norm, k_norm;
  float qk_eps = 1e-6f, clip = 0.f;
  bool qk_per_head = true;
  // (set_attention) the layer's own sliding window (0: none; -1: the step's) and each query head's
  // sink logit [H] (gpt-oss; empty: none)
  int64_t window = -1;
  std::vector<float> sinks;
  // (set_sandwich) RMSNorm weights of the attention's and the FFN's outputs before their residual adds (Gemma's
  // post_attention_layernorm / post_feedforward_layernorm; empty: none), and (set_local_rope) whether q and k
  // rotate by the step's second RoPE tables (Gemma 3's sliding layers)
  std::vector<float> attn_out_norm, ffn_out_norm;
  bool local_rope = false;
  float softcap = 0.f;  // (set_softcap) Gemma 2's cap on the attention logits, 0: none
  bool extras() const { return !q_norm.empty() || clip > 0.f; }
  Group qkv, o, gate_up, down;  // gate_up/down empty: attention only (the layer's FFN runs elsewhere)
  std::shared_ptr<Moe> moe;  // or its FFN is these routed experts (when forward's `moe`)
  std::shared_ptr<Latent> mla;  // its attention is latent attention (qkv empty), or null
  bool runs() const { return !qkv.empty() || mla; }  // false: a placeholder its caller runs
};

std::vector<float> to_floats(const at::Tensor& t) {
  auto c = t.to(at::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

template <typename T>
inline float rnd(float v) { return float(T(v)); }  // round to the model's dtype (identity for fp32)

// rows of W [n, D] fp32 dotted with x [D]: y [n] (a MoE router's logits).
TIERED_CLONES void dot_rows(const float* W, const float* x, int64_t n, int64_t D, float* y) {
  for (int64_t e = 0; e < n; ++e) {
    const float* w = W + e * D;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < D; ++i) acc += w[i] * x[i];
    y[e] = acc;
  }
}

}  // namespace

TIERED_CLONES void rms_norm(const float* x, const float* w, float eps, int64_t D, float* y) {  // kernel.h
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / float(D) + eps);
  for (int64_t i = 0; i < D; ++i) y[i] = x[i] * r * w[i];
}

TIERED_CLONES void silu_mul(const float* g, const float* u, float* a, int64_t n) {  // kernel.h
#pragma omp simd  // scalar without it (~5% of a 32-row SmolLM2 step)
  for (int64_t i = 0; i < n; ++i) a[i] = g[i] / (1.f + exp_fast(-g[i])) * u[i];
}

// a [n] = gelu_tanh(g) * u (Gemma's GeGLU, kernel.h's gelu_tanh), fp32
TIERED_CLONES void gelu_tanh_mul(const float* g, const float* u, float* a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) a[i] = gelu_tanh(g[i]) * u[i];
}

TIERED_CLONES void clamped_glu(const float* g, const float* u, float* a, int64_t n, float alpha, float limit) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {  // kernel.h
    const float gi = std::min(g[i], limit), ui = std::max(std::min(u[i], limit), -limit);
    a[i] = (ui + 1.f) * (gi / (1.f + exp_fast(-alpha * gi)));
  }
}

namespace {

// 8 floats as one vector (GCC's vector extensions: each target_clones copy compiles them to its own
// ISA, 256-bit AVX registers in the AVX2 and AVX-512 copies). The helpers are always inlined, so the
// ABI note GCC gives for 32-byte vector arguments does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v8f __attribute__((vector_size(32)));

// The int8 KV cache (Plan.dtypes["kv_cache"] "int8", memory/sizes.kv_bytes_per_token): each (position, KV head)
// row is hd int8 values and then one fp32 scale per block of 32 of them (per block of hd where hd % 32 != 0),
// hd + 4 hd / 32 bytes: x ~ q * s with s = max|x| / 127 over the block and q = round(x / s)
// (models/layers.quantize_kv_rows, the same bits). llama.cpp's q8_0 cache has the same blocks with fp16 scales;
// a scale per head row of 64 had 2.2x the KL to an fp32 cache on SmolLM2. attend_vec widens the int8 rows in
// registers as it widens bf16 ones, times their block's scale; the prompt rows' attention (attention_runs) and
// heads whose width is no multiple of 32 dequantize rows into fp32 scratch.
constexpr int64_t kKvBlock = 32;
__attribute__((always_inline)) inline int64_t kv_block(int64_t hd) { return hd % kKvBlock == 0 ? kKvBlock : hd; }
// elements (bytes) of one packed int8 row of hd values
__attribute__((always_inline)) inline int64_t q8_row(int64_t hd) {
  return hd + int64_t(sizeof(float)) * (hd / kv_block(hd));
}
// the scale of the block holding column c of the packed int8 row at p (hd values, then the blocks' fp32 scales)
__attribute__((always_inline)) inline float block_scale(const int8_t* p, int64_t hd, int64_t c) {
  float s;
  std::memcpy(&s, p + hd + int64_t(sizeof(float)) * (c / kv_block(hd)), sizeof(float));
  return s;
}
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

// Vec (v8f here, v16f for the wide attention below) from floats p[0..lanes)
template <typename Vec>
__attribute__((always_inline)) inline Vec loadv(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
__attribute__((always_inline)) inline v8f load8(const float* p) { return loadv<v8f>(p); }
// 8 bf16 -> fp32 (bits << 16) by interleaving them with zeros: one permute in the AVX-512 copy, where
// __builtin_convertvector's widening compiled to two 4-wide ones, a byte shift and an insert.
__attribute__((always_inline)) inline v8f load8(const uint16_t* p) {
  v8h h;
  std::memcpy(&h, p, sizeof(h));
  typedef uint16_t v16h __attribute__((vector_size(32)));
  const v8h z = {};
  const v16h u = __builtin_shufflevector(z, h, 0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  v8f v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
// rows [t, t + 8) of a cache K [., w] as fp32: K's own rows when E is float, else (bf16 bits) widened
// into kb [8 w] (w % 8 == 0), which the caller's scratch holds.
template <typename E>
__attribute__((always_inline)) inline const float* rows8_f32(const E* K, int64_t t, int64_t w, float* kb) {
  if constexpr (std::is_same_v<E, uint16_t>) {
    for (int64_t i = 0; i < 8 * w; i += 8) {
      const v8f x = load8(K + t * w + i);
      std::memcpy(kb + i, &x, sizeof(v8f));
    }
    return kb;
  } else {
    return K + t * w;
  }
}
__attribute__((always_inline)) inline float hsum8(v8f s) {
  s += __builtin_shufflevector(s, s, 4, 5, 6, 7, 0, 1, 2, 3);
  s += __builtin_shufflevector(s, s, 2, 3, 0, 1, 6, 7, 4, 5);
  s += __builtin_shufflevector(s, s, 1, 0, 3, 2, 5, 4, 7, 6);
  return s[0];
}

// p [n] <- cap tanh(p / cap): Gemma 2's soft-capped attention logits (models/gemma.attend_softcapped), before the
// softmax (the keys past a row's window are not in p: its mask)
inline void cap_scores(float* p, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) p[i] = cap * std::tanh(p[i] * inv);
}

// p [rows, n] <- softmax of each row, in place. With `ml` (a part of the keys, split attention):
// p <- exp(p - max) unnormalized, and ml [rows, 2] <- (max, sum) of each row, for merge_parts.
__attribute__((always_inline)) inline void softmax_rows(float* p, int64_t rows, int64_t n, float* ml) {
  for (int64_t j = 0; j < rows; ++j) {
    float* pj = p + j * n;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)  // std::max's loop stayed scalar: ~20% of a 1024-key attention
    for (int64_t t = 0; t < n; ++t) mx = pj[t] > mx ? pj[t] : mx;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) sum += (pj[t] = exp_fast(pj[t] - mx));
    if (ml) {
      ml[2 * j] = mx;
      ml[2 * j + 1] = sum;
      continue;
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; ++t) pj[t] *= inv;
  }
}

// ord[0..kk) <- the indices of the kk largest of v[0..n), largest first, the lower index first among
// equals (torch.topk leaves the order of equals to its partial sort: the lower expert here, as before).
inline void top_indices(const float* v, int64_t n, int64_t kk, int64_t* ord) {
  std::iota(ord, ord + n, int64_t(0));
  std::partial_sort(ord, ord + kk, ord + n,
                    [&](int64_t a, int64_t c) { return v[a] > v[c] || (v[a] == v[c] && a < c); });
}

// v [E] <- `fill` outside the topk_group best of m's n_group groups of E / n_group consecutive experts,
// a group scored by its best value (best = 1) or the sum of its two best (best = 2): as
// models/deepseek.DeepSeekRouter._group_mask.
void mask_groups(const Moe& m, float* v, int64_t E, int best, float fill) {
  const int64_t G = m.n_group, S = E / G;
  std::vector<float> score(G);
  std::vector<int64_t> ord(std::max(G, S));
  for (int64_t g = 0; g < G; ++g) {
    const float* vg = v + g * S;
    if (best == 1) {
      score[g] = *std::max_element(vg, vg + S);
    } else {
      top_indices(vg, S, 2, ord.data());
      score[g] = vg[ord[0]] + vg[ord[1]];
    }
  }
  top_indices(score.data(), G, m.topk_group, ord.data());
  std::vector<char> keep(G, 0);
  for (int64_t j = 0; j < m.topk_group; ++j) keep[ord[j]] = 1;
  for (int64_t g = 0; g < G; ++g)
    if (!keep[g]) std::fill(v + g * S, v + (g + 1) * S, fill);
}

// One row's routing (set_moe's rule) on its logits l fp32 [E] (kSoftmax: already rounded to the
// model's dtype) -> idx [k] and weight fp32 [k], the best choice first:
//   softmax, greedy: p = softmax(l); the top k of p, divided by their sum when norm_topk;
//   group_limited_greedy: the same with p set to 0 outside the topk_group groups of best max(p)
//     (DeepSeek-V2, arXiv 2405.04434, §2.2.2's device-limited routing as transformers' V2 has it);
//   noaux_tc: p = sigmoid(l), choice c = p + bias, c = -inf outside the topk_group groups of best
//     top-2 sum of c; the top k of c keep their p, divided by (their sum + 1e-20) when norm_topk
//     (DeepSeek-V3, arXiv 2412.19437, §2.1.2);
// then every weight times `scaling`: models/deepseek.DeepSeekRouter.select op for op in fp32.
void route_row(const Moe& m, const float* l, int64_t E, int64_t* idx, float* wt) {
  const int64_t k = m.top_k;
  std::vector<float> p(l, l + E), c;
  std::vector<int64_t> order(E);
  float s = 0.f;
  if (m.method == Routing::kNoauxTc) {
    c.resize(E);
    for (int64_t e = 0; e < E; ++e) {
      p[e] = 1.f / (1.f + std::exp(-l[e]));
      c[e] = p[e] + m.bias[e];
    }
    if (m.n_group > 1) mask_groups(m, c.data(), E, 2, -INFINITY);
    top_indices(c.data(), E, k, order.data());
    for (int64_t j = 0; j < k; ++j) s += p[order[j]];
    s += 1e-20f;
  } else {
    softmax_rows(p.data(), 1, E, nullptr);
    if (m.method == Routing::kGroupLimitedGreedy && m.n_group > 1) mask_groups(m, p.data(), E, 1, 0.f);
    top_indices(p.data(), E, k, order.data());
    for (int64_t j = 0; j < k; ++j) s += p[order[j]];
  }
  for (int64_t j = 0; j < k; ++j) {
    idx[j] = order[j];
    const float w = m.norm_topk ? p[order[j]] / s : p[order[j]];
    wt[j] = w * m.scaling;
  }
}

// p[0..4) = scale x the sums of a0..a3's 8 lanes (4 dot products' partial sums), one shuffle tree.
__attribute__((always_inline)) inline void hsum8x4(v8f a0, v8f a1, v8f a2, v8f a3, float scale, float* p) {
  // unpack lo / hi within each 128-bit lane: [a0_0+a0_2, a1_0+a1_2, a0_1+a0_3, a1_1+a1_3 | same for 4..7]
  const v8f s01 = __builtin_shufflevector(a0, a1, 0, 8, 1, 9, 4, 12, 5, 13) +
                  __builtin_shufflevector(a0, a1, 2, 10, 3, 11, 6, 14, 7, 15);
  const v8f s23 = __builtin_shufflevector(a2, a3, 0, 8, 1, 9, 4, 12, 5, 13) +
                  __builtin_shufflevector(a2, a3, 2, 10, 3, 11, 6, 14, 7, 15);
  // [a0_0..3, a1_0..3, a2_0..3, a3_0..3 | the same over lanes 4..7]
  const v8f u = __builtin_shufflevector(s01, s23, 0, 1, 8, 9, 4, 5, 12, 13) +
                __builtin_shufflevector(s01, s23, 2, 3, 10, 11, 6, 7, 14, 15);
  const v8f w = u + __builtin_shufflevector(u, u, 4, 5, 6, 7, 0, 1, 2, 3);
  for (int i = 0; i < 4; ++i) p[i] = w[i] * scale;
}

// 16 floats as one vector: the attention's wide path (AVX-512 CPUs: g_attend_wide). In the x86-64-v4 copy of
// attend() a single 512-bit register; the narrower copies never take that path.
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

template <typename Vec>
constexpr int kLanes = int(sizeof(Vec) / sizeof(float));

// Vec from lanes int8 values (an int8 KV cache row's), sign-extended and converted. Through int16 and int32:
// GCC 12 turns each step into vpmovsxbw / vpmovsxwd (and vcvtdq2ps), where int8 -> float in one
// __builtin_convertvector was lowered to a scalar sign-extend and convert per element (0.44x the bf16 cache's
// decode speed at 4-8k positions, 2 Zen 4 cores).
typedef int8_t v8b __attribute__((vector_size(8)));
typedef int16_t v8s __attribute__((vector_size(16)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int8_t v16b __attribute__((vector_size(16)));
typedef int16_t v16s __attribute__((vector_size(32)));
typedef int32_t v16i __attribute__((vector_size(64)));
template <typename Vec>
__attribute__((always_inline)) inline Vec loadv(const int8_t* p) {
  if constexpr (std::is_same_v<Vec, v16f>) {
    v16b b;
    std::memcpy(&b, p, sizeof(b));
    return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(b, v16s), v16i), v16f);
  } else {
    v8b b;
    std::memcpy(&b, p, sizeof(b));
    return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(b, v8s), v8i), v8f);
  }
}
__attribute__((always_inline)) inline v8f load8(const int8_t* p) { return loadv<v8f>(p); }

// 2 x lanes bf16 -> their even and odd elements as fp32 (bits << 16, and the high halves as they are): no
// shuffles, so a bf16 cache's rows convert on the ALU ports beside the FMAs (a permutation widening
// 8 at a time ran on the shuffle port, which the dot products' sums also need).
template <typename Vec>
__attribute__((always_inline)) inline void load_split(const uint16_t* p, Vec& even, Vec& odd) {
  using Bits = std::conditional_t<std::is_same_v<Vec, v16f>, v16u, v8u>;
  Bits u;
  std::memcpy(&u, p, sizeof(u));
  const Bits e = u << 16, o = u & 0xffff0000u;
  std::memcpy(&even, &e, sizeof(Vec));
  std::memcpy(&odd, &o, sizeof(Vec));
}
// a vector's partial sums as 8 lanes (hsum8x4's operands)
__attribute__((always_inline)) inline v8f as8(v8f a) { return a; }
__attribute__((always_inline)) inline v8f as8(v16f a) {
  return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}

// o [J, hd] = p [J, n] V [n, hd] for J query heads (rows of p ldp apart, of V ldv apart; `add`: o +=
// instead): 4 x lanes columns at a time (Vec v8f: 32; v16f: 64; hd a multiple of that) in J x 4 registers, each
// value row loaded (a bf16 cache: widened as even and odd columns, load_split; o's columns put back in order
// when stored) once for the J heads.
template <typename Vec, int J, typename E>
__attribute__((always_inline)) inline void weigh_values(const float* p, int64_t n, const E* V, int64_t hd, float* o,
                                                        int64_t ldv, int64_t ldp, bool add) {
  constexpr int W = kLanes<Vec>, B = 4 * W;
  // the column (of the B) that lane i of accumulator c holds
  auto col = [](int c, int i) { return std::is_same_v<E, uint16_t> ? 2 * W * (c / 2) + 2 * i + c % 2 : W * c + i; };
  for (int64_t c0 = 0; c0 < hd; c0 += B) {
    Vec acc[J][4] = {};
    alignas(64) float buf[J * B];
    if (add) {
      for (int j = 0; j < J; ++j)
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < W; ++i) buf[j * B + W * c + i] = o[j * hd + c0 + col(c, i)];
      for (int j = 0; j < J; ++j)
        for (int c = 0; c < 4; ++c) std::memcpy(&acc[j][c], buf + j * B + W * c, sizeof(Vec));
    }
    for (int64_t t = 0; t < n; ++t) {
      Vec v[4];
      if constexpr (std::is_same_v<E, uint16_t>) {
        load_split(V + t * ldv + c0, v[0], v[1]);
        load_split(V + t * ldv + c0 + 2 * W, v[2], v[3]);
      } else {
        for (int c = 0; c < 4; ++c) v[c] = loadv<Vec>(V + t * ldv + c0 + W * c);
        if constexpr (std::is_same_v<E, int8_t>)  // each vector's block scale (hd % 32 == 0: 32 columns a block)
          for (int c = 0; c < 4; ++c) v[c] *= block_scale(V + t * ldv, hd, c0 + W * c);
      }
      for (int j = 0; j < J; ++j) {
        const float w = p[j * ldp + t];
        for (int c = 0; c < 4; ++c) acc[j][c] += w * v[c];
      }
    }
    for (int j = 0; j < J; ++j)
      for (int c = 0; c < 4; ++c) std::memcpy(buf + j * B + W * c, &acc[j][c], sizeof(Vec));
    for (int j = 0; j < J; ++j)
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < W; ++i) o[j * hd + c0 + col(c, i)] = buf[j * B + W * c + i];
  }
}

// p [j * ldp + u] = scale x q_j . K_u for J query heads q [J, hd] and U keys K [U, hd] (U % 4 == 0): J x U
// accumulators of lanes columns, each key's columns loaded (a bf16 cache: widened, load_split) once for the J
// heads, one shuffle tree (hsum8x4) for 4 dot products. A bf16 cache's q comes with each 2 x lanes columns'
// even ones first, then the odd ones, as load_split widens the keys.
template <typename Vec, int J, int U, typename E>
__attribute__((always_inline)) inline void score_keys(const float* q, const E* K, int64_t hd, float scale, float* p,
                                                      int64_t ldp, int64_t ldk) {
  constexpr int W = kLanes<Vec>;
  Vec a[J][U] = {};
  if constexpr (std::is_same_v<E, uint16_t>) {  // q: each 2W columns' even, then odd ones (attend_vec's qs)
    for (int64_t c = 0; c < hd; c += 2 * W) {
      Vec qe[J], qo[J];
      for (int j = 0; j < J; ++j) qe[j] = loadv<Vec>(q + j * hd + c), qo[j] = loadv<Vec>(q + j * hd + c + W);
      for (int u = 0; u < U; ++u) {
        Vec ke, ko;
        load_split(K + u * ldk + c, ke, ko);
        for (int j = 0; j < J; ++j) a[j][u] += qe[j] * ke + qo[j] * ko;
      }
    }
  } else for (int64_t c = 0; c < hd; c += W) {
    Vec qv[J];
    for (int j = 0; j < J; ++j) qv[j] = loadv<Vec>(q + j * hd + c);
    for (int u = 0; u < U; ++u) {
      Vec k = loadv<Vec>(K + u * ldk + c);
      if constexpr (std::is_same_v<E, int8_t>) k *= block_scale(K + u * ldk, hd, c);  // (hd % 32 == 0)
      for (int j = 0; j < J; ++j) a[j][u] += qv[j] * k;
    }
  }
  for (int j = 0; j < J; ++j)
    for (int u = 0; u < U; u += 4)
      hsum8x4(as8(a[j][u]), as8(a[j][u + 1]), as8(a[j][u + 2]), as8(a[j][u + 3]), scale, p + j * ldp + u);
}

}  // namespace

// Whether attend takes its 16-wide path (AVX-512 CPUs; the kernel tuning's "attend_wide" may turn it off).
bool g_attend_wide = [] {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return bool(__builtin_cpu_supports("avx512f"));
#else
  return false;
#endif
}();

namespace {

// attend's vector loops for a float or bf16 cache: 8-float vectors (hd % 32 == 0), or with Wide 16-float ones
// (hd % 64 == 0; g_attend_wide: AVX-512), the same sums in another order. Scores 8 keys at a time
// (score_keys in Vec): up to 4 query heads x 4 keys in registers, each key's columns loaded (a bf16
// cache: widened) once for those heads, one shuffle tree for 4 dot products. A bf16 cache's keys widen as even
// and odd columns (load_split), so the queries are split likewise: qs [group, hd], each block
// of 16 (Wide: 32) columns' even ones, then their odd ones.
template <bool Wide, typename E>
__attribute__((always_inline)) inline void attend_vec(const float* q, int64_t group, const E* K, const E* V, int64_t n,
                                                      int64_t hd, float scale, float* p, float* o, float* ml,
                                                      float softcap) {
  using Vec = std::conditional_t<Wide, v16f, v8f>;
  alignas(64) float q_local[16 * 256];
  std::vector<float> q_heap;
  const float* qs = q;
  if constexpr (std::is_same_v<E, uint16_t>) {
    constexpr int half = Wide ? 16 : 8;
    float* split = group * hd <= 16 * 256 ? q_local : (q_heap.resize(group * hd), q_heap.data());
    for (int64_t j = 0; j < group * hd; j += 2 * half)
      for (int i = 0; i < half; ++i) split[j + i] = q[j + 2 * i], split[j + half + i] = q[j + 2 * i + 1];
    qs = split;
  }
  int64_t t = 0;
  constexpr bool q8 = std::is_same_v<E, int8_t>;  // an int8 cache's packed rows: hd values, then their blocks' scales
  const int64_t ld = q8 ? q8_row(hd) : hd;  // elements from one cached row to the next
  const int64_t row_bytes = ld * int64_t(sizeof(E));
  for (; t + 8 <= n; t += 8) {
    // the cache comes from DRAM (another layer's ran in between): ask for the keys two blocks
    // ahead, and for this block's values, which the weighing below reads from the L2 then
    const char* kn = reinterpret_cast<const char*>(K + std::min(t + 16, n - 1) * ld);
    const char* vn = reinterpret_cast<const char*>(V + t * ld);
    for (int64_t b = 0; b < 8 * row_bytes; b += 64) {
      __builtin_prefetch(kn + b);
      __builtin_prefetch(vn + b);
    }
    // 4 heads and 4 keys a call: 16 accumulators (AVX2's 16 registers spill a little; AVX-512's 32
    // do not), 3 heads' 12 fit either. On 2 Sapphire Rapids cores one KV head's 1024 cached keys
    // (bf16) took 12-13 ns a key for 3 heads of 64 (was 21), 28-29 for 4 of 128 (was 52), one core.
    const E* k8 = K + t * ld;
    int64_t j = 0;
    for (; j + 4 <= group; j += 4)
      for (int h = 0; h < 8; h += 4)
        score_keys<Vec, 4, 4>(qs + j * hd, k8 + h * ld, hd, scale, p + j * n + t + h, n, ld);
    for (; j + 3 <= group; j += 3)
      for (int h = 0; h < 8; h += 4)
        score_keys<Vec, 3, 4>(qs + j * hd, k8 + h * ld, hd, scale, p + j * n + t + h, n, ld);
    if (group - j == 2) score_keys<Vec, 2, 8>(qs + j * hd, k8, hd, scale, p + j * n + t, n, ld);
    if (group - j == 1) score_keys<Vec, 1, 8>(qs + j * hd, k8, hd, scale, p + j * n + t, n, ld);
  }
  for (; t < n; ++t) {  // the last keys one at a time: two FMA chains a dot product
    const E* k = K + t * ld;
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * hd;
      v8f a0 = {}, a1 = {};
      for (int64_t c = 0; c < hd; c += 16) {
        if constexpr (q8) {  // blocks of 32 columns: c and c + 8 share one
          const float sc = block_scale(k, hd, c);
          a0 += load8(qj + c) * (load8(k + c) * sc);
          a1 += load8(qj + c + 8) * (load8(k + c + 8) * sc);
        } else {
          a0 += load8(qj + c) * load8(k + c);
          a1 += load8(qj + c + 8) * load8(k + c + 8);
        }
      }
      p[j * n + t] = hsum8(a0 + a1) * scale;
    }
  }
  if (softcap > 0.f) cap_scores(p, group * n, softcap);
  softmax_rows(p, group, n, ml);
  // o: up to 4 query heads x 32 (Wide: 64) columns in 16 registers, each value row converted once for them
  int64_t j = 0;
  for (; j + 4 <= group; j += 4) weigh_values<Vec, 4>(p + j * n, n, V, hd, o + j * hd, ld, n, false);
  for (; j + 3 <= group; j += 3) weigh_values<Vec, 3>(p + j * n, n, V, hd, o + j * hd, ld, n, false);
  if (group - j == 2) weigh_values<Vec, 2>(p + j * n, n, V, hd, o + j * hd, ld, n, false);
  if (group - j == 1) weigh_values<Vec, 1>(p + j * n, n, V, hd, o + j * hd, ld, n, false);
}

// One KV head's attention for its `group` query heads q [group, hd] over n cached rows K, V [n, hd]:
// o [group, hd] = softmax(q K^T * scale) V, each key and value row read once for the whole group.
// p: scratch [group, n]. E is the cache's element: float, or bf16 as its bits. With `ml` (a part of
// the keys): o unnormalized and ml [group, 2] the parts' (max, sum) of scores (softmax_rows).
// always_inline: each target_clones copy of attend() below must get its own wide-vector copy of this
// loop (an out-of-line template would be compiled once, for the x86-64 baseline's SSE: measured 4-wide
// and FMA-less, ~18% of a 16-row SmolLM2 step). Wide: attend_vec's 16-float vectors where hd allows.
template <bool Wide, typename E, typename Load>
__attribute__((always_inline)) inline void attend_impl(const float* q, int64_t group, const E* K, const E* V, int64_t n, int64_t hd, float scale,
                        float* p, float* o, float* ml, float softcap, Load load) {
  if constexpr (std::is_same_v<E, float> || std::is_same_v<E, uint16_t>) {
    if constexpr (Wide) {
      if (hd % 64 == 0 && hd <= 256) return attend_vec<true>(q, group, K, V, n, hd, scale, p, o, ml, softcap);
    }
    if (hd % 32 == 0 && hd <= 256) return attend_vec<false>(q, group, K, V, n, hd, scale, p, o, ml, softcap);  // head_dim 64, 96, 128, ..
  }
  for (int64_t t = 0; t < n; ++t) {
    const E* k = K + t * hd;
    for (int64_t j = 0; j < group; ++j) {
      const float* qj = q + j * hd;
      float d = 0.f;
#pragma omp simd reduction(+ : d)
      for (int64_t i = 0; i < hd; ++i) d += qj[i] * load(k[i]);
      p[j * n + t] = d * scale;
    }
  }
  if (softcap > 0.f) cap_scores(p, group * n, softcap);
  softmax_rows(p, group, n, ml);
  std::fill(o, o + group * hd, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const E* v = V + t * hd;
    for (int64_t j = 0; j < group; ++j) {
      const float w = p[j * n + t];
      float* oj = o + j * hd;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i) oj[i] += w * load(v[i]);
    }
  }
}

TIERED_CLONES void attend(const float* q, int64_t group, const float* K, const float* V, int64_t n, int64_t hd,
                          float scale, float* p, float* o, float* ml, float softcap = 0.f) {
  auto same = [](float v) { return v; };
  if (g_attend_wide) attend_impl<true>(q, group, K, V, n, hd, scale, p, o, ml, softcap, same);
  else attend_impl<false>(q, group, K, V, n, hd, scale, p, o, ml, softcap, same);
}

TIERED_CLONES void attend(const float* q, int64_t group, const uint16_t* K, const uint16_t* V, int64_t n, int64_t hd,
                          float scale, float* p, float* o, float* ml, float softcap = 0.f) {
  if (g_attend_wide) attend_impl<true>(q, group, K, V, n, hd, scale, p, o, ml, softcap, bf16_to_float);
  else attend_impl<false>(q, group, K, V, n, hd, scale, p, o, ml, softcap, bf16_to_float);
}

// attend over packed int8 rows (hd values and their blocks' scales each, q8_row(hd) apart; hd % 32 == 0, at most
// 256): the vector loops widening the int8 values in registers, each vector times its block's scale.
TIERED_CLONES void attend(const float* q, int64_t group, const int8_t* K, const int8_t* V, int64_t n, int64_t hd,
                          float scale, float* p, float* o, float* ml, float softcap = 0.f) {
  if (g_attend_wide && hd % 64 == 0) attend_vec<true>(q, group, K, V, n, hd, scale, p, o, ml, softcap);
  else attend_vec<false>(q, group, K, V, n, hd, scale, p, o, ml, softcap);
}

// A prompt's query rows at once (DecodeStep::attention's runs: consecutive positions of one sequence).
// One KV head's keys are first transposed into blocks of `lanes` keys, KT [nb, hd, lanes] fp32 (zeros past
// the last key: transpose_keys), so that one vector holds `lanes` keys' scores of one query: no horizontal
// sums (attend_vec spends about as many shuffles and adds on its 4-key trees as FMAs on the dots), each
// block's column loaded once for up to JQ queries (the rows' heads of that KV head) whose elements are
// FMA broadcast operands. The values are weighed as attend_vec weighs them, for up to 6 queries a pass.
template <typename Vec, typename E>
__attribute__((always_inline)) inline void transpose_keys_impl(const E* K, int64_t n, int64_t hd, float* KT) {
  constexpr int W = kLanes<Vec>;
  for (int64_t b = 0; b * W < n; ++b) {
    float* kt = KT + b * hd * W;
    const int64_t m = std::min<int64_t>(W, n - b * W);
    for (int64_t w = 0; w < W; ++w) {
      if (w >= m) {
        for (int64_t d = 0; d < hd; ++d) kt[d * W + w] = 0.f;
        continue;
      }
      const E* k = K + (b * W + w) * hd;
      for (int64_t d = 0; d < hd; ++d) {
        if constexpr (std::is_same_v<E, uint16_t>) kt[d * W + w] = bf16_to_float(k[d]);
        else kt[d * W + w] = k[d];
      }
    }
  }
}

TIERED_CLONES void transpose_keys(const float* K, int64_t n, int64_t hd, int64_t lanes, float* KT) {
  if (lanes == 16) transpose_keys_impl<v16f>(K, n, hd, KT);
  else transpose_keys_impl<v8f>(K, n, hd, KT);
}
TIERED_CLONES void transpose_keys(const uint16_t* K, int64_t n, int64_t hd, int64_t lanes, float* KT) {
  if (lanes == 16) transpose_keys_impl<v16f>(K, n, hd, KT);
  else transpose_keys_impl<v8f>(K, n, hd, KT);
}

// p [j * ldp + t] = scale x q_j . key t for JQ queries q [JQ, hd] and the keys of nb blocks of KT: two
// blocks at a time in JQ x 2 accumulators (AVX-512: JQ 12, 24 of the 32 registers; AVX2: JQ 6, 12 of 16).
template <typename Vec, int JQ>
__attribute__((always_inline)) inline void score_blocks(const float* q, const float* KT, int64_t nb, int64_t hd,
                                                        float scale, float* p, int64_t ldp) {
  constexpr int W = kLanes<Vec>;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    Vec a[JQ][2] = {};
    const float* k0 = KT + b * hd * W;
    for (int64_t d = 0; d < hd; ++d) {
      const Vec x0 = loadv<Vec>(k0 + d * W), x1 = loadv<Vec>(k0 + (hd + d) * W);
      for (int j = 0; j < JQ; ++j) {
        const float qj = q[j * hd + d];
        a[j][0] += qj * x0;
        a[j][1] += qj * x1;
      }
    }
    for (int j = 0; j < JQ; ++j)
      for (int u = 0; u < 2; ++u) {
        const Vec s = a[j][u] * scale;
        std::memcpy(p + j * ldp + (b + u) * W, &s, sizeof(Vec));
      }
  }
  if (b < nb) {
    Vec a[JQ] = {};
    const float* k0 = KT + b * hd * W;
    for (int64_t d = 0; d < hd; ++d) {
      const Vec x0 = loadv<Vec>(k0 + d * W);
      for (int j = 0; j < JQ; ++j) a[j] += q[j * hd + d] * x0;
    }
    for (int j = 0; j < JQ; ++j) {
      const Vec s = a[j] * scale;
      std::memcpy(p + j * ldp + b * W, &s, sizeof(Vec));
    }
  }
}

// The arguments of attend_rows: one KV head and R consecutive rows of one sequence.
struct RowsTask {
  const float* q;      // the first row's query heads of this KV head, [group, hd]; rows ldq apart
  int64_t ldq, R, group, hd;
  float scale;
  const float* KT;     // transpose_keys of this head's keys from key kt_lo on
  int64_t kt_lo;
  const int64_t* lo;   // row r attends keys [lo[r], hi[r]) (absolute positions); lo, hi non-decreasing in r
  const int64_t* hi;
  float* o;            // out [R * group, hd]: row r's head h at (r * group + h) * hd, normalized
  float* scratch;      // p and the queries: rows_scratch(..) floats
  int64_t v_lo = 0;    // the first key the values V given to attend_rows hold (0: the head's cache from key 0)
};

inline int64_t rows_scratch(int64_t R, int64_t group, int64_t hd, int64_t keys, int64_t lanes) {
  const int64_t jpad = (R * group + 11) / 12 * 12;
  return jpad * (keys + 2 * lanes) + jpad * hd;
}

template <typename Vec, typename E>
__attribute__((always_inline)) inline void attend_rows_impl(const RowsTask& a, const E* V) {
  constexpr int W = kLanes<Vec>, JQ = W == 16 ? 12 : 6, JV = W == 16 ? 6 : 3;
  const int64_t J = a.R * a.group, hd = a.hd;
  const int64_t jpad = (J + JQ - 1) / JQ * JQ;
  const int64_t klo = a.lo[0], khi = a.hi[a.R - 1];
  const int64_t b0 = (klo - a.kt_lo) / W, b1 = (khi - a.kt_lo + W - 1) / W;
  const int64_t base = a.kt_lo + b0 * W;  // p's column 0
  const int64_t ldp = (b1 - b0) * W;
  float* qb = a.scratch;
  float* p = qb + jpad * hd;
  for (int64_t r = 0; r < a.R; ++r)
    std::memcpy(qb + r * a.group * hd, a.q + r * a.ldq, a.group * hd * sizeof(float));
  std::fill(qb + J * hd, qb + jpad * hd, 0.f);
  for (int64_t j = 0; j < jpad; j += JQ)
    score_blocks<Vec, JQ>(qb + j * hd, a.KT + b0 * hd * W, b1 - b0, hd, a.scale, p + j * ldp, ldp);
  // each query's softmax over its row's keys; zeros elsewhere in [klo, khi)
  for (int64_t j = 0; j < J; ++j) {
    const int64_t r = j / a.group;
    float* pj = p + j * ldp;
    const int64_t v0 = a.lo[r] - base, v1 = a.hi[r] - base;
    std::fill(pj + (klo - base), pj + v0, 0.f);
    softmax_rows(pj + v0, 1, v1 - v0, nullptr);
    std::fill(pj + v1, pj + (khi - base), 0.f);
  }
  const int64_t n = khi - klo;
  const float* pk = p + (klo - base);
  const E* Vk = V + (klo - a.v_lo) * hd;
  int64_t j = 0;
  for (; j + JV <= J; j += JV) weigh_values<Vec, JV>(pk + j * ldp, n, Vk, hd, a.o + j * hd, hd, ldp, false);
  switch (J - j) {
    case 5: if constexpr (JV > 5) weigh_values<Vec, 5>(pk + j * ldp, n, Vk, hd, a.o + j * hd, hd, ldp, false); break;
    case 4: if constexpr (JV > 4) weigh_values<Vec, 4>(pk + j * ldp, n, Vk, hd, a.o + j * hd, hd, ldp, false); break;
    case 3: if constexpr (JV > 3) weigh_values<Vec, 3>(pk + j * ldp, n, Vk, hd, a.o + j * hd, hd, ldp, false); break;
    case 2: weigh_values<Vec, 2>(pk + j * ldp, n, Vk, hd, a.o + j * hd, hd, ldp, false); break;
    case 1: weigh_values<Vec, 1>(pk + j * ldp, n, Vk, hd, a.o + j * hd, hd, ldp, false); break;
    default: break;
  }
}

// One RowsTask's attention (V: this head's cached values from key 0, [., hd]); lanes 16 (AVX-512, hd % 64
// == 0) or 8 (hd % 32 == 0), as transpose_keys laid KT out.
TIERED_CLONES void attend_rows(const RowsTask& a, const float* V, int64_t lanes) {
  if (lanes == 16) attend_rows_impl<v16f>(a, V);
  else attend_rows_impl<v8f>(a, V);
}
TIERED_CLONES void attend_rows(const RowsTask& a, const uint16_t* V, int64_t lanes) {
  if (lanes == 16) attend_rows_impl<v16f>(a, V);
  else attend_rows_impl<v8f>(a, V);
}

template <typename E>  // other cache dtypes (fp16, fp64): the plain loops
void attend(const float* q, int64_t group, const E* K, const E* V, int64_t n, int64_t hd, float scale, float* p,
            float* o, float* ml, float softcap = 0.f) {
  attend_impl<false>(q, group, K, V, n, hd, scale, p, o, ml, softcap, [](E v) { return float(v); });
}

// Multi-head latent attention's decode step (DeepSeek-V2, arXiv 2405.04434, §2.1 and Appendix C's
// absorbed form; models/deepseek.LatentAttention): every query head attends over one shared cache
// row per position, [c_kv (R) | k_pe (r)], W = R + r wide. Dimension legend as there: R =
// kv_lora_rank, r = qk_rope_head_dim, n = qk_nope_head_dim, v = v_head_dim, G = query heads.
//
// One decode row's G heads: q [G, W] fp32, each head's absorbed query [q_lat (R) | q_pe (r)]; K [S, W]
// its S cached rows (E: float, or bf16 as its bits). o [G, R] = softmax(q K^T * scale) K[:, :R]: the
// weighted latents, each cached row read once for the G heads. With `bf16` (a bf16 model) the scores,
// the probabilities and o are rounded to bf16 where the module's bf16 matmuls round them (scores
// before the scale, as `.float() * scale`). p [G, S] and kb [8 W] are scratch.
template <typename E>
__attribute__((always_inline)) inline void latent_attend_impl(const float* q, int64_t G, const E* K, int64_t S,
                                                              int64_t W, int64_t R, float scale, bool bf16, float* p,
                                                              float* kb, float* o) {
  auto load = [](E e) -> float {
    if constexpr (std::is_same_v<E, uint16_t>) return bf16_to_float(e);
    else return float(e);
  };
  if (W % 8 == 0) {  // scores 8 rows at a time, 8 independent FMA chains a head (as attend_impl)
    int64_t t = 0;
    const int64_t row_bytes = W * int64_t(sizeof(E));
    for (; t + 8 <= S; t += 8) {
      const char* kn = reinterpret_cast<const char*>(K + std::min(t + 16, S - 1) * W);
      for (int64_t b = 0; b < 8 * row_bytes; b += 64) __builtin_prefetch(kn + b);
      const float* kf = rows8_f32(K, t, W, kb);
      int64_t j = 0;
      for (; j + 4 <= G; j += 4)  // 4 heads x 4 rows in 16 registers: 8 loads for 16 FMAs
        for (int h = 0; h < 8; h += 4) {
          const float* k0 = kf + h * W;
          v8f a[4][4] = {};
          for (int64_t c = 0; c < W; c += 8) {
            v8f kv[4], qv[4];
            for (int u = 0; u < 4; ++u) kv[u] = load8(k0 + u * W + c), qv[u] = load8(q + (j + u) * W + c);
            for (int i = 0; i < 4; ++i)
              for (int u = 0; u < 4; ++u) a[i][u] += qv[i] * kv[u];
          }
          for (int i = 0; i < 4; ++i) hsum8x4(a[i][0], a[i][1], a[i][2], a[i][3], 1.f, p + (j + i) * S + t + h);
        }
      for (; j < G; ++j) {
        const float* qj = q + j * W;
        v8f a[8] = {};
        for (int64_t c = 0; c < W; c += 8) {
          const v8f qv = load8(qj + c);
          for (int u = 0; u < 8; ++u) a[u] += qv * load8(kf + u * W + c);
        }
        hsum8x4(a[0], a[1], a[2], a[3], 1.f, p + j * S + t);
        hsum8x4(a[4], a[5], a[6], a[7], 1.f, p + j * S + t + 4);
      }
    }
    for (; t < S; ++t) {
      const E* k = K + t * W;
      for (int64_t j = 0; j < G; ++j) {
        const float* qj = q + j * W;
        v8f a0 = {};
        for (int64_t c = 0; c < W; c += 8) a0 += load8(qj + c) * load8(k + c);
        p[j * S + t] = hsum8(a0);
      }
    }
  } else {
    for (int64_t t = 0; t < S; ++t) {
      const E* k = K + t * W;
      for (int64_t j = 0; j < G; ++j) {
        const float* qj = q + j * W;
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int64_t c = 0; c < W; ++c) d += qj[c] * load(k[c]);
        p[j * S + t] = d;
      }
    }
  }
  for (int64_t i = 0; i < G * S; ++i) p[i] = (bf16 ? rnd<at::BFloat16>(p[i]) : p[i]) * scale;
  softmax_rows(p, G, S, nullptr);
  if (bf16)
    for (int64_t i = 0; i < G * S; ++i) p[i] = rnd<at::BFloat16>(p[i]);
  if (R % 32 == 0) {
    // up to 3 heads x 32 latent columns in 12 registers, each row converted once for them; in blocks of
    // rows that stay in the L2 while every column and head passes over them (over all S rows at once,
    // V2-Lite's 4096 positions were re-read from DRAM for each of the 16 x 3 passes: ~5x slower)
    const int64_t block = std::max<int64_t>(8, (int64_t(128) << 10) / (W * int64_t(sizeof(E))));
    for (int64_t t0 = 0; t0 < S; t0 += block) {
      const int64_t m = std::min(block, S - t0);
      const E* Kb = K + t0 * W;
      int64_t j = 0;
      for (; j + 3 <= G; j += 3) weigh_values<v8f, 3>(p + j * S + t0, m, Kb, R, o + j * R, W, S, t0 > 0);
      if (G - j == 2) weigh_values<v8f, 2>(p + j * S + t0, m, Kb, R, o + j * R, W, S, t0 > 0);
      if (G - j == 1) weigh_values<v8f, 1>(p + j * S + t0, m, Kb, R, o + j * R, W, S, t0 > 0);
    }
  } else {
    std::fill(o, o + G * R, 0.f);
    for (int64_t t = 0; t < S; ++t) {
      const E* k = K + t * W;
      for (int64_t j = 0; j < G; ++j) {
        const float w = p[j * S + t];
        float* oj = o + j * R;
#pragma omp simd
        for (int64_t c = 0; c < R; ++c) oj[c] += w * load(k[c]);
      }
    }
  }
  if (bf16)
    for (int64_t i = 0; i < G * R; ++i) o[i] = rnd<at::BFloat16>(o[i]);
}

TIERED_CLONES void latent_attend(const float* q, int64_t G, const float* K, int64_t S, int64_t W, int64_t R,
                                 float scale, bool bf16, float* p, float* kb, float* o) {
  latent_attend_impl(q, G, K, S, W, R, scale, bf16, p, kb, o);
}

TIERED_CLONES void latent_attend(const float* q, int64_t G, const uint16_t* K, int64_t S, int64_t W, int64_t R,
                                 float scale, bool bf16, float* p, float* kb, float* o) {
  latent_attend_impl(q, G, K, S, W, R, scale, bf16, p, kb, o);
}

// The absorbed products on kv_b_proj's fp32 weight itself (the lossless mode, where no bf16 per-head
// copies are made: LatentAttention.install_absorbed), one head at a time. Keys: q_lat [B, R] =
// W_UK^T q_nope, W_UK [n, R] the head's key rows, qn [B, n]. Values: out [B, v] (rows ldo apart) =
// W_UV o_lat, W_UV [v, R] the head's value rows, ol [B, R].
TIERED_CLONES void absorb_keys(const float* Wk, int64_t n, int64_t R, const float* qn, int64_t B, float* ql) {
  std::fill(ql, ql + B * R, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float* w = Wk + i * R;
    for (int64_t b = 0; b < B; ++b) {
      const float a = qn[b * n + i];
      float* y = ql + b * R;
#pragma omp simd
      for (int64_t c = 0; c < R; ++c) y[c] += a * w[c];
    }
  }
}

TIERED_CLONES void absorb_values(const float* Wv, int64_t v, int64_t R, const float* ol, int64_t B, float* out,
                                 int64_t ldo) {
  for (int64_t j = 0; j < v; ++j) {
    const float* w = Wv + j * R;
    for (int64_t b = 0; b < B; ++b) {
      const float* x = ol + b * R;
      float d = 0.f;
#pragma omp simd reduction(+ : d)
      for (int64_t c = 0; c < R; ++c) d += w[c] * x[c];
      out[b * ldo + j] = d;
    }
  }
}

// The cache's element type as the vector loops see it (bf16 as its bits).
template <typename T> struct Elem { using type = T; };
template <> struct Elem<at::BFloat16> { using type = uint16_t; };

// The int8 KV cache (kKvBlock above): the row layout of cache type C, its writer and a scratch reader.
template <typename C>
int64_t row_elems(int64_t hd) { return std::is_same_v<C, int8_t> ? q8_row(hd) : hd; }

inline void quantize_row(const float* x, int64_t hd, int8_t* q) {
  const int64_t bs = kv_block(hd);
  for (int64_t b0 = 0; b0 < hd; b0 += bs) {
    float amax = 0.f;
    for (int64_t i = b0; i < b0 + bs; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = amax / 127.f;
    for (int64_t i = b0; i < b0 + bs; ++i)
      q[i] = s > 0.f ? int8_t(std::clamp(std::nearbyint(x[i] / s), -127.f, 127.f)) : int8_t(0);
    std::memcpy(q + hd + int64_t(sizeof(float)) * (b0 / bs), &s, sizeof(float));
  }
}

// out [n, hd] fp32 = n packed int8 rows (hd values and their blocks' scales each, q8_row(hd) bytes apart) dequantized
TIERED_CLONES void dequantize_rows(const int8_t* q, int64_t n, int64_t hd, float* out) {
  const int64_t rs = q8_row(hd), bs = kv_block(hd);
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* r = q + t * rs;
    float* o = out + t * hd;
    for (int64_t b0 = 0; b0 < hd; b0 += bs) {
      const float s = block_scale(r, hd, b0);
#pragma omp simd
      for (int64_t i = b0; i < b0 + bs; ++i) o[i] = float(r[i]) * s;
    }
  }
}

// One forward's RoPE rows [B, rotary_dim] fp32: every layer's, and the local layers' own (set_local_rope; null
// where the model has none)
struct Rope {
  const float *cos, *sin, *local_cos, *local_sin;
};

class DecodeStep {
 public:
  // rotary_dim: RoPE rotates each q / k head's first rotary_dim features (rotate-half over them) and
  // leaves the rest as they are (a partial RoPE: GLM-4.5's partial_rotary_factor); 0 = head_dim.
  DecodeStep(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, int64_t window,
             int64_t rotary_dim)
      : D(hidden), H(heads), Hkv(kv_heads), hd(head_dim), rd(rotary_dim ? rotary_dim : head_dim),
        scale_(float(scale)), window_(window) {
    TIERED_CHECK(H % Hkv == 0 && hd % 2 == 0, "decode step: heads must be a multiple of kv heads, head_dim even");
    TIERED_CHECK(rd % 2 == 0 && 2 <= rd && rd <= hd, "decode step: rotary_dim must be even, in [2, head_dim], got ",
                rd);
  }

  void add_layer(const at::Tensor& in_norm, const at::Tensor& post_norm, double eps, std::vector<KernelPtr> qkv,
                 std::vector<KernelPtr> o, std::vector<KernelPtr> gate_up, std::vector<KernelPtr> down) {
    Layer L;
    L.in_norm = to_floats(in_norm);
    L.post_norm = to_floats(post_norm);
    L.eps = float(eps);
    L.qkv = Group(std::move(qkv));
    L.o = Group(std::move(o));
    L.gate_up = Group(std::move(gate_up));
    L.down = Group(std::move(down));
    if (L.qkv.empty()) {  // a placeholder for a layer the caller runs itself (never run here), or set_latent's
      layers_.push_back(std::move(L));
      return;
    }
    TIERED_CHECK(latent_width_ == 0, "decode step: a step of latent-attention layers takes no q/k/v layers");
    TIERED_CHECK(L.qkv.in == D && L.qkv.out == (H + 2 * Hkv) * hd, "decode step: q/k/v kernels are ", L.qkv.in,
                " -> ", L.qkv.out, ", expected ", D, " -> ", (H + 2 * Hkv) * hd);
    TIERED_CHECK(L.o.in == H * hd && L.o.out == D, "decode step: o_proj kernel has the wrong shape");
    if (!L.gate_up.empty())
      TIERED_CHECK(L.gate_up.in == D && L.gate_up.out % 2 == 0 && L.down.in == L.gate_up.out / 2 && L.down.out == D,
                  "decode step: gate/up and down kernels have the wrong shapes");
    layers_.push_back(std::move(L));
  }

  // Layer l's attention normalizes q and k (models/layers.Attention): RMSNorm weights q_norm and
  // k_norm over each head's head_dim elements (per_head: Qwen3) or over the whole q / k projection
  // (OLMoE), both empty for none; and clamps q, k and v to [-clip, clip] when clip > 0 (OLMoE's
  // clip_qkv), between the whole-projection norm and the per-head one, as the module does.
  void set_qk(int64_t l, const at::Tensor& q_norm, const at::Tensor& k_norm, double eps, bool per_head, double clip) {
    TIERED_CHECK(0 <= l && l < num_layers() && !layers_[l].qkv.empty(), "decode step: set_qk needs a layer, got ", l);
    Layer& L = layers_[l];
    if (q_norm.numel() || k_norm.numel()) {
      const int64_t nq = per_head ? hd : H * hd, nk = per_head ? hd : Hkv * hd;
      TIERED_CHECK(q_norm.numel() == nq && k_norm.numel() == nk, "decode step: q/k norm weights must have ", nq,
                  " and ", nk, " elements, got ", q_norm.numel(), " and ", k_norm.numel());
      L.q_norm = to_floats(q_norm);
      L.k_norm = to_floats(k_norm);
    }
    L.qk_eps = float(eps);
    L.qk_per_head = per_head;
    L.clip = clip > 0 ? float(clip) : 0.f;
  }

  // Layer l's attention (a q/k/v layer) attends only to each row's last `window` positions (> 0), to all
  // of them (0), or as the step's window says (-1); and with `sinks` [H] (gpt-oss's attention sinks,
  // models/gpt_oss.attend_with_sinks; empty: none) each query head's softmax has one more logit, its
  // sink, which takes weight and is dropped: o = sum_t e^(s_t) v_t / (sum_t e^(s_t) + e^(sink)).
  // The most bytes a prompt's attention holds as transposed keys (attention_runs; 32 MiB by default): past
  // it the KV heads go in batches, one head at least.
  void set_max_transposed_bytes(int64_t bytes) { max_transposed_ = bytes; }
  // Whether a prompt's runs of rows over a bf16 KV cache attend in bf16 on tiered's bf16 attention
  // (gemv::bf16_runs_attention: AMX, or AVX512-BF16) where it runs: the queries rounded to bf16, as the modules'
  // prompts attend (layers.set_prompt_attention)
  void set_prompt_attention_bf16(bool on) { prompt_bf16_ = on; }

  // Gemma's layers (models/gemma.GemmaDecoderLayer): layer l normalizes its attention's output with attn_out [D]
  // and its FFN's output with ffn_out [D] (RMSNorm, the layer's eps) before each residual add.
  void set_sandwich(int64_t l, const at::Tensor& attn_out, const at::Tensor& ffn_out) {
    TIERED_CHECK(0 <= l && l < num_layers() && !layers_[l].qkv.empty(), "decode step: set_sandwich needs a q/k/v ",
                "layer, got ", l);
    TIERED_CHECK(attn_out.numel() == D && ffn_out.numel() == D, "decode step: sandwich norms must be [", D, "]");
    layers_[l].attn_out_norm = to_floats(attn_out);
    layers_[l].ffn_out_norm = to_floats(ffn_out);
  }
  // Layer l's q and k rotate by forward's local_cos / local_sin (Gemma 3's sliding layers: their own RoPE base).
  void set_local_rope(int64_t l) {
    TIERED_CHECK(0 <= l && l < num_layers() && !layers_[l].qkv.empty(), "decode step: set_local_rope needs a q/k/v ",
                "layer, got ", l);
    layers_[l].local_rope = true;
  }
  // Layer l's attention logits are soft-capped: cap tanh(s / cap) before the softmax (Gemma 2; 0: none).
  void set_softcap(int64_t l, double cap) {
    TIERED_CHECK(0 <= l && l < num_layers() && !layers_[l].qkv.empty() && cap >= 0, "decode step: set_softcap needs ",
                "a q/k/v layer and a cap >= 0, got ", l, ", ", cap);
    layers_[l].softcap = float(cap);
  }
  // The dense FFNs' GLU activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU).
  void set_activation(const std::string& act) {
    TIERED_CHECK(act == "silu" || act == "gelu_tanh", "decode step: activation must be silu or gelu_tanh, got ", act);
    gelu_ = act == "gelu_tanh";
  }

  void set_attention(int64_t l, int64_t window, const at::Tensor& sinks) {
    TIERED_CHECK(0 <= l && l < num_layers() && !layers_[l].qkv.empty(), "decode step: set_attention needs a ",
                "q/k/v layer, got ", l);
    TIERED_CHECK(window >= -1, "decode step: window must be > 0, 0 (none) or -1 (the step's), got ", window);
    TIERED_CHECK(sinks.numel() == 0 || (sinks.dim() == 1 && sinks.numel() == H), "decode step: sinks must be [",
                H, "] or empty, got ", sinks.sizes());
    layers_[l].window = window;
    layers_[l].sinks = sinks.numel() ? to_floats(sinks) : std::vector<float>{};
  }

  // Layer l (added with no q/k/v kernels: add_layer's in_norm, post_norm, eps, o_proj and FFN) runs
  // DeepSeek's multi-head latent attention (models/deepseek.LatentAttention; DeepSeek-V2 §2.1) in its
  // absorbed decode form (Appendix C), with the step's head_dim as the RoPE key width r:
  //   q = W_q h (q: [H (n + r), D]), or W_qb norm(W_qa h) (q_a [q_lora, D], q_a_norm [q_lora], q_b);
  //   [c_kv | k_pe] = W_kva h (kv_a [R + r, D]), c_kv = norm(c_kv) (kv_a_norm [R]);
  //   RoPE on each head's q_pe and on k_pe (interleave: pairs gathered evens-then-odds first);
  //   [c_kv | k_pe] into the cache row (the cache is [L, slots, 1, max_len, R + r]);
  //   per head q_lat = W_UK^T q_nope, o_lat = softmax([q_lat | q_pe] . rows * scale) c_kv,
  //   out = W_UV o_lat: through uk / uv (H kernels each, n -> R and R -> v), or both empty and
  //   kv_b fp32 [H (n + v), R] (kv_b_proj's weight, read in place);
  //   x += W_o out.
  // Every layer of the step is then latent (or a placeholder): one cache layout.
  void set_latent(int64_t l, std::vector<KernelPtr> q, std::vector<KernelPtr> q_a, const at::Tensor& q_a_norm,
                  double q_a_eps, std::vector<KernelPtr> q_b, std::vector<KernelPtr> kv_a, const at::Tensor& kv_a_norm,
                  double kv_a_eps, std::vector<KernelPtr> uk, std::vector<KernelPtr> uv, const at::Tensor& kv_b,
                  double scale, bool interleave) {
    TIERED_CHECK(0 <= l && l < num_layers() && layers_[l].qkv.empty() && !layers_[l].o.empty(),
                "decode step: set_latent needs a layer added with no q/k/v kernels and an o_proj, got ", l);
    TIERED_CHECK(window_ == 0, "decode step: latent attention has no sliding window");
    TIERED_CHECK(rd == hd, "decode step: latent attention rotates its whole RoPE key (rotary_dim = head_dim)");
    for (const Layer& other : layers_)
      TIERED_CHECK(other.qkv.empty(), "decode step: a step of latent-attention layers takes no q/k/v layers");
    Layer& L = layers_[l];
    auto A = std::make_shared<Latent>();
    A->q = Group(std::move(q));
    A->q_a = Group(std::move(q_a));
    A->q_b = Group(std::move(q_b));
    A->kv_a = Group(std::move(kv_a));
    const int64_t r = hd;
    TIERED_CHECK(A->kv_a.in == D && A->kv_a.out > r && kv_a_norm.numel() == A->kv_a.out - r,
                "decode step: kv_a_proj_with_mqa must be [R + ", r, ", ", D, "] and kv_a_layernorm [R]");
    A->R = A->kv_a.out - r;
    if (A->q.empty()) {
      TIERED_CHECK(!A->q_a.empty() && A->q_a.in == D && q_a_norm.numel() == A->q_a.out && A->q_b.in == A->q_a.out,
                  "decode step: a latent layer needs q_proj, or q_a_proj [q_lora, ", D,
                  "], q_a_layernorm [q_lora] and q_b_proj [H (n + r), q_lora]");
      A->q_a_norm = to_floats(q_a_norm);
      A->q_a_eps = float(q_a_eps);
    } else {
      TIERED_CHECK(A->q.in == D && A->q_a.empty() && A->q_b.empty(), "decode step: q_proj must be [H (n + r), ", D,
                  "] (and no q_a / q_b beside it)");
    }
    const Group& qg = A->q.empty() ? A->q_b : A->q;
    TIERED_CHECK(qg.out % H == 0 && qg.out / H > r, "decode step: the query projection gives ", qg.out,
                " values, not H (n + r) for ", H, " heads with r = ", r);
    A->n = qg.out / H - r;
    TIERED_CHECK(L.o.in % H == 0 && L.o.out == D, "decode step: o_proj must be [", D, ", H v]");
    A->v = L.o.in / H;
    const int64_t R = A->R, n = A->n, v = A->v;
    TIERED_CHECK(uk.size() == uv.size() && (uk.empty() || int64_t(uk.size()) == H),
                "decode step: the absorbed kernels must be H = ", H, " per half, or none");
    for (int64_t h = 0; h < int64_t(uk.size()); ++h)
      TIERED_CHECK(uk[h] && uv[h] && uk[h]->in_features == n && uk[h]->out_features == R && uv[h]->in_features == R &&
                      uv[h]->out_features == v,
                  "decode step: absorbed kernels must map n = ", n, " -> R = ", R, " (keys) and R -> v = ", v,
                  " (values)");
    if (uk.empty()) {
      TIERED_CHECK(kv_b.dim() == 2 && kv_b.scalar_type() == at::kFloat && kv_b.is_contiguous() && kv_b.is_cpu() &&
                      kv_b.size(0) == H * (n + v) && kv_b.size(1) == R,
                  "decode step: without absorbed kernels kv_b must be contiguous float32 [", H * (n + v), ", ", R, "]");
      A->kv_b = kv_b;
      A->kvb = kv_b.data_ptr<float>();
    }
    A->uk = std::move(uk);
    A->uv = std::move(uv);
    A->kv_a_norm = to_floats(kv_a_norm);
    A->kv_a_eps = float(kv_a_eps);
    A->scale = float(scale);
    A->interleave = interleave;
    if (!L.gate_up.empty())
      TIERED_CHECK(L.gate_up.in == D && L.gate_up.out % 2 == 0 && L.down.in == L.gate_up.out / 2 && L.down.out == D,
                  "decode step: gate/up and down kernels have the wrong shapes");
    TIERED_CHECK(latent_width_ == 0 || latent_width_ == R + r, "decode step: latent layers of different widths");
    latent_width_ = R + r;
    L.mla = std::move(A);
  }

  // Layer l's FFN becomes a MoE block run in the step: router weight [E, D], top_k, norm_topk_prob,
  // every expert's kernels (BoundExperts, E of them), the shared expert (gate/up, down; all empty:
  // none) with its [1, D] gate kernel (Qwen-MoE: out + sigmoid(gate h) shared(h)) or none (DeepSeek's
  // shared experts: out + shared(h)), and the routing rule (route_row):
  //   method "softmax": models/moe.Router (logits rounded to the model's dtype, as it computes them);
  //   "greedy", "group_limited_greedy", "noaux_tc": models/deepseek.DeepSeekRouter's topk_method
  //   (fp32 logits), over n_group groups of which topk_group are kept (grouped methods), bias [E] fp32
  //   (noaux_tc's e_score_correction_bias; none otherwise), every weight times `scaling`.
  // gpt-oss (models/gpt_oss.py): router_bias [E] added to the "softmax" method's logits (its top-k
  // softmaxed among themselves = the full softmax's top k renormalized, norm_topk_prob), and
  // swiglu_limit > 0: the experts are its biased clamped-GLU ones (gemv::Glu; their kernels Db / Fb
  // wide, the bias an input column), with swiglu_alpha; 0: SiLU's SwiGLU.
  // Routing hooks and the trace are the caller's: it runs such steps through the block's module instead.
  void set_moe(int64_t l, const at::Tensor& router, int64_t top_k, bool norm_topk,
               std::shared_ptr<gemv::BoundExperts> experts, std::vector<KernelPtr> shared_gate_up,
               std::vector<KernelPtr> shared_down, std::vector<KernelPtr> shared_gate, const std::string& method,
               int64_t n_group, int64_t topk_group, double scaling, c10::optional<at::Tensor> bias,
               c10::optional<at::Tensor> router_bias, double swiglu_limit, double swiglu_alpha, int64_t amx_rows) {
    TIERED_CHECK(0 <= l && l < num_layers() && layers_[l].runs() && layers_[l].gate_up.empty(),
                "decode step: set_moe needs an attention-only layer, got ", l);
    TIERED_CHECK(router.dim() == 2 && router.size(1) == D, "decode step: the router must be [E, ", D, "]");
    const int64_t E = router.size(0);
    const bool glu = swiglu_limit > 0;  // gpt-oss's experts: input width Db, the bias column, then zeros
    const int64_t width = glu ? (D + 32) / 32 * 32 : D;  // ModelConfig.expert_shapes' biased_width(D)
    TIERED_CHECK(experts && experts->num_experts() == E && experts->hidden() == width, "decode step: ", E,
                " experts of input width ", width, " expected");
    TIERED_CHECK(!glu || (experts->k[2]->out_features == D && experts->k[2]->in_features > experts->k[0]->out_features),
                "decode step: gpt-oss experts' down projections must be [", D, ", Fb] with Fb > F");
    TIERED_CHECK(1 <= top_k && top_k <= E, "decode step: top_k must be in [1, ", E, "]");
    auto m = std::make_shared<Moe>();
    const std::pair<const char*, Routing> methods[] = {{"softmax", Routing::kSoftmax}, {"greedy", Routing::kGreedy},
        {"group_limited_greedy", Routing::kGroupLimitedGreedy}, {"noaux_tc", Routing::kNoauxTc}};
    auto it = std::find_if(std::begin(methods), std::end(methods), [&](const auto& p) { return method == p.first; });
    TIERED_CHECK(it != std::end(methods), "decode step: unknown routing method '", method,
                "' (softmax, greedy, group_limited_greedy or noaux_tc)");
    m->method = it->second;
    const bool grouped = m->method == Routing::kGroupLimitedGreedy || m->method == Routing::kNoauxTc;
    TIERED_CHECK(grouped || (n_group == 1 && topk_group == 1), "decode step: routing method '", method,
                "' takes no groups, got n_group ", n_group, ", topk_group ", topk_group);
    TIERED_CHECK(n_group >= 1 && E % n_group == 0, "decode step: ", E, " experts do not split into n_group = ",
                n_group, " groups");
    TIERED_CHECK(1 <= topk_group && topk_group <= n_group, "decode step: topk_group must be in [1, ", n_group,
                "], got ", topk_group);
    TIERED_CHECK(n_group == 1 || top_k <= topk_group * (E / n_group), "decode step: top_k = ", top_k,
                " exceeds the ", topk_group * (E / n_group), " experts of the topk_group kept groups");
    TIERED_CHECK(m->method != Routing::kNoauxTc || n_group == 1 || E / n_group >= 2,
                "decode step: noaux_tc scores a group by its two best experts: groups need 2 or more, got ",
                E / n_group);
    TIERED_CHECK(std::isfinite(scaling) && scaling > 0, "decode step: the routed scaling must be > 0, got ", scaling);
    TIERED_CHECK(m->method != Routing::kSoftmax || scaling == 1.0,
                "decode step: routing method 'softmax' has no routed scaling, got ", scaling);
    const bool has_bias = bias && bias->defined() && bias->numel() > 0;
    TIERED_CHECK(has_bias == (m->method == Routing::kNoauxTc), "decode step: noaux_tc takes a bias [E] ",
                "(e_score_correction_bias), the other methods none");
    if (has_bias) {
      TIERED_CHECK(bias->dim() == 1 && bias->numel() == E, "decode step: the bias must be [", E, "], got ",
                  bias->sizes());
      m->bias = to_floats(*bias);
    }
    if (router_bias && router_bias->numel()) {
      TIERED_CHECK(router_bias->dim() == 1 && router_bias->numel() == E && m->method == Routing::kSoftmax,
                  "decode step: router_bias must be [", E, "] (softmax routing only), got ", router_bias->sizes());
      m->router_bias = to_floats(*router_bias);
    }
    if (glu) {
      TIERED_CHECK(std::isfinite(swiglu_alpha) && std::isfinite(swiglu_limit), "decode step: bad swiglu limit / alpha");
      m->glu = std::make_unique<gemv::Glu>(gemv::Glu{float(swiglu_limit), float(swiglu_alpha)});
    }
    m->router = to_floats(router);
    m->top_k = top_k, m->norm_topk = norm_topk, m->experts = std::move(experts), m->amx_rows = std::max<int64_t>(0, amx_rows);
    m->n_group = n_group, m->topk_group = topk_group, m->scaling = float(scaling);
    m->shared_gu = Group(std::move(shared_gate_up));
    m->shared_down = Group(std::move(shared_down));
    m->shared_gate = Group(std::move(shared_gate));
    TIERED_CHECK(!m->shared_gu.empty() || (m->shared_down.empty() && m->shared_gate.empty()),
                "decode step: shared_down / shared_gate given without shared_gate_up");
    if (!m->shared_gu.empty())
      TIERED_CHECK(m->shared_gu.in == D && m->shared_gu.out % 2 == 0 && m->shared_down.in == m->shared_gu.out / 2 &&
                      m->shared_down.out == D &&
                      (m->shared_gate.empty() || (m->shared_gate.in == D && m->shared_gate.out == 1)),
                  "decode step: the shared expert's kernels (gate/up [2F, ", D, "], down [", D,
                  ", F], gate [1, ", D, "] or none) have the wrong shapes");
    layers_[l].moe = std::move(m);
  }

  // Layer l's routing rule (set_moe) on logits fp32 [N, E]: (idx int64 [N, k], weight fp32 [N, k]), the
  // best choice first, the weights before the step rounds them to the model's dtype. For tests: the
  // step itself routes its rows in moe_block.
  std::tuple<at::Tensor, at::Tensor> route(int64_t l, const at::Tensor& logits) {
    TIERED_CHECK(0 <= l && l < num_layers() && layers_[l].moe, "decode step: layer ", l, " has no set_moe");
    const Moe& m = *layers_[l].moe;
    const int64_t E = m.experts->num_experts(), k = m.top_k;
    TIERED_CHECK(logits.dim() == 2 && logits.size(1) == E && logits.scalar_type() == at::kFloat,
                "decode step: logits must be float32 [N, ", E, "]");
    auto lf = logits.contiguous();
    const int64_t N = lf.size(0);
    auto idx = at::empty({N, k}, at::TensorOptions().dtype(at::kLong));
    auto wt = at::empty({N, k}, at::TensorOptions().dtype(at::kFloat));
    for (int64_t b = 0; b < N; ++b)
      route_row(m, lf.data_ptr<float>() + b * E, E, idx.data_ptr<int64_t>() + b * k, wt.data_ptr<float>() + b * k);
    return {idx, wt};
  }

  // Routed experts the step's MoE layers have run since the last call (distinct experts per layer
  // and step, summed: the runner's resident uses), then zero.
  int64_t take_moe_uses() { return std::exchange(moe_uses_, 0); }

  void set_head(const at::Tensor& norm, double eps, KernelPtr lm_head) {
    final_norm_ = to_floats(norm);
    final_eps_ = float(eps);
    lm_head_ = std::move(lm_head);
    TIERED_CHECK(lm_head_->in_features == D, "decode step: lm_head kernel has the wrong input width");
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // x [B, D] (model dtype, updated in place); cos, sin [B, rotary_dim] fp32; slots, positions int64 [B];
  // k_cache, v_cache [L, num_slots, Hkv, max_len, hd] in x's dtype, or bfloat16 beside float32 x (the
  // plan's 16-bit KV cache under quantized decode weights: half the bytes each step's attention
  // streams; keys and values are rounded to bf16 as they are written); latent layers' (set_latent) k
  // [L, num_slots, 1, max_len, R + r] and v [..., 0]. Runs layers [first, last); a layer with set_moe
  // runs its MoE block too when `moe` (float32 or bfloat16 x), else attention only. post_norm [B, D]
  // (x's dtype), when given, receives the last layer's post-attention RMSNorm of the new x: the input
  // of the FFN module its caller runs (a latent layer's rounded as models/layers.RMSNorm rounds).
  void forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
               const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache, int64_t first, int64_t last,
               bool moe = true, c10::optional<at::Tensor> post_norm = c10::nullopt,
               c10::optional<at::Tensor> local_cos = c10::nullopt, c10::optional<at::Tensor> local_sin = c10::nullopt) {
    TIERED_CHECK(x.dim() == 2 && x.size(1) == D && x.is_contiguous(), "decode step: x must be contiguous [B, ", D, "]");
    TIERED_CHECK(0 <= first && first <= last && last <= num_layers(), "decode step: bad layer range");
    TIERED_CHECK(!post_norm || (first < last && post_norm->sizes() == x.sizes() && post_norm->is_contiguous() &&
                                post_norm->scalar_type() == x.scalar_type()),
                "decode step: post_norm must be contiguous, x's shape and dtype, after at least one layer");
    const bool bf16_cache = x.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;
    const bool int8_cache = k_cache.scalar_type() == at::kChar;
    TIERED_CHECK(!int8_cache || (!latent_width_ && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)),
                "decode step: an int8 KV cache needs float32 or bfloat16 x and plain (not latent) attention");
    TIERED_CHECK((k_cache.scalar_type() == x.scalar_type() || bf16_cache || int8_cache) &&
                v_cache.scalar_type() == k_cache.scalar_type() &&
                k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 5 &&
                (latent_width_ ? k_cache.size(2) == 1 && k_cache.size(4) == latent_width_
                               : k_cache.size(2) == Hkv && k_cache.size(4) == (int8_cache ? q8_row(hd) : hd)),
                "decode step: the KV cache must be contiguous [L, slots, Hkv, max_len, hd] in x's dtype "
                "(or bfloat16 beside float32 x, or int8 rows of hd values and a float32 scale per block of 32 "
                "values: [..., hd + hd / 8]); "
                "latent attention's k [L, slots, 1, max_len, R + r]");
    TIERED_CHECK(!latent_width_ || x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "decode step: latent attention runs in float32 or bfloat16, got ", x.scalar_type());
    const int64_t B = x.size(0);
    auto c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
    auto sl = slots.to(at::kLong).contiguous(), ps = positions.to(at::kLong).contiguous();
    TIERED_CHECK(c.numel() == B * rd && s.numel() == B * rd && sl.numel() == B && ps.numel() == B,
                "decode step: cos/sin must be [B, rotary_dim], slots/positions [B]");
    at::Tensor lc, ls;  // the local layers' RoPE tables (set_local_rope), [B, rotary_dim]
    if (local_cos && local_sin) {
      lc = local_cos->to(at::kFloat).contiguous(), ls = local_sin->to(at::kFloat).contiguous();
      TIERED_CHECK(lc.numel() == B * rd && ls.numel() == B * rd, "decode step: local_cos/sin must be [B, rotary_dim]");
    }
    for (int64_t l = first; l < last; ++l)
      TIERED_CHECK(!layers_[l].local_rope || lc.defined(), "decode step: layer ", l, " rotates by local_cos / local_sin");
    const Rope rope{c.data_ptr<float>(), s.data_ptr<float>(), lc.defined() ? lc.data_ptr<float>() : nullptr,
                    ls.defined() ? ls.data_ptr<float>() : nullptr};
    for (int64_t l = first; l < last; ++l)
      TIERED_CHECK(layers_[l].runs(), "decode step: layer ", l, " is a placeholder (its caller runs it)");
    for (int64_t l = first; l < last && moe; ++l)
      TIERED_CHECK(!layers_[l].moe || x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                  "decode step: a MoE layer runs in float32 or bfloat16, got ", x.scalar_type());
    const int64_t n_slots = k_cache.size(1), max_len = k_cache.size(3);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t slot = sl.data_ptr<int64_t>()[b], pos = ps.data_ptr<int64_t>()[b];
      TIERED_CHECK(0 <= slot && slot < n_slots && 0 <= pos && pos < max_len, "decode step: slot ", slot,
                  " / position ", pos, " outside the KV cache");
    }
    pybind11::gil_scoped_release nogil;
    RECORD_FUNCTION("tiered::decode_layers", std::vector<c10::IValue>());  // its self time: the glue
    if (int8_cache) {
      int8_t* kq = k_cache.data_ptr<int8_t>();
      int8_t* vq = v_cache.data_ptr<int8_t>();
      const int64_t* sp = sl.data_ptr<int64_t>();
      const int64_t* pp = ps.data_ptr<int64_t>();
      if (x.scalar_type() == at::kFloat)
        run<float, int8_t>(x.data_ptr<float>(), B, rope, sp, pp, kq, vq, n_slots, max_len, first, last, moe,
                           post_norm ? post_norm->data_ptr<float>() : nullptr);
      else
        run<at::BFloat16, int8_t>(x.data_ptr<at::BFloat16>(), B, rope, sp, pp, kq, vq, n_slots, max_len, first, last,
                                  moe, post_norm ? post_norm->data_ptr<at::BFloat16>() : nullptr);
      return;
    }
    if (bf16_cache) {
      run<float, at::BFloat16>(x.data_ptr<float>(), B, rope,
                               sl.data_ptr<int64_t>(), ps.data_ptr<int64_t>(), k_cache.data_ptr<at::BFloat16>(),
                               v_cache.data_ptr<at::BFloat16>(), n_slots, max_len, first, last, moe,
                               post_norm ? post_norm->data_ptr<float>() : nullptr);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "tiered_decode", [&] {
      run<scalar_t, scalar_t>(x.data_ptr<scalar_t>(), B, rope,
                              sl.data_ptr<int64_t>(), ps.data_ptr<int64_t>(), k_cache.data_ptr<scalar_t>(),
                              v_cache.data_ptr<scalar_t>(), n_slots, max_len, first, last, moe,
                              post_norm ? post_norm->data_ptr<scalar_t>() : nullptr);
    });
  }

  // x [B, D] model dtype -> logits [B, V] fp32: the final RMSNorm and the lm_head kernel.
  at::Tensor logits(const at::Tensor& x) {
    TIERED_CHECK(lm_head_, "decode step: no lm_head (set_head)");
    TIERED_CHECK(x.dim() == 2 && x.size(1) == D, "decode step: x must be [B, ", D, "]");
    const int64_t B = x.size(0);
    auto xf = x.to(at::kFloat).contiguous();
    auto out = at::empty({B, lm_head_->out_features}, at::TensorOptions().dtype(at::kFloat));
    pybind11::gil_scoped_release nogil;
    std::vector<float> h(B * D);
    const bool low = x.scalar_type() != at::kFloat;
    for (int64_t b = 0; b < B; ++b) {
      rms_norm(xf.data_ptr<float>() + b * D, final_norm_.data(), final_eps_, D, h.data() + b * D);
      if (low) round_rows(x.scalar_type(), h.data() + b * D, D);
    }
    run_one(*lm_head_, h.data(), B, out.data_ptr<float>());
    return out;
  }

 private:
  // y_b = norm(y_b) with w, rounded to T, for each of the B rows (set_sandwich's output norms)
  template <typename T>
  void out_norm(const std::vector<float>& w, float eps, int64_t B, float* y) const {
    each_row(B, [&](int64_t b) {
      float* yb = y + b * D;
      rms_norm(yb, w.data(), eps, D, yb);
      for (int64_t i = 0; i < D; ++i) yb[i] = rnd<T>(yb[i]);
    });
  }

  static void round_rows(at::ScalarType t, float* v, int64_t n) {
    if (t == at::kBFloat16) for (int64_t i = 0; i < n; ++i) v[i] = rnd<at::BFloat16>(v[i]);
    else if (t == at::kHalf) for (int64_t i = 0; i < n; ++i) v[i] = rnd<at::Half>(v[i]);
  }

  // fn(b) for every row b in [0, B): across torch's threads from parallel_rows() rows on, else on this thread. A
  // row's glue a layer (norms, RoPE, the KV write, SwiGLU) takes about a fork / join's time (~1-2 us) at a few
  // thousand residual elements: from kParallelRows rows, and from kParallelElems elements (rows x D) where D is
  // small. SmolLM2 (D 576) decoded 4 / 6 / 8 sequences at 842 -> 874, 918 -> 945 and 1152 -> 1080 tok/s with its
  // glue on one thread (2 Sapphire Rapids cores, 2026-12-06; 5 and 7 within 1%): from 8 rows now.
  static constexpr int64_t kParallelRows = 4, kParallelElems = 4608;
  int64_t parallel_rows() const { return std::max<int64_t>(kParallelRows, (kParallelElems + D - 1) / D); }
  template <typename Fn>
  void each_row(int64_t B, const Fn& fn) const {
    if (B < parallel_rows()) {
      for (int64_t b = 0; b < B; ++b) fn(b);
      return;
    }
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) fn(b);
    });
  }

  // The glue runs row-parallel in four regions a layer: [x += y; h = norm(x)] (the previous
  // layer's FFN residual with this layer's input norm), RoPE and the KV write, [x += y; h = norm(x)]
  // (the attention residual with the post-attention norm), SwiGLU; attention splits its key rows over the threads (split-K).
  template <typename T, typename C>
  void run(T* xs, int64_t B, const Rope& rope, const int64_t* slots, const int64_t* pos, C* kc,
           C* vc, int64_t n_slots, int64_t max_len, int64_t first, int64_t last, bool moe, T* hs) {
    const int64_t QK = (H + Hkv) * hd, QKV = (H + 2 * Hkv) * hd, half = rd / 2;
    std::vector<float> x(B * D), h(B * D), qkv(B * QKV), att(B * H * hd), y(B * D), tmp;
    for (int64_t i = 0; i < B * D; ++i) x[i] = float(xs[i]);
    // x_b += y_b (when add), rounded; then h_b = norm(x_b) with `w`, rounded
    // (module_order: as models/layers.RMSNorm rounds, qk_norm: the latent layers, which replace it)
    auto residual_norm = [&](bool add, const std::vector<float>& w, float eps, bool module_order = false) {
      each_row(B, [&](int64_t b) {
        float* xb = x.data() + b * D;
        if (add) {
          const float* yb = y.data() + b * D;
          for (int64_t i = 0; i < D; ++i) xb[i] = rnd<T>(xb[i] + yb[i]);
        }
        float* hb = h.data() + b * D;
        if (module_order) {
          std::copy(xb, xb + D, hb);
          qk_norm<T>(hb, D, w.data(), eps);
          return;
        }
        rms_norm(xb, w.data(), eps, D, hb);
        for (int64_t i = 0; i < D; ++i) hb[i] = rnd<T>(hb[i]);
      });
    };
    bool pending = false;  // y holds the previous layer's FFN output, not yet added to x
    for (int64_t l = first; l < last; ++l) {
      const Layer& L = layers_[l];
      // attention: h = norm(x); qkv = W_qkv h
      residual_norm(pending, L.in_norm, L.eps, L.mla != nullptr);
      pending = false;
      if (L.mla) {
        latent_attention<T, C>(L, l, B, h.data(), rope.cos, rope.sin, slots, pos, kc, n_slots, max_len, y.data());
      } else {
        L.qkv.run(h.data(), B, qkv.data(), tmp);
        // RoPE on q and k (rotate-half over each head's first rd features; the rest, a partial
        // RoPE's, pass through), rounded to the model's dtype; then k, v into the cache
        each_row(B, [&](int64_t b) {
          const float* cb = (L.local_rope ? rope.local_cos : rope.cos) + b * rd;
          const float* sb = (L.local_rope ? rope.local_sin : rope.sin) + b * rd;
          float* r = qkv.data() + b * QKV;
          if (L.extras()) qk_extras<T>(L, r);
          for (int64_t j = 0; j < H + Hkv; ++j) {
            float* v = r + j * hd;
            for (int64_t i = 0; i < half; ++i) {
              const float x1 = v[i], x2 = v[i + half];
              v[i] = rnd<T>(x1 * cb[i] - x2 * sb[i]);
              v[i + half] = rnd<T>(x2 * cb[i + half] + x1 * sb[i + half]);
            }
            for (int64_t i = rd; i < hd; ++i) v[i] = rnd<T>(v[i]);
          }
          for (int64_t g = 0; g < Hkv; ++g) {
            const int64_t at_ = (((l * n_slots + slots[b]) * Hkv + g) * max_len + pos[b]) * row_elems<C>(hd);
            if constexpr (std::is_same_v<C, int8_t>) {
              quantize_row(r + H * hd + g * hd, hd, kc + at_);
              quantize_row(r + QK + g * hd, hd, vc + at_);
            } else {
              for (int64_t i = 0; i < hd; ++i) {
                kc[at_ + i] = C(r[H * hd + g * hd + i]);
                vc[at_ + i] = C(r[QK + g * hd + i]);
              }
            }
          }
        });
        attention<T, C>(l, B, qkv.data(), kc, vc, slots, pos, n_slots, max_len, att.data());
        L.o.run(att.data(), B, y.data(), tmp);
        if (!L.attn_out_norm.empty()) out_norm<T>(L.attn_out_norm, L.eps, B, y.data());
      }
      if (L.moe && moe) {  // x += the routed experts' weighted sum of norm(x)
        residual_norm(true, L.post_norm, L.eps, L.mla != nullptr);
        moe_block<T>(*L.moe, B, h.data(), y.data());
        pending = true;
        continue;
      }
      if (L.gate_up.empty()) {  // attention only: the caller runs this layer's FFN
        each_row(B, [&](int64_t b) {
          for (int64_t i = b * D; i < (b + 1) * D; ++i) x[i] = rnd<T>(x[i] + y[i]);
        });
        continue;
      }
      // FFN: x += W_down (silu(g) * u), [g | u] = W_gu norm(x)
      residual_norm(true, L.post_norm, L.eps, L.mla != nullptr);
      const int64_t F = L.down.in;
      gu_.resize(B * 2 * F);
      act_.resize(B * F);
      L.gate_up.run(h.data(), B, gu_.data(), tmp);
      each_row(B, [&](int64_t b) {
        const float* g = gu_.data() + b * 2 * F;
        float* a = act_.data() + b * F;
        if (gelu_) return gelu_tanh_mul(g, g + F, a, F);
        if (std::is_same<T, float>::value || !L.mla) return silu_mul(g, g + F, a, F);
        for (int64_t i = 0; i < F; ++i) {  // a latent layer's MLP module in T: g, u, silu(g), the product rounded
          const float gi = rnd<T>(g[i]), ui = rnd<T>(g[F + i]);
          a[i] = rnd<T>(rnd<T>(gi / (1.f + std::exp(-gi))) * ui);
        }
      });
      L.down.run(act_.data(), B, y.data(), tmp);
      if (!L.ffn_out_norm.empty()) out_norm<T>(L.ffn_out_norm, L.eps, B, y.data());
      if (L.mla)
        for (int64_t i = 0; i < B * D; ++i) y[i] = rnd<T>(y[i]);
      pending = true;
    }
    if (pending)
      each_row(B, [&](int64_t b) {
        for (int64_t i = b * D; i < (b + 1) * D; ++i) x[i] = rnd<T>(x[i] + y[i]);
      });
    for (int64_t i = 0; i < B * D; ++i) xs[i] = T(x[i]);
    if (hs) {  // the last layer's post-attention norm of x, for the caller's FFN module
      const Layer& L = layers_[last - 1];
      residual_norm(false, L.post_norm, L.eps, L.mla != nullptr);
      for (int64_t i = 0; i < B * D; ++i) hs[i] = T(h[i]);
    }
  }

  // y [B, D] = W_o (latent attention of h [B, D]) for latent layer l (set_latent), rounded to T, its
  // cache rows written; as models/deepseek.LatentAttention computes a decode step: each projection's
  // output, the normed latents, RoPE's outputs, q_lat, the scores before the scale, the
  // probabilities, o_lat and W_UV o_lat rounded to T where the module rounds them (identities in
  // fp32). The heads are split over the threads: each thread's heads take their absorbed queries,
  // attend over each row's cached positions (every row read once for them) and map their weighted
  // latents back, in one parallel region a layer (the kernels inside run on their caller's thread).
  template <typename T, typename C>
  void latent_attention(const Layer& L, int64_t l, int64_t B, const float* h, const float* cos, const float* sin,
                        const int64_t* slots, const int64_t* pos, C* kc, int64_t n_slots, int64_t max_len, float* y) {
    if constexpr (!(std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) ||
                  !(std::is_same_v<C, float> || std::is_same_v<C, at::BFloat16>)) {
      TIERED_CHECK(false, "decode step: latent attention runs in float32 or bfloat16");
    } else {
      using E = typename Elem<C>::type;
      constexpr bool low = std::is_same_v<T, at::BFloat16>;
      const Latent& A = *L.mla;
      const int64_t R = A.R, r = hd, n = A.n, v = A.v, W = R + r, QW = H * (n + r), half = r / 2;
      std::vector<float> q(B * QW), kv(B * W), att(B * H * v), qa, tmp;
      // q [B, H (n + r)]: W_q h, or W_qb norm(W_qa h); [c_kv | k_pe] [B, R + r] = W_kva h
      if (A.q.empty()) {
        const int64_t QA = A.q_a.out;
        qa.resize(B * QA);
        A.q_a.run(h, B, qa.data(), tmp);
        each_row(B, [&](int64_t b) {
          float* z = qa.data() + b * QA;
          for (int64_t i = 0; i < QA; ++i) z[i] = rnd<T>(z[i]);
          qk_norm<T>(z, QA, A.q_a_norm.data(), A.q_a_eps);
        });
        A.q_b.run(qa.data(), B, q.data(), tmp);
      } else {
        A.q.run(h, B, q.data(), tmp);
      }
      A.kv_a.run(h, B, kv.data(), tmp);
      // the latent normed; RoPE on k_pe and each head's q_pe; [c_kv | k_pe] into the row's cache row
      each_row(B, [&](int64_t b) {
        float* qb = q.data() + b * QW;
        float* kb = kv.data() + b * W;
        for (int64_t i = 0; i < QW; ++i) qb[i] = rnd<T>(qb[i]);
        for (int64_t i = 0; i < W; ++i) kb[i] = rnd<T>(kb[i]);
        qk_norm<T>(kb, R, A.kv_a_norm.data(), A.kv_a_eps);
        const float* cb = cos + b * r;
        const float* sb = sin + b * r;
        std::vector<float> g(r);
        auto rope = [&](float* z) {
          if (A.interleave) {  // (x0, x1), (x2, x3), .. -> x0, x2, .., x1, x3, ..: then rotate-half
            for (int64_t i = 0; i < half; ++i) g[i] = z[2 * i], g[half + i] = z[2 * i + 1];
            std::copy(g.begin(), g.end(), z);
          }
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = z[i], x2 = z[i + half];
            z[i] = rnd<T>(x1 * cb[i] - x2 * sb[i]);
            z[i + half] = rnd<T>(x2 * cb[i + half] + x1 * sb[i + half]);
          }
        };
        rope(kb + R);
        for (int64_t j = 0; j < H; ++j) rope(qb + j * (n + r) + n);
        C* row = kc + ((l * n_slots + slots[b]) * max_len + pos[b]) * W;
        for (int64_t i = 0; i < W; ++i) row[i] = C(kb[i]);
      });
      at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
        const int64_t G = h1 - h0;
        std::vector<float> qf(B * G * W), ol(B * G * R), xin(B * std::max(n, R)), yout(B * std::max(R, v)), p,
            kbuf(8 * W);
        for (int64_t j = 0; j < G; ++j) {  // qf [B, G, W]: [W_UK^T q_nope | q_pe] of each head
          const int64_t hh = h0 + j;
          for (int64_t b = 0; b < B; ++b)
            std::memcpy(xin.data() + b * n, q.data() + b * QW + hh * (n + r), n * sizeof(float));
          if (A.uk.empty())
            absorb_keys(A.kvb + hh * (n + v) * R, n, R, xin.data(), B, yout.data());
          else
            A.uk[hh]->run(xin.data(), B, yout.data());
          for (int64_t b = 0; b < B; ++b) {
            float* dst = qf.data() + (b * G + j) * W;
            for (int64_t c = 0; c < R; ++c) dst[c] = rnd<T>(yout[b * R + c]);
            std::memcpy(dst + R, q.data() + b * QW + hh * (n + r) + n, r * sizeof(float));
          }
        }
        for (int64_t b = 0; b < B; ++b) {  // ol [B, G, R]: the weighted latents over positions 0..pos[b]
          const int64_t S = pos[b] + 1;
          p.resize(G * S);
          const C* rows = kc + (l * n_slots + slots[b]) * max_len * W;
          latent_attend(qf.data() + b * G * W, G, reinterpret_cast<const E*>(rows), S, W, R, A.scale, low, p.data(),
                        kbuf.data(), ol.data() + b * G * R);
        }
        for (int64_t j = 0; j < G; ++j) {  // att [B, H v]: W_UV o_lat of each head
          const int64_t hh = h0 + j;
          for (int64_t b = 0; b < B; ++b)
            std::memcpy(xin.data() + b * R, ol.data() + (b * G + j) * R, R * sizeof(float));
          float* out = att.data() + hh * v;
          if (A.uv.empty()) {
            absorb_values(A.kvb + (hh * (n + v) + n) * R, v, R, xin.data(), B, out, H * v);
          } else {
            A.uv[hh]->run(xin.data(), B, yout.data());
            for (int64_t b = 0; b < B; ++b) std::memcpy(out + b * H * v, yout.data() + b * v, v * sizeof(float));
          }
          for (int64_t b = 0; b < B; ++b)
            for (int64_t c = 0; c < v; ++c) out[b * H * v + c] = rnd<T>(out[b * H * v + c]);
        }
      });
      L.o.run(att.data(), B, y, tmp);
      for (int64_t i = 0; i < B * D; ++i) y[i] = rnd<T>(y[i]);
    }
  }

  // One row's q, k, v (r [(H + 2 Hkv) hd], the fused projection's fp32 outputs) as the module has
  // them before RoPE: rounded to T; the whole-projection norms; the clip; the per-head norms.
  template <typename T>
  void qk_extras(const Layer& L, float* r) const {
    const int64_t QKV = (H + 2 * Hkv) * hd;
    for (int64_t i = 0; i < QKV; ++i) r[i] = rnd<T>(r[i]);
    const bool norm = !L.q_norm.empty();
    if (norm && !L.qk_per_head) {
      qk_norm<T>(r, H * hd, L.q_norm.data(), L.qk_eps);
      qk_norm<T>(r + H * hd, Hkv * hd, L.k_norm.data(), L.qk_eps);
    }
    if (L.clip > 0.f)
      for (int64_t i = 0; i < QKV; ++i) r[i] = std::min(std::max(r[i], -L.clip), L.clip);
    if (norm && L.qk_per_head)
      for (int64_t j = 0; j < H + Hkv; ++j) qk_norm<T>(r + j * hd, hd, (j < H ? L.q_norm : L.k_norm).data(), L.qk_eps);
  }

  // v [n] (values of T) = models/layers.RMSNorm(v) in place: fp32 as F.rms_norm; a lower-precision T
  // as the module computes it, weight * (v / rms(v) rounded to T), rounded to T.
  template <typename T>
  static void qk_norm(float* v, int64_t n, const float* w, float eps) {
    if (std::is_same<T, float>::value) {
      rms_norm(v, w, eps, n, v);
      return;
    }
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
    const float r = 1.f / std::sqrt(ss / float(n) + eps);
    for (int64_t i = 0; i < n; ++i) v[i] = rnd<T>(w[i] * rnd<T>(v[i] * r));
  }

  // y [B, D] = the MoE block of h [B, D] (rounded to T), as models/moe.MoEBlock computes it with
  // the runner's one-call layer: logits = W_router h (rounded to T for models/moe.Router, fp32 for
  // DeepSeek's); route_row's experts and weights, the weights rounded to T; then gemv::moe_experts
  // (bf16 rounding of its sums when T is bf16); then the shared expert, gated or not.
  template <typename T>
  void moe_block(const Moe& m, int64_t B, const float* h, float* y) {
    const int64_t E = m.experts->num_experts(), k = m.top_k;
    std::vector<int64_t> idx(B * k);
    std::vector<float> wt(B * k);
    std::vector<float> logits(B * E);
    // the router's logits of every row, its [E, D] weight split over the threads (Qwen3-MoE's 1 MB
    // fp32 router comes from DRAM each token: ~0.1 ms a layer on one core)
    at::parallel_for(0, E, E * D >= (1 << 16) ? 8 : E, [&](int64_t e0, int64_t e1) {
      for (int64_t b = 0; b < B; ++b) dot_rows(m.router.data() + e0 * D, h + b * D, e1 - e0, D, logits.data() + b * E + e0);
    });
    if (!m.router_bias.empty())  // gpt-oss's router: W h + b
      for (int64_t i = 0; i < B * E; ++i) logits[i] += m.router_bias[i % E];
    if (m.method == Routing::kSoftmax)  // models/moe.Router's logits are in the activation dtype
      for (int64_t i = 0; i < B * E; ++i) logits[i] = rnd<T>(logits[i]);
    for (int64_t b = 0; b < B; ++b) {
      route_row(m, logits.data() + b * E, E, idx.data() + b * k, wt.data() + b * k);
      for (int64_t j = 0; j < k; ++j) wt[b * k + j] = rnd<T>(wt[b * k + j]);
    }
    std::vector<int64_t> used(idx);
    std::sort(used.begin(), used.end());
    moe_uses_ += std::unique(used.begin(), used.end()) - used.begin();
    gemv::moe_experts(m.experts->k.data(), h, B, D, idx.data(), wt.data(), k, std::is_same<T, at::BFloat16>::value,
                      y, m.glu.get(), nullptr, E, m.amx_rows);
    if (m.shared_gu.empty()) return;
    // y += sigmoid(W_sg h) * W_down (silu(g) * u), [g | u] = W_gu h, or without a gate y += W_down (..):
    // each term rounded to T as the block's torch ops round it (out + [sigmoid(gate(h)) *] shared(h))
    const int64_t F = m.shared_down.in;
    std::vector<float> gu(B * 2 * F), act(B * F), e(B * D), g(B), tmp;
    m.shared_gu.run(h, B, gu.data(), tmp);
    for (int64_t b = 0; b < B; ++b)  // F.silu(gate(h)) * up(h) in T: g, u, silu(g) and the product each rounded
      for (int64_t i = 0; i < F; ++i) {
        const float gi = rnd<T>(gu[b * 2 * F + i]), ui = rnd<T>(gu[b * 2 * F + F + i]);
        act[b * F + i] = rnd<T>(rnd<T>(gi / (1.f + std::exp(-gi))) * ui);
      }
    m.shared_down.run(act.data(), B, e.data(), tmp);
    const bool gated = !m.shared_gate.empty();
    if (gated) m.shared_gate.run(h, B, g.data(), tmp);
    for (int64_t b = 0; b < B; ++b) {
      float* yb = y + b * D;
      const float* eb = e.data() + b * D;
      if (!gated) {
        for (int64_t i = 0; i < D; ++i) yb[i] = rnd<T>(yb[i] + rnd<T>(eb[i]));
        continue;
      }
      const float sg = rnd<T>(1.f / (1.f + std::exp(-rnd<T>(g[b]))));
      for (int64_t i = 0; i < D; ++i) yb[i] = rnd<T>(yb[i] + rnd<T>(sg * rnd<T>(eb[i])));
    }
  }

  // The rows of `att` (attention's) that come in runs of at least kRunRows consecutive positions of one
  // sequence (a prompt's or a chunk's rows), computed with attend_rows: each KV head's keys of the run
  // transposed once (transpose_keys), then tasks of R rows x one KV head (R x group queries, R chosen so
  // that the score kernel pads them least), cut over the threads by their keys x queries. Returns
  // which rows it computed (empty: none; a cache other than fp32 / bf16, or hd not a multiple of 32).
  // Per row (attend) each key was loaded and widened for one row's group of heads and every 4 keys'
  // scores took a shuffle tree a head: on 2 Zen 4 cores (2026-12-02, in one process, the same rows in
  // order and reversed, 8 layers of SmolLM2's attention over a bf16 cache) a step of 512 rows from
  // position 0 took 0.94x the time, 1024 rows at 1024 0.85x, at 3072 0.80x; the attention itself runs
  // ~45 GMAC/s a thread there, near its fp32 FMAs' bound.
  template <typename T, typename C>
  std::vector<char> attention_runs(int64_t l, int64_t B, const float* qkv, const C* kc, const C* vc,
                                   const int64_t* slots, const int64_t* pos, int64_t n_slots, int64_t max_len,
                                   int64_t window, float* att) const {
    using E = typename Elem<C>::type;
    constexpr bool q8 = std::is_same_v<C, int8_t>;  // keys dequantized as they are transposed, values into vt_buf_
    std::vector<char> in_run;
    if constexpr (!std::is_same_v<E, float> && !std::is_same_v<E, uint16_t> && !q8) {
      return in_run;
    } else {
      if (hd % 32 != 0 || B < kRunRows) return in_run;
      const int64_t QKV = (H + 2 * Hkv) * hd, group = H / Hkv;
      const int64_t lanes = g_attend_wide && hd % 64 == 0 ? 16 : 8;
      struct Run { int64_t b0, b1, kt_lo, kt_hi, kt_rows; };  // kt_rows: its keys padded to whole blocks
      std::vector<Run> runs;
      for (int64_t b = 0; b < B;) {
        int64_t e = b + 1;
        while (e < B && slots[e] == slots[b] && pos[e] == pos[e - 1] + 1) ++e;
        if (e - b >= kRunRows) runs.push_back({b, e, 0, pos[e - 1] + 1, 0});
        b = e;
      }
      if (runs.empty()) return in_run;
      in_run.assign(B, 0);
      std::vector<int64_t> lo(B), hi(B);
      for (auto& r : runs)
        for (int64_t b = r.b0; b < r.b1; ++b) {
          in_run[b] = 1;
          hi[b] = pos[b] + 1;
          lo[b] = hi[b] - keys_span(pos[b], window);
        }
      for (auto& r : runs) r.kt_lo = lo[r.b0], r.kt_rows = (r.kt_hi - r.kt_lo + lanes - 1) / lanes * lanes;
      // rows per task: R x group queries, padded to the score kernel's JQ (12 or 6) with the least padding a
      // query (up to 12 rows or 48 queries; the fewer rows among equals): group 3 takes 4 rows, 7 five (35 of 36)
      const int64_t jq = lanes == 16 ? 12 : 6;
      int64_t R = 1;
      double best = 1e9;
      for (int64_t r = 1; r <= 12 && (r == 1 || r * group <= 48); ++r) {
        const double waste = double((r * group + jq - 1) / jq * jq - r * group) / double(r * group);
        if (waste < best - 1e-9) best = waste, R = r;
      }
      const int64_t rs = row_elems<C>(hd);
      auto head_cache = [&](const C* cache, const Run& r, int64_t g) {
        return reinterpret_cast<const E*>(cache + ((l * n_slots + slots[r.b0]) * Hkv + g) * max_len * rs);
      };
      if constexpr (std::is_same_v<C, at::BFloat16>) {
        // bf16 prompts (set_prompt_attention_bf16) on tiered's bf16 attention where it runs (AMX, AVX512-BF16), a
        // sliding layer's with its window
        if (prompt_bf16_) {
          std::vector<gemv::Bf16AttnRun> bf;
          for (auto& r : runs)
            bf.push_back({qkv + r.b0 * QKV, r.b1 - r.b0, pos[r.b0], head_cache(kc, r, 0), head_cache(vc, r, 0),
                          att + r.b0 * H * hd, window});
          if (gemv::bf16_runs_attention(bf, QKV, H * hd, max_len * hd, H, Hkv, hd, scale_)) return in_run;
        }
      }
      // KV heads in batches whose transposed keys fit max_transposed_ (one head at least): a 1024-token chunk
      // of a Llama-3-8B-width model at position 31k would hold 128 MB for all 8 heads at once
      int64_t run_keys = 0;  // transposed key rows a head, over the runs
      for (auto& r : runs) run_keys += r.kt_rows;
      const int64_t per_head = run_keys * hd * int64_t(sizeof(float));
      const int64_t batch = std::clamp<int64_t>(max_transposed_ / std::max<int64_t>(per_head, 1), 1, Hkv);
      for (int64_t g0 = 0; g0 < Hkv; g0 += batch) {
        const int64_t g1 = std::min(Hkv, g0 + batch), nh = g1 - g0;
        // each run's keys of heads [g0, g1) transposed, a (run, KV head) item a task
        std::vector<int64_t> kt_at(runs.size() * nh + 1, 0);
        for (size_t i = 0; i < runs.size(); ++i)
          for (int64_t h = 0; h < nh; ++h) kt_at[i * nh + h + 1] = kt_at[i * nh + h] + runs[i].kt_rows * hd;
        kt_buf_.resize(kt_at.back());
        if constexpr (q8) vt_buf_.resize(kt_at.back());
        at::parallel_for(0, int64_t(runs.size()) * nh, 1, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i) {
            const Run& r = runs[i / nh];
            const int64_t n = r.kt_hi - r.kt_lo;
            if constexpr (q8) {
              thread_local std::vector<float> kd;
              kd.resize(n * hd);
              dequantize_rows(head_cache(kc, r, g0 + i % nh) + r.kt_lo * rs, n, hd, kd.data());
              transpose_keys(kd.data(), n, hd, lanes, kt_buf_.data() + kt_at[i]);
              dequantize_rows(head_cache(vc, r, g0 + i % nh) + r.kt_lo * rs, n, hd, vt_buf_.data() + kt_at[i]);
            } else {
              transpose_keys(head_cache(kc, r, g0 + i % nh) + r.kt_lo * hd, n, hd, lanes, kt_buf_.data() + kt_at[i]);
            }
          }
        });
        struct Task { int64_t run, b0, b1, g; };
        std::vector<Task> tasks;
        std::vector<double> cost{0.0};  // prefix sums of keys x queries
        for (size_t i = 0; i < runs.size(); ++i)
          for (int64_t b = runs[i].b0; b < runs[i].b1; b += R) {
            const int64_t e = std::min(b + R, runs[i].b1);
            for (int64_t g = g0; g < g1; ++g) {
              tasks.push_back({int64_t(i), b, e, g});
              cost.push_back(cost.back() + double(hi[e - 1] - lo[b]) * double((e - b) * group));
            }
          }
        const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), int64_t(tasks.size())));
        auto run_tasks = [&](int64_t k0, int64_t k1) {
          thread_local std::vector<float> scratch, o;
          for (int64_t k = k0; k < k1; ++k) {
            // thread k: the tasks whose cost starts in [k, k + 1) / nt of the total
            const double total = cost.back();
            const int64_t t0 = std::lower_bound(cost.begin(), cost.end() - 1, total * k / nt) - cost.begin();
            const int64_t t1 = std::lower_bound(cost.begin(), cost.end() - 1, total * (k + 1) / nt) - cost.begin();
            for (int64_t t = t0; t < t1 && t < int64_t(tasks.size()); ++t) {
              const Task& tk = tasks[t];
              const Run& r = runs[tk.run];
              const int64_t rows = tk.b1 - tk.b0;
              scratch.resize(rows_scratch(rows, group, hd, hi[tk.b1 - 1] - lo[tk.b0], lanes));
              o.resize(rows * group * hd);
              RowsTask a{qkv + tk.b0 * QKV + tk.g * group * hd, QKV, rows, group, hd, scale_,
                         kt_buf_.data() + kt_at[tk.run * nh + tk.g - g0], r.kt_lo, lo.data() + tk.b0,
                         hi.data() + tk.b0, o.data(), scratch.data()};
              if constexpr (q8) {
                a.v_lo = r.kt_lo;
                attend_rows(a, vt_buf_.data() + kt_at[tk.run * nh + tk.g - g0], lanes);
              } else {
                attend_rows(a, head_cache(vc, r, tk.g), lanes);
              }
              for (int64_t b = tk.b0; b < tk.b1; ++b) {
                float* out = att + b * H * hd + tk.g * group * hd;
                const float* src = o.data() + (b - tk.b0) * group * hd;
                for (int64_t i = 0; i < group * hd; ++i) out[i] = rnd<T>(src[i]);
              }
            }
          }
        };
        if (nt == 1) run_tasks(0, 1);
        else at::parallel_for(0, nt, 1, run_tasks);
      }
      return in_run;
    }
  }

  // The cached rows a row at position `pos` attends to: the last `window` of its pos + 1 (all without a window).
  static int64_t keys_span(int64_t pos, int64_t window) { return window > 0 ? std::min(pos + 1, window) : pos + 1; }

  // att [B, H*hd] = softmax(q k^T * scale) v over each row's cached positions, rounded to T. The
  // H / Hkv query heads of one KV head share each key and value row as it is read. A prompt's rows
  // (runs of consecutive positions) go to attention_runs unless the layer has sinks; the rest below.
  //
  // Each (row, KV head) item's key rows are cut into parts of at most ~kPartKeys (part_keys; split-K, as
  // flash-decoding splits a long context): a part gives its unnormalized output with its scores' max
  // and sum, and merge_parts rescales and adds them in order. How an item is cut depends on its own
  // key count alone, never on the batch beside it or the thread count: a row's output is the same
  // bits at any row of any batch and on any number of threads (when parts were one run a thread
  // over all items, three equal rows of a batch gave two different greedy texts, and a row changed
  // with the thread governor's count). The parts then go to the threads in order, about equal keys
  // a thread. At batch 1 an item per KV head left threads idle (SmolLM2's 3 KV heads on 2 threads:
  // 2 and 1), and below ~450 keys the step ran attention on one thread while the others waited
  // (measured ~71 ns a key and layer, 14% of a 128-key SmolLM2 step on 2 cores).
  template <typename T, typename C>
  void attention(int64_t l, int64_t B, const float* qkv, const C* kc, const C* vc, const int64_t* slots,
                 const int64_t* pos, int64_t n_slots, int64_t max_len, float* att) const {
    using E = typename Elem<C>::type;
    const int64_t QKV = (H + 2 * Hkv) * hd, group = H / Hkv;
    const Layer& L = layers_[l];
    const int64_t window = L.window < 0 ? window_ : L.window;
    const float* sinks = L.sinks.empty() ? nullptr : L.sinks.data();  // [H]: KV head g's at g * group
    auto span = [&](int64_t b) { return keys_span(pos[b], window); };
    // a prompt's rows (runs of kRunRows+ consecutive positions of one sequence) go to attention_runs;
    // keys_of is 0 for them here
    std::vector<char> in_run;
    if (!sinks && L.softcap == 0.f)  // (soft-capped layers score their rows one at a time: attend's cap_scores)
      in_run = attention_runs<T, C>(l, B, qkv, kc, vc, slots, pos, n_slots, max_len, window, att);
    auto keys_of = [&](int64_t b) { return !in_run.empty() && in_run[b] ? int64_t(0) : span(b); };
    int64_t keys = 0;  // key rows read per KV head, over the batch
    for (int64_t b = 0; b < B; ++b) keys += keys_of(b);
    if (keys == 0) return;
    // keys [t0, t1) of item bg's (row b, KV head g); `ml` null: the whole item, normalized into att
    auto part = [&](int64_t bg, int64_t t0, int64_t t1, float* o, float* ml, std::vector<float>& p) {
      const int64_t b = bg / Hkv, g = bg % Hkv;
      const int64_t lo = pos[b] + 1 - keys_of(b) + t0;
      const int64_t base = (((l * n_slots + slots[b]) * Hkv + g) * max_len + lo) * row_elems<C>(hd);
      const float* q = qkv + b * QKV + g * group * hd;  // the group's query heads, consecutive
      p.resize(group * (t1 - t0));
      if constexpr (std::is_same_v<C, int8_t>) {
        if (hd % 32 == 0 && hd <= 256)
          return attend(q, group, kc + base, vc + base, t1 - t0, hd, scale_, p.data(), o, ml, L.softcap);
        thread_local std::vector<float> kd, vd;  // other head sizes: the part's rows dequantized
        kd.resize((t1 - t0) * hd), vd.resize((t1 - t0) * hd);
        dequantize_rows(kc + base, t1 - t0, hd, kd.data());
        dequantize_rows(vc + base, t1 - t0, hd, vd.data());
        attend(q, group, kd.data(), vd.data(), t1 - t0, hd, scale_, p.data(), o, ml, L.softcap);
      } else {
        attend(q, group, reinterpret_cast<const E*>(kc + base), reinterpret_cast<const E*>(vc + base), t1 - t0, hd,
               scale_, p.data(), o, ml, L.softcap);
      }
    };
    auto out_of = [&](int64_t bg) { return att + (bg / Hkv) * H * hd + (bg % Hkv) * group * hd; };
    const int64_t items = B * Hkv, work = keys * Hkv;
    // one thread below kSplitKeys, else all of them
    const int64_t nt = work < kSplitKeys ? 1 : std::max<int64_t>(1, at::get_num_threads());
    struct Seg { int64_t bg, t0, t1, slot; };  // slot: its partial output's index, -1 = whole item
    std::vector<Seg> segs;  // every item's parts, items in order
    std::vector<int64_t> first_part(items, -1), parts(items, 0);
    int64_t nparts = 0;
    for (int64_t bg = 0; bg < items; ++bg) {
      const int64_t n = keys_of(bg / Hkv), len = part_keys(n), P = n ? (n + len - 1) / len : 0;
      parts[bg] = P;
      if (P == 1) segs.push_back({bg, 0, n, -1});
      if (P < 2) continue;
      first_part[bg] = nparts;
      for (int64_t i = 0; i < P; ++i) segs.push_back({bg, i * len, std::min(n, (i + 1) * len), nparts++});
    }
    // thread k runs the parts whose middle key falls in [k * work / nt, (k + 1) * work / nt)
    std::vector<int64_t> bounds(nt + 1, int64_t(segs.size()));
    bounds[0] = 0;
    for (int64_t i = 0, start = 0, k = 1; i < int64_t(segs.size()); ++i) {
      const int64_t len = segs[i].t1 - segs[i].t0, mid = start + len / 2;
      while (k < nt && mid >= k * work / nt) bounds[k++] = i;
      start += len;
    }
    const int64_t stride = group * hd + 2 * group;  // a part's o [group, hd], then (max, sum) [group, 2]
    std::vector<float> partial(nparts * stride);
    auto sink_of = [&](int64_t bg) { return sinks ? sinks + (bg % Hkv) * group : nullptr; };
    auto run_threads = [&](int64_t k0, int64_t k1) {
      std::vector<float> p, whole(sinks ? stride : 0);
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t si = bounds[k]; si < bounds[k + 1]; ++si) {
          const Seg& seg = segs[si];
          if (seg.slot < 0 && sinks) {  // a whole item, normalized with its heads' sinks
            part(seg.bg, seg.t0, seg.t1, whole.data(), whole.data() + group * hd, p);
            merge_parts<T>(whole.data(), 1, group, hd, out_of(seg.bg), sink_of(seg.bg));
          } else if (seg.slot < 0) {
            float* o = out_of(seg.bg);
            part(seg.bg, seg.t0, seg.t1, o, nullptr, p);
            for (int64_t i = 0; i < group * hd; ++i) o[i] = rnd<T>(o[i]);
          } else {
            float* o = partial.data() + seg.slot * stride;
            part(seg.bg, seg.t0, seg.t1, o, o + group * hd, p);
          }
        }
    };
    if (nt == 1)
      run_threads(0, 1);
    else
      at::parallel_for(0, nt, 1, run_threads);
    for (int64_t bg = 0; bg < items; ++bg)
      if (parts[bg] > 1)
        merge_parts<T>(partial.data() + first_part[bg] * stride, parts[bg], group, hd, out_of(bg), sink_of(bg));
  }

  // o [group, hd] <- sum_s e^(m_s - m) o_s / sum_s e^(m_s - m) l_s over `n` parts of one item's keys
  // (each part: o_s [group, hd] unnormalized, then (m_s, l_s) a query head), rounded to T. With `sink`
  // [group] (the heads' sink logits) the denominator has e^(sink_j - m) more, m then at least sink_j.
  template <typename T>
  static void merge_parts(const float* part, int64_t n, int64_t group, int64_t hd, float* o,
                          const float* sink = nullptr) {
    const int64_t stride = group * hd + 2 * group;
    for (int64_t j = 0; j < group; ++j) {
      float m = sink ? sink[j] : -INFINITY;
      for (int64_t s = 0; s < n; ++s) m = std::max(m, part[s * stride + group * hd + 2 * j]);
      float l = sink ? std::exp(sink[j] - m) : 0.f;
      float* oj = o + j * hd;
      std::fill(oj, oj + hd, 0.f);
      for (int64_t s = 0; s < n; ++s) {
        const float* ps = part + s * stride;
        const float w = std::exp(ps[group * hd + 2 * j] - m);
        l += w * ps[group * hd + 2 * j + 1];
        for (int64_t i = 0; i < hd; ++i) oj[i] += w * ps[j * hd + i];
      }
      const float inv = 1.f / l;
      for (int64_t i = 0; i < hd; ++i) oj[i] = rnd<T>(oj[i] * inv);
    }
  }

  // attention runs on one thread below this many (key row, KV head) pairs over the batch
  static constexpr int64_t kSplitKeys = 256;
  // The keys of an item's part (attention) for an item of n keys, a function of n alone: ceil(n / 256) parts,
  // at least 2 from 128 keys (SmolLM2's 3 KV heads at batch 1 then balance on 2 threads), of a multiple
  // of 8 keys (attend scores 8 at a time; the rest go one by one), the last part shorter. Parts of ~64
  // keys took SmolLM2's batch-4 steps at 1024 keys 16-17 -> 22-23 ms: each part's first keys are not
  // prefetched and its last n % 8 go one by one.
  static int64_t part_keys(int64_t n) {
    const int64_t P = std::max<int64_t>((n + kPartKeys - 1) / kPartKeys, n >= 128 ? 2 : 1);
    return std::max<int64_t>(8, ((n + P - 1) / P + 7) / 8 * 8);
  }
  static constexpr int64_t kPartKeys = 256;
  // rows of one sequence at consecutive positions that attention_runs takes together (a prompt's)
  static constexpr int64_t kRunRows = 8;
  // a prompt's runs attend in bf16 (the queries rounded, the probabilities in bf16) over a bf16 cache:
  // set_prompt_attention_bf16, as the modules' prompts do (Plan.dtypes["prompt_attention"])
  bool prompt_bf16_ = false;
  // attention_runs' transposed keys at most (KV heads in batches past it; set_max_transposed_bytes)
  int64_t max_transposed_ = int64_t(32) << 20;
  mutable std::vector<float> kt_buf_;  // attention_runs' transposed keys
  mutable std::vector<float> vt_buf_;  // and an int8 cache's values dequantized (kt_buf_'s offsets)

  int64_t D, H, Hkv, hd;
  int64_t rd;  // RoPE's width: each q / k head's first rd features rotate (rd = hd unless partial)
  float scale_;
  int64_t window_;
  int64_t latent_width_ = 0;  // R + r when the layers are latent attention's (set_latent): the cache row's width
  std::vector<Layer> layers_;
  std::vector<float> final_norm_;
  float final_eps_ = 1e-6f;
  KernelPtr lm_head_;
  std::vector<float> gu_, act_;
  int64_t moe_uses_ = 0;
  bool gelu_ = false;  // the dense FFNs' GLU is GeGLU (set_activation)
};

// The inverse CDF of weights p [V] at u in [0, 1): the first token whose cumulative weight exceeds u times
// `total`, walking the sums of blocks of kB weights (bs [ceil(V / kB)], float64) and then one block; when
// rounding leaves u * total at the total, the last token with weight.
int64_t cdf_pick(const float* p, int64_t V, const double* bs, int64_t kB, double total, double u) {
  const double target = u * total;
  double cum = 0.0;
  for (int64_t k = 0; k * kB < V; ++k) {
    if (cum + bs[k] <= target) {
      cum += bs[k];
      continue;
    }
    for (int64_t i = k * kB, e = std::min(V, (k + 1) * kB); i < e; ++i)
      if ((cum += p[i]) > target) return i;
  }
  for (int64_t i = V - 1; i > 0; --i)
    if (p[i] > 0.f) return i;
  return 0;
}

// One draw from softmax(l / T) over l fp32 [V] (inv_t = 1 / T > 0) at a uniform u in [0, 1): the
// first token whose cumulative weight exceeds u times the total (inverse CDF, as torch.searchsorted
// right=True on a float64 cumsum). The weights exp((l - max) / T) are computed once, vectorized, and
// summed per block of 256 in float64, so the search walks block sums and then one block. -inf logits
// weigh exactly 0 and are never drawn; when rounding leaves u * total at the total, the last token
// with weight is returned. p: scratch [V].
TIERED_CLONES int64_t sample_row(const float* l, int64_t V, float inv_t, double u, float* p) {
  constexpr int64_t kB = 256;
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < V; ++i) mx = l[i] > mx ? l[i] : mx;
  const int64_t nb = (V + kB - 1) / kB;
  double total = 0.0;
  thread_local std::vector<double> bs;
  bs.resize(nb);
  for (int64_t k = 0; k < nb; ++k) {
    const int64_t e = std::min(V, (k + 1) * kB);
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = k * kB; i < e; ++i) {
      const float w = exp_fast((l[i] - mx) * inv_t);
      p[i] = l[i] == -INFINITY ? 0.f : w;
      s += p[i];
    }
    bs[k] = s;
    total += s;
  }
  return cdf_pick(p, V, bs.data(), kB, total, u);
}

// One draw from a row of logits l [V] as engine/sampling.filtered_logits filters it: the
// repetition penalty on `seen` (positive logits / pen, negative * pen), / T, top-k (k > 0: tokens
// below the k-th largest dropped), top-p (< 1: the smallest prefix of tokens by descending
// probability whose mass reaches p), min-p (> 0: tokens below min_p x the top probability
// dropped), then a CDF inversion at u over the tokens left, in token order (sample_row's).
// One pass of exp over V: the weights w = exp(z - max z) (the top token's exactly 1) decide every
// filter, since top-p's and min-p's probabilities are w / sum w and their ratios to the top one w
// itself; top-p sorts only the tokens with w >= 1e-4 (all of them if those miss p), and the draw
// walks the kept tokens alone. On SmolLM2's 49k vocabulary with the CLI's defaults (T 0.2, top-p
// 0.9, penalty 1.1) ~4x faster than filtering z to -inf and drawing over all V again (2 Zen 3
// cores, 2026-11-30). z, p: [V] scratch.
TIERED_CLONES int64_t sample_filtered_row(const float* l, int64_t V, const int64_t* seen, int64_t n_seen, float pen,
                                          float T, int64_t top_k, float top_p, float min_p, double u, float* z,
                                          float* p) {
  const float inv_t = 1.f / T;
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) z[i] = l[i] * inv_t;
  if (pen != 1.f)
    for (int64_t j = 0; j < n_seen; ++j) {
      const int64_t s = seen[j];
      if (s >= 0 && s < V) z[s] = (l[s] > 0.f ? l[s] / pen : l[s] * pen) * inv_t;
    }
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t i = 0; i < V; ++i) mx = z[i] > mx ? z[i] : mx;
  if (top_k > 0 && top_k < V) {
    std::vector<float> tmp(z, z + V);
    std::nth_element(tmp.begin(), tmp.begin() + (top_k - 1), tmp.end(), std::greater<float>());
    const float kth = tmp[top_k - 1];
    for (int64_t i = 0; i < V; ++i)
      if (z[i] < kth) z[i] = -INFINITY;
  }
  // weights, with min-p's cut at once where no top-p comes first (the top token's w is 1)
  const bool nucleus = top_p < 1.f;
  const float cut = nucleus ? 0.f : min_p;
  constexpr int64_t kB = 256;
  const int64_t nb = (V + kB - 1) / kB;
  thread_local std::vector<double> bs;
  thread_local std::vector<float> bmax;  // each block's largest weight: top-p's candidates lie in few blocks
  bs.resize(nb), bmax.resize(nb);
  double total = 0.0;
  for (int64_t k = 0; k < nb; ++k) {
    const int64_t e = std::min(V, (k + 1) * kB);
    float s = 0.f, m = 0.f;
#pragma omp simd reduction(+ : s) reduction(max : m)
    for (int64_t i = k * kB; i < e; ++i) {
      const float w = exp_fast(z[i] - mx);
      p[i] = z[i] == -INFINITY || w < cut ? 0.f : w;
      s += p[i];
      m = p[i] > m ? p[i] : m;
    }
    bs[k] = s, bmax[k] = m;
    total += s;
  }
  if (nucleus) {
    constexpr float kCandidate = 1e-4f;  // of the top token's weight
    thread_local std::vector<int64_t> idx;
    idx.clear();
    double mass = 0.0;
    for (int64_t k = 0; k < nb; ++k)
      if (bmax[k] >= kCandidate)
        for (int64_t i = k * kB, e = std::min(V, (k + 1) * kB); i < e; ++i)
          if (p[i] >= kCandidate) idx.push_back(i), mass += p[i];
    if (mass < double(top_p) * total) {  // the candidates miss p: every token with weight
      idx.clear();
      for (int64_t i = 0; i < V; ++i)
        if (p[i] > 0.f) idx.push_back(i);
    }
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    const double reach = double(top_p) * total;
    double cum = 0.0;
    size_t n = 0;
    while (n < idx.size() && cum < reach) cum += p[idx[n++]];  // keep while the mass before is below p
    while (n > 1 && min_p > 0.f && p[idx[n - 1]] < min_p * p[idx[0]]) --n;
    idx.resize(n);
    if (n == 0) return 0;
    std::sort(idx.begin(), idx.end());
    double kept = 0.0;
    for (int64_t i : idx) kept += p[i];
    const double target = u * kept;
    cum = 0.0;
    for (int64_t i : idx)
      if ((cum += p[i]) > target) return i;
    return idx.back();
  }
  return cdf_pick(p, V, bs.data(), kB, total, u);
}

// The first maximum of l [V] (a NaN counts as the maximum, as numpy's and torch's argmax take it).
int64_t argmax_row(const float* l, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(l[i])) return i;
    if (l[i] > l[best]) best = i;
  }
  return best;
}

// Up to n decode steps of one sequence in one call, each on the token the step before drew: from
// `token` at position `pos` of KV-cache slot `slot`, its embedding row (`embed`: the table [V, D] in
// any float dtype, or with q8_0 GGUF Q8_0 blocks uint8 [V, D / 32 * 34]) rounded to x's dtype, every
// layer (DecodeStep.forward over all of them: the caller checks that the step runs each), the final
// norm and lm_head (DecodeStep.logits), then the next token as engine/sampling.sample_tokens draws it:
// temperature 0 the first maximum after the repetition penalty on the ids seen (`seen` int64 [n0], then
// each drawn token), a draw with the temperature alone (`plain`: engine/sampling.plain_draw's call) sample_row's
// at u[i], any other sample_filtered_row's. Stops after a token in `stop` (int64) or after n tokens. x: [1, D] scratch in
// the residual stream's dtype; cos, sin: the rotary tables [positions, rotary_dim] fp32; u float64 [n]
// (the request's generator drew them). Returns (tokens int64 [m], seconds float64 [m]: each token's
// time since the call began), m <= n. `interrupt` (int32 [1], or none): another thread makes it nonzero
// to end the burst after the token being computed (a server's new request joins the next step). The
// engine's loop around a step (scheduling, the step's input tensors, sampling, detokenizing) cost
// ~0.13 ms a token on 2 Zen 3 cores, 3.5% of SmolLM2's ITL.
std::tuple<at::Tensor, at::Tensor> decode_burst(DecodeStep& step, int64_t token, int64_t slot, int64_t pos, int64_t n,
                                                const at::Tensor& embed, bool q8_0, at::Tensor x, const at::Tensor& cos,
                                                const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                                                const at::Tensor& stop, const at::Tensor& seen, double penalty,
                                                double temperature, int64_t top_k, double top_p, double min_p,
                                                bool plain, const at::Tensor& u,
                                                const c10::optional<at::Tensor>& interrupt) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t D = x.size(-1), V = embed.size(0), L = step.num_layers();
  TIERED_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "burst: x must be contiguous [1, D]");
  TIERED_CHECK(embed.dim() == 2 && embed.is_contiguous() &&
                  (q8_0 ? embed.scalar_type() == at::kByte && D % 32 == 0 && embed.size(1) == D / 32 * 34
                        : embed.size(1) == D),
              "burst: embed must be contiguous [V, D] (or Q8_0 blocks uint8 [V, D / 32 * 34])");
  TIERED_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && pos + n <= cos.size(0),
              "burst: cos / sin must be float32 [positions, rotary_dim] covering every position of the burst");
  TIERED_CHECK(n >= 1 && u.numel() >= n && u.scalar_type() == at::kDouble, "burst: u must be float64 [n], n >= 1");
  TIERED_CHECK(temperature >= 0 && penalty > 0, "burst: temperature must be >= 0 and penalty > 0");
  TIERED_CHECK(!interrupt || (interrupt->scalar_type() == at::kInt && interrupt->numel() == 1 && interrupt->is_cpu()),
              "burst: interrupt must be a CPU int32 tensor of one element");
  // another thread sets it (a server's new request): read afresh after each token
  const int32_t* flag = interrupt ? interrupt->data_ptr<int32_t>() : nullptr;
  auto stops = stop.to(at::kLong).contiguous();
  const int64_t* sp = stops.data_ptr<int64_t>();
  auto sn = seen.to(at::kLong).contiguous();
  std::vector<int64_t> seen_ids(sn.data_ptr<int64_t>(), sn.data_ptr<int64_t>() + sn.numel());
  auto uu = u.contiguous();
  const double* up = uu.data_ptr<double>();
  auto slots = at::full({1}, slot, at::TensorOptions().dtype(at::kLong));
  auto positions = at::empty({1}, at::TensorOptions().dtype(at::kLong));
  auto row = at::empty({1, D}, at::TensorOptions().dtype(at::kFloat));
  auto tokens = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  auto seconds = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  std::vector<float> z(V), p(V);
  const bool greedy = temperature == 0;
  TIERED_CHECK(!(greedy && plain), "burst: a greedy draw is not a plain one");
  int64_t m = 0;
  for (; m < n; ++m) {
    TIERED_CHECK(0 <= token && token < V, "burst: token id ", token, " outside the embedding of ", V, " rows");
    if (q8_0) {
      q8_0_row(embed.data_ptr<uint8_t>() + token * embed.size(1), D, row.data_ptr<float>());
      x.copy_(row);
    } else {
      x.copy_(embed.select(0, token).unsqueeze(0));
    }
    positions.data_ptr<int64_t>()[0] = pos + m;
    step.forward(x, cos.narrow(0, pos + m, 1), sin.narrow(0, pos + m, 1), slots, positions, k_cache, v_cache, 0, L);
    auto lg = step.logits(x);
    const float* l = lg.data_ptr<float>();
    const int64_t Vh = lg.size(1);
    if (greedy && penalty == 1) {
      token = argmax_row(l, Vh);
    } else if (greedy) {  // the penalty (engine/sampling.apply_repetition_penalty), then the argmax
      std::copy(l, l + Vh, z.begin());
      for (int64_t s : seen_ids)
        if (0 <= s && s < Vh) z[s] = l[s] > 0.f ? l[s] / float(penalty) : l[s] * float(penalty);
      token = argmax_row(z.data(), Vh);
    } else if (plain) {
      token = sample_row(l, Vh, float(1.0 / temperature), up[m], p.data());
    } else {
      token = sample_filtered_row(l, Vh, seen_ids.data(), int64_t(seen_ids.size()), float(penalty),
                                  float(temperature), top_k, float(top_p), float(min_p), up[m], z.data(), p.data());
    }
    tokens.data_ptr<int64_t>()[m] = token;
    seconds.data_ptr<double>()[m] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (penalty != 1) seen_ids.push_back(token);
    if (std::find(sp, sp + stops.numel(), token) != sp + stops.numel() ||
        (flag != nullptr && __atomic_load_n(flag, __ATOMIC_ACQUIRE) != 0)) {
      ++m;
      break;
    }
  }
  return {tokens.narrow(0, 0, m), seconds.narrow(0, 0, m)};
}

// token int64: sample_filtered_row on logits fp32 [V] (CPU, contiguous), seen int64 [n], u float64.
int64_t sample_filtered(const at::Tensor& logits, const at::Tensor& seen, double penalty, double temperature,
                        int64_t top_k, double top_p, double min_p, double u) {
  TIERED_CHECK(logits.dim() == 1 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.is_cpu() &&
                  logits.numel() > 0, "sample_filtered: logits must be a contiguous CPU float32 [V] tensor");
  TIERED_CHECK(temperature > 0 && penalty > 0 && top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1 && top_k >= 0,
              "sample_filtered: temperature and penalty must be > 0, top_p in (0, 1], min_p in [0, 1], top_k >= 0");
  auto s = seen.to(at::kLong).contiguous();
  const int64_t V = logits.numel();
  pybind11::gil_scoped_release nogil;
  thread_local std::vector<float> z, p;
  z.resize(V), p.resize(V);
  return sample_filtered_row(logits.data_ptr<float>(), V, s.data_ptr<int64_t>(), s.numel(), float(penalty),
                             float(temperature), top_k, float(top_p), float(min_p), u, z.data(), p.data());
}

// tokens int64 [B]: one draw per row of logits fp32 [B, V] at temperatures [B] (> 0) and uniforms
// u float64 [B] (the requests' own generators drew them), rows in parallel.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u) {
  TIERED_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.is_cpu(),
              "sample_rows: logits must be a contiguous CPU float32 [B, V] tensor");
  const int64_t B = logits.size(0), V = logits.size(1);
  TIERED_CHECK(V > 0, "sample_rows: empty vocabulary");
  auto t = temperature.to(at::kFloat).contiguous();
  auto uu = u.to(at::kDouble).contiguous();
  TIERED_CHECK(t.numel() == B && uu.numel() == B, "sample_rows: temperature and u must have B = ", B, " entries");
  auto out = at::empty({B}, at::kLong);
  const float* L = logits.data_ptr<float>();
  const float* T = t.data_ptr<float>();
  const double* U = uu.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TIERED_CHECK(T[b] > 0.f, "sample_rows: temperatures must be > 0");
  {
    pybind11::gil_scoped_release nogil;
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      thread_local std::vector<float> p;
      p.resize(V);
      for (int64_t b = b0; b < b1; ++b) o[b] = sample_row(L + b * V, V, 1.f / T[b], U[b], p.data());
    });
  }
  return out;
}

}  // namespace

void register_decode(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeStep>(m, "DecodeStep",
                         "Native decode step of dense Llama-family layers and DeepSeek latent-attention layers "
                         "(tiered/kernels/csrc/decode.cpp).")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, int64_t, int64_t>(), py::arg("hidden"),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("window") = 0,
           py::arg("rotary_dim") = 0)
      .def("add_layer", &DecodeStep::add_layer, py::arg("in_norm"), py::arg("post_norm"), py::arg("eps"),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"))
      .def("set_head", &DecodeStep::set_head, py::arg("norm"), py::arg("eps"), py::arg("lm_head"))
      .def("num_layers", &DecodeStep::num_layers)
      .def("forward", &DecodeStep::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("positions"), py::arg("k_cache"), py::arg("v_cache"), py::arg("first"), py::arg("last"),
           py::arg("moe") = true, py::arg("post_norm") = py::none(), py::arg("local_cos") = py::none(),
           py::arg("local_sin") = py::none())
      .def("set_moe", &DecodeStep::set_moe, py::arg("layer"), py::arg("router"), py::arg("top_k"),
           py::arg("norm_topk_prob"), py::arg("experts"), py::arg("shared_gate_up") = std::vector<KernelPtr>{},
           py::arg("shared_down") = std::vector<KernelPtr>{}, py::arg("shared_gate") = std::vector<KernelPtr>{},
           py::arg("method") = "softmax", py::arg("n_group") = 1, py::arg("topk_group") = 1, py::arg("scaling") = 1.0,
           py::arg("bias") = py::none(), py::arg("router_bias") = py::none(), py::arg("swiglu_limit") = 0.0,
           py::arg("swiglu_alpha") = 1.702, py::arg("amx_rows") = 0)
      .def("set_attention", &DecodeStep::set_attention, py::arg("layer"), py::arg("window"), py::arg("sinks"))
      .def("set_sandwich", &DecodeStep::set_sandwich, py::arg("layer"), py::arg("attn_out"), py::arg("ffn_out"))
      .def("set_local_rope", &DecodeStep::set_local_rope, py::arg("layer"))
      .def("set_softcap", &DecodeStep::set_softcap, py::arg("layer"), py::arg("cap"))
      .def("set_activation", &DecodeStep::set_activation, py::arg("act"))
      .def("set_max_transposed_bytes", &DecodeStep::set_max_transposed_bytes, py::arg("bytes"))
      .def("set_prompt_attention_bf16", &DecodeStep::set_prompt_attention_bf16, py::arg("on"))
      .def("route", &DecodeStep::route, py::arg("layer"), py::arg("logits"))
      .def("set_qk", &DecodeStep::set_qk, py::arg("layer"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"),
           py::arg("per_head"), py::arg("clip") = 0.0)
      .def("set_latent", &DecodeStep::set_latent, py::arg("layer"), py::arg("q"), py::arg("q_a"), py::arg("q_a_norm"),
           py::arg("q_a_eps"), py::arg("q_b"), py::arg("kv_a"), py::arg("kv_a_norm"), py::arg("kv_a_eps"), py::arg("uk"),
           py::arg("uv"), py::arg("kv_b"), py::arg("scale"), py::arg("interleave"))
      .def("take_moe_uses", &DecodeStep::take_moe_uses)
      .def("logits", &DecodeStep::logits, py::arg("x"))
      .def("burst", &decode_burst, py::arg("token"), py::arg("slot"), py::arg("position"), py::arg("n"),
           py::arg("embed"), py::arg("q8_0"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("stop"), py::arg("seen"), py::arg("penalty"), py::arg("temperature"),
           py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("plain"), py::arg("u"),
           py::arg("interrupt") = py::none(),
           "(tokens int64 [m], seconds float64 [m]): up to n decode steps of one sequence, each on the token the "
           "step before drew (embedding, every layer, logits, the draw), stopping after a token in `stop`, or "
           "after the token during which `interrupt` (int32 [1]) became nonzero (decode.cpp: decode_burst)");
  m.def("sample_filtered", &sample_filtered, py::arg("logits"), py::arg("seen"), py::arg("penalty"),
        py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"),
        "token: one draw from logits fp32 [V] after engine/sampling.filtered_logits' filters (repetition penalty on "
        "seen int64 [n], / temperature, top-k, top-p, min-p) at the uniform u (float64, in [0, 1)).");
  m.def("sample_rows", &sample_rows, py::arg("logits"), py::arg("temperature"), py::arg("u"),
        "tokens int64 [B]: one draw per row from softmax(logits [B, V] fp32 / temperature [B]) at the uniforms "
        "u [B] (float64, in [0, 1)) by inverting the CDF; rows in parallel.");
}

}  // namespace tiered
