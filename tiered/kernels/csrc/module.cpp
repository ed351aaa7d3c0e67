// The extension module: each source file registers its functions here.
#include "kernel.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tiered's native CPU kernels (tiered/kernels/csrc)";
  tiered::register_kernels(m);
  tiered::register_decode(m);
  tiered::register_gemv(m);
  tiered::register_prompt(m);
}
