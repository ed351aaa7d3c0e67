// A prompt's elementwise glue on the CPU, one pass each where torch's ops take several: RoPE (q and k rotated
// into a new tensor), SwiGLU's activation (silu(gate) * up from the fused gate/up GEMM's output) and RMSNorm with
// the residual add before it and the cast after it. On 2 Sapphire
// Rapids cores a 941-token SmolLM2 forward spent ~0.9 ms a layer in RoPE's torch ops (multiplies, an add, the
// rotate-half's chunk, negation and concatenation) and ~0.9 in SiLU and the product over the strided halves
// (torch.profiler, 2026-12-05).
#include "kernel.h"

#include <ATen/Parallel.h>

// products rounded before their sum, as torch's separate multiply and add ops round them: the same values as
// apply_rotary's torch ops bit for bit (GCC would otherwise fuse them into FMAs in the AVX2 / AVX-512 clones)
#pragma GCC optimize("fp-contract=off")

namespace tiered {
namespace {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return float(v); }

// out [hd] = x * c + rotate_half(x) * s (rotate_half: [-x2, x1] of the halves x1, x2), each product rounded to
// fp32 and then their sum, as apply_rotary's torch ops compute it, then rounded to T.
template <typename T>
TIERED_CLONES void rope_row(const T* x, const float* c, const float* s, int64_t hd, T* out) {
  const int64_t h = hd / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = to_float(x[i]) * c[i], b = -to_float(x[i + h]) * s[i];
    out[i] = T(a + b);
  }
  for (int64_t i = h; i < hd; ++i) {
    const float a = to_float(x[i]) * c[i], b = to_float(x[i - h]) * s[i];
    out[i] = T(a + b);
  }
}

// out [F] = silu(g) * u in fp32 (exp_fast), rounded to T once; fp32 rows are silu_mul's (the decode step's).
TIERED_CLONES void swiglu_row(const at::BFloat16* g, const at::BFloat16* u, int64_t F, at::BFloat16* out) {
  for (int64_t i = 0; i < F; ++i) {
    const float gi = float(g[i]);
    out[i] = at::BFloat16(gi / (1.f + exp_fast(-gi)) * float(u[i]));
  }
}
inline void swiglu_row(const float* g, const float* u, int64_t F, float* out) { silu_mul(g, u, out, F); }

// out [F] = gelu_tanh(g) * u (Gemma's GeGLU) in fp32 (kernel.h's gelu_tanh), rounded to T once
TIERED_CLONES void geglu_row(const at::BFloat16* g, const at::BFloat16* u, int64_t F, at::BFloat16* out) {
  for (int64_t i = 0; i < F; ++i) out[i] = at::BFloat16(gelu_tanh(float(g[i])) * float(u[i]));
}
inline void geglu_row(const float* g, const float* u, int64_t F, float* out) { gelu_tanh_mul(g, u, out, F); }

// out [F] = gpt-oss's clamped GLU of bf16 g and u (kernel.h's clamped_glu: fp32, exp_fast), rounded to bf16 once
TIERED_CLONES void clamped_glu_row(const at::BFloat16* g, const at::BFloat16* u, int64_t F, at::BFloat16* out,
                                   float alpha, float limit) {
  for (int64_t i = 0; i < F; ++i) {
    const float gi = std::min(float(g[i]), limit), ui = std::max(std::min(float(u[i]), limit), -limit);
    out[i] = at::BFloat16((ui + 1.f) * (gi / (1.f + exp_fast(-alpha * gi))));
  }
}

// torch's .to(bfloat16) of v: round to nearest even, NaN to its quiet NaN; plain integer arithmetic and a select,
// so that loops of it vectorize
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(r);
}

// h [n] = x + d, d read as fp32 (a bf16 d exactly), the sum rounded to fp32 once: torch's x + d for fp32 x
TIERED_CLONES void add_row(const float* x, const float* d, int64_t n, float* h) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] = x[i] + d[i];
}
TIERED_CLONES void add_row(const float* x, const uint16_t* d, int64_t n, float* h) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] = x[i] + bf16_to_float(d[i]);
}

