// tiered's own GEMV kernels for CPU decode (batch 1..8, any batch works): int4 group-32 and int8
// per-row weights (each also in a tiled layout of 16 rows side by side), bf16 weights, and fp8 E4M3
// weights with fp32 scales per 128 x 128 block (DeepSeek-V3 / Qwen3-FP8's), read as stored, fp32 rows
// in and out; and a fused SwiGLU expert (any mix of those kinds).
//
// Each kernel is a `Gemv`: besides Kernel::run it computes any range of output rows from an `Act`
// (one call's activations, prepared once: bf16 copy, group sums), so a fused expert prepares x once
// for gate and up and runs both in one parallel region.
//
// ISA: one build, chosen at run time. AVX-512 (F/BW/VL + BF16: vdpbf16ps, VNNI: vpdpbusd) -> AVX2 + F16C +
// FMA (F16C: fp8 codes widened as fp16) -> scalar.
// `set_isa` forces a lower path (tests run every path on an AVX-512 machine).
#pragma once
#include "kernel.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace tiered {
namespace gemv {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Isa best_isa();     // what this CPU supports
Isa current_isa();  // what the kernels use now (best_isa unless set_isa lowered it)

// One call's activations, prepared once for every kernel reading them (what each reads: its
// Gemv::needs, an ActNeeds). All pointers are rows of B: x fp32 [B, K] as given. With bf16: xr fp32
// [B, K] = x rounded to bf16; xb bf16 bits [B, K] of xr; gsum fp32 [B, K/32] = sums of xr over
// groups of 32 (int4's zero term); null without.
//
// With q8, x quantized per group of 32 to int8, like
// llama.cpp's Q8_0 activations: dx = max|x| / 127, xq = round(x * 127 / max|x|) (half to even),
// G = K/32 groups padded to Gp = 4 * ceil(G/4) (padding zero). Per row b:
//   xq int8 [Gp * 32], in chunks of 4 groups (128 bytes): bytes 16l..16l+15 = group 4c+l's even
//      columns 0, 2, .., 30 and bytes 64+16l.. its odd columns: so one 64-byte load of plain int4
//      codes (even column in the low nibble) ANDed with 0x0F pairs with the first half, shifted
//      right by 4 with the second;
//   dx16 fp32 [Gp / 4 * 16]: lane i of chunk c = dx of group 4c + i/4 (the 32-bit lane of a 64-byte
//      dot product vpdpbusd leaves sums of group 4c + i/4);
//   xsum fp32 [Gp]: exact sums of x (fp32, unrounded) per group;
//   m8 fp32 [Gp]: -8 * dx * sum(xq) per group (int4's q - 8 offset, taken out per row block);
//   xqt int8 [K]: the same xq in column order, and dxg fp32 [G] its dx per group (the tiled int4
//      layout's operands).
// With w16 (the AVX2 paths of the tiled int4 layout and of int8 weights), x quantized per group of 32 to int16: dw = max|x| / 32639, xw = round(x / dw) (15 bits
// where bf16 keeps 8), as uint32 words of two int16 in the order that path's vpmaddwd reads them: per
// 8 columns c8, words (x0, x2), (x4, x6), (x1, x3), (x5, x7) of x[8 c8 ..] (low half first): xw uint32
// [B, K/2]; xs int16 [B, K] the same values in column order (the int8 kernel's AVX2 path);
// dw fp32 [B, K/32]; wsum fp32 [B, K/32] the exact sums of x per group. With w16 and split (the
// tiled layouts' kernels) also xsq int32 [B, K/32], the sums of xs per group (the tiled int8
// layout's +128 offset term), and on AVX-512 xh, xl int8 [B, K] in column order with
// xs = 256 xh + xl (32639 = 127 * 257 keeps both in a signed byte).
// With s16 (the q6k kernels: Q6_K's scale per 16 weights), the sums per 16 columns of the quantized rows: s16w int32
// [B, K/16] of xs (with w16), s16q int32 [B, K/16] of xqt (with q8).
// With pairs (the tiled int4 layout on bf16 activations, AVX-512): xp uint32 [B, K/2], per 8 columns c8 and j < 4 the bf16 words of x[8 c8 + j] (low)
// and x[8 c8 + 4 + j] (high).
struct Act {
  const float* x = nullptr;
  const float* xr = nullptr;
  const uint16_t* xb = nullptr;
  const float* gsum = nullptr;
  const int8_t* xq = nullptr;
  const float *dx16 = nullptr, *xsum = nullptr, *m8 = nullptr;
  const int8_t* xqt = nullptr;
  const float* dxg = nullptr;
  const uint32_t* xp = nullptr;
  const uint32_t* xw = nullptr;
  const int16_t* xs = nullptr;
  const int8_t *xh = nullptr, *xl = nullptr;
  const int32_t* xsq = nullptr;
  const int32_t* xqs = nullptr;  // q8: sum of xqt per group [B, G]
  const float *dw = nullptr, *wsum = nullptr;
  const int32_t *s16w = nullptr, *s16q = nullptr;
  int64_t B = 0, K = 0, Gp = 0;  // Gp: padded groups per row of xq / xsum / m8 (0 without q8)
  // The call size whose activation formats these rows take where a kernel picks them by it (the tiled
  // int4 layout's q8_from): 0 = B. A MoE step's expert rows take the step's tokens (swiglu_group), so a
  // row reads the same formats however many rows of the step its expert has.
  int64_t format_rows = 0;
  int64_t rows_for_format() const { return format_rows ? format_rows : B; }
};

// What a call's kernels read of its Act (bf16 rounding, int8 or int16 quantization, bf16 pairs):
// `prepare` computes only that.
struct ActNeeds {
  bool bf16 = true, q8 = false, pairs = false, w16 = false, split = false, s16 = false;
  static ActNeeds only_q8() { return {false, true, false, false}; }
  static ActNeeds only_w16(bool split = false) { return {false, false, false, true, split}; }
  ActNeeds operator|(const ActNeeds& o) const {
    return {bf16 || o.bf16, q8 || o.q8, pairs || o.pairs, w16 || o.w16, split || o.split, s16 || o.s16};
  }
};

// Buffers an Act lives in (one per concurrent Act; reused across calls: no allocation once warm).
struct ActBuffers {
  std::vector<float> xr, gsum, dx16, xsum, m8, dxg, dw, wsum;
  std::vector<uint16_t> xb;
  std::vector<int8_t> xq, xqt, xh, xl;
  std::vector<int16_t> xs;
  std::vector<int32_t> xsq, xqs, s16w, s16q;
  std::vector<uint32_t> xp, xw;
  Act prepare(const float* x, int64_t B, int64_t K, ActNeeds needs = {});
  void quantize_q8(const float* x, int64_t B, int64_t K, Act& a);
};

struct Gemv : Kernel {
  // y[b * ldy + n] for b in [b0, b0 + nb), n in [n0, n1): one thread's share of a call.
  virtual void rows(const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) const = 0;
  // Rows per parallel work item and bytes each item reads (to size chunks).
  virtual int64_t block_rows() const { return 16; }
  // What rows() reads of the Act in a call of B activation rows (default: the bf16 rounding only).
  virtual ActNeeds needs(int64_t B) const { return {}; }
  void run(const float* x, int64_t B, float* y) const override;
};

// gpt-oss's experts (models/gpt_oss.py): each projection's bias is its weight's input column D (F for
// down), zero columns after it (gate / up [F, Db], down [D, Fb]), so each projection multiplies its
// input with a 1 then zeros appended; the activation is the clamped GLU (clamped_glu, kernel.h).
struct Glu {
  float limit = 7.f, alpha = 1.702f;
};

// A MoE layer's routed SwiGLU experts and their weighted sum for N tokens: k[3 e..3 e + 2] the
// (gate, up, down) kernels of expert e (each D -> F -> D; with `glu`, gpt-oss's biased experts
// Db -> F, Fb -> D), x fp32 [N, D], idx int64 [N, top_k]
// (expert of each slot, distinct within a row), wt fp32 [N, top_k] -> out fp32 [N, D] =
// sum_j wt[n, j] * expert_idx[n, j](x[n]), added in ascending expert order, then token order, each
// expert output, product and sum rounded to bf16 when `bf16` (torch's bf16 index_add_ of ys * w).
// `given` (or nullptr): per expert e, nullptr to compute it, else its outputs fp32 [rows of e, D] already
// computed elsewhere (a prompt's expert past the kernels' rows: a dequantized GEMM), in its entries' flat order;
// its kernels k[3 e..] are then not called, and its outputs join the sum in its place in the expert order.
// Every expert's rows take the activation formats of a call of N rows (Act::format_rows): a token's output
// does not depend on how many other tokens its experts took (batch 1 keeps its own formats).
// `amx_experts` and `amx_rows`: the layer's number of experts and the rows an expert averages (N top_k /
// amx_experts) from which the call runs its experts on the AMX GEMM (moe_experts_amx: the native step's MoE blocks);
// 0: never. `amx_own` > 0: below that average, each expert of more than amx_own rows still runs on it (a prompt's
// expert past the grouped kernels' rows: the modules' prefill, ExpertFormat.group_rows); 0: none.
void moe_experts(const Gemv* const* k, const float* x, int64_t N, int64_t D, const int64_t* idx, const float* wt,
                 int64_t top_k, bool bf16, float* out, const Glu* glu = nullptr, const float* const* given = nullptr,
                 int64_t amx_experts = 0, int64_t amx_rows = 0, int64_t amx_own = 0);

// One SwiGLU expert on the AMX GEMM: y fp32 [n, D] = down(silu(gate(x)) * up(x)) for x fp32 [n, D]: gate and up
// over x rounded to bf16 into bf16, their SwiGLU in fp32 rounded once to bf16 (kernel.h's swiglu_bf16), down over
// that into fp32: the numerics of a prompt's dequantized expert in torch (quant/experts.ExpertFormat.dequantized's
// bf16 GLU) but for down's output, kept in fp32. With `glu`, gpt-oss's biased experts: x's rows with their 1 and
// zeros (gate's Db inputs), the clamped GLU in fp32 (kernel.h) over the bf16 gate and up, rounded to bf16 with its
// own 1 and zeros (down's Fb inputs). A projection without the AMX path (Q4_K_M's Q6_K down as tiled int8) runs its
// own kernel over its bf16 rows widened to fp32. False, y untouched, where the gate has no AMX path here
// (Kernel::run_amx_bf16: tiled int4 and mxfp4 on a CPU with AMX, amx_rows() on).
bool amx_swiglu(const Gemv& gate, const Gemv& up, const Gemv& down, const float* x, int64_t D, int64_t n, float* y,
                const Glu* glu = nullptr);

// One run of a prompt's rows in the native step's attention (DecodeStep::attention_runs): n rows of one sequence at
// positions p0 .. p0 + n - 1, each attending causally to the cached keys 0 .. its own position, or with a sliding
// `window` (> 0) to its last `window` of them only.
struct Bf16AttnRun {
  const float* q;     // row i's query heads at q + i * ldq (head h at + h * hd), fp32
  int64_t n, p0;
  const uint16_t* k;  // kv head g's keys at k + g * head_ld, rows hd apart, bf16 (from key 0); v alike
  const uint16_t* v;
  float* out;         // row i's heads at out + i * ldo: bf16 values, widened
  int64_t window = 0;
};

// The runs' causal attention in bf16 (csrc/gemv.cpp attn_block, bf16_prompt_attention's: 32 queries x 64 keys of
// scores, in AMX tiles where the native step's AMX calls run, else by AVX512-BF16's vdpbf16ps; an online softmax in
// fp32, the probabilities in bf16 against V), the queries rounded to bf16 as torch casts them (the modules' bf16
// prompt attention, Plan.dtypes["prompt_attention"]); a windowed run's keys packed from its first row's window's
// block on. False, out untouched, where neither kernel runs here (bf16_attention_available), or hd is not a multiple
// of 32 up to 256.
bool bf16_runs_attention(const std::vector<Bf16AttnRun>& runs, int64_t ldq, int64_t ldo, int64_t head_ld, int64_t H,
                         int64_t Hkv, int64_t hd, float scale);

// The kernels of every expert of one MoE layer, bound once to where their weights stay (resident
// in RAM): k[3 e + j] = projection j (gate, up, down) of expert e. `owner` keeps them alive.
struct BoundExperts {
  std::vector<const Gemv*> k;
  std::shared_ptr<void> owner;
  int64_t num_experts() const { return int64_t(k.size()) / 3; }
  int64_t hidden() const { return k.empty() ? 0 : k[0]->in_features; }
};

}  // namespace gemv
}  // namespace tiered
