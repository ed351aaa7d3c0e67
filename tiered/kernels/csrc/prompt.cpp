// A prompt's elementwise glue on the CPU, one pass each where torch's ops take several: RoPE (q and k rotated
// into a new tensor) and SwiGLU's activation (silu(gate) * up from the fused gate/up GEMM's output). On 2 Sapphire
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

// elements of work a parallel item holds at least (a fork and join costs ~1 us on 2 cores)
constexpr int64_t kGrainElements = 1 << 14;

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TIERED_CHECK(x.dim() == 4 && x.stride(3) == 1, "rope: x must be [B, H, T, hd] with contiguous rows, got sizes ",
               x.sizes(), " strides ", x.strides());
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), hd = x.size(3);
  TIERED_CHECK(hd % 2 == 0, "rope: head_dim must be even, got ", hd);
  TIERED_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rope: cos and sin must be fp32");
  TIERED_CHECK(cos.numel() == B * T * hd && sin.numel() == B * T * hd,
               "rope: cos and sin must hold [B, 1, T, hd] = ", B * T * hd, " values, got ", cos.numel());
  TIERED_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rope: x must be fp32 or bf16, got ",
               x.scalar_type());
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({B, H, T, hd}, x.options());
  const int64_t rows = B * H * T;
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  auto run = [&](auto* xp, auto* op) {
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / hd), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / (H * T), h = (r / T) % H, t = r % T;
        rope_row(xp + b * sb + h * sh + t * st, cp + (b * T + t) * hd, sp + (b * T + t) * hd, hd, op + r * hd);
      }
    });
  };
  if (x.scalar_type() == at::kFloat) run(x.data_ptr<float>(), out.data_ptr<float>());
  else run(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
}

at::Tensor swiglu(const at::Tensor& gu) {
  TIERED_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0 && gu.stride(-1) == 1,
               "swiglu: gu must be [..., 2F] with contiguous rows, got sizes ", gu.sizes());
  TIERED_CHECK(gu.scalar_type() == at::kFloat || gu.scalar_type() == at::kBFloat16,
               "swiglu: gu must be fp32 or bf16, got ", gu.scalar_type());
  const at::Tensor g2 = gu.reshape({-1, gu.size(-1)});  // a view where the rows are evenly strided
  const int64_t N = g2.size(0), F = g2.size(1) / 2, ld = g2.stride(0);
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = F;
  at::Tensor out = at::empty(shape, gu.options());
  auto run = [&](auto* gp, auto* op) {
    at::parallel_for(0, N, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(F, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) swiglu_row(gp + r * ld, gp + r * ld + F, F, op + r * F);
    });
  };
  if (gu.scalar_type() == at::kFloat) run(g2.data_ptr<float>(), out.data_ptr<float>());
  else run(g2.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

void register_prompt(pybind11::module& m) {
  namespace py = pybind11;
  m.def("rope", &rope, py::arg("x"), py::arg("cos"), py::arg("sin"),
        "x [B, H, T, hd] fp32 or bf16 (rows contiguous, any other strides), cos / sin fp32 [B, 1, T, hd] -> "
        "x * cos + rotate_half(x) * sin, a new contiguous [B, H, T, hd] in x's dtype (models/layers.apply_rotary)",
        py::call_guard<py::gil_scoped_release>());
  m.def("swiglu", &swiglu, py::arg("gu"),
        "gu [..., 2F] fp32 or bf16 (gate then up; rows contiguous) -> silu(gate) * up [..., F] in gu's dtype, "
        "computed in fp32 and rounded once (models/layers.swiglu)",
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace tiered