// elements of work a parallel item holds at least (a fork and join costs ~1 us on 2 cores)
constexpr int64_t kGrainElements = 1 << 14;

// out [hd] = rope_row of rms_norm(x) (fp32: kernel.h's rms_norm, then rope_row's products), rounded to T once: a
// Qwen3 head's q/k norm and RoPE as RMSNorm's native pass and rope over fp32 rows compute them (the same values
// bit for bit), without the normalized rows in memory. buf [2 hd] fp32 scratch.
// (bf16 rows widened and rounded by bit arithmetic, bf16_to_float / bf16_bits, which vectorize where
// at::BFloat16's conversions did not: with x's rows read in their own order, 1.2 -> 0.83 ms a
// Qwen3-30B-A3B-width layer's 512-token q with its norm)
inline void widen_row(const float* x, int64_t n, float* y) { std::memcpy(y, x, n * sizeof(float)); }
inline void widen_row(const at::BFloat16* x, int64_t n, float* y) {
  const uint16_t* b = reinterpret_cast<const uint16_t*>(x);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_float(b[i]);
}
inline void narrow_row(const float* y, int64_t n, float* out) { std::memcpy(out, y, n * sizeof(float)); }
inline void narrow_row(const float* y, int64_t n, at::BFloat16* out) {
  uint16_t* b = reinterpret_cast<uint16_t*>(out);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) b[i] = bf16_bits(y[i]);
}

template <typename T>
TIERED_CLONES void norm_rope_row(const T* x, const float* w, float eps, const float* c, const float* s, int64_t hd,
                                 float* buf, T* out) {
  float *xf = buf, *nf = buf + hd;
  widen_row(x, hd, xf);
  rms_norm(xf, w, eps, hd, nf);
  rope_row(nf, c, s, hd, xf);
  narrow_row(xf, hd, out);
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                const c10::optional<at::Tensor>& norm_weight, double eps) {
  TIERED_CHECK(x.dim() == 4 && x.stride(3) == 1, "rope: x must be [B, H, T, hd] with contiguous rows, got sizes ",
               x.sizes(), " strides ", x.strides());
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), hd = x.size(3);
  if (norm_weight)
    TIERED_CHECK(norm_weight->scalar_type() == at::kFloat && norm_weight->dim() == 1 && norm_weight->size(0) == hd,
                 "rope: norm_weight must be fp32 [", hd, "], got ", norm_weight->scalar_type(), " ",
                 norm_weight->sizes());
  TIERED_CHECK(hd % 2 == 0, "rope: head_dim must be even, got ", hd);
  TIERED_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rope: cos and sin must be fp32");
  TIERED_CHECK(cos.numel() == B * T * hd && sin.numel() == B * T * hd,
               "rope: cos and sin must hold [B, 1, T, hd] = ", B * T * hd, " values, got ", cos.numel());
  TIERED_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rope: x must be fp32 or bf16, got ",
               x.scalar_type());
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  // rows in x's own order: where x is a projection's output seen as heads ([B, T, H, hd] in memory, transposed),
  // its tokens' heads side by side, read in that order and written so (out [B, T, H, hd] transposed): each token's
  // heads were read one token apart (10 KB for Qwen3-30B-A3B's fused q/k/v) and a 512-token prompt's q with its
  // norm took 1.1 ms a layer on 2 AMX cores, 2026-12-06
  const bool token_major = H > 1 && T > 1 && x.stride(1) < x.stride(2);
  at::Tensor out = token_major ? at::empty({B, T, H, hd}, x.options()).transpose(1, 2) : at::empty({B, H, T, hd}, x.options());
  const int64_t rows = B * H * T;
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  const int64_t ob = out.stride(0), oh = out.stride(1), ot = out.stride(2);
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  const at::Tensor wc = norm_weight ? norm_weight->contiguous() : at::Tensor();
  const float* wp = norm_weight ? wc.data_ptr<float>() : nullptr;
  const float e = float(eps);
  auto run = [&](auto* xp, auto* op) {
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / hd), [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(wp ? 2 * hd : 0);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / (H * T), h = token_major ? r % H : (r / T) % H, t = token_major ? (r / H) % T : r % T;
        const auto* xr = xp + b * sb + h * sh + t * st;
        auto* orow = op + b * ob + h * oh + t * ot;
        const float *cr = cp + (b * T + t) * hd, *sr = sp + (b * T + t) * hd;
        if (wp) norm_rope_row(xr, wp, e, cr, sr, hd, buf.data(), orow);
        else rope_row(xr, cr, sr, hd, orow);
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>(), out.data_ptr<float>());
  else run(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
}

