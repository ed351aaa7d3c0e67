// Kernels that call torch's own CPU weight kernels (the packed int4 / int8 ones and dense mm),
// plus the Python-facing wrapper every Kernel shares.
#include "kernel.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace tiered {

at::Tensor rows_to(const float* x, int64_t B, int64_t K, at::ScalarType dtype) {
  auto t = at::empty({B, K}, at::TensorOptions().dtype(dtype));
  const int64_t n = B * K;
  switch (dtype) {
    case at::kFloat: std::memcpy(t.data_ptr<float>(), x, n * sizeof(float)); break;
    case at::kBFloat16: {
      auto* d = t.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < n; ++i) d[i] = at::BFloat16(x[i]);
      break;
    }
    case at::kHalf: {
      auto* d = t.data_ptr<at::Half>();
      for (int64_t i = 0; i < n; ++i) d[i] = at::Half(x[i]);
      break;
    }
    default: TIERED_CHECK(false, "rows_to: unsupported dtype ", dtype);
  }
  return t;
}

void rows_from(const at::Tensor& t0, float* y) {
  auto t = t0.contiguous();
  const int64_t n = t.numel();
  switch (t.scalar_type()) {
    case at::kFloat: std::memcpy(y, t.data_ptr<float>(), n * sizeof(float)); break;
    case at::kBFloat16: {
      const auto* s = t.data_ptr<at::BFloat16>();
      for (int64_t i = 0; i < n; ++i) y[i] = float(s[i]);
      break;
    }
    case at::kHalf: {
      const auto* s = t.data_ptr<at::Half>();
      for (int64_t i = 0; i < n; ++i) y[i] = float(s[i]);
      break;
    }
    default: TIERED_CHECK(false, "rows_from: unsupported dtype ", t.scalar_type());
  }
}

namespace {

void add_bias(const c10::optional<at::Tensor>& bias, int64_t B, int64_t N, float* y) {
  if (!bias) return;
  auto b = bias->to(at::kFloat).contiguous();
  const float* bp = b.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r)
    for (int64_t j = 0; j < N; ++j) y[r * N + j] += bp[j];
}

// torch's `_weight_int4pack_mm_for_cpu`: bf16 activations, packed int4 weights with per-group
// scales and zero points (quant/int4.py's Int4Linear).
struct Int4PackKernel : Kernel {
  at::Tensor packed, scales_zeros;
  int64_t group;
  c10::optional<at::Tensor> bias;
  void run(const float* x, int64_t B, float* y) const override {
    auto xin = rows_to(x, B, in_features, at::kBFloat16);
    rows_from(at::_weight_int4pack_mm_for_cpu(xin, packed, group, scales_zeros), y);
    add_bias(bias, B, out_features, y);
  }
  int64_t weight_bytes() const override { return packed.nbytes() + scales_zeros.nbytes(); }
  std::string name() const override { return "int4pack(torch)"; }
};

// torch's `_weight_int8pack_mm`: bf16 activations, int8 weights [N, K] with a scale per row.
struct Int8PackKernel : Kernel {
  at::Tensor q, scale;
  c10::optional<at::Tensor> bias;
  void run(const float* x, int64_t B, float* y) const override {
    auto xin = rows_to(x, B, in_features, at::kBFloat16);
    rows_from(at::_weight_int8pack_mm(xin, q, scale), y);
    add_bias(bias, B, out_features, y);
  }
  int64_t weight_bytes() const override { return q.nbytes() + scale.nbytes(); }
  std::string name() const override { return "int8pack(torch)"; }
};

// A dense weight [N, K] in its own dtype (fp32 in the lossless mode, or bf16), through at::linear.
struct DenseKernel : Kernel {
  at::Tensor w;
  c10::optional<at::Tensor> bias;
  void run(const float* x, int64_t B, float* y) const override {
    auto xin = rows_to(x, B, in_features, w.scalar_type());
    rows_from(at::linear(xin, w, bias), y);
  }
  int64_t weight_bytes() const override { return w.nbytes(); }
  std::string name() const override { return std::string("dense(") + c10::toString(w.scalar_type()) + ")"; }
};

