// tiered's own GEMV kernels for CPU decode (batch 1..8, any batch works): int4 group-32, int8
// per-row and bf16 weights, read as stored, fp32 rows in and out; and a fused SwiGLU expert.
//
// Each kernel is a `Gemv`: besides Kernel::run it computes any range of output rows from an `Act`
// (one call's activations, prepared once: bf16 copy, group sums), so a fused expert prepares x once
// for gate and up and runs both in one parallel region.
//
// ISA: one build, chosen at run time. AVX-512 (F/BW/VL + BF16: vdpbf16ps) -> AVX2 + FMA -> scalar.
// `set_isa` forces a lower path (tests run every path on an AVX-512 machine).
#pragma once
#include "kernel.h"

#include <cstdint>
#include <vector>

namespace tiered {
namespace gemv {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Isa best_isa();     // what this CPU supports
Isa current_isa();  // what the kernels use now (best_isa unless set_isa lowered it)

// One call's activations, prepared once for every kernel reading them. All pointers are rows of
// B: x fp32 [B, K] as given; xr fp32 [B, K] = x rounded to bf16; xb bf16 bits [B, K] of xr;
// gsum fp32 [B, K/32] = sums of xr over groups of 32 (int4's zero term).
struct Act {
  const float* x = nullptr;
  const float* xr = nullptr;
  const uint16_t* xb = nullptr;
  const float* gsum = nullptr;
  int64_t B = 0, K = 0;
};

// Buffers an Act lives in (one per concurrent Act; reused across calls: no allocation once warm).
struct ActBuffers {
  std::vector<float> xr, gsum;
  std::vector<uint16_t> xb;
  Act prepare(const float* x, int64_t B, int64_t K);
};

struct Gemv : Kernel {
  // y[b * ldy + n] for b in [b0, b0 + nb), n in [n0, n1): one thread's share of a call.
  virtual void rows(const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) const = 0;
  // Rows per parallel work item and bytes each item reads (to size chunks).
  virtual int64_t block_rows() const { return 16; }
  void run(const float* x, int64_t B, float* y) const override;
};

}  // namespace gemv
}  // namespace tiered