at::Tensor swiglu(const at::Tensor& gu, const c10::optional<at::Tensor>& up, const std::string& act) {
  TIERED_CHECK(act == "silu" || act == "gelu_tanh", "swiglu: act must be silu or gelu_tanh, got ", act);
  const bool gelu = act == "gelu_tanh";
  TIERED_CHECK(gu.scalar_type() == at::kFloat || gu.scalar_type() == at::kBFloat16,
               "swiglu: gu must be fp32 or bf16, got ", gu.scalar_type());
  const bool pair = up.has_value();  // gate and up as two tensors (an expert's two projections' outputs)
  TIERED_CHECK(gu.dim() >= 1 && gu.stride(-1) == 1 && (pair || gu.size(-1) % 2 == 0),
               "swiglu: gu must be [..., 2F] (or the gate [..., F] beside `up`) with contiguous rows, got sizes ",
               gu.sizes());
  if (pair)
    TIERED_CHECK(up->sizes() == gu.sizes() && up->scalar_type() == gu.scalar_type() && up->stride(-1) == 1,
                 "swiglu: up must be the gate's shape and dtype with contiguous rows, got ", up->sizes(), " ",
                 up->scalar_type(), " beside ", gu.sizes(), " ", gu.scalar_type());
  const at::Tensor g2 = gu.reshape({-1, gu.size(-1)});  // a view where the rows are evenly strided
  const at::Tensor u2 = pair ? up->reshape({-1, up->size(-1)}) : g2;
  const int64_t N = g2.size(0), F = pair ? g2.size(1) : g2.size(1) / 2, ld = g2.stride(0), ldu = u2.stride(0);
  const int64_t off = pair ? 0 : F;  // up's columns within its rows
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = F;
  at::Tensor out = at::empty(shape, gu.options());
  auto run = [&](auto* gp, auto* upp, auto* op) {
    at::parallel_for(0, N, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(F, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (gelu) geglu_row(gp + r * ld, upp + r * ldu + off, F, op + r * F);
        else swiglu_row(gp + r * ld, upp + r * ldu + off, F, op + r * F);
      }
    });
  };
  if (gu.scalar_type() == at::kFloat) run(g2.data_ptr<float>(), u2.data_ptr<float>(), out.data_ptr<float>());
  else run(g2.data_ptr<at::BFloat16>(), u2.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
}