at::Tensor call_kernel(const Kernel& k, const at::Tensor& x0, bool step = false) {
  TIERED_CHECK(x0.dim() == 2 && x0.size(1) == k.in_features, "kernel ", k.name(), ": x must be [B, ",
              k.in_features, "], got ", x0.sizes());
  auto x = x0.to(at::kFloat).contiguous();
  auto y = at::empty({x.size(0), k.out_features}, at::TensorOptions().dtype(at::kFloat));
  {
    pybind11::gil_scoped_release nogil;
    if (step) k.run_step(x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
    else k.run(x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
  }
  return y;
}

std::string cpu_isa() {
  std::string s;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) s += "avx2 ";
  if (__builtin_cpu_supports("fma")) s += "fma ";
  if (__builtin_cpu_supports("avx512f")) s += "avx512f ";
  if (__builtin_cpu_supports("avx512bw")) s += "avx512bw ";
  if (__builtin_cpu_supports("avx512vnni")) s += "avx512vnni ";
  if (__builtin_cpu_supports("avx512bf16")) s += "avx512bf16 ";
  if (!s.empty()) s.pop_back();
  return s;
}

}  // namespace

void q8_0_row(const uint8_t* row, int64_t dim, float* out) {
  for (int64_t g = 0; g < dim / 32; ++g) {
    const uint8_t* b = row + g * 34;
    const float d = float(c10::Half(uint16_t(b[0] | (b[1] << 8)), c10::Half::from_bits()));
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) out[g * 32 + j] = float(q[j]) * d;
  }
}

namespace {

// GGUF Q8_0 rows of an embedding table blocks uint8 [V, dim / 32 * 34] (per block of 32: an fp16
// scale d, then 32 int8 q) at ids int64 [n] -> fp32 [n, dim] = q * d, the products of
// gguf.quants.dequantize (quant/embedding.q8_0_rows) in one call: a decode step's lookup right after
// the step's weights have streamed through the caches took ~60 us as numpy ops, cold.
at::Tensor q8_0_rows(const at::Tensor& blocks, const at::Tensor& ids, int64_t dim) {
  TIERED_CHECK(dim > 0 && dim % 32 == 0 && blocks.dim() == 2 && blocks.scalar_type() == at::kByte &&
              blocks.is_contiguous() && blocks.size(1) == dim / 32 * 34,
              "q8_0_rows: blocks must be contiguous uint8 [V, dim / 32 * 34]");
  auto idx = ids.to(at::kLong).contiguous().view(-1);
  const int64_t n = idx.numel(), V = blocks.size(0), rb = blocks.size(1);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TIERED_CHECK(0 <= ip[i] && ip[i] < V, "q8_0_rows: token id ", ip[i], " outside the table of ", V, " rows");
  auto out = at::empty({n, dim}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* base = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) q8_0_row(base + ip[i] * rb, dim, o + i * dim);
  return out;
}

// y [G, B, N_g] = for each group g, kernels[g](x [G, B, K] row block g): G independent projections in
// one call (latent attention's per-head absorbed matrices, models/deepseek.py). x fp32 contiguous
// [G, B, K]; every kernel takes K inputs and gives N outputs. The GIL is released; each kernel's run
// may use torch's OpenMP team, one group after another.
at::Tensor run_grouped(const std::vector<KernelPtr>& kernels, const at::Tensor& x) {
  const int64_t G = int64_t(kernels.size());
  TIERED_CHECK(G > 0 && x.dim() == 3 && x.size(0) == G && x.scalar_type() == at::kFloat && x.is_contiguous(),
               "run_grouped: x must be contiguous float32 [G, B, K] with G = ", G, " kernels, got ", x.sizes());
  const int64_t B = x.size(1), K = kernels[0]->in_features, N = kernels[0]->out_features;
  for (const auto& k : kernels)
    TIERED_CHECK(k && k->in_features == K && k->out_features == N && x.size(2) == K,
                 "run_grouped: every kernel must map ", x.size(2), " inputs to ", N, " outputs");
  auto y = at::empty({G, B, N}, at::TensorOptions().dtype(at::kFloat));
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  {
    pybind11::gil_scoped_release nogil;
    for (int64_t g = 0; g < G; ++g) kernels[g]->run(xp + g * B * K, B, yp + g * B * N);
  }
  return y;
}

}  // namespace

