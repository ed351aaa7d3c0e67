// tiered's CPU kernel interface: one projection y = x W^T (+ bias) on fp32 rows.
//
// Every decode-path weight (int4 / int8 / bf16 / fp32, torch's kernels or our own) is a Kernel,
// so the native decode step (decode.cpp) runs any of them without knowing its format.
#pragma once
#include <torch/extension.h>
#include <memory>

namespace tiered {

struct Kernel {
  int64_t in_features = 0;
  int64_t out_features = 0;
  virtual ~Kernel() = default;
  // y [B, out_features] fp32 = x [B, in_features] fp32 . W^T (+ bias). Rows are contiguous.
  // Called without the GIL; may use at::parallel_for (torch's OpenMP team).
  virtual void run(const float* x, int64_t B, float* y) const = 0;
  // The weight bytes one call reads (for benchmarks and the planner's bytes-per-token figures).
  virtual int64_t weight_bytes() const = 0;
  virtual std::string name() const = 0;
};

using KernelPtr = std::shared_ptr<Kernel>;

// Round-trip helpers between fp32 rows and a tensor of another dtype.
at::Tensor rows_to(const float* x, int64_t B, int64_t K, at::ScalarType dtype);
void rows_from(const at::Tensor& t, float* y);  // t [B, N] contiguous any float dtype -> y fp32

// a [n] = silu(g) * u (SwiGLU's activation), fp32, vectorized with a polynomial exp (decode.cpp).
void silu_mul(const float* g, const float* u, float* a, int64_t n);

void register_kernels(pybind11::module& m);
void register_decode(pybind11::module& m);
void register_gemv(pybind11::module& m);  // gemv.cpp: tiered's own int4 / int8 / bf16 GEMV kernels

}  // namespace tiered
