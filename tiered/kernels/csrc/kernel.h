// tiered's CPU kernel interface: one projection y = x W^T (+ bias) on fp32 rows.
//
// Every decode-path weight (int4 / int8 / bf16 / fp32, torch's kernels or our own) is a Kernel,
// so the native decode step (decode.cpp) runs any of them without knowing its format.
#pragma once
#include <torch/extension.h>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>

namespace tiered {

// Error messages without iostreams. TORCH_CHECK formats its arguments with a string stream
// compiled into this library; on the H200 host of shared/gpu-runs/2026-11-26-h200 the built library
// carried its own copy of libstdc++'s stream code, and inserting a number there segfaulted (the
// process died on every failed check, where the caller expects a RuntimeError). cat() formats with
// std::to_string / snprintf (libc) instead, and TIERED_CHECK hands TORCH_CHECK one finished string.
inline void cat_one(std::string& s, const char* v) { s += v; }
inline void cat_one(std::string& s, const std::string& v) { s += v; }
inline void cat_one(std::string& s, char v) { s += v; }
inline void cat_one(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void cat_one(std::string& s, at::ScalarType v) { s += c10::toString(v); }
inline void cat_one(std::string& s, double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  s += b;
}
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>, int> = 0>
inline void cat_one(std::string& s, T v) { s += std::to_string(v); }
inline void cat_one(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += ']';
}
template <class... A>
std::string cat(const A&... a) {
  std::string s;
  (cat_one(s, a), ...);
  return s;
}

}  // namespace tiered

#define TIERED_CHECK(cond, ...) TORCH_CHECK(cond, ::tiered::cat(__VA_ARGS__))

namespace tiered {

// decode.cpp: whether the native step's attention runs 16-float vectors (AVX-512 CPUs; the kernel tuning's
// "attend_wide"). Set between calls, not during one.
extern bool g_attend_wide;

struct Kernel {
  int64_t in_features = 0;
  int64_t out_features = 0;
  virtual ~Kernel() = default;
  // y [B, out_features] fp32 = x [B, in_features] fp32 . W^T (+ bias). Rows are contiguous.
  // Called without the GIL; may use at::parallel_for (torch's OpenMP team).
  virtual void run(const float* x, int64_t B, float* y) const = 0;
  // `run` as the native decode step calls it (decode.cpp's run_one: its projections over a batch's rows, a prompt's
  // rows): a kernel may take another path there (tiled int4 and int8 on AMX from 24
  // rows: Int4TGemv::run_step, Int8Gemv::run_step).
  virtual void run_step(const float* x, int64_t B, float* y) const { run(x, B, y); }
  // `run` on tiered's AMX GEMM over the rows rounded to bf16, whatever B, where this kernel has that path here
  // (tiled int4 and mxfp4: Int4TGemv, on a CPU with AMX, amx_rows on): true; false (nothing written) elsewhere.
  virtual bool run_amx(const float* x, int64_t B, float* y) const { return false; }
  // `run_amx` over rows already in bf16 (x [B, in_features] bf16 bits), into fp32 yf or bf16 yb (the other
  // nullptr): the AMX GEMM's own output, no rounding pass between two GEMMs (gemv.cpp's amx_swiglu).
  virtual bool run_amx_bf16(const uint16_t* x, int64_t B, float* yf, uint16_t* yb) const { return false; }
  // The weight bytes one call reads (for benchmarks and the planner's bytes-per-token figures).
  virtual int64_t weight_bytes() const = 0;
  virtual std::string name() const = 0;
};

using KernelPtr = std::shared_ptr<Kernel>;

// Round-trip helpers between fp32 rows and a tensor of another dtype.
at::Tensor rows_to(const float* x, int64_t B, int64_t K, at::ScalarType dtype);
void rows_from(const at::Tensor& t, float* y);  // t [B, N] contiguous any float dtype -> y fp32

// Inner loops (decode.cpp's glue, prompt.cpp's), compiled for AVX-512, AVX2+FMA and the x86-64 baseline and picked at load
// time (gcc's target_clones): the build has no -march flags, so this is how they get wide vectors.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TIERED_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TIERED_CLONES
#endif

// e^x for x <= 0 .. small positive (softmax, SiLU), as plain arithmetic so that loops of it vectorize
// (std::exp does not without -ffast-math): 2^(x log2 e) = 2^n 2^f, a degree-6 polynomial for 2^f on
// [-0.5, 0.5] (relative error < 2e-7, as std::exp's float result to within 2 ulp), 2^n by exponent bits.
// Its constants: the clamp, log2 e (which gemv.cpp's AMX attention shares: its softmax in base 2), and the
// polynomial's coefficients from the highest degree down.
constexpr float kExpLo = -87.f, kExpHi = 88.f, kLog2e = 1.44269504088896341f;
constexpr float kExp2Poly[7] = {1.5403530393381609e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
                                5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.f};
__attribute__((always_inline)) inline float exp_fast(float x) {
  x = x < kExpLo ? kExpLo : x;  // selects GCC if-converts (-fno-trapping-math); std::min / max stayed scalar
  x = x > kExpHi ? kExpHi : x;
  const float t = x * kLog2e;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = kExp2Poly[0];
  p = p * f + kExp2Poly[1];
  p = p * f + kExp2Poly[2];
  p = p * f + kExp2Poly[3];
  p = p * f + kExp2Poly[4];
  p = p * f + kExp2Poly[5];
  p = p * f + kExp2Poly[6];
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += int32_t(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

// GELU's tanh approximation (torch's gelu(approximate="tanh"), Gemma's GeGLU): 0.5 x (1 + tanh(z)), z = sqrt(2 / pi)
// (x + 0.044715 x^3), as x / (1 + e^(-2z)) (SiLU's form: no cancellation where tanh nears -1), by exp_fast
// (clamped: its ends give tanh's +-1)
__attribute__((always_inline)) inline float gelu_tanh(float x) {
  const float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);  // sqrt(2 / pi) (x + 0.044715 x^3)
  return x / (1.f + exp_fast(-2.f * z));
}

// out [n] = y rounded to bf16 (nearest even, NaN kept quiet: torch's .to(bfloat16)); prompt.cpp's norms, gemv.cpp's
// AMX rows of the native step
void round_row(const float* y, int64_t n, uint16_t* out);

// a bf16 value's bits as fp32 (exact): decode.cpp's bf16 KV rows, prompt.cpp's bf16 residual deltas
__attribute__((always_inline)) inline float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// y [D] = x / sqrt(mean(x^2) + eps) * w, fp32 (models/layers.RMSNorm on fp32 rows; y may be x): the native decode
// step's norms and a prompt's (prompt.cpp), the same function (decode.cpp).
void rms_norm(const float* x, const float* w, float eps, int64_t D, float* y);
// a [n] = silu(g) * u (SwiGLU's activation), fp32, vectorized with a polynomial exp (decode.cpp).
void silu_mul(const float* g, const float* u, float* a, int64_t n);
// a [n] = gelu_tanh(g) * u (Gemma's GeGLU: GELU's tanh approximation), fp32, the same polynomial exp (decode.cpp).
void gelu_tanh_mul(const float* g, const float* u, float* a, int64_t n);
// a [n] bf16 = silu(g) * u for bf16 g and u, in fp32 (exp_fast) and rounded once (prompt.cpp's `swiglu`, what a
// prompt's dequantized expert and gemv.cpp's amx_swiglu take); a may be g.
void swiglu_bf16(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n);
// a [n] bf16 = clamped_glu of bf16 g and u in fp32, rounded once (gemv.cpp's amx_swiglu for gpt-oss's experts).
void clamped_glu_bf16(const uint16_t* g, const uint16_t* u, uint16_t* a, int64_t n, float alpha, float limit);
// a [n] = (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit): gpt-oss's clamped
// GLU (models/gpt_oss.clamped_glu), fp32, the same polynomial exp (decode.cpp).
void clamped_glu(const float* g, const float* u, float* a, int64_t n, float alpha, float limit);

// out [dim] fp32 = one GGUF Q8_0 row (dim / 32 blocks of 34 bytes: an fp16 scale d, then 32 int8 q) as q * d,
// gguf.quants.dequantize's products (kernels.cpp; the embedding lookups of q8_0_rows and DecodeStep.burst).
void q8_0_row(const uint8_t* row, int64_t dim, float* out);

void register_kernels(pybind11::module& m);
void register_decode(pybind11::module& m);
void register_gemv(pybind11::module& m);  // gemv.cpp: tiered's own int4 / int8 / bf16 GEMV kernels
void register_prompt(pybind11::module& m);  // prompt.cpp: a prompt's elementwise glue (RoPE, SwiGLU)

}  // namespace tiered