void register_kernels(pybind11::module& m) {
  namespace py = pybind11;
  m.def("q8_0_rows", &q8_0_rows, py::arg("blocks"), py::arg("ids"), py::arg("dim"),
        "GGUF Q8_0 embedding rows: blocks uint8 [V, dim / 32 * 34], ids int64 [n] -> fp32 [n, dim]");
  py::class_<Kernel, KernelPtr>(m, "Kernel", "One projection y [B, N] fp32 = x [B, K] . W^T (+ bias).")
      .def_readonly("in_features", &Kernel::in_features)
      .def_readonly("out_features", &Kernel::out_features)
      .def("weight_bytes", &Kernel::weight_bytes)
      .def("name", &Kernel::name)
      .def("__call__", [](const Kernel& k, const at::Tensor& x) { return call_kernel(k, x); },
           "x [B, K] any float dtype -> y [B, N] fp32")
      .def("step", [](const Kernel& k, const at::Tensor& x) { return call_kernel(k, x, true); },
           "As __call__, through the path the native decode step calls (Kernel::run_step: e.g. tiled int4 and int8 on "
           "AMX from 24 rows)");
  m.def("run_grouped", &run_grouped, py::arg("kernels"), py::arg("x"),
        "G projections in one call: x float32 [G, B, K] -> y float32 [G, B, N], y[g] = kernels[g](x[g]).");
  m.def("int4pack_kernel", [](at::Tensor packed, int64_t group, at::Tensor scales_zeros, int64_t in_features,
                              int64_t out_features, c10::optional<at::Tensor> bias) -> KernelPtr {
    auto k = std::make_shared<Int4PackKernel>();
    k->packed = packed; k->group = group; k->scales_zeros = scales_zeros; k->bias = bias;
    k->in_features = in_features; k->out_features = out_features;
    return k;
  }, py::arg("packed"), py::arg("group"), py::arg("scales_zeros"), py::arg("in_features"), py::arg("out_features"),
     py::arg("bias") = py::none());
  m.def("int8pack_kernel", [](at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> bias) -> KernelPtr {
    TIERED_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "int8pack_kernel: q must be int8 [N, K]");
    TIERED_CHECK(q.size(1) % 16 == 0, "int8pack_kernel: torch's _weight_int8pack_mm needs K % 16 == 0, got K = ",
                 q.size(1), " (quant/int8.int8pack_mm)");
    auto k = std::make_shared<Int8PackKernel>();
    k->q = q.contiguous(); k->scale = scale; k->bias = bias;
    k->out_features = q.size(0); k->in_features = q.size(1);
    return k;
  }, py::arg("q"), py::arg("scale"), py::arg("bias") = py::none());
  m.def("dense_kernel", [](at::Tensor w, c10::optional<at::Tensor> bias) -> KernelPtr {
    TIERED_CHECK(w.dim() == 2, "dense_kernel: w must be [N, K]");
    auto k = std::make_shared<DenseKernel>();
    k->w = w;
    k->bias = bias ? c10::optional<at::Tensor>(bias->to(w.scalar_type())) : c10::nullopt;
    k->out_features = w.size(0); k->in_features = w.size(1);
    return k;
  }, py::arg("w"), py::arg("bias") = py::none());
  m.def("cpu_isa", &cpu_isa, "The SIMD extensions this CPU has that the kernels can use (space-separated).");
}

}  // namespace tiered