// h = x + delta (x itself without delta) and y = rms_norm(h) * w in `dtype`, one pass over each row.
std::tuple<at::Tensor, at::Tensor> residual_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps,
                                                     at::ScalarType dtype, const c10::optional<at::Tensor>& delta) {
  TIERED_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "rms_norm: x must be fp32 [..., D], got ", x.scalar_type(),
               " ", x.sizes());
  const int64_t D = x.size(-1);
  TIERED_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == D, "rms_norm: weight must be fp32 [", D,
               "], got ", w.scalar_type(), " ", w.sizes());
  TIERED_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rms_norm: dtype must be fp32 or bf16, got ", dtype);
  if (delta) {
    TIERED_CHECK(delta->sizes() == x.sizes(), "rms_norm: delta must have x's sizes ", x.sizes(), ", got ", delta->sizes());
    TIERED_CHECK(delta->scalar_type() == at::kFloat || delta->scalar_type() == at::kBFloat16,
                 "rms_norm: delta must be fp32 or bf16, got ", delta->scalar_type());
  }
  const at::Tensor x2 = x.reshape({-1, D}).contiguous(), wc = w.contiguous();
  const at::Tensor d2 = delta ? delta->reshape({-1, D}).contiguous() : at::Tensor();
  const int64_t N = x2.size(0);
  at::Tensor h = delta ? at::empty({N, D}, x2.options()) : x2;
  at::Tensor y = at::empty({N, D}, x2.options().dtype(dtype));
  const float *xp = x2.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const bool bf16_delta = delta && d2.scalar_type() == at::kBFloat16, bf16_out = dtype == at::kBFloat16;
  const float* dp = delta && !bf16_delta ? d2.data_ptr<float>() : nullptr;
  const uint16_t* dbp = bf16_delta ? reinterpret_cast<const uint16_t*>(d2.data_ptr<at::BFloat16>()) : nullptr;
  float* yp = bf16_out ? nullptr : y.data_ptr<float>();
  uint16_t* ybp = bf16_out ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr;
  const float e = float(eps);
  at::parallel_for(0, N, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(bf16_out ? D : 0);
    for (int64_t r = r0; r < r1; ++r) {
      float* hr = hp + r * D;
      if (dbp) add_row(xp + r * D, dbp + r * D, D, hr);
      else if (dp) add_row(xp + r * D, dp + r * D, D, hr);
      if (bf16_out) {
        rms_norm(hr, wp, e, D, buf.data());
        round_row(buf.data(), D, ybp + r * D);
      } else {
        rms_norm(hr, wp, e, D, yp + r * D);
      }
    }
  });
  return {delta ? h.view(x.sizes()) : x, y.view(x.sizes())};
}

}  // namespace

void clamped_glu_bf16(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n, float alpha, float limit) {
  clamped_glu_row(reinterpret_cast<const at::BFloat16*>(g), reinterpret_cast<const at::BFloat16*>(u), n,
                  reinterpret_cast<at::BFloat16*>(a), alpha, limit);
}

void swiglu_bf16(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n) {
  swiglu_row(reinterpret_cast<const at::BFloat16*>(g), reinterpret_cast<const at::BFloat16*>(u), n,
             reinterpret_cast<at::BFloat16*>(a));
}

TIERED_CLONES void round_row(const float* y, int64_t n, uint16_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(y[i]);
}

void register_prompt(pybind11::module& m) {
  namespace py = pybind11;
  m.def("rope", &rope, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("norm_weight") = py::none(),
        py::arg("eps") = 0.0,
        "x [B, H, T, hd] fp32 or bf16 (rows contiguous, any other strides), cos / sin fp32 [B, 1, T, hd] -> "
        "x * cos + rotate_half(x) * sin, a new [B, H, T, hd] in x's dtype with contiguous rows, its heads side by side "
        "where x's are (a projection's output viewed as heads), else contiguous (models/layers.apply_rotary); "
        "with norm_weight (fp32 [hd]) each row is first RMS-normalized with it (eps; Qwen3's per-head q/k norm), "
        "in fp32 throughout and rounded once",
        py::call_guard<py::gil_scoped_release>());
  m.def("swiglu", &swiglu, py::arg("gu"), py::arg("up") = py::none(), py::arg("act") = "silu",
        "gu [..., 2F] fp32 or bf16 (gate then up; rows contiguous) -> silu(gate) * up [..., F] in gu's dtype, "
        "computed in fp32 and rounded once (models/layers.swiglu); with `up` (gu's shape and dtype, rows contiguous) "
        "gu is the gate [..., F] and up the other half (an expert's two projections: quant/experts.ExpertFormat); "
        "act \"gelu_tanh\": gelu_tanh(gate) * up instead (Gemma's GeGLU, models/layers.glu)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &residual_rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("dtype"),
        py::arg("delta") = py::none(),
        "x [..., D] fp32, weight fp32 [D], delta None or [..., D] fp32 / bf16 -> (h, y): h = x + delta (x itself "
        "without delta), y = h / sqrt(mean(h^2) + eps) * weight computed in fp32 and rounded once to dtype (fp32 or "
        "bf16), both [..., D] (models/layers.RMSNorm.residual; the native decode step's norm)",
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace tiered
