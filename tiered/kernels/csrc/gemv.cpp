// tiered's own GEMV kernels (see gemv.h): int4 group-32 (bf16 or int8 activations), int8 per-row, bf16,
// fp8 (E4M3, 128 x 128 block scales); AVX-512 / AVX2 / scalar.
//
// Layouts (read as stored, no repacking at call time):
//   int4: codes uint8 [N, K/2], two codes per byte, column 2i in the low nibble, 2i+1 in the high
//         one (ExpertFormat's "plain" layout); scale, zero (and an optional zero residual) bf16,
//         indexed [n, g] through any strides (Int4Linear's scales_zeros [G, N, 2] as is).
//         w = (q - 8) * scale + zero + residual.
//   int8: q int8 [N, K], scale [N] (w = q * scale).
//   bf16: w bf16 [N, K].
//   fp8: q uint8 [N, K] (FP8 E4M3 "fn" bit patterns), bs fp32 [ceil(N/128), ceil(K/128)] (a scale
//         per 128 x 128 block, DeepSeek-V3's "weight_scale_inv"): w = e4m3(q) * bs[n/128, k/128].
// Numerics: int4 and bf16 read activations rounded to bf16 (as torch's int4 / bf16 kernels do) and
// accumulate in fp32; int8 and fp8 read fp32 activations. The AVX-512 int4 path turns a code q into the
// bf16 number 128 + q (bits 0x4300 | q: exact) and takes the 136 * sum(x) it adds out with the
// zero term, so each group is one vdpbf16ps per activation row. int4 with act "q8" (Int4Q8Gemv)
// reads x quantized to int8 per group of 32 (llama.cpp's Q8_0) and does 4 groups per vpdpbusd pair
// (AVX2: vpmaddubsw + vpmaddwd), the integer dots exact; see "int4 x q8" below.
#include "gemv.h"

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>

#define TIERED_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx2,fma")))
#define TIERED_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TIERED_FORCE_INLINE inline __attribute__((always_inline))

namespace tiered {
namespace gemv {
namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxNB = 8;  // activation rows per inner pass (accumulators held in registers)
// int16 activations (Act::xs) are rounded to +-32639 = 127 * 257, not 32767: then every value is
// 256 h + l with h and l signed bytes (Act::xh, xl), which vpdpbusd multiplies by unsigned weight
// bytes exactly (int4t_w16_avx512). One bit in 32767 coarser than the full int16 range.
constexpr float kW16Levels = 32639.f;

inline uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float bf16f(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::atomic<int> g_isa{-1};

// Kernel tuning, set per machine (tiered/kernels/tune.py measures it once after the build; set_tuning):
// g_stream_prefetch: the weight-stream loops issue software prefetches ahead of their loads (batch-1 calls of the
//   formats of a byte or more a weight: g_stream_prefetch_bytes instead). On the
//   2-core Zen 3 VMs (AVX2) they lifted batch-1 int4 decode (prefetch 4 KB ahead); on a Zen 4 VM
//   (AVX-512) the same loops read 81-88% of the DRAM rate with them and 95-100% without (the L2
//   stream prefetcher keeps up alone there, and the extra loads only compete with it).
// g_int4_w16: tiled int4 at batch 1 on AVX-512 with VBMI reads int16 activations (int4t_w16_avx512)
//   instead of bf16 pairs (int4t_avx512): on that Zen 4 VM 86% vs 74% of the DRAM rate (the bf16
//   path's vpmultishiftqb + vpternlogd + vdpbf16ps per 32 weights is compute-bound near DRAM speed).
// g_prefetch_l2: those prefetches fill the L2 (prefetcht1) rather than the L1 (prefetcht0). A prefetch
//   into the L1 holds one of the core's ~16 L1 miss buffers until its line arrives, so at DRAM latency
//   it caps one core's stream near 16 lines a latency; the L2's queue holds ~48. On the 2-core Sapphire
//   Rapids VM (2026-11-30; Qwen3-30B-A3B-width Q4_0 experts on int8 activations, cycled over 3.2 GB,
//   alternated processes) t1 lifted one token's 8 experts of a layer from 12.9-13.8 GB/s to 15.4-15.7
//   on 2 threads, and a prompt's 100 experts of 2 rows from 13.8-14.4 to 17.6-18.7.
// g_stream_prefetch_rows: calls of 2+ activation rows issue those prefetches even where g_stream_prefetch is off.
//   Such a call computes longer per weight byte than batch 1, and its weight stream overlapped the compute poorly
//   without them on that Zen 4 VM (2026-12-02, int4 on 8 int8 rows, weights cycled past the L3): a 4096 x 4096
//   weight 0.99-1.0 ms against 0.73-0.83 with them (0.61 in cache), a SmolLM2 gate/up 107 us against 93-98, where
//   batch 1 read 282-432 us either way.
// g_stream_prefetch_bytes: the same switch for batch-1 calls of weights stored in a byte or more a weight (int8,
//   int8-g32, fp8, bf16, fp32; run_region tells them by their weight_bytes), g_stream_prefetch then governing the
//   sub-byte formats' (int4, mxfp4, the k-quants). Their loops compute less a weight byte than the int4 ones', and on
//   the Zen 4 VM (2026-12-07, weights cycled past the L3, one row) the prefetches made OLMoE-width bf16 experts 28%
//   and int8-g32 decode copies 7% slower where a 4096 x 4096 int4 copy ran 10% faster with them: one switch for both
//   was a coin flip of the tuning's summed A/B, and SmolLM2's decode (int4 layers, an int8-g32 head) ran 250 tok/s
//   with them on and 272 with them off.
// Scale and zero-point prefetches (a second, strided stream) stay on either way. Plain globals: the
// setter runs between kernel calls, never during one.
inline bool g_stream_prefetch = true;
inline bool g_int4_w16 = false;
inline bool g_prefetch_l2 = false;
inline bool g_stream_prefetch_rows = true;
inline bool g_stream_prefetch_bytes = true;
// whether the kernel call running on this thread has 2+ activation rows, and whether its weight takes a byte or more a
// weight (both set by run_region around each call)
inline thread_local bool t_rows_call = false;
inline thread_local bool t_byte_call = false;

// A software prefetch of the weight stream at p (when the machine's tuning asks for them).
// The prefetch helpers are always_inline: GCC's IPA finds a plain inline helper free of side effects
// (a prefetch does not count) and deletes the calls it did not inline early, e.g. from a kernel of
// another target attribute: every int4 kernel had lost its stream and scale prefetches that way.
TIERED_FORCE_INLINE void prefetch_stream(const void* p) {
  if (!(t_byte_call ? g_stream_prefetch_bytes : g_stream_prefetch) && !(g_stream_prefetch_rows && t_rows_call)) return;
  if (g_prefetch_l2) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  else _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}


// ------------------------------------------------------------------------------------ weights
struct Int4W {
  const uint8_t* codes;
  int64_t ldc;  // bytes per row (K / 2)
  const uint16_t *s, *z, *zr;  // zr may be null
  int64_t s_n, s_g, z_n, z_g, zr_n, zr_g;  // element strides
  const float* bias;  // [N] or null
  // The tiled layout: tile t (rows 16t..16t+15) starts at codes + t * tstride, its group g's 256 code
  // bytes at + g * gstride. Scales apart (gstride 256): s = sz [N/16, G, 16, 2] (z = s + 1), a tile's
  // scales and zeros one contiguous run. Scales inline (inline_sz, gstride 320: five whole cache
  // lines a group): each group's code bytes are followed by its 16 (s, z) bf16 pairs, so that a
  // kernel reads one stream (a second stream of scales cost one thread up to ~25% of its int4 rate,
  // sessions 18-19). Residuals, when read, are zr [N/16, G, 16] either way (strides unused): inline
  // too, a group-tile would be 352 bytes, and half the groups' 64-byte code loads would straddle two
  // lines (1.2-1.4x slower calls of 5-8 rows).
  bool tiled = false;
  bool inline_sz = false;
  // MXFP4 (ExpertFormat's "mxfp4" kind; tiled): each code is an FP4 e2m1 code, its weight
  // (kE2m1U[q] - 12) * scale + zero (+ residual): the kernels put the unpacked nibbles through that
  // table (vpshufb) and centre on 12, not 8 (centre()). Only the int8-activation paths (int4tq8s_*,
  // int4tq8_avx2, int4t_scalar's q8 form) and int4t_dequantize read it: such a weight's Int4TGemv
  // has q8_from 1 (make_int4_tiled, ExpertSpec::bind_slot), so the bf16 / int16 paths never see it.
  bool e2m1 = false;
  int64_t gstride = 256, tstride = 0;  // bytes per group of a tile, per tile
  int centre() const { return e2m1 ? 12 : 8; }
  const uint8_t* tile(int64_t m0) const { return codes + (m0 / 16) * tstride; }
  const uint16_t* tile_sz(int64_t m0, int64_t G, int64_t g) const {
    return inline_sz ? reinterpret_cast<const uint16_t*>(tile(m0) + g * gstride + 256) : s + ((m0 / 16) * G + g) * 32;
  }
  const uint16_t* tile_zr(int64_t m0, int64_t G, int64_t g) const { return zr + ((m0 / 16) * G + g) * 16; }
};

// FP4 e2m1 code -> 12 + 2 * its value (codes 0..7: 0, .5, 1, 1.5, 2, 3, 4, 6; 8..15 their negatives, bit 3
// the sign: transformers' FP4_VALUES): in [0, 24], vpdpbusd's / vpmaddubsw's unsigned operand. The weight
// is (u - 12) * scale, scale 2^(e - 128) (E8M0 e, halved for the doubled values): the MXFP4 value exactly.
alignas(16) constexpr uint8_t kE2m1U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

struct Int8W {
  const int8_t* q;  // [N, K] per row, or the tiled layout's bytes (see "int8, tiled") when `tiled`
  const float* scale;  // [N] fp32, or null and
  const uint16_t* scale_bf16;  // [N] bf16 (as ExpertFormat stores it)
  const float* bias;
  bool tiled = false;
  // int8-g32 (tiled only): fp16 scales per row and group of 32, [N/16, K/32, 16] (a tile's 16 rows
  // side by side, as the codes): w = q * gs[n, g]; then the row scale is 1.
  const uint16_t* gs = nullptr;
  float s(int64_t n) const { return gs ? 1.f : scale ? scale[n] : bf16f(scale_bf16[n]); }
};

struct Bf16W {
  const uint16_t* w;
  const float* bias;
};

struct F32W {
  const float* w;
  const float* bias;
};

struct Fp8W {  // see "fp8" below
  const uint8_t* q;  // [N, K] e4m3fn bit patterns
  const float* bs;  // [ceil(N/rb), ceil(K/128)] block scales, or [ceil(N/rb), 1] (cs 0: one per row block)
  const float* bias;
  int64_t rb = 128;  // rows per scale: 128 (blocks), 1 (per output channel), >= N (one per tensor)
  int64_t cs = 1;  // 1: a scale per 128 columns; 0: one across all columns
};

// ------------------------------------------------------------------------------------ scalar
// A block of <= kBlock rows' scales and zero terms, gathered once from their strided home (e.g.
// [G, N, 2]: one cache line per group for 16 rows) into fp32 rows [r, g]: sc = scale,
// zc = zero + residual - off * scale (off: what the path's code representation adds to q - 8).
// Layout [g, r] (kBlock floats per group), so a vector of 16 rows is one load.
constexpr int64_t kBlock = 16;

struct Int4Block {
  std::vector<float> sc, zc;
  float* S(int64_t G) { sc.resize(G * kBlock); return sc.data(); }
  float* Z(int64_t G) { zc.resize(G * kBlock); return zc.data(); }
  void gather(const Int4W& w, int64_t n0, int64_t rn, int64_t G, float off) {
    float *S_ = S(G), *Z_ = Z(G);
    if (w.tiled) {  // n0 is a tile's first row
      for (int64_t g = 0; g < G; ++g)
        for (int64_t r = 0; r < rn; ++r) {
          const uint16_t* sz = w.tile_sz(n0, G, g) + 2 * r;
          const float s = bf16f(sz[0]);
          const float z = bf16f(sz[1]) + (w.zr ? bf16f(w.tile_zr(n0, G, g)[r]) : 0.f);
          S_[g * kBlock + r] = s;
          Z_[g * kBlock + r] = z - off * s;
        }
      return;
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < rn; ++r) {
        const int64_t n = n0 + r;
        const float s = bf16f(w.s[n * w.s_n + g * w.s_g]);
        float z = bf16f(w.z[n * w.z_n + g * w.z_g]);
        if (w.zr) z += bf16f(w.zr[n * w.zr_n + g * w.zr_g]);
        S_[g * kBlock + r] = s;
        Z_[g * kBlock + r] = z - off * s;
      }
  }
};

// True when a full block's scales and zeros sit as Int4Linear's / ExpertFormat's [G, N, 2] bf16
// (and the residual as [G, N]): 16 rows of one group are then 64 contiguous bytes.
inline bool interleaved(const Int4W& w, int64_t rn) {
  return rn == kBlock && !w.tiled && w.s_n == 2 && w.z == w.s + 1 && w.z_n == 2 && w.z_g == w.s_g &&
         (!w.zr || w.zr_n == 1);
}

void int4_scalar(const Int4W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y,
                 int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  thread_local Int4Block blk;
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const int64_t rn = std::min(kBlock, n1 - m0);
    blk.gather(w, m0, rn, G, 8.f);
    for (int64_t r = 0; r < rn; ++r) {
      const int64_t n = m0 + r;
      const uint8_t* c = w.codes + n * w.ldc;
      const float *sc = blk.sc.data() + r, *zc = blk.zc.data() + r;
      for (int64_t j = 0; j < nb; ++j) {
        const float* x = a.xr + (b0 + j) * K;
        const float* gs = a.gsum + (b0 + j) * G;
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          float d = 0.f;
          for (int64_t i = 0; i < kGroup / 2; ++i) {
            const uint8_t byte = c[g * 16 + i];
            d += float(byte & 15) * x[g * kGroup + 2 * i] + float(byte >> 4) * x[g * kGroup + 2 * i + 1];
          }
          acc += sc[g * kBlock] * d + zc[g * kBlock] * gs[g];
        }
        y[(b0 + j) * ldy + n] = acc + (w.bias ? w.bias[n] : 0.f);
      }
    }
  }
}

// Row formats of the int8 and bf16 kernels, shared by their scalar and AVX2 loops: how a row's
// weights become fp32 (at: one, load16: 16 as two AVX2 vectors), which activations it reads and how
// a row's dot becomes y (int8: times the row scale).
struct Int8Rows {
  using T = int8_t;
  static const T* row(const Int8W& w, int64_t n, int64_t K) { return w.q + n * K; }
  static const float* act(const Act& a) { return a.x; }
  static TIERED_AVX2 inline __attribute__((always_inline)) void load16(const T* q, __m256& w0, __m256& w1) {
    w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
    w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8))));
  }
  static float at(const T* q, int64_t k) { return float(q[k]); }
  static float out(const Int8W& w, int64_t n, float dot) { return dot * w.s(n) + (w.bias ? w.bias[n] : 0.f); }
};

struct Bf16Rows {
  using T = uint16_t;
  static const T* row(const Bf16W& w, int64_t n, int64_t K) { return w.w + n * K; }
  static const float* act(const Act& a) { return a.xr; }
  static TIERED_AVX2 inline __attribute__((always_inline)) void load16(const T* r, __m256& w0, __m256& w1) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r));
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
    w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
  }
  static float at(const T* r, int64_t k) { return bf16f(r[k]); }
  static float out(const Bf16W& w, int64_t n, float dot) { return dot + (w.bias ? w.bias[n] : 0.f); }
};

// fp32 weights (the lossless mode's decode weights) against the unrounded fp32 x.
struct F32Rows {
  using T = float;
  static const T* row(const F32W& w, int64_t n, int64_t K) { return w.w + n * K; }
  static const float* act(const Act& a) { return a.x; }
  static TIERED_AVX2 inline __attribute__((always_inline)) void load16(const T* r, __m256& w0, __m256& w1) {
    w0 = _mm256_loadu_ps(r), w1 = _mm256_loadu_ps(r + 8);
  }
  static float at(const T* r, int64_t k) { return r[k]; }
  static float out(const F32W& w, int64_t n, float dot) { return dot + (w.bias ? w.bias[n] : 0.f); }
};

template <class R, class W>
void rows_scalar(const W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t K = a.K;
  for (int64_t n = n0; n < n1; ++n) {
    const typename R::T* r = R::row(w, n, K);
    for (int64_t j = 0; j < nb; ++j) {
      const float* x = R::act(a) + (b0 + j) * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += R::at(r, k) * x[k];
      y[(b0 + j) * ldy + n] = R::out(w, n, acc);
    }
  }
}

// ------------------------------------------------------------------------------------ AVX2
TIERED_AVX2 inline __attribute__((always_inline)) float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 rows' scales and zero terms with offset `off` (S = s, Z = z + zr - off s, fp32) from their 8 (s, z)
// bf16 pairs and 8 bf16 residuals (zr null: none): one 32-byte load.
TIERED_AVX2 inline __attribute__((always_inline)) void scales8_avx2(const uint16_t* sz, const uint16_t* zr, __m256& S,
                                                                   __m256& Z, float off = 8.f) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz));
  S = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  __m256 zv = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u))));
  if (zr) {
    const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(zr));
    zv = _mm256_add_ps(zv, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(r), 16)));
  }
  Z = _mm256_fnmadd_ps(_mm256_set1_ps(off), S, zv);
}

// The same, stored to S[0..7] and Z[0..7].
TIERED_AVX2 inline __attribute__((always_inline)) void fill8_avx2(const uint16_t* sz, const uint16_t* zr, float* S,
                                                                 float* Z, float off = 8.f) {
  __m256 sv, zv;
  scales8_avx2(sz, zr, sv, zv, off);
  _mm256_storeu_ps(S, sv);
  _mm256_storeu_ps(Z, zv);
}

template <int NB>
TIERED_AVX2 void int4_avx2(const Int4W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const float* xr[NB];
  const float* gs[NB];
  for (int j = 0; j < NB; ++j) xr[j] = a.xr + (b0 + j) * K, gs[j] = a.gsum + (b0 + j) * G;
  thread_local Int4Block blk;
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const int64_t rn = std::min(kBlock, n1 - m0);
    if (interleaved(w, rn)) {
      float *S = blk.S(G), *Z = blk.Z(G);
      for (int64_t g = 0; g < G; ++g)
        for (int h = 0; h < 2; ++h)  // rows 8h .. 8h + 7
          fill8_avx2(w.s + (m0 + 8 * h) * 2 + g * w.s_g, w.zr ? w.zr + m0 + 8 * h + g * w.zr_g : nullptr,
                     S + g * kBlock + 8 * h, Z + g * kBlock + 8 * h);
    } else {
      blk.gather(w, m0, rn, G, 8.f);
    }
    for (int64_t r = 0; r < rn; ++r) {
      const int64_t n = m0 + r;
      const uint8_t* c = w.codes + n * w.ldc;
      const float *sc = blk.sc.data() + r, *zc = blk.zc.data() + r;
      __m256 acc[NB];
      for (int j = 0; j < NB; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + g * 16));
        const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
        const __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi);  // codes 0..15, 16..31
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c0));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c0, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c1));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c1, 8)));
        const __m256 sv = _mm256_broadcast_ss(sc + g * kBlock);
        for (int j = 0; j < NB; ++j) {
          const float* x = xr[j] + g * kGroup;
          __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
          t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), t);
          t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), t);
          t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), t);
          acc[j] = _mm256_fmadd_ps(sv, t, acc[j]);
        }
      }
      for (int j = 0; j < NB; ++j) {
        float corr = 0.f;
        for (int64_t g = 0; g < G; ++g) corr += zc[g * kBlock] * gs[j][g];
        y[(b0 + j) * ldy + n] = hsum256(acc[j]) + corr + (w.bias ? w.bias[n] : 0.f);
      }
    }
  }
}

// Bytes ahead that the kernels prefetch in their weight stream: a tile's code stream, or a row
// loop's rows (contiguous, so it runs on into the next rows).
constexpr int64_t kPrefetchAhead = 4096;

// int8 and bf16 weights share one AVX2 row loop: fp32 FMAs of 16 weights at a time (the row
// formats Int8Rows / Bf16Rows above say how their weights become fp32). Up to kRowsTwoAcc
// activation rows each row sums into two accumulators (two FMA chains a row hide the FMA's
// latency); past it into one: NB rows are then NB chains already, and two a row would need
// 2 NB + 2 ymm registers, past AVX2's 16 from 8 rows (GCC spilled three of them to the stack,
// a load, FMA and store each step: a 1024 x 3584 bf16 SwiGLU expert took 2.9 ms at 8 rows
// against 1.3 at 4, 2 Zen 3 cores, 2026-12-01).
constexpr int kRowsTwoAcc = 4;

template <int NB, class R, class W>
TIERED_AVX2 void rows_avx2(const W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr bool two = NB <= kRowsTwoAcc;
  constexpr int NA = two ? NB : 1;  // second accumulators
  const int64_t K = a.K;
  const float* x[NB];
  for (int j = 0; j < NB; ++j) x[j] = R::act(a) + (b0 + j) * K;
  for (int64_t n = n0; n < n1; ++n) {
    const typename R::T* r = R::row(w, n, K);
    __m256 acc0[NB], acc1[NA];
    float tail[NB];
    for (int j = 0; j < NB; ++j) acc0[j] = _mm256_setzero_ps(), tail[j] = 0.f;
    for (int j = 0; j < NA; ++j) acc1[j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      __m256 w0, w1;
      prefetch_stream(reinterpret_cast<const char*>(r + k) + kPrefetchAhead);
      R::load16(r + k, w0, w1);
      for (int j = 0; j < NB; ++j) {
        acc0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[j] + k), acc0[j]);
        if constexpr (two)
          acc1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[j] + k + 8), acc1[j]);
        else
          acc0[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[j] + k + 8), acc0[j]);
      }
    }
    for (; k < K; ++k)
      for (int j = 0; j < NB; ++j) tail[j] += R::at(r, k) * x[j][k];
    for (int j = 0; j < NB; ++j) {
      __m256 s = acc0[j];
      if constexpr (two) s = _mm256_add_ps(s, acc1[j]);
      y[(b0 + j) * ldy + n] = R::out(w, n, hsum256(s) + tail[j]);
    }
  }
}

// int8 weights on int16 activations (Act::xs, K % 32 == 0): 16 weights sign-extended to int16 and
// one vpmaddwd against 16 of xs per step, exact int32 dots per group of 32 (|.| <= 4 * 127 * 32767
// per lane), one fp32 FMA per group: y = s_n sum_g dw_g dot_g. Half the instructions per weight of
// the fp32 FMA loop (which converts every weight to fp32).
template <int NB>
TIERED_AVX2 void int8_w16_avx2(const Int8W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  const int16_t* xs[NB];
  const float* dw[NB];
  for (int j = 0; j < NB; ++j) xs[j] = a.xs + (b0 + j) * K, dw[j] = a.dw + (b0 + j) * G;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* r = w.q + n * K;
    __m256 acc[NB];
    for (int j = 0; j < NB; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* rg = r + g * kGroup;
      prefetch_stream(reinterpret_cast<const char*>(rg) + kPrefetchAhead);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rg)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rg + 16)));
      for (int j = 0; j < NB; ++j) {
        const int16_t* x = xs[j] + g * kGroup;
        const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                                           _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(dw[j][g]), acc[j]);
      }
    }
    for (int j = 0; j < NB; ++j) y[(b0 + j) * ldy + n] = Int8Rows::out(w, n, hsum256(acc[j]));
  }
}

// ------------------------------------------------------------------------------------ AVX-512
TIERED_AVX512 inline __attribute__((always_inline)) __m512 dot_bf16(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(w), reinterpret_cast<__m512bh&>(x));
}

// A block's scales and zero terms (Int4Block, [g, r]): vector loads when they sit as [G, N, 2].
TIERED_AVX512 void int4_fill_block_avx512(const Int4W& w, int64_t m0, int64_t rn, int64_t G, float off, Int4Block& blk) {
  if ((w.tiled && rn == kBlock) || interleaved(w, rn)) {
    float *S = blk.S(G), *Z = blk.Z(G);
    const __m512i hi16 = _mm512_set1_epi32(int(0xFFFF0000u));
    const __m512 ov = _mm512_set1_ps(off);
    for (int64_t g = 0; g < G; ++g) {
      const __m512i v = _mm512_loadu_si512(w.tiled ? w.tile_sz(m0, G, g) : w.s + m0 * 2 + g * w.s_g);  // (s, z) of 16 rows
      const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
      if (w.zr) {
        const __m256i r = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w.tiled ? w.tile_zr(m0, G, g) : w.zr + m0 + g * w.zr_g));
        zv = _mm512_add_ps(zv, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
      }
      _mm512_storeu_ps(S + g * kBlock, sv);
      _mm512_storeu_ps(Z + g * kBlock, _mm512_fnmadd_ps(ov, sv, zv));
    }
  } else {
    blk.gather(w, m0, rn, G, off);
  }
}

// One int4 group: 16 bytes -> 32 bf16 words (128 + q) in column order, one dot per activation row.
template <int NB>
TIERED_AVX512 inline __attribute__((always_inline)) void int4_group_avx512(const uint8_t* c, const float* sc, int64_t g,
                                                                           const uint16_t* const* xb, __m512* acc) {
  const __m512i nib = _mm512_set1_epi32(0x000F000F), bias128 = _mm512_set1_epi32(0x43004300);
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + g * 16)));
  // byte b -> dword (b & 15) | (b >> 4) << 16, then | 0x4300 in each word
  const __m512i q = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), nib, 0xA8);  // (d | t) & nib
  const __m512i wv = _mm512_or_si512(q, bias128);
  const __m512 sv = _mm512_set1_ps(sc[g * kBlock]);
  for (int j = 0; j < NB; ++j) {
    const __m512i xv = _mm512_loadu_si512(xb[j] + g * kGroup);
    acc[j] = _mm512_fmadd_ps(sv, dot_bf16(_mm512_setzero_ps(), wv, xv), acc[j]);
  }
}

template <int NB>
TIERED_AVX512 void int4_avx512(const Int4W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                               int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  const uint16_t* xb[NB];
  const float* gs[NB];
  for (int j = 0; j < NB; ++j) xb[j] = a.xb + (b0 + j) * K, gs[j] = a.gsum + (b0 + j) * G;
  thread_local Int4Block blk;
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const int64_t rn = std::min(kBlock, n1 - m0);
    int4_fill_block_avx512(w, m0, rn, G, 136.f, blk);
    float corr[NB][kBlock];  // zero terms of the block's rows: sum_g zc[g, r] * gsum[g]
    for (int j = 0; j < NB; ++j) {
      __m512 cv = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) cv = _mm512_fmadd_ps(_mm512_loadu_ps(blk.zc.data() + g * kBlock), _mm512_set1_ps(gs[j][g]), cv);
      _mm512_storeu_ps(corr[j], cv);
    }
    for (int64_t r = 0; r < rn; ++r) {
      const int64_t n = m0 + r;
      const uint8_t* c = w.codes + n * w.ldc;
      const float* sc = blk.sc.data() + r;
      __m512 acc0[NB], acc1[NB];
      for (int j = 0; j < NB; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps();
      int64_t g = 0;
      for (; g + 2 <= G; g += 2) {
        int4_group_avx512<NB>(c, sc, g, xb, acc0);
        int4_group_avx512<NB>(c, sc, g + 1, xb, acc1);
      }
      if (g < G) int4_group_avx512<NB>(c, sc, g, xb, acc0);
      for (int j = 0; j < NB; ++j)
        y[(b0 + j) * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[j], acc1[j])) + corr[j][r] +
                                (w.bias ? w.bias[n] : 0.f);
    }
  }
}

// ------------------------------------------------------------------------------------ int4 x q8
// The int4 kernel on int8 activations (Act with q8, llama.cpp's Q8_0 activations). Per row n and
// group g, with w = (q - 8) s + z (z: the zero plus its residual) and x ~ dx * xq:
//   sum_i w_i x_i ~ s dx (sum_i q_i xq_i - 8 sum_i xq_i) + z sum_i x_i
// The integer dot sum_i q_i xq_i is one vpdpbusd pair per 4 groups (u8 codes x s8 activations);
// the other two terms depend on the row only through s and z, so a row block computes them for its
// 16 rows at once (`corr`). Only s dx sum (q - 8) xq sees the activations' rounding ((q - 8) is
// centred: a smaller error than Q4_1 x Q8_1's uncentred q); the zero term uses exact sums of x.
struct Int4Q8Block {
  Int4Block sz;  // scales and zeros (off 0) [Gp, kBlock]; padding groups zero
  std::vector<float> st;  // scales transposed: row r's 4 of chunk c at c * 64 + (r % 4) * 16 + (r / 4) * 4
  float corr[kMaxNB][kBlock];  // sum_g z[g, r] xsum[g] + s[g, r] m8[g] per activation row
};

void int4q8_scalar(const Int4W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y,
                   int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup, Gp = a.Gp;
  thread_local Int4Block blk;
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const int64_t rn = std::min(kBlock, n1 - m0);
    blk.gather(w, m0, rn, G, 0.f);
    for (int64_t r = 0; r < rn; ++r) {
      const int64_t n = m0 + r;
      const uint8_t* c = w.codes + n * w.ldc;
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t b = b0 + j;
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const int8_t* xq = a.xq + b * Gp * kGroup + (g / 4) * 128 + (g % 4) * 16;
          int32_t d = 0;
          for (int64_t i = 0; i < kGroup / 2; ++i) d += int32_t(c[g * 16 + i] & 15) * xq[i] + int32_t(c[g * 16 + i] >> 4) * xq[64 + i];
          const float dx = a.dx16[b * Gp * 4 + g * 4];
          acc += blk.sc[g * kBlock + r] * (dx * float(d) + a.m8[b * Gp + g]) + blk.zc[g * kBlock + r] * a.xsum[b * Gp + g];
        }
        y[b * ldy + n] = acc + (w.bias ? w.bias[n] : 0.f);
      }
    }
  }
}

// corr of a block's rows (any ISA; the AVX-512 path has its own).
void int4q8_corr(Int4Q8Block& b, const Act& a, int64_t b0, int nb, int64_t G) {
  const float *S = b.sz.sc.data(), *Z = b.sz.zc.data();
  for (int j = 0; j < nb; ++j) {
    const float *xs = a.xsum + (b0 + j) * a.Gp, *m = a.m8 + (b0 + j) * a.Gp;
    float* cr = b.corr[j];
    for (int64_t r = 0; r < kBlock; ++r) cr[r] = 0.f;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = 0; r < kBlock; ++r) cr[r] += Z[g * kBlock + r] * xs[g] + S[g * kBlock + r] * m[g];
  }
}

template <int NB>
TIERED_AVX2 void int4q8_avx2(const Int4W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup, Gp = a.Gp;
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* xq[NB];
  const float* dx[NB];
  for (int j = 0; j < NB; ++j) xq[j] = a.xq + (b0 + j) * Gp * kGroup, dx[j] = a.dx16 + (b0 + j) * Gp * 4;
  thread_local Int4Q8Block blk;
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const int64_t rn = std::min(kBlock, n1 - m0);
    blk.sz.gather(w, m0, rn, G, 0.f);
    blk.sz.sc.resize(Gp * kBlock, 0.f);  // padding groups: scale 0
    int4q8_corr(blk, a, b0, NB, G);
    for (int64_t r = 0; r < rn; ++r) {
      const int64_t n = m0 + r;
      const uint8_t* c = w.codes + n * w.ldc;
      const float* S = blk.sz.sc.data() + r;
      __m256 acc[NB];
      for (int j = 0; j < NB; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; g += 2) {  // groups g, g + 1: chunk g / 4, half (g / 2) % 2
        const __m256i v = g + 1 < G ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + g * 16))
                                    : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + g * 16)));
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        const float s0 = S[g * kBlock], s1 = S[(g + 1) * kBlock];
        const __m256 sv = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
        const int64_t off = (g / 4) * 128 + ((g / 2) % 2) * 32, doff = (g / 4) * 16 + ((g / 2) % 2) * 8;
        for (int j = 0; j < NB; ++j) {
          const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + off)));
          const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + off + 64)));
          const __m256i d = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones);  // |.| <= 2 * 2 * 15 * 128
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sv, _mm256_loadu_ps(dx[j] + doff)), acc[j]);
        }
      }
      for (int j = 0; j < NB; ++j) y[(b0 + j) * ldy + n] = hsum256(acc[j]) + blk.corr[j][r] + (w.bias ? w.bias[n] : 0.f);
    }
  }
}

template <int NB>
TIERED_AVX512 void int4q8_terms_avx512(Int4Q8Block& b, const Act& a, int64_t b0, int64_t G) {
  const int64_t Gp = a.Gp;
  const float *S = b.sz.sc.data(), *Z = b.sz.zc.data();
  for (int j = 0; j < NB; ++j) {
    const float *xs = a.xsum + (b0 + j) * Gp, *m = a.m8 + (b0 + j) * Gp;
    __m512 cv = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      cv = _mm512_fmadd_ps(_mm512_loadu_ps(Z + g * kBlock), _mm512_set1_ps(xs[g]), cv);
      cv = _mm512_fmadd_ps(_mm512_loadu_ps(S + g * kBlock), _mm512_set1_ps(m[g]), cv);
    }
    _mm512_storeu_ps(b.corr[j], cv);
  }
  b.st.resize(Gp * kBlock);
  for (int64_t c = 0; c < Gp / 4; ++c) {  // 4 groups x 16 rows -> 16 rows x 4 groups (4x4 per 128-bit lane)
    const float* s = S + c * 4 * kBlock;
    const __m512 a0 = _mm512_loadu_ps(s), a1 = _mm512_loadu_ps(s + kBlock), a2 = _mm512_loadu_ps(s + 2 * kBlock),
                 a3 = _mm512_loadu_ps(s + 3 * kBlock);
    const __m512d t0 = _mm512_castps_pd(_mm512_unpacklo_ps(a0, a1)), t1 = _mm512_castps_pd(_mm512_unpackhi_ps(a0, a1));
    const __m512d t2 = _mm512_castps_pd(_mm512_unpacklo_ps(a2, a3)), t3 = _mm512_castps_pd(_mm512_unpackhi_ps(a2, a3));
    float* o = b.st.data() + c * 64;
    _mm512_storeu_ps(o, _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2)));        // rows 4L
    _mm512_storeu_ps(o + 16, _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2)));   // rows 4L + 1
    _mm512_storeu_ps(o + 32, _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3)));   // rows 4L + 2
    _mm512_storeu_ps(o + 48, _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3)));   // rows 4L + 3
  }
}

// A row's 4 scales of chunk c, each over its group's 4 lanes.
TIERED_AVX512 inline __attribute__((always_inline)) __m512 scales16(const float* sp, int64_t c) {
  const __m512i expand = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(expand, _mm512_castps128_ps512(_mm_loadu_ps(sp + c * 64)));
}

// One chunk (4 groups, 64 code bytes) of R rows: per row and activation row 2 vpdpbusd and one fma;
// each activation vector loaded once for the R rows.
template <int NB, int R>
TIERED_AVX512 inline __attribute__((always_inline)) void int4q8_chunk(const __m512i* v, const __m512* s16,
                                                                      const int8_t* const* xq, const float* const* dx,
                                                                      int64_t c, __m512 (*acc)[NB]) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512i lo[R], hi[R];
  for (int i = 0; i < R; ++i) lo[i] = _mm512_and_si512(v[i], m4), hi[i] = _mm512_and_si512(_mm512_srli_epi16(v[i], 4), m4);
  for (int j = 0; j < NB; ++j) {
    const __m512i xa = _mm512_loadu_si512(xq[j] + c * 128), xb = _mm512_loadu_si512(xq[j] + c * 128 + 64);
    const __m512 dv = _mm512_loadu_ps(dx[j] + c * 16);
    for (int i = 0; i < R; ++i) {
      const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], xa), hi[i], xb);
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s16[i], dv), acc[i][j]);
    }
  }
}

// Rows r0 .. r0 + R - 1 of a block (codes c0 = row r0's).
template <int NB, int R>
TIERED_AVX512 inline __attribute__((always_inline)) void int4q8_rows_avx512(
    const uint8_t* c0, int64_t ldc, const float* st, int64_t r0, int64_t G, const int8_t* const* xq,
    const float* const* dx, __m512 (*acc)[NB]) {
  const int64_t full = G / 4, tail = G % 4;
  const float* sp[R];
  for (int i = 0; i < R; ++i) {
    sp[i] = st + ((r0 + i) % 4) * 16 + ((r0 + i) / 4) * 4;
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  }
  __m512i v[R];
  __m512 s[R];
  for (int64_t ch = 0; ch < full; ++ch) {
    for (int i = 0; i < R; ++i) {
      prefetch_stream(c0 + i * ldc + ch * 64 + 512);
      v[i] = _mm512_loadu_si512(c0 + i * ldc + ch * 64), s[i] = scales16(sp[i], ch);
    }
    int4q8_chunk<NB, R>(v, s, xq, dx, ch, acc);
  }
  if (tail) {
    const __mmask64 tmask = (__mmask64(1) << (tail * 16)) - 1;
    for (int i = 0; i < R; ++i) v[i] = _mm512_maskz_loadu_epi8(tmask, c0 + i * ldc + full * 64), s[i] = scales16(sp[i], full);
    int4q8_chunk<NB, R>(v, s, xq, dx, full, acc);
  }
}

// Scale (and zero residual) lines of the block at row m0, one share per call (share of shares):
// they sit one group per N * 4 bytes apart, too far for the hardware prefetcher.
TIERED_FORCE_INLINE void prefetch_block_scales(const Int4W& w, int64_t m0, int64_t G, int64_t share, int64_t shares) {
  for (int64_t g = share * G / shares; g < (share + 1) * G / shares; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(w.s + m0 * w.s_n + g * w.s_g), _MM_HINT_T0);
    if (w.zr) _mm_prefetch(reinterpret_cast<const char*>(w.zr + m0 * w.zr_n + g * w.zr_g), _MM_HINT_T0);
  }
}

template <int NB>
TIERED_AVX512 inline __attribute__((always_inline)) void int4q8_out(const Int4W& w, const Int4Q8Block& blk, const Act& a,
                                                                    int64_t b0, int64_t m0, int64_t r, const __m512* acc,
                                                                    float* y, int64_t ldy) {
  const int64_t n = m0 + r;
  for (int j = 0; j < NB; ++j)
    y[(b0 + j) * ldy + n] = _mm512_reduce_add_ps(acc[j]) + blk.corr[j][r] + (w.bias ? w.bias[n] : 0.f);
}

template <int NB>
TIERED_AVX512 void int4q8_avx512(const Int4W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                                 int64_t ldy) {
  constexpr int R = NB <= 2 ? 4 : 2;  // rows at once: R * NB accumulators in registers
  const int64_t K = a.K, G = K / kGroup, Gp = a.Gp;
  const int8_t* xq[NB];
  const float* dx[NB];
  for (int j = 0; j < NB; ++j) xq[j] = a.xq + (b0 + j) * Gp * kGroup, dx[j] = a.dx16 + (b0 + j) * Gp * 4;
  thread_local Int4Q8Block blk;
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const int64_t rn = std::min(kBlock, n1 - m0);
    int4_fill_block_avx512(w, m0, rn, G, 0.f, blk.sz);
    blk.sz.sc.resize(Gp * kBlock, 0.f);  // padding groups: scale 0
    int4q8_terms_avx512<NB>(blk, a, b0, G);
    const bool next = m0 + kBlock < n1;
    int64_t r = 0;
    for (; r + R <= rn; r += R) {
      if (next) prefetch_block_scales(w, m0 + kBlock, G, r / R, kBlock / R);
      __m512 acc[R][NB];
      int4q8_rows_avx512<NB, R>(w.codes + (m0 + r) * w.ldc, w.ldc, blk.st.data(), r, G, xq, dx, acc);
      for (int i = 0; i < R; ++i) int4q8_out<NB>(w, blk, a, b0, m0, r + i, acc[i], y, ldy);
    }
    for (; r < rn; ++r) {
      __m512 acc[1][NB];
      int4q8_rows_avx512<NB, 1>(w.codes + (m0 + r) * w.ldc, w.ldc, blk.st.data(), r, G, xq, dx, acc);
      int4q8_out<NB>(w, blk, a, b0, m0, r, acc[0], y, ldy);
    }
  }
}

template <int NB>
TIERED_AVX512 void int8_avx512(const Int8W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                               int64_t ldy) {
  const int64_t K = a.K;
  const float* x[NB];
  for (int j = 0; j < NB; ++j) x[j] = a.x + (b0 + j) * K;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = w.q + n * K;
    __m512 acc0[NB], acc1[NB];
    float tail[NB];
    for (int j = 0; j < NB; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps(), tail[j] = 0.f;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      prefetch_stream(q + k + 1024);
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k))));
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16))));
      for (int j = 0; j < NB; ++j) {
        acc0[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[j] + k), acc0[j]);
        acc1[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[j] + k + 16), acc1[j]);
      }
    }
    for (; k < K; ++k)
      for (int j = 0; j < NB; ++j) tail[j] += float(q[k]) * x[j][k];
    for (int j = 0; j < NB; ++j)
      y[(b0 + j) * ldy + n] =
          (_mm512_reduce_add_ps(_mm512_add_ps(acc0[j], acc1[j])) + tail[j]) * w.s(n) + (w.bias ? w.bias[n] : 0.f);
  }
}

// int8 weights on int16 activations (Act::xs, K % 32 == 0), AVX-512: one group of 32 weights is
// one vpmovsxbw + vpmaddwd per activation row (16 exact int32 pair sums), then one fp32 FMA by the
// group's scale dw_g into U independent accumulators per row. The fp32 loop above (int8_avx512)
// converts every weight to fp32 and chains one FMA per 16 weights into two accumulators: at batch 1
// it computed ~27 GB/s of weights per thread from cache on a Zen 4 core, about this VM's DRAM rate, so
// a stream from DRAM could not reach it. The same numerics as int8_w16_avx2 (sums in another order).
template <int NB>
TIERED_AVX512 void int8_w16_avx512(const Int8W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                                   int64_t ldy) {
  constexpr int U = NB <= 2 ? 4 : (NB <= 4 ? 2 : 1);  // groups per step: U chains per activation row
  const int64_t K = a.K, G = K / kGroup;
  const int16_t* xs[NB];
  const float* dw[NB];
  for (int j = 0; j < NB; ++j) xs[j] = a.xs + (b0 + j) * K, dw[j] = a.dw + (b0 + j) * G;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* r = w.q + n * K;
    __m512 acc[NB][U];
    for (int j = 0; j < NB; ++j)
      for (int u = 0; u < U; ++u) acc[j][u] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + U <= G; g += U) {
      const int8_t* rg = r + g * kGroup;
      for (int u = 0; u < U * kGroup; u += 64) prefetch_stream(rg + u + kPrefetchAhead);
      __m512i wq[U];
      for (int u = 0; u < U; ++u) wq[u] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rg + u * kGroup)));
      for (int j = 0; j < NB; ++j)
        for (int u = 0; u < U; ++u) {
          const __m512i d = _mm512_madd_epi16(wq[u], _mm512_loadu_si512(xs[j] + (g + u) * kGroup));
          acc[j][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(dw[j][g + u]), acc[j][u]);
        }
    }
    for (; g < G; ++g) {
      const __m512i wq = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + g * kGroup)));
      for (int j = 0; j < NB; ++j) {
        const __m512i d = _mm512_madd_epi16(wq, _mm512_loadu_si512(xs[j] + g * kGroup));
        acc[j][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(dw[j][g]), acc[j][0]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      __m512 s = acc[j][0];
      for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[j][u]);
      y[(b0 + j) * ldy + n] = Int8Rows::out(w, n, _mm512_reduce_add_ps(s));
    }
  }
}

template <int NB>
TIERED_AVX512 void bf16_avx512(const Bf16W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                               int64_t ldy) {
  const int64_t K = a.K;
  const uint16_t* xb[NB];
  const float* xr[NB];
  for (int j = 0; j < NB; ++j) xb[j] = a.xb + (b0 + j) * K, xr[j] = a.xr + (b0 + j) * K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* r = w.w + n * K;
    __m512 acc0[NB], acc1[NB];
    float tail[NB];
    for (int j = 0; j < NB; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps(), tail[j] = 0.f;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      prefetch_stream(r + k + 512);
      const __m512i w0 = _mm512_loadu_si512(r + k), w1 = _mm512_loadu_si512(r + k + 32);
      for (int j = 0; j < NB; ++j) {
        acc0[j] = dot_bf16(acc0[j], w0, _mm512_loadu_si512(xb[j] + k));
        acc1[j] = dot_bf16(acc1[j], w1, _mm512_loadu_si512(xb[j] + k + 32));
      }
    }
    for (; k + 32 <= K; k += 32) {
      const __m512i w0 = _mm512_loadu_si512(r + k);
      for (int j = 0; j < NB; ++j) acc0[j] = dot_bf16(acc0[j], w0, _mm512_loadu_si512(xb[j] + k));
    }
    for (; k < K; ++k)
      for (int j = 0; j < NB; ++j) tail[j] += bf16f(r[k]) * xr[j][k];
    for (int j = 0; j < NB; ++j)
      y[(b0 + j) * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[j], acc1[j])) + tail[j] + (w.bias ? w.bias[n] : 0.f);
  }
}

// ------------------------------------------------------------------------------------ int4, tiled
// The "tiled" int4 layout: 16 output rows side by side, so that one SIMD lane is one row and the
// weights of 16 rows are converted once per load for every activation row. Per 16-row tile
// (N / 16 tiles of 8 K bytes) and per 8 columns c8 = k / 8, 64 bytes: byte 4r + j (row r, j < 4)
// holds q[n, 8 c8 + j] in its low nibble and q[n, 8 c8 + 4 + j] in its high one. Scales and zeros
// per tile too (Int4W::tiled): sz [N/16, G, 16, 2], zr [N/16, G, 16].
//   bf16 activations (Act.xp: pairs (x[8 c8 + j], x[8 c8 + 4 + j]) as bf16 dwords): AVX-512 VBMI
//     picks both nibbles of byte j of every lane into one dword's two words (vpmultishiftqb), ORs in
//     0x4300 (the bf16 number 128 + q, exact) and does one vdpbf16ps per 32 weights per activation
//     row, with the 136 * sum(x) it adds taken out with the zero term, as the plain int4 path does.
//   q8 activations (Act.xqt, plain order): one 64-byte load ANDed with 0x0F, and shifted right by
//     4, gives two vpdpbusd operands of 4 columns x 16 rows against a broadcast of 4 bytes of x.
//   MXFP4 (Int4W::e2m1: gpt-oss's experts, quant/mxfp4.py): the same bytes, each nibble an FP4 e2m1
//     code that one vpshufb per operand maps to u = kE2m1U[q] in [0, 24] right after the unpack; the
//     dot is centred on 12 (w = (u - 12) s + z), on q8 activations only.

inline bool has_vbmi() {
  static const bool v = (__builtin_cpu_init(), __builtin_cpu_supports("avx512vbmi"));
  return v;
}

// q[16 t + r, k] of one tile whose groups are gstride bytes apart (Int4W::gstride)
inline uint8_t tiled_code(const uint8_t* tile, int64_t gstride, int64_t r, int64_t k) {
  const uint8_t b = tile[(k / kGroup) * gstride + ((k % kGroup) / 8) * 64 + r * 4 + (k % 4)];
  return (k % 8) < 4 ? (b & 15) : (b >> 4);
}

// The same code as the kernels multiply it: through kE2m1U for MXFP4 (Int4W::e2m1)
inline int32_t tiled_u(const Int4W& w, const uint8_t* tile, int64_t r, int64_t k) {
  const uint8_t q = tiled_code(tile, w.gstride, r, k);
  return w.e2m1 ? kE2m1U[q] : q;
}

void int4t_scalar(const Int4W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y,
                  int64_t ldy, bool q8) {
  const int64_t K = a.K, G = K / kGroup;
  thread_local Int4Block blk;
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    blk.gather(w, m0, kBlock, G, q8 ? 0.f : 8.f);  // q8 keeps the -8 term apart (m8), as the SIMD paths do
    const uint8_t* tile = w.tile(m0);
    for (int64_t r = 0; r < kBlock; ++r)
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t b = b0 + j;
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const float s = blk.sc[g * kBlock + r], zc = blk.zc[g * kBlock + r];
          if (q8) {  // s dx (sum q xq - 8 sum xq) + z sum x
            int32_t d = 0;
            for (int64_t i = 0; i < kGroup; ++i) d += tiled_u(w, tile, r, g * kGroup + i) * a.xqt[b * K + g * kGroup + i];
            if (w.e2m1)  // the centred dot in integers, as the SIMD paths take it: s dx sum (u - 12) xq + z sum x
              acc += s * a.dxg[b * G + g] * float(d - 12 * a.xqs[b * G + g]) + zc * a.xsum[b * a.Gp + g];
            else
              acc += s * a.dxg[b * G + g] * float(d) + s * a.m8[b * a.Gp + g] + zc * a.xsum[b * a.Gp + g];
          } else {
            float d = 0.f;
            for (int64_t i = 0; i < kGroup; ++i) d += float(tiled_code(tile, w.gstride, r, g * kGroup + i)) * a.xr[b * K + g * kGroup + i];
            acc += s * d + zc * a.gsum[b * G + g];
          }
        }
        y[b * ldy + m0 + r] = acc + (w.bias ? w.bias[m0 + r] : 0.f);
      }
  }
}

// The scales and zero terms of group g of the tile at row m0 (one 64-byte line of sz, and every
// other group one line of zr): the kernels' second stream, fetched one tile ahead a group at a time
// (a fill pass over a tile's scales stalled on them: ~30% of a batch-1 call at OLMoE widths, where
// the hardware prefetcher alone did not keep up). Even so, int4t_fill_block_avx2's pass still spent
// ~30% of int4t_w16_avx2's time waiting on them, so that kernel reads each group's scales where it
// uses them (scales8_avx2), and their loads overlap the code stream's.
TIERED_FORCE_INLINE void prefetch_tile_scales(const Int4W& w, int64_t m0, int64_t G, int64_t g) {
  _mm_prefetch(reinterpret_cast<const char*>(w.tile_sz(m0, G, g)), _MM_HINT_T0);
  if (w.zr && !(g & 1)) _mm_prefetch(reinterpret_cast<const char*>(w.tile_zr(m0, G, g)), _MM_HINT_T0);
}

// A tiled kernel's prefetches for group g of a tile: its 4 code lines kPrefetchAhead bytes ahead
// (codes: the group's 256 bytes), and the next tile's scales (next: that tile's first row, or -1).
// With the scales inline they are in the code stream, so only kernels that read a tile's scales in
// a pass of their own before its codes (block_fill: int4_fill_block_avx512, int4t_fill_block_avx2)
// fetch them ahead: that pass reads G lines 320 bytes apart.
TIERED_FORCE_INLINE void prefetch_group(const Int4W& w, const uint8_t* codes, int64_t next, int64_t G, int64_t g,
                                        bool block_fill = false) {
  for (int l = 0; l < 4; ++l) prefetch_stream(codes + kPrefetchAhead + 64 * l);
  if (w.inline_sz) prefetch_stream(codes + kPrefetchAhead + 256);  // the group's (s, z) line, in the stream
  if (next >= 0 && (!w.inline_sz || block_fill)) prefetch_tile_scales(w, next, G, g);
}

// A tile's scales and zero terms (offset `off`, 8 or 0) from its contiguous [G, 16, 2] bf16 run (and
// [G, 16] residual): 8 rows per 32-byte load.
TIERED_AVX2 void int4t_fill_block_avx2(const Int4W& w, int64_t m0, int64_t G, Int4Block& blk, float off = 8.f) {
  float *S = blk.S(G), *Z = blk.Z(G);
  for (int64_t g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h)
      fill8_avx2(w.tile_sz(m0, G, g) + 16 * h, w.zr ? w.tile_zr(m0, G, g) + 8 * h : nullptr, S + g * kBlock + 8 * h,
                 Z + g * kBlock + 8 * h, off);
}

// int4t_w16_avx2's pieces. One 8-row half of a chunk's 64-byte line (32 bytes at c) -> the int16
// pairs of its columns (0, 2), (4, 6), (1, 3), (5, 7) in q[0..3].
TIERED_AVX2 inline __attribute__((always_inline)) void w16_unpack_avx2(const uint8_t* c, __m256i* q) {
  const __m256i m = _mm256_set1_epi32(0x000F000F);
  const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  q[0] = _mm256_and_si256(d, m), q[1] = _mm256_and_si256(_mm256_srli_epi32(d, 4), m);
  q[2] = _mm256_and_si256(_mm256_srli_epi32(d, 8), m), q[3] = _mm256_and_si256(_mm256_srli_epi32(d, 12), m);
}

// The 4 xw words of one chunk of 8 columns, each broadcast.
TIERED_AVX2 inline __attribute__((always_inline)) void w16_bcast_avx2(const uint32_t* xw, __m256i* x) {
  for (int i = 0; i < 4; ++i) x[i] = _mm256_set1_epi32(int32_t(xw[i]));
}

// t += the 8 rows' int32 dots of one chunk: 4 vpmaddwd.
TIERED_AVX2 inline __attribute__((always_inline)) void w16_dot_avx2(const __m256i* q, const __m256i* x, __m256i& t) {
  const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(q[0], x[0]), _mm256_madd_epi16(q[1], x[1]));
  const __m256i r = _mm256_add_epi32(_mm256_madd_epi16(q[2], x[2]), _mm256_madd_epi16(q[3], x[3]));
  t = _mm256_add_epi32(t, _mm256_add_epi32(p, r));
}

// AVX2 (int16 activations, Act::xw; AVX-512 without VBMI below q8_from): per 8-row half of a tile and chunk of 8
// columns, the 4 code bytes of a row hold columns j (low nibble of byte j) and 4 + j (high); masking
// the row's 32-bit word with 0x000F000F after shifts of 0, 4, 8, 12 leaves the int16 pairs of
// columns (0, 2), (4, 6), (1, 3), (5, 7), which one vpmaddwd each multiplies by the matching pair of
// xw and sums into the row's int32 lane: 4 multiply-adds per 64 weights where fp32 FMAs on bf16 x
// need 8 plus 8 conversions. Exact integer dots (|sum| <= 32 * 15 * 32767 per group), one fp32 FMA
// per group and row: y = sum_g s_g dw_g dot_g + (z_g - 8 s_g) wsum_g.
template <int NB>
TIERED_AVX2 void int4t_w16_avx2(const Int4W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                                int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const uint8_t* tile = w.tile(m0);
    __m256 acc[NB][2], corr[NB][2];
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) acc[j][h] = corr[j][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256i ti[NB][2];
      for (int j = 0; j < NB; ++j) ti[j][0] = ti[j][1] = _mm256_setzero_si256();
      const uint8_t* chunk = tile + g * w.gstride;  // 4 chunks of 8 columns x 16 rows (rows 0-7, then 8-15)
      prefetch_group(w, chunk, m0 + kBlock < n1 ? m0 + kBlock : -1, G, g);
      const uint32_t* xg[NB];
      for (int j = 0; j < NB; ++j) xg[j] = a.xw + (b0 + j) * (K / 2) + g * (kGroup / 2);
#pragma GCC unroll 1  // unrolled, GCC hoists the chunks' loads and products and spills them
      for (int c4 = 0; c4 < 4; ++c4) {
        if constexpr (NB == 1) {  // one half's codes at a time: 13 live vectors, no spills
          __m256i x[4], q[4];
          w16_bcast_avx2(xg[0] + c4 * 4, x);
          for (int h = 0; h < 2; ++h) w16_unpack_avx2(chunk + c4 * 64 + 32 * h, q), w16_dot_avx2(q, x, ti[0][h]);
        } else {  // both halves' codes stay while each row broadcasts its x once
          __m256i q[2][4];
          for (int h = 0; h < 2; ++h) w16_unpack_avx2(chunk + c4 * 64 + 32 * h, q[h]);
          for (int j = 0; j < NB; ++j) {
            __m256i x[4];
            w16_bcast_avx2(xg[j] + c4 * 4, x);
            for (int h = 0; h < 2; ++h) w16_dot_avx2(q[h], x, ti[j][h]);
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256 sv, zv;
        scales8_avx2(w.tile_sz(m0, G, g) + 16 * h, w.zr ? w.tile_zr(m0, G, g) + 8 * h : nullptr, sv, zv);
        for (int j = 0; j < NB; ++j) {
          const int64_t bg = (b0 + j) * G + g;
          acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ti[j][h]), _mm256_mul_ps(sv, _mm256_set1_ps(a.dw[bg])), acc[j][h]);
          corr[j][h] = _mm256_fmadd_ps(zv, _mm256_set1_ps(a.wsum[bg]), corr[j][h]);
        }
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) {
        float out[8];
        _mm256_storeu_ps(out, _mm256_add_ps(acc[j][h], corr[j][h]));
        for (int r = 0; r < 8; ++r) {
          const int64_t n = m0 + 8 * h + r;
          y[(b0 + j) * ldy + n] = out[r] + (w.bias ? w.bias[n] : 0.f);
        }
      }
  }
}

// A tiled int4 tile's scales s and zero terms z + zr of group g for its 16 rows (one 64-byte line of
// (s, z) bf16 pairs, and 32 bytes of residuals when the weight has them).
TIERED_AVX512 inline __attribute__((always_inline)) void tile_scales_avx512(const Int4W& w, int64_t m0, int64_t G,
                                                                           int64_t g, __m512& sv, __m512& zv) {
  const __m512i v = _mm512_loadu_si512(w.tile_sz(m0, G, g));
  sv = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  zv = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))));
  if (w.zr) {
    const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.tile_zr(m0, G, g)));
    zv = _mm512_add_ps(zv, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
  }
}

// One activation row's outputs of the tile at m0: acc + corr (+ bias) into y[m0 .. m0 + 16).
TIERED_AVX512 inline __attribute__((always_inline)) void store_tile_avx512(const Int4W& w, __m512 acc, __m512 corr,
                                                                          int64_t m0, float* y) {
  __m512 out = _mm512_add_ps(acc, corr);
  if (w.bias) out = _mm512_add_ps(out, _mm512_loadu_ps(w.bias + m0));
  _mm512_storeu_ps(y + m0, out);
}

// int4t_w16_avx2 on AVX-512 (VNNI), on the int16 activations split into signed bytes, xs = 256 xh + xl
// (Act::xh, xl): a chunk's 64-byte line is the 16 rows' dwords in one vector; ANDed with 0x0F, and
// shifted right by 4 and ANDed, it gives the unsigned nibbles of columns 8c..8c+3 and 8c+4..8c+7 of
// all 16 rows, and one vpdpbusd each against a broadcast of 4 bytes of xh, and one of xl, adds 4
// products per row lane. Per group the row's int32 dot is 256 sum(h) + sum(l): exactly the int16
// dot (|.| <= 32 * 15 * 32639), so the same integer dots and the same fp32 operations per row and
// group as int4t_w16_avx2, and the same results up to the order of the final sums. 7 integer ops
// per 128 weights where unpacking to int16 pairs for vpdpwssd took 11: from cache on a Zen 4 core
// 34-35 GB/s of an OLMoE-width int4 weight a thread, against 28 (both are near the bound of 4
// multiply-adds per 64 bytes there). Two chains per part and row (nibble halves) up to 2 rows, one
// from 3 rows on. Scales and zero terms of a group: one 64-byte line of (s, z) bf16 pairs and 32
// bytes of residuals for the 16 rows, read where they are used (as scales8_avx2).
template <int NB>
TIERED_AVX512 void int4t_w16_avx512(const Int4W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                                    int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  const __m512i m4 = _mm512_set1_epi8(15);
  const __m512 eight = _mm512_set1_ps(8.f);
  constexpr int C = NB <= 2 ? 2 : 1;  // chains per part (h, l) and row: 2 C NB accumulators live
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const uint8_t* tile = w.tile(m0);
    const int64_t next = m0 + kBlock < n1 ? m0 + kBlock : -1;
    __m512 acc[NB], corr[NB];
    for (int j = 0; j < NB; ++j) acc[j] = corr[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* chunk = tile + g * w.gstride;  // 4 chunks of 8 columns x 16 rows
      prefetch_group(w, chunk, next, G, g);
      __m512i th[NB][C], tl[NB][C];
      for (int j = 0; j < NB; ++j)
        for (int c = 0; c < C; ++c) th[j][c] = tl[j][c] = _mm512_setzero_si512();
      for (int c4 = 0; c4 < 4; ++c4) {
        const __m512i d = _mm512_loadu_si512(chunk + 64 * c4);
        const __m512i ql = _mm512_and_si512(d, m4), qh = _mm512_and_si512(_mm512_srli_epi16(d, 4), m4);
        for (int j = 0; j < NB; ++j) {
          const int64_t k = (b0 + j) * K + g * kGroup + c4 * 8;
          int32_t h0, h1, l0, l1;
          std::memcpy(&h0, a.xh + k, 4), std::memcpy(&h1, a.xh + k + 4, 4);
          std::memcpy(&l0, a.xl + k, 4), std::memcpy(&l1, a.xl + k + 4, 4);
          th[j][0] = _mm512_dpbusd_epi32(th[j][0], ql, _mm512_set1_epi32(h0));
          th[j][C - 1] = _mm512_dpbusd_epi32(th[j][C - 1], qh, _mm512_set1_epi32(h1));
          tl[j][0] = _mm512_dpbusd_epi32(tl[j][0], ql, _mm512_set1_epi32(l0));
          tl[j][C - 1] = _mm512_dpbusd_epi32(tl[j][C - 1], qh, _mm512_set1_epi32(l1));
        }
      }
      __m512 sv, zv;
      tile_scales_avx512(w, m0, G, g, sv, zv);
      zv = _mm512_fnmadd_ps(eight, sv, zv);
      for (int j = 0; j < NB; ++j) {
        const int64_t bg = (b0 + j) * G + g;
        __m512i ti = _mm512_slli_epi32(C == 2 ? _mm512_add_epi32(th[j][0], th[j][1]) : th[j][0], 8);
        ti = _mm512_add_epi32(ti, C == 2 ? _mm512_add_epi32(tl[j][0], tl[j][1]) : tl[j][0]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ti), _mm512_mul_ps(sv, _mm512_set1_ps(a.dw[bg])), acc[j]);
        corr[j] = _mm512_fmadd_ps(zv, _mm512_set1_ps(a.wsum[bg]), corr[j]);
      }
    }
    for (int j = 0; j < NB; ++j) store_tile_avx512(w, acc[j], corr[j], m0, y + (b0 + j) * ldy);
  }
}

// AVX2 on int8 activations (Act::xqt; calls of at least q8_from rows): the codes ANDed with 0x0F,
// and shifted right by 4 and ANDed, are vpmaddubsw's unsigned operand against a broadcast of 4 bytes
// of xq. Each int16 pair sum is at most 2 * 15 * 128 = 3840, so the 8 of a group (4 chunks x 2
// nibbles) add up in int16 exactly (<= 30720) before one vpmaddwd by ones widens them to the row's
// int32 lane. y = sum_g s_g (dx_g dot_g + c_g) + Z_g xsum_g with c_g = m8_g + 8 xsum_g and
// Z = z + zr - 8 s (q - 8 against the quantized sum).
//
// A call of more than kQ8StreamRows rows unpacks each tile (16 rows) once into nibble vectors
// (int4tq8_unpack_avx2: L1/L2-resident, 512 bytes a group), read by every pass of at most 4
// activation rows; smaller calls stream (int4tq8s_avx2, below). Per chunk of 8 columns the tile's 4
// vectors (rows 0-7 and 8-15, low and high nibbles) stay in registers while each row broadcasts its
// 8 bytes of xq once: a pass does 16 integer ops per 256 multiply-adds and row (8 int16
// accumulators, 4 code vectors and 2 broadcasts: 14 registers; GCC keeps a few sums on the stack, yet
// passes of 3 rows, which it keeps in registers, took 0.97-1.15x the time at 16 and 64 rows on 2 Zen 3
// cores, 2026-12-01: each code vector then serves fewer rows).

// One 64-byte chunk (8 columns x 16 rows) -> its nibble vectors lo0 lo1 hi0 hi1 (rows 0-7, 8-15); MXFP4's
// (E2M1) through kE2m1U, one vpshufb each (the table in both 128-bit lanes).
template <bool E2M1 = false>
TIERED_AVX2 inline __attribute__((always_inline)) void int4tq8_chunk_avx2(const uint8_t* c, __m256i* q) {
  const __m256i m4 = _mm256_set1_epi8(15);
  const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
  q[0] = _mm256_and_si256(d0, m4), q[1] = _mm256_and_si256(d1, m4);
  q[2] = _mm256_and_si256(_mm256_srli_epi16(d0, 4), m4), q[3] = _mm256_and_si256(_mm256_srli_epi16(d1, 4), m4);
  if constexpr (E2M1) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2m1U)));
    for (int i = 0; i < 4; ++i) q[i] = _mm256_shuffle_epi8(lut, q[i]);
  }
}

// The tile at m0 unpacked into u (16 vectors a group), prefetching its code stream ahead and, a group
// at a time, the next tile's scales (next: that tile's row, or -1).
template <bool E2M1>
TIERED_AVX2 inline void int4tq8_unpack_avx2(const Int4W& w, int64_t m0, int64_t next, int64_t G, __m256i* u) {
  const uint8_t* tile = w.tile(m0);
  for (int64_t g = 0; g < G; ++g) {
    prefetch_group(w, tile + g * w.gstride, next, G, g, true);
    for (int c4 = 0; c4 < 4; ++c4) {
      __m256i q[4];
      int4tq8_chunk_avx2<E2M1>(tile + g * w.gstride + 64 * c4, q);
      for (int i = 0; i < 4; ++i) _mm256_storeu_si256(u + 16 * g + 4 * c4 + i, q[i]);
    }
  }
}

// One pass of NB activation rows over a tile unpacked in u (calls of more than kQ8StreamRows rows:
// smaller ones stream, int4tq8s_avx2). MXFP4 (E2M1): u in [0, 24] makes a pair sum up to 2 * 24 * 127,
// so a group's int16 sums are widened every 2 chunks (<= 4 * 6096), the dot centred on 12 in int32
// (- 12 sum xq) and scaled by s dx, blk's zero terms of offset 0 and cm unused.
template <int NB, bool E2M1>
TIERED_AVX2 inline void int4tq8_tile_avx2(const Act& a, const Int4W& w, const __m256i* u, int64_t next,
                                          const Int4Block& blk, const float* cm, int64_t b0, int64_t m0, float* y,
                                          int64_t ldy) {
  const float* bias = w.bias;
  const int64_t K = a.K, G = K / kGroup;
  const int8_t* xq[NB];
  const float *dx[NB], *xs[NB], *c[NB];
  const int32_t* xqs[NB];
  for (int j = 0; j < NB; ++j) {
    const int64_t b = b0 + j;
    xq[j] = a.xqt + b * K, dx[j] = a.dxg + b * G, xs[j] = a.xsum + b * a.Gp, c[j] = cm + j * G, xqs[j] = a.xqs + b * G;
  }
  const float *S = blk.sc.data(), *Z = blk.zc.data();
  float acc[NB][kBlock];
  {  // the zero terms Z xsum (the s terms ride on c below): 2 NB independent FMA chains, g outermost
    __m256 cv[NB][2];
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) cv[j][h] = bias ? _mm256_loadu_ps(bias + m0 + 8 * h) : _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m256 z0 = _mm256_loadu_ps(Z + g * kBlock), z1 = _mm256_loadu_ps(Z + g * kBlock + 8);
      for (int j = 0; j < NB; ++j) {
        const __m256 xv = _mm256_set1_ps(xs[j][g]);
        cv[j][0] = _mm256_fmadd_ps(z0, xv, cv[j][0]), cv[j][1] = _mm256_fmadd_ps(z1, xv, cv[j][1]);
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc[j] + 8 * h, cv[j][h]);
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    __m256i t[NB][2], t32[NB][2];
    for (int j = 0; j < NB; ++j) t[j][0] = t[j][1] = t32[j][0] = t32[j][1] = _mm256_setzero_si256();
#pragma GCC unroll 1  // unrolled, GCC hoists the products of all 4 chunks ahead of their adds and spills them
    for (int c4 = 0; c4 < 4; ++c4) {
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_loadu_si256(u + 16 * g + 4 * c4 + i);
      const __m256i lo0 = q[0], lo1 = q[1], hi0 = q[2], hi1 = q[3];
      for (int j = 0; j < NB; ++j) {
        int32_t v0, v1;
        std::memcpy(&v0, xq[j] + g * kGroup + c4 * 8, 4), std::memcpy(&v1, xq[j] + g * kGroup + c4 * 8 + 4, 4);
        const __m256i x0 = _mm256_set1_epi32(v0), x1 = _mm256_set1_epi32(v1);
        t[j][0] = _mm256_add_epi16(t[j][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, x0), _mm256_maddubs_epi16(hi0, x1)));
        t[j][1] = _mm256_add_epi16(t[j][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, x0), _mm256_maddubs_epi16(hi1, x1)));
      }
      if constexpr (E2M1) {
        if (c4 == 1)
          for (int j = 0; j < NB; ++j)
            for (int h = 0; h < 2; ++h) t32[j][h] = _mm256_madd_epi16(t[j][h], ones), t[j][h] = _mm256_setzero_si256();
      }
    }
    const __m256 s0 = _mm256_loadu_ps(S + g * kBlock), s1 = _mm256_loadu_ps(S + g * kBlock + 8);
    for (int j = 0; j < NB; ++j) {
      const __m256 d = _mm256_set1_ps(dx[j][g]);
      __m256 v0, v1;
      if constexpr (E2M1) {
        const __m256i c12 = _mm256_set1_epi32(12 * xqs[j][g]);
        v0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(t[j][0], ones), t32[j][0]), c12)), d);
        v1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(t[j][1], ones), t32[j][1]), c12)), d);
      } else {
        const __m256 cg = _mm256_set1_ps(c[j][g]);
        v0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(t[j][0], ones)), d, cg);
        v1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(t[j][1], ones)), d, cg);
      }
      _mm256_storeu_ps(acc[j], _mm256_fmadd_ps(v0, s0, _mm256_loadu_ps(acc[j])));
      _mm256_storeu_ps(acc[j] + 8, _mm256_fmadd_ps(v1, s1, _mm256_loadu_ps(acc[j] + 8)));
    }
  }
  for (int j = 0; j < NB; ++j) std::memcpy(y + (b0 + j) * ldy + m0, acc[j], sizeof(acc[j]));
}

// One pass of nb <= 4 activation rows over a tile (int4tq8_tile_avx2 at that width).
template <bool E2M1>
TIERED_AVX2 inline void int4tq8_pass_avx2(int64_t nb, const Act& a, const Int4W& w, const __m256i* u, int64_t next,
                                          const Int4Block& blk, const float* cm, int64_t b0, int64_t m0, float* y,
                                          int64_t ldy) {
  switch (nb) {
    case 1: int4tq8_tile_avx2<1, E2M1>(a, w, u, next, blk, cm, b0, m0, y, ldy); break;
    case 2: int4tq8_tile_avx2<2, E2M1>(a, w, u, next, blk, cm, b0, m0, y, ldy); break;
    case 3: int4tq8_tile_avx2<3, E2M1>(a, w, u, next, blk, cm, b0, m0, y, ldy); break;
    default: int4tq8_tile_avx2<4, E2M1>(a, w, u, next, blk, cm, b0, m0, y, ldy); break;
  }
}

// The int8-activation fields of NB activation rows from b0 (the streaming kernels' operands): xqt,
// dx per group, the exact sum of x per group and the sum of xqt per group.
template <int NB>
struct Q8Rows {
  const int8_t* xq[NB];
  const float *dx[NB], *xs[NB];
  const int32_t* xqs[NB];
  Q8Rows(const Act& a, int64_t b0) {
    const int64_t G = a.K / kGroup;
    for (int j = 0; j < NB; ++j) {
      const int64_t b = b0 + j;
      xq[j] = a.xqt + b * a.K, dx[j] = a.dxg + b * G, xs[j] = a.xsum + b * a.Gp, xqs[j] = a.xqs + b * G;
    }
  }
};

// Activation rows per pass of the streaming kernel below.
constexpr int64_t kQ8PassRows = 3;

// Calls on int8 activations streamed as int4tq8s_avx512 streams: per chunk the tile's 4 nibble vectors
// against each row's 8 bytes of xqt (vpmaddubsw, int16 sums exact per group as in int4tq8_tile_avx2,
// MXFP4's widened every 2 chunks as there), then per group and 8-row half the centred int32 dot
// (Act::xqs; centre 12 for MXFP4), its scale s dx and the zero term (z + zr) xsum, with the (s, z) line
// and residuals read in the stream and the next tile's prefetched: no per-tile block, no separate
// zero-term pass. One tile (16 rows at m0) for NB <= 3 activation rows. The chunk loop keeps 2 NB int16
// sums, the 4 nibble vectors, 2 broadcasts and the nibble mask in registers (13 of AVX2's 16 at 3 rows);
// from 3 rows on the fp32 sums (one per row and 8-row half) wait in L1, read and written once a group.
// With 4 rows and both kinds of sums in registers (passes of 4 until 2026-12-01) GCC spilled int16 sums
// inside the chunk loop, a store-to-load chain every chunk. On 2 Zen 3 cores (2026-12-01, one thread,
// weights in cache, the two builds alternated in time) this took 0.83-0.95x the time of the 4-row
// passes at 8 and 12 rows (768 x 2048, 2048 x 768, 1728 x 576, 576 x 1536: a routed expert's rows in a
// prompt), 0.79-0.88x at 2 rows, the same at 1 and 4.
template <int NB, bool E2M1>
TIERED_AVX2 inline void int4tq8s_tile_avx2(const Int4W& w, const Act& a, int64_t b0, int64_t G, int64_t m0,
                                           int64_t next, float* y, int64_t ldy) {
  const Q8Rows<NB> x(a, b0);
  constexpr int32_t kCentre = E2M1 ? 12 : 8;
  const __m256i ones = _mm256_set1_epi16(1), hi = _mm256_set1_epi32(int(0xFFFF0000u));
  const uint8_t* tile = w.tile(m0);
  constexpr bool kInRegs = NB <= 2;  // room for the fp32 sums too (a decode step's 1-2 rows)
  alignas(32) float mem[NB][kBlock];
  __m256 reg[NB][2];
  for (int j = 0; j < NB; ++j)
    for (int h = 0; h < 2; ++h) {
      const __m256 b = w.bias ? _mm256_loadu_ps(w.bias + m0 + 8 * h) : _mm256_setzero_ps();
      if constexpr (kInRegs) reg[j][h] = b;
      else _mm256_store_ps(mem[j] + 8 * h, b);
    }
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* pg = tile + g * w.gstride;
    prefetch_group(w, pg, next, G, g);
    __m256i t[NB][2], t32[NB][2];
    for (int j = 0; j < NB; ++j) t[j][0] = t[j][1] = t32[j][0] = t32[j][1] = _mm256_setzero_si256();
#pragma GCC unroll 1  // unrolled, GCC hoists the products of all 4 chunks ahead of their adds and spills them
    for (int c4 = 0; c4 < 4; ++c4) {
      __m256i q[4];
      int4tq8_chunk_avx2<E2M1>(pg + 64 * c4, q);
      for (int j = 0; j < NB; ++j) {
        int32_t v0, v1;
        std::memcpy(&v0, x.xq[j] + g * kGroup + c4 * 8, 4), std::memcpy(&v1, x.xq[j] + g * kGroup + c4 * 8 + 4, 4);
        const __m256i x0 = _mm256_set1_epi32(v0), x1 = _mm256_set1_epi32(v1);
        t[j][0] = _mm256_add_epi16(_mm256_add_epi16(t[j][0], _mm256_maddubs_epi16(q[0], x0)), _mm256_maddubs_epi16(q[2], x1));
        t[j][1] = _mm256_add_epi16(_mm256_add_epi16(t[j][1], _mm256_maddubs_epi16(q[1], x0)), _mm256_maddubs_epi16(q[3], x1));
      }
      if constexpr (E2M1) {
        if (c4 == 1)
          for (int j = 0; j < NB; ++j)
            for (int h = 0; h < 2; ++h) t32[j][h] = _mm256_madd_epi16(t[j][h], ones), t[j][h] = _mm256_setzero_si256();
      }
    }
    const uint16_t* sz = w.tile_sz(m0, G, g);
    for (int h = 0; h < 2; ++h) {  // rows 8h..8h+7: 8 (s, z) bf16 pairs, 8 residuals
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + 16 * h));
      const __m256 sv = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      __m256 zv = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
      if (w.zr) {
        const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.tile_zr(m0, G, g) + 8 * h));
        zv = _mm256_add_ps(zv, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(r), 16)));
      }
      for (int j = 0; j < NB; ++j) {
        __m256i ti = _mm256_madd_epi16(t[j][h], ones);
        if constexpr (E2M1) ti = _mm256_add_epi32(ti, t32[j][h]);
        ti = _mm256_sub_epi32(ti, _mm256_set1_epi32(kCentre * x.xqs[j][g]));
        __m256 s = kInRegs ? reg[j][h] : _mm256_load_ps(mem[j] + 8 * h);
        s = _mm256_fmadd_ps(zv, _mm256_set1_ps(x.xs[j][g]), s);
        s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ti), _mm256_mul_ps(sv, _mm256_set1_ps(x.dx[j][g])), s);
        if constexpr (kInRegs) reg[j][h] = s;
        else _mm256_store_ps(mem[j] + 8 * h, s);
      }
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(y + (b0 + j) * ldy + m0 + 8 * h, kInRegs ? reg[j][h] : _mm256_load_ps(mem[j] + 8 * h));
}

// Rows [b0, b0 + nb) streamed tile by tile: each tile's codes come from memory once, for the first
// pass of at most kQ8PassRows rows, and the passes after it read them from L1 / L2 (a tile is K/32 x 320 bytes:
// 5.6 KiB at K = 576, 40 at 4096). Up to kQ8StreamRows rows (below: where this beats unpacking).
template <bool E2M1 = false>
TIERED_AVX2 void int4tq8s_avx2(const Int4W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1,
                               float* y, int64_t ldy) {
  const int64_t G = a.K / kGroup;
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const int64_t next = m0 + kBlock < n1 ? m0 + kBlock : -1;
    for (int64_t j0 = b0; j0 < b0 + nb; j0 += kQ8PassRows) {
      switch (std::min<int64_t>(kQ8PassRows, b0 + nb - j0)) {
        case 1: int4tq8s_tile_avx2<1, E2M1>(w, a, j0, G, m0, next, y, ldy); break;
        case 2: int4tq8s_tile_avx2<2, E2M1>(w, a, j0, G, m0, next, y, ldy); break;
        default: int4tq8s_tile_avx2<kQ8PassRows, E2M1>(w, a, j0, G, m0, next, y, ldy); break;
      }
    }
  }
}

template <bool E2M1>
TIERED_AVX2 void int4tq8_avx2(const Int4W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1,
                              float* y, int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  thread_local Int4Block blk;
  thread_local std::vector<__m256i> u;  // the unpacked tile: 16 vectors a group
  thread_local std::vector<float> cm;  // c = m8 + 8 xsum per activation row and group (MXFP4: unused)
  cm.resize(nb * G);
  if constexpr (!E2M1)
    for (int64_t j = 0; j < nb; ++j)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = (b0 + j) * a.Gp + g;
        cm[j * G + g] = a.m8[i] + 8.f * a.xsum[i];
      }
  u.resize(16 * G);
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const int64_t next = m0 + kBlock < n1 ? m0 + kBlock : -1;
    int4tq8_unpack_avx2<E2M1>(w, m0, next, G, u.data());  // first: with the scales inline it streams their lines in,
    int4t_fill_block_avx2(w, m0, G, blk, E2M1 ? 0.f : 8.f);  // so this pass over them hits the cache
    for (int64_t j0 = b0; j0 < b0 + nb; j0 += 4)
      int4tq8_pass_avx2<E2M1>(std::min<int64_t>(4, b0 + nb - j0), a, w, u.data(), next, blk,
                              cm.data() + (j0 - b0) * G, j0, m0, y, ldy);
  }
}

#define TIERED_AVX512_VBMI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx512vbmi,avx2,fma")))

// y for one tile and NB activation rows: acc (16 rows) + sum_g zc[g] * gsum[j][g] + bias.
template <int NB>
TIERED_AVX512 inline __attribute__((always_inline)) void int4t_store(const Int4W& w, const float* const* gs,
                                                                     const Int4Block& blk, int64_t G, int64_t m0,
                                                                     int64_t b0, const __m512* acc, float* y, int64_t ldy) {
  for (int j = 0; j < NB; ++j) {
    __m512 cv = acc[j], c1 = _mm512_setzero_ps();  // two FMA chains: one is latency-bound at batch 1
    int64_t g = 0;
    for (; g + 1 < G; g += 2) {
      cv = _mm512_fmadd_ps(_mm512_loadu_ps(blk.zc.data() + g * kBlock), _mm512_set1_ps(gs[j][g]), cv);
      c1 = _mm512_fmadd_ps(_mm512_loadu_ps(blk.zc.data() + (g + 1) * kBlock), _mm512_set1_ps(gs[j][g + 1]), c1);
    }
    if (g < G) cv = _mm512_fmadd_ps(_mm512_loadu_ps(blk.zc.data() + g * kBlock), _mm512_set1_ps(gs[j][g]), cv);
    cv = _mm512_add_ps(cv, c1);
    if (w.bias) cv = _mm512_add_ps(cv, _mm512_loadu_ps(w.bias + m0));
    _mm512_storeu_ps(y + (b0 + j) * ldy + m0, cv);
  }
}

template <int NB>
TIERED_AVX512_VBMI void int4t_avx512(const Int4W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                                     int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  constexpr int C = NB == 1 ? 4 : NB <= 3 ? 2 : 1;  // independent vdpbf16ps chains per row
  const uint32_t* xp[NB];
  const float* gs[NB];
  for (int j = 0; j < NB; ++j) xp[j] = a.xp + (b0 + j) * (K / 2), gs[j] = a.gsum + (b0 + j) * G;
  // vpmultishiftqb controls: in each qword (rows 2i, 2i+1), bytes 0 / 2 of each dword <- bits 8jj / 8jj + 4
  // of that row's dword (the low / high nibble of its byte jj; the other bits are masked off below)
  __m512i ctl[4];
  for (int jj = 0; jj < 4; ++jj) {
    const uint64_t lo = 8 * jj, hi = 8 * jj + 4;
    const uint64_t q = lo | (lo << 8) | (hi << 16) | (hi << 24) | ((32 + lo) << 32) | ((32 + lo) << 40) |
                       ((32 + hi) << 48) | ((32 + hi) << 56);
    ctl[jj] = _mm512_set1_epi64(int64_t(q));
  }
  const __m512i nib = _mm512_set1_epi32(0x000F000F), bias128 = _mm512_set1_epi32(0x43004300);
  thread_local Int4Block blk;
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    int4_fill_block_avx512(w, m0, kBlock, G, 136.f, blk);
    const uint8_t* tile = w.tile(m0);
    __m512 acc[NB];
    for (int j = 0; j < NB; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512 t[NB][C];
      for (int j = 0; j < NB; ++j)
        for (int c = 0; c < C; ++c) t[j][c] = _mm512_setzero_ps();
      const uint8_t* p = tile + g * w.gstride;
      prefetch_group(w, p, w.inline_sz && m0 + kBlock < n1 ? m0 + kBlock : -1, G, g, true);
      for (int c4 = 0; c4 < 4; ++c4) {
        const __m512i v = _mm512_loadu_si512(p + c4 * 64);
        for (int jj = 0; jj < 4; ++jj) {
          const __m512i wv = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(ctl[jj], v), nib, bias128, 0xEA);
          const int64_t e = (g * 4 + c4) * 4 + jj;
          for (int j = 0; j < NB; ++j) t[j][jj % C] = dot_bf16(t[j][jj % C], wv, _mm512_set1_epi32(int(xp[j][e])));
        }
      }
      const __m512 sv = _mm512_loadu_ps(blk.sc.data() + g * kBlock);
      for (int j = 0; j < NB; ++j) {
        __m512 s = t[j][0];
        for (int c = 1; c < C; ++c) s = _mm512_add_ps(s, t[j][c]);
        acc[j] = _mm512_fmadd_ps(s, sv, acc[j]);
      }
    }
    int4t_store<NB>(w, gs, blk, G, m0, b0, acc, y, ldy);
  }
}

// Tiled int4 on int8 activations (AVX-512 VNNI; llama.cpp's Q4_0 x Q8_0), every call size (passes of
// up to 8 rows), streamed as int4t_w16_avx512 streams: per chunk of 8 columns x 16 rows 2 vpdpbusd
// (the low and high nibbles against 4 bytes of xqt each), half the multiply-adds of the split int16
// form. Per group the centred dot sum((q - 8) xq) = dot - 8 sum(xq) (Act::xqs) is exact in int32:
// each row's chain starts at -8 sum(xq) (one broadcast, where a subtraction after the dots took a
// broadcast and an integer op a row and group), one chain a row from 4 rows on (2 at 3, 4 at 1-2:
// enough in flight to hide vpdpbusd's latency), so the epilogue is a conversion, a multiply and two
// FMAs a row and group, against 8 vpdpbusd. On 2 Zen 4 cores (2026-12-02, interleaved in one
// process, the same bits out) that took 0.90-0.95x the time of a subtraction after two chains at 8,
// 16 and 512 rows, 0.93-0.98x at 2-4 (576 x 576 to 4096 x 4096).
// Then y = sum_g s dx_g centred_g + (z + zr) xsum_g. The tile's (s, z) line and residuals are read
// where used and the next tile's prefetched, with no per-tile block of scales: a kernel that filled
// one for calls of 5+ rows spent most of its time in that pass (at 8 rows, 768 x 2048: ~100 us
// against ~60-85 reading them in the loop), and with the scales inline it waited on lines 320 B apart.
// MXFP4 (E2M1): each nibble vector through kE2m1U (one vpshufb, the table in every 128-bit lane), u in
// [0, 24] still vpdpbusd's unsigned operand (4 products of at most 24 * 127 a lane: int32 holds a group
// exactly), the dot centred on 12 instead of 8. Until 2026-11-30 MXFP4 ran int4tq8s_avx2 here: on 2 Sapphire
// Rapids cores a gpt-oss-20b expert projection (2880 x 2880) at 16 rows took ~1.6 ms, ~12 ps a
// multiply-add where int4 codes on this kernel took 3.4.
// AMX (TDPBSSD) was tried for calls of 16+ rows (2026-12-02): A = 16 rows' 32 bytes of xqt, B = a group's four
// chunks unpacked and centred (each is one B row as laid out, no transposition), the 16 x 16 int32 product stored
// and scaled per group in this kernel's order (the same bits). On 2 Sapphire Rapids cores it took 0.87-1.14x this
// kernel's time at 32-512 rows (6-13x at 1-5): the per-32 scales of both operands need a tile store and a 16-row
// epilogue every 8192 multiply-adds, and tileloadd / tdpbssd / tilestored (~5 / 8 / 10 ns) ran one after another
// there, not overlapping that epilogue (~16 ns). AMX pays on long accumulations: the dequantized bf16 GEMM to
// which q8_dequantize_rows / q8_expert_grouped_rows hand the largest calls.
template <int NB, bool E2M1 = false>
TIERED_AVX512 void int4tq8s_avx512(const Int4W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                                   int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  const __m512i m4 = _mm512_set1_epi8(15);
  constexpr int32_t kCentre = E2M1 ? 12 : 8;
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2m1U)));
  constexpr int T = NB <= 2 ? 4 : NB == 3 ? 2 : 1;  // int32 chains a row
  const Q8Rows<NB> x(a, b0);
  thread_local std::vector<int32_t> cq;  // -centre sum(xqt) per row and group: where each group's dot starts
  cq.resize(NB * G);
  for (int j = 0; j < NB; ++j)
    for (int64_t g = 0; g < G; ++g) cq[j * G + g] = -kCentre * x.xqs[j][g];
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const uint8_t* tile = w.tile(m0);
    const int64_t next = m0 + kBlock < n1 ? m0 + kBlock : -1;
    __m512 acc[NB], corr[NB];
    for (int j = 0; j < NB; ++j) acc[j] = corr[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* chunk = tile + g * w.gstride;
      prefetch_group(w, chunk, next, G, g);
      __m512i t[NB][T];
      for (int j = 0; j < NB; ++j) {
        t[j][0] = _mm512_set1_epi32(cq[j * G + g]);
        for (int c = 1; c < T; ++c) t[j][c] = _mm512_setzero_si512();
      }
      for (int c4 = 0; c4 < 4; ++c4) {
        const __m512i d = _mm512_loadu_si512(chunk + 64 * c4);
        __m512i ql = _mm512_and_si512(d, m4), qh = _mm512_and_si512(_mm512_srli_epi16(d, 4), m4);
        if constexpr (E2M1) ql = _mm512_shuffle_epi8(lut, ql), qh = _mm512_shuffle_epi8(lut, qh);
        const int c = (2 * c4) % T, c1 = (2 * c4 + 1) % T;
        for (int j = 0; j < NB; ++j) {
          int32_t x0, x1;
          std::memcpy(&x0, x.xq[j] + g * kGroup + c4 * 8, 4), std::memcpy(&x1, x.xq[j] + g * kGroup + c4 * 8 + 4, 4);
          t[j][c] = _mm512_dpbusd_epi32(t[j][c], ql, _mm512_set1_epi32(x0));
          t[j][c1] = _mm512_dpbusd_epi32(t[j][c1], qh, _mm512_set1_epi32(x1));
        }
      }
      __m512 sv, zv;
      tile_scales_avx512(w, m0, G, g, sv, zv);
      for (int j = 0; j < NB; ++j) {
        __m512i ti = t[j][0];
        for (int c = 1; c < T; ++c) ti = _mm512_add_epi32(ti, t[j][c]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ti), _mm512_mul_ps(sv, _mm512_set1_ps(x.dx[j][g])), acc[j]);
        corr[j] = _mm512_fmadd_ps(zv, _mm512_set1_ps(x.xs[j][g]), corr[j]);
      }
    }
    for (int j = 0; j < NB; ++j) store_tile_avx512(w, acc[j], corr[j], m0, y + (b0 + j) * ldy);
  }
}
// Dequantizing a tiled weight (the prefill path of a weight held only tiled): tile rows
// 16t..16t+15 as w = q * s + (z + zr - 8 s) (blk from gather(.., 8)), written to rows of ldo
// elements, fp32 (of) or bf16 rounded to nearest even (ob). Every path computes the same mul and
// add in fp32, so all give identical bits. MXFP4 (E2M1, blk from gather(.., 0)): w = (u - 12) * s +
// (z + zr), u = kE2m1U[q], the code centred in integers first: (u - 12) s is the MXFP4 weight exactly
// (2 significant bits times a power of two, or the bias times 1), with no u * s to overflow.
template <bool E2M1>
void int4t_dequant_scalar(const Int4Block& blk, const uint8_t* tile, int64_t gstride, int64_t K, float* of, uint16_t* ob,
                          int64_t ldo) {
  for (int64_t r = 0; r < kBlock; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t gi = (k / kGroup) * kBlock + r;
      const uint8_t q = tiled_code(tile, gstride, r, k);
      const float v = float(E2M1 ? int32_t(kE2m1U[q]) - 12 : int32_t(q)) * blk.sc[gi] + blk.zc[gi];
      if (of) of[r * ldo + k] = v; else ob[r * ldo + k] = to_bf16(v);
    }
}

// Row r's 32 codes of group g as bytes in column order: its dword of each of the group's four
// 64-byte chunks holds columns 8c + j (low nibbles) and 8c + 4 + j (high). E2M1: through kE2m1U.
template <bool E2M1>
TIERED_AVX2 inline void tiled_group_codes(const uint8_t* tile, int64_t gstride, int64_t r, int64_t g, __m128i& c0,
                                          __m128i& c1) {
  int32_t d[4];
  for (int c = 0; c < 4; ++c) std::memcpy(d + c, tile + g * gstride + c * 64 + 4 * r, 4);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d)), m4 = _mm_set1_epi8(15);
  __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
  if constexpr (E2M1) {
    const __m128i lut = _mm_load_si128(reinterpret_cast<const __m128i*>(kE2m1U));
    lo = _mm_shuffle_epi8(lut, lo), hi = _mm_shuffle_epi8(lut, hi);
  }
  c0 = _mm_unpacklo_epi32(lo, hi);  // columns 0..15
  c1 = _mm_unpackhi_epi32(lo, hi);  // columns 16..31
}

// AVX-512 lanes as 16 rows (the GGUF repacking passes) or 16 values: the 32-bit words at p + each lane's offset
// in vidx; the fp16 in each lane's low half as fp32; to_bf16 of each lane (in its low 16 bits)
TIERED_AVX512 inline __m512i gather_lanes(__m512i vidx, const uint8_t* p) { return _mm512_i32gather_epi32(vidx, p, 1); }
TIERED_AVX512 inline __m512 fp16_lo_lanes(__m512i v) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF))));
}
TIERED_AVX512 inline __m512i bf16_lanes(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i r = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  return _mm512_srli_epi32(_mm512_add_epi32(u, r), 16);
}

template <bool E2M1>
TIERED_AVX512 void int4t_dequant_avx512(const Int4Block& blk, const uint8_t* tile, int64_t gstride, int64_t K, float* of,
                                        uint16_t* ob, int64_t ldo) {
  const int64_t G = K / kGroup;
  const __m512i centre = _mm512_set1_epi32(E2M1 ? 12 : 0);
  for (int64_t r = 0; r < kBlock; ++r)
    for (int64_t g = 0; g < G; ++g) {
      __m128i c[2];
      tiled_group_codes<E2M1>(tile, gstride, r, g, c[0], c[1]);
      const __m512 s = _mm512_set1_ps(blk.sc[g * kBlock + r]), z = _mm512_set1_ps(blk.zc[g * kBlock + r]);
      for (int h = 0; h < 2; ++h) {
        const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(c[h]), centre);
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), s), z);
        const int64_t at = r * ldo + g * kGroup + 16 * h;
        if (of) {
          _mm512_storeu_ps(of + at, v);
        } else {  // VCVTNEPS2BF16: round to nearest even in one instruction (bf16_lanes' five)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob + at), (__m256i)_mm512_cvtneps_pbh(v));
        }
      }
    }
}

template <bool E2M1>
TIERED_AVX2 void int4t_dequant_avx2(const Int4Block& blk, const uint8_t* tile, int64_t gstride, int64_t K, float* of,
                                    uint16_t* ob, int64_t ldo) {
  const int64_t G = K / kGroup;
  const __m256i half = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), centre = _mm256_set1_epi32(E2M1 ? 12 : 0);
  for (int64_t r = 0; r < kBlock; ++r)
    for (int64_t g = 0; g < G; ++g) {
      __m128i c[2];
      tiled_group_codes<E2M1>(tile, gstride, r, g, c[0], c[1]);
      const __m256 s = _mm256_set1_ps(blk.sc[g * kBlock + r]), z = _mm256_set1_ps(blk.zc[g * kBlock + r]);
      for (int h = 0; h < 2; ++h) {
        __m256 v[2];
        const __m256i q0 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(c[h]), centre);
        const __m256i q1 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(c[h], 8)), centre);
        v[0] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q0), s), z);
        v[1] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q1), s), z);
        const int64_t at = r * ldo + g * kGroup + 16 * h;
        if (of) {
          _mm256_storeu_ps(of + at, v[0]), _mm256_storeu_ps(of + at + 8, v[1]);
        } else {
          __m256i u[2];
          for (int i = 0; i < 2; ++i) {
            u[i] = _mm256_castps_si256(v[i]);
            u[i] = _mm256_add_epi32(u[i], _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u[i], 16), one)));
            u[i] = _mm256_srli_epi32(u[i], 16);
          }  // packus interleaves 128-bit lanes: put them back in order
          const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(u[0], u[1]), 0xD8);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob + at), p);
        }
      }
    }
}

// Rows [n0, n1) (whole tiles) of a tiled int4 weight into out [n1 - n0, K] (fp32 of, or bf16 ob),
// tiles spread over torch's thread pool.
void int4t_dequantize(const Int4W& w, int64_t K, int64_t n0, int64_t n1, float* of, uint16_t* ob) {
  const int isa = current_isa();
  at::parallel_for(n0 / kBlock, n1 / kBlock, 1, [&](int64_t t0, int64_t t1) {
    Int4Block blk;
    const int64_t G = K / kGroup;
    for (int64_t t = t0; t < t1; ++t) {
      blk.gather(w, t * kBlock, kBlock, G, w.e2m1 ? 0.f : 8.f);
      const uint8_t* tile = w.tile(t * kBlock);
      const int64_t at = (t * kBlock - n0) * K;
      float* o32 = of ? of + at : nullptr;
      uint16_t* o16 = of ? nullptr : ob + at;
      if (w.e2m1) {
        if (isa == kAvx512) int4t_dequant_avx512<true>(blk, tile, w.gstride, K, o32, o16, K);
        else if (isa == kAvx2) int4t_dequant_avx2<true>(blk, tile, w.gstride, K, o32, o16, K);
        else int4t_dequant_scalar<true>(blk, tile, w.gstride, K, o32, o16, K);
      } else {
        if (isa == kAvx512) int4t_dequant_avx512<false>(blk, tile, w.gstride, K, o32, o16, K);
        else if (isa == kAvx2) int4t_dequant_avx2<false>(blk, tile, w.gstride, K, o32, o16, K);
        else int4t_dequant_scalar<false>(blk, tile, w.gstride, K, o32, o16, K);
      }
    }
  });
}

// ------------------------------------------------------------------------------------ int4, tiled, AMX GEMM
// A prompt's rows times a tiled int4 weight on AMX (Sapphire Rapids and later): y [M, N] = x [M, K] bf16 @ W^T,
// W's weights as int4t_dequantize rounds them to bf16 and the products summed in fp32 by TDPBF16PS. Where
// Int4Linear.dense had dequantized the whole weight to bf16 in memory for one oneDNN GEMM, which packs it again
// for AMX at every call (two passes over N K bf16 beside the GEMM; on 2 Sapphire Rapids cores ~30% of a
// SmolLM2 prompt's [400 x 576] @ [576 x 3072] call) and builds its kernels again for every new row count (2-5 ms
// each, ~15 ms for a prompt of a length not seen before, 2026-12-05), each thread here dequantizes its 32-row
// blocks of W straight into AMX's pair-interleaved (VNNI) tile layout in a buffer that stays in its L1 / L2, and
// runs every 32-row block of x against it: tiles 0-3 the 2 x 2 fp32 accumulators, 4-5 x's two 16-row tiles,
// 6-7 W's two 16-row tiles, one group of 32 columns a step. The tiled layout's group is one B tile.

constexpr int64_t kAmxRows = 16;  // rows of a tile; its 64 bytes a row: 32 bf16 or 16 fp32

struct AmxConfig {  // ldtilecfg's 64-byte palette 1 configuration
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#ifndef ARCH_REQ_XCOMP_PERM
#define ARCH_REQ_XCOMP_PERM 0x1023
#endif
#ifndef XFEATURE_XTILEDATA
#define XFEATURE_XTILEDATA 18
#endif

// Whether this CPU has AMX-TILE and AMX-BF16 and Linux let this process use the tile data (arch_prctl, once).
bool amx_ready() {
  static const bool ok = [] {
#if defined(__x86_64__) && defined(__linux__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
    if (!__builtin_cpu_supports("avx512bf16")) return false;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

// v grown to hold n elements from a 64-byte boundary, and that boundary: a tile row is 64 bytes, and from malloc's
// 16-byte alignment (blocks of 128 KB and more are mmap'd, their data 16 bytes past a page) each row of x's or W's
// tiles straddled two cache lines.
template <typename T>
T* aligned64(std::vector<T>& v, int64_t n) {
  v.resize(n + 64 / sizeof(T));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

#define TIERED_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx2,fma")))

// Every tile 16 rows of 64 bytes (bf16 A and B tiles, fp32 C tiles) in this thread's tile configuration (ldtilecfg):
// the AMX GEMM's and the prompt attention's layout
TIERED_AMX inline void amx_load_tiles() {
  AmxConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = kAmxRows, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// The 16 rows' weights (int4t_dequantize's values, fp32) of the column at bits [shift, shift + 4) of each lane's dword
// v: the nibble through tab (q as a float, or E2M1's value) by one vpermps, which reads only an index's low 4 bits (an
// and, a convert and, for E2M1, a dword permute and a subtraction before: ~10% of a Mixtral-width weight's 16-row call,
// 2026-12-06), then q s + z in one FMA: q s is exact (a 4-bit integer times a bf16 scale), so the rounding is the one
// of int4t_dequantize's q * s + z.
TIERED_AMX TIERED_FORCE_INLINE __m512 vnni_weight(__m512i v, int shift, __m512 tab, __m512 s, __m512 z) {
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(shift ? _mm512_srli_epi32(v, shift) : v, tab), s, z);
}
// The 16 rows' pairs (even, odd) as bf16 in each lane (even in the low half): VCVTNE2PS2BF16 rounds both to nearest
// even at once (words 0-15 even's, 16-31 odd's; bf16_lanes took five instructions a vector), one word permute
// interleaves them. (It flushes fp32 denormals to zero, which int4 weights of bf16 scales do not reach.)
TIERED_AMX TIERED_FORCE_INLINE __m512i vnni_pair(__m512 even, __m512 odd, __m512i interleave) {
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}
// vnni_pair's word permutation: word 2r <- word r (the even column's row r), word 2r + 1 <- word 16 + r (the odd one's)
TIERED_AMX TIERED_FORCE_INLINE __m512i vnni_interleave() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19,
                          3, 18, 2, 17, 1, 16, 0);
}

// Tile t's (rows m0..m0+15) groups as B tiles: bv [G][16 pairs][16 rows][2] bf16 (as uint32 pairs), the pair
// (2p, 2p + 1) of group g's columns of row r at bv[(g * 16 + p) * 16 + r]. A group's chunk c (64 bytes) holds,
// per row r, the dword whose byte j has column 8c + j in its low nibble and 8c + 4 + j in its high one: loaded
// as 16 lanes = 16 rows, each column is a shift and a mask away, scaled with the lanes' own (scale, zero).
template <bool E2M1>
TIERED_AMX void int4t_vnni_tile(const Int4W& w, int64_t m0, int64_t G, int64_t g0, int64_t g1, uint32_t* bv) {
  // q's value: q, or E2M1's kE2m1U[q] - 12 (exact small integers)
  const __m512 tab = E2M1 ? _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(
                                              reinterpret_cast<const __m128i*>(kE2m1U)))),
                                          _mm512_set1_ps(12.f))
                          : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i interleave = vnni_interleave();
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  const __m512 off = _mm512_set1_ps(E2M1 ? 0.f : 8.f);
  const uint8_t* tile = w.tile(m0);
  for (int64_t g = g0; g < g1; ++g) {
    // the 16 rows' (scale, zero) bf16 pairs as Int4Block::gather reads them, one vector each: s, then z plus the
    // zero residual (+0 without one, as gather adds), less off * s (its two roundings, in its order). As
    // int4_fill_block_avx512 reads them, but inside this loop: filling an Int4Block first and reading it back took
    // 1.2-1.5x the time of a Mixtral-width weight's 8-row call (6.0-7.3 against 4.4-4.8 ms, 2 AMX cores, 2026-12-06)
    const __m512i sz = _mm512_loadu_si512(w.tile_sz(m0, G, g));
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
    __m512 z = _mm512_castsi512_ps(_mm512_and_si512(sz, high));
    z = _mm512_add_ps(z, w.zr ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(w.tile_zr(m0, G, g)))), 16))
                              : _mm512_setzero_ps());
    z = _mm512_sub_ps(z, _mm512_mul_ps(off, s));
    uint32_t* out = bv + (g - g0) * 16 * 16;
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(tile + g * w.gstride + c * 64);
      for (int j = 0; j < 4; j += 2) {  // pairs (8c + j, 8c + j + 1) low nibbles, (8c + 4 + j, 8c + 5 + j) high
        const __m512i lo = vnni_pair(vnni_weight(v, 8 * j, tab, s, z), vnni_weight(v, 8 * (j + 1), tab, s, z), interleave);
        const __m512i hi =
            vnni_pair(vnni_weight(v, 8 * j + 4, tab, s, z), vnni_weight(v, 8 * (j + 1) + 4, tab, s, z), interleave);
        _mm512_storeu_si512(out + (4 * c + j / 2) * 16, lo);
        _mm512_storeu_si512(out + (4 * c + 2 + j / 2) * 16, hi);
      }
    }
  }
}

// A tiled int8 weight's rows m0..m0+15 (int8, tiled: 64 bytes a tile and 4 columns, byte 4r + j column 4c + j of
// row r, plus 128), groups g0..g1 of K as B tiles in int4t_vnni_tile's layout: w = (u - 128) s, s the row's fp16 scale
// of the group (int8-g32) or the row's own, rounded to bf16 (as the int4 tiles round q s + z). A chunk's 16 lanes are
// the 16 rows, its four bytes a lane four consecutive columns: two pairs.
TIERED_AMX void int8t_vnni_tile(const Int8W& w, int64_t K, int64_t m0, int64_t G, int64_t g0, int64_t g1, uint32_t* bv) {
  const __m512i interleave = vnni_interleave();
  const __m512i lowb = _mm512_set1_epi32(0xFF), c128 = _mm512_set1_epi32(128);
  const uint8_t* tile = reinterpret_cast<const uint8_t*>(w.q) + m0 * K;
  alignas(64) float rs[16];
  if (!w.gs)
    for (int r = 0; r < 16; ++r) rs[r] = w.s(m0 + r);
  auto value = [&](__m512i v, int j, __m512 s) TIERED_AMX {  // byte j of each lane as (u - 128) s
    const __m512i u = _mm512_and_si512(j ? _mm512_srli_epi32(v, 8 * j) : v, lowb);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(u, c128)), s);
  };
  for (int64_t g = g0; g < g1; ++g) {
    const __m512 s = w.gs ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.gs + ((m0 / 16) * G + g) * 16)))
                          : _mm512_load_ps(rs);
    uint32_t* out = bv + (g - g0) * 16 * 16;
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_loadu_si512(tile + (g * 8 + c) * 64);
      _mm512_storeu_si512(out + (2 * c) * 16, vnni_pair(value(v, 0, s), value(v, 1, s), interleave));
      _mm512_storeu_si512(out + (2 * c + 1) * 16, vnni_pair(value(v, 2, s), value(v, 3, s), interleave));
    }
  }
}

// A weight's B tiles for amx_blocks: tiled int4 (or MXFP4) and tiled int8
TIERED_AMX TIERED_FORCE_INLINE void vnni_tile(const Int4W& w, int64_t, int64_t m0, int64_t G, int64_t g0, int64_t g1,
                                              uint32_t* b) {
  if (w.e2m1) int4t_vnni_tile<true>(w, m0, G, g0, g1, b);
  else int4t_vnni_tile<false>(w, m0, G, g0, g1, b);
}
TIERED_AMX TIERED_FORCE_INLINE void vnni_tile(const Int8W& w, int64_t K, int64_t m0, int64_t G, int64_t g0, int64_t g1,
                                              uint32_t* b) {
  int8t_vnni_tile(w, K, m0, G, g0, g1, b);
}

// C tiles (0..3) = (Acc: the 32 x 32 fp32 block at c, ldc floats apart; else 0) + x's 16-row tiles (4, 5: a0 and
// a1, n groups of 16 x 32 bf16 each 1 KB apart) times W's (6, 7: b0 and b1, n groups of 1 KB), stored back to c;
// TwoA / TwoB: the second x / W tile is there (an M / N tail of 16 rows has one). (Tried and slower on 2 Sapphire
// Rapids cores: prefetching the next step's x tiles into the L1, 1.2-1.8x the time; one x tile against two W tiles
// with both double-buffered, 1.2-1.9x.)
template <bool TwoA, bool TwoB>
TIERED_AMX TIERED_FORCE_INLINE void amx_block(const uint16_t* a0, const uint16_t* a1, const uint32_t* b0,
                                               const uint32_t* b1, int64_t n, float* c, int64_t ldc, bool acc) {
  const int64_t ldb = ldc * int64_t(sizeof(float));
  if (acc) {
    _tile_loadd(0, c, ldb);
    if constexpr (TwoB) _tile_loadd(1, c + kAmxRows, ldb);
    if constexpr (TwoA) _tile_loadd(2, c + kAmxRows * ldc, ldb);
    if constexpr (TwoA && TwoB) _tile_loadd(3, c + kAmxRows * ldc + kAmxRows, ldb);
  } else {
    _tile_zero(0);
    if constexpr (TwoB) _tile_zero(1);
    if constexpr (TwoA) _tile_zero(2);
    if constexpr (TwoA && TwoB) _tile_zero(3);
  }
  // the products in the order (x0 W0), (x1 W0), (x0 W1), (x1 W1): W0's register is free after the second, x0's
  // after the third, so the next step's first loads run under this step's last product
  for (int64_t g = 0; g < n; ++g) {
    _tile_loadd(4, a0 + g * kAmxRows * kGroup, 64);
    _tile_loadd(6, b0 + g * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TwoA) {
      _tile_loadd(5, a1 + g * kAmxRows * kGroup, 64);
      _tile_dpbf16ps(2, 5, 6);
    }
    if constexpr (TwoB) {
      _tile_loadd(7, b1 + g * 256, 64);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (TwoA) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, ldb);
  if constexpr (TwoB) _tile_stored(1, c + kAmxRows, ldb);
  if constexpr (TwoA) _tile_stored(2, c + kAmxRows * ldc, ldb);
  if constexpr (TwoA && TwoB) _tile_stored(3, c + kAmxRows * ldc + kAmxRows, ldb);
}

// rows x nn of the accumulators c (ldc floats apart) + bias into y (fp32 yf or bf16 yb, ldy apart)
TIERED_AMX void amx_epilogue(const float* c, int64_t ldc, int64_t rows, int64_t nn, const float* bias, float* yf,
                             uint16_t* yb, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < nn; i += 16) {
      __m512 v = _mm512_loadu_ps(c + r * ldc + i);
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + i));
      if (yf) _mm512_storeu_ps(yf + r * ldy + i, v);
      else _mm256_storeu_si256(reinterpret_cast<__m256i*>(yb + r * ldy + i), _mm512_cvtepi32_epi16(bf16_lanes(v)));
    }
}

// The blocking of amx_blocks: kAmxPanel 32-row blocks of W at a time, K in chunks of kAmxChunk groups (4096
// columns). Each 32-row block of x had been read against one block of W at a time, all of K: x [M, K] streamed
// from beyond the L2 once per 32 rows of W where it is larger (a 512-row prompt at K = 4096: 4 MB, 448 times for
// a 14336-row weight). Four blocks a panel read it a quarter as often, with the panel's converted chunk (1 MB)
// and one x block's (256 KB) in the L2. With the buffers' alignment (aligned64), against the kernel before both
// (2 Sapphire Rapids cores, 2026-12-06, 3 alternated processes, results/xeon-amx-2026-12-06/amx-panels): 4096 x
// 14336 at 128 / 256 / 512 rows 14.8-15.4 / 27.5-28.7 / 49.5-56.3 -> 10.5-10.9 / 18.0-18.6 / 31.2-34.4 ms, 14336 x
// 4096 at 512 43.5-49.0 -> 30.8-32.0, 3072 x 576 at 512 1.17-1.38 -> 0.98-1.09. (In one process, before the
// alignment: chunks of 32 groups with panels of 8 blocks, 64 with 4 or 2, 96 with 6, 256 with 3 as fast or slower
// than 128 with 4. Tile loads from the L2 are this loop's bound: ~48 cycles a TDPBF16PS against ~22 with
// both operands in the L1 and ~14 for the product alone, one thread.)
// Where x's rows fit the L2 (kAmxL2Bytes, of the 2 MB a core of every CPU with AMX so far has) the panel takes as
// many blocks as fit beside them: x then stays in the L2 from one panel to the next (14336 x 4096 at 128 rows, x 1 MB:
// 10.0-10.2 ms with one block a panel, 12.2-12.7 with four, whose 1 MB pushed x out), and a block's converted weights
// are not read right after they are written (at 16 rows 3.5-3.7 ms with four, 5.1-7.0 with one).
// Calls of up to kAmxSmallTiles x tiles (64 rows: a prompt's experts) take one block at a time and K in chunks of
// kAmxSmallChunk groups instead: the chunk's converted weights (6 KB) are read from the L1 right after they are
// written and x's tiles (in the L2 throughout) against them. One int4 weight a call, cold, against the panels (2 AMX
// cores, 2026-12-06, alternated processes, medians of 96 calls): Qwen3-30B-A3B's 2048 x 768 expert projection at 16 /
// 32 / 48 / 64 rows 0.13-0.16 / 0.12-0.15 / 0.15-0.18 / 0.17-0.20 -> 0.10-0.11 / 0.11 / 0.13-0.14 / 0.15 ms, 768 x
// 2048 at 48 / 64 0.14-0.15 / 0.17-0.19 -> 0.12-0.13 / 0.14-0.15; Mixtral's 4096 x 14336 at 16 / 32 / 48 / 64
// 4.4 / 5.0-5.3 / 6.0 / 6.4 -> 3.3-3.5 / 3.8-4.2 / 4.6-5.0 / 5.6-5.9 ms, 14336 x 4096 4.7 / 5.4-5.6 / 6.5-6.7 / 7.0-7.2
// -> 3.4-3.6 / 4.3-4.5 / 5.1-5.9 / 6.1-6.6. Chunks of 4 groups ran as 3 on Qwen's widths and 5-15% slower on Mixtral's,
// 2 and 6 slower on both, 1 up to 1.5x the panels' time; past 64 rows (96-256) within the noise of the panels.
constexpr int64_t kAmxPanel = 4, kAmxChunk = 128, kAmxL2Bytes = 1280 << 10, kAmxSmallTiles = 4, kAmxSmallChunk = 3;

// x's 32-row blocks against the weight's 32-row blocks j0..j1 (amx_gemm's work on one thread), kAmxPanel
// blocks of W at a time and K in chunks of kAmxChunk groups (up to kAmxSmallTiles x tiles: one block, chunks of
// kAmxSmallChunk groups): each chunk of a panel dequantized into bv, then every
// 32-row block of x's chunk against each block of it, their fp32 sums kept in cb between chunks.
template <typename W>
TIERED_AMX void amx_blocks(const W& w, const uint16_t* xa, int64_t M, int64_t K, int64_t N, float* yf, uint16_t* yb,
                           int64_t ldy, int64_t j0, int64_t j1) {
  const int64_t G = K / kGroup;
  const int64_t MT = (M + kAmxRows - 1) / kAmxRows;
  const int64_t x_bytes = MT * kAmxRows * K * int64_t(sizeof(uint16_t)), block_bytes = 2 * kBlock * K * int64_t(sizeof(uint16_t));
  int64_t P = G > kAmxChunk || x_bytes + block_bytes > kAmxL2Bytes
                        ? kAmxPanel
                        : std::min(kAmxPanel, (kAmxL2Bytes - x_bytes) / block_bytes);
  int64_t Gc = std::min(G, kAmxChunk);
  if (MT <= kAmxSmallTiles) P = 1, Gc = std::min(G, kAmxSmallChunk);
  amx_load_tiles();
  thread_local std::vector<uint32_t> bv_;
  thread_local std::vector<float> cb_;
  uint32_t* const bv = aligned64(bv_, P * 2 * Gc * 256);
  float* const cb = aligned64(cb_, ((MT + 1) / 2) * P * 4 * kAmxRows * kAmxRows);
  constexpr int64_t ldc = 2 * kAmxRows, kC = 4 * kAmxRows * kAmxRows;
  for (int64_t s0 = j0; s0 < j1; s0 += P) {
    const int64_t s1 = std::min(j1, s0 + P);
    for (int64_t g0 = 0; g0 < G; g0 += Gc) {
      const int64_t g1 = std::min(G, g0 + Gc), n = g1 - g0;
      for (int64_t j = s0; j < s1; ++j) {
        const int64_t n0 = j * 2 * kBlock;
        for (int64_t h = 0; h < (n0 + kBlock < N ? 2 : 1); ++h) {
          vnni_tile(w, K, n0 + h * kBlock, G, g0, g1, bv + ((j - s0) * 2 + h) * n * 256);
        }
      }
      for (int64_t mt = 0; mt < MT; mt += 2) {  // two x tiles a block, the last alone where MT is odd
        const uint16_t* a0 = xa + (mt * G + g0) * kAmxRows * kGroup;
        const uint16_t* a1 = xa + ((mt + 1) * G + g0) * kAmxRows * kGroup;
        const bool two_a = mt + 1 < MT;
        for (int64_t j = s0; j < s1; ++j) {
          const int64_t n0 = j * 2 * kBlock;
          const bool two_b = n0 + kBlock < N;
          const uint32_t *b0 = bv + (j - s0) * 2 * n * 256, *b1 = b0 + n * 256;
          float* c = cb + ((mt / 2) * P + (j - s0)) * kC;
          const bool acc = g0 > 0;
          if (two_a && two_b) amx_block<true, true>(a0, a1, b0, b1, n, c, ldc, acc);
          else if (two_a) amx_block<true, false>(a0, a1, b0, b1, n, c, ldc, acc);
          else if (two_b) amx_block<false, true>(a0, a1, b0, b1, n, c, ldc, acc);
          else amx_block<false, false>(a0, a1, b0, b1, n, c, ldc, acc);
          if (g1 == G) {
            const int64_t m0 = mt * kAmxRows, rows = std::min<int64_t>((two_a ? 2 : 1) * kAmxRows, M - m0);
            amx_epilogue(c, ldc, rows, two_b ? 2 * kBlock : kBlock, w.bias ? w.bias + n0 : nullptr,
                         yf ? yf + m0 * ldy + n0 : nullptr, yb ? yb + m0 * ldy + n0 : nullptr, ldy);
          }
        }
      }
    }
  }
  _tile_release();
}

// y [M, N] (ldy apart; bf16 yb or fp32 yf) = x [M, K] bf16 (lda elements apart) @ W^T (+ W's bias) for a
// tiled int4 or tiled int8 weight (N % 16 == 0, K % 32 == 0; amx_ready()). x is first copied into its tiles' order, xa
// [M/16][K/32][16][32] (the last row tile zero-padded), so that each tile load reads 1 KB in a row (the first
// version loaded x's rows in place, K elements apart: not timed against this one in the same minutes); threads
// then take 32-row blocks of W.
template <typename W>
void amx_gemm(const W& w, const uint16_t* x, int64_t lda, int64_t M, int64_t K, int64_t N, float* yf, uint16_t* yb,
              int64_t ldy) {
  const int64_t NB = (N + 2 * kBlock - 1) / (2 * kBlock), MT = (M + kAmxRows - 1) / kAmxRows, G = K / kGroup;
  thread_local std::vector<uint16_t> xa;
  uint16_t* const xp = aligned64(xa, MT * kAmxRows * K);
  at::parallel_for(0, MT, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < kAmxRows; ++r) {
        const int64_t m = t * kAmxRows + r;
        for (int64_t g = 0; g < G; ++g) {
          uint16_t* dst = xp + ((t * G + g) * kAmxRows + r) * kGroup;
          if (m < M) std::memcpy(dst, x + m * lda + g * kGroup, kGroup * sizeof(uint16_t));
          else std::memset(dst, 0, kGroup * sizeof(uint16_t));
        }
      }
  });
  at::parallel_for(0, NB, 1, [&](int64_t j0, int64_t j1) { amx_blocks(w, xp, M, K, N, yf, yb, ldy, j0, j1); });
}
void int4t_amx_gemm(const Int4W& w, const uint16_t* x, int64_t lda, int64_t M, int64_t K, int64_t N, float* yf,
                    uint16_t* yb, int64_t ldy) {
  amx_gemm(w, x, lda, M, K, N, yf, yb, ldy);
}

// ------------------------------------------------------------------------------------ prompt attention on AMX
// (and on AVX512-BF16 without AMX: attn_block_avx512, the same layouts and softmax with vdpbf16ps for the tiles)
// A prompt's causal attention (queries 0..T-1 over keys 0..S-1, S >= T, query i sees keys 0..i: SDPA's top-left
// causal mask) in bf16 on AMX tiles, flash-style: per (sequence, head, 32 queries) the scores of 64 keys at a time
// in 2 x 2 tiles a half, an online softmax in fp32 (base 2, exp2_512; its max moved lazily, kAttnLazyMax), the
// probabilities rounded to bf16 as A tiles against V. K and V are first packed per kv head into the tiles' B layout
// (kp: 16 keys x 32 features a tile, each key's feature pair a dword; vp: 32 keys x 16 features, each feature's pair
// of keys a dword), zero past S. Against torch's bf16 flash attention (2 AMX cores, 2026-12-06, medians of 20):
// SmolLM2's 9 x 64 heads (kv 3) at 512 / 1024 / 2048 tokens 0.31 / 1.11 / 3.99 ms against 0.83 / 2.20 / 7.22,
// Qwen3-30B-A3B's 32 x 128 (kv 4) 1.92 / 6.22 / 24.1 against 3.52 / 10.6 / 34.8; within torch's own bf16 error of
// an fp32 reference. The first version (base e with exp_fast's degree-6 polynomial, the max and the rescale's
// exponential at every block of every row) took 0.60 / 2.23 / 8.19 and 2.99 / 10.5 / 38.4 ms: the softmax, not the
// tiles, was 60% of it (perf). Blocks of 32 keys took 1.5x the time (each row's softmax passes and the tiles' round
// trips through memory per block), and a softmax whose exp_fast GCC left scalar (a conditional call: libm's
// nearbyintf each) 15x.
constexpr int64_t kAttnQ = 32, kAttnK = 64;
// How far (base 2) a row's scores may pass the max its exponentials are taken against before it moves: the
// probabilities stay <= 2^8 (exact in fp32 sums, bf16's relative precision at any scale), and a row rescales its
// outputs only where its max jumps, not at each new max (FlashAttention-4's conditional rescaling); the exponentials
// no longer wait on each block's max (a horizontal reduction, then the rescale's exponential: ~60 cycles a row).
constexpr float kAttnLazyMax = 8.f;
// Keys 0..n-1 padded to whole key blocks (the packed K / V's length), and n queries' blocks of kAttnQ
inline int64_t attn_padded_keys(int64_t n) { return (n + kAttnK - 1) / kAttnK * kAttnK; }
inline int64_t attn_query_blocks(int64_t n) { return (n + kAttnQ - 1) / kAttnQ; }
// The first key of the key block holding the first key a query at position `pos` sees: 0, or with a sliding `window`
// (> 0) its window's first key's block of kAttnK (no later query sees a key before it: what a block of queries packs
// and scans from)
inline int64_t attn_first_key(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) / kAttnK * kAttnK : 0;
}

// kp [Sp / 16][hd / 32][16 pairs][16 keys] and vp [Sp / 32][hd / 16][16 pairs][16 features] (dwords) of one kv head:
// k, v [S, hd] bf16 rows `ld` elements apart, Sp >= S padded to whole key blocks (kAttnK)
void attn_pack_kv(const uint16_t* k, const uint16_t* v, int64_t ld, int64_t S, int64_t Sp, int64_t hd, uint32_t* kp,
                  uint32_t* vp) {
  const int64_t C = hd / 32, CC = hd / 16;
  for (int64_t kb = 0; kb < Sp / 16; ++kb)
    for (int64_t c = 0; c < C; ++c) {
      uint32_t* t = kp + (kb * C + c) * 256;
      for (int64_t n = 0; n < 16; ++n) {
        const int64_t key = kb * 16 + n;
        for (int64_t p = 0; p < 16; ++p) {
          uint32_t d = 0;
          if (key < S) std::memcpy(&d, k + key * ld + c * 32 + 2 * p, 4);
          t[p * 16 + n] = d;
        }
      }
    }
  for (int64_t kb = 0; kb < Sp / 32; ++kb)
    for (int64_t cc = 0; cc < CC; ++cc) {
      uint32_t* t = vp + (kb * CC + cc) * 256;
      for (int64_t p = 0; p < 16; ++p) {
        const int64_t k0 = kb * 32 + 2 * p, k1 = k0 + 1;
        for (int64_t n = 0; n < 16; ++n) {
          const uint32_t lo = k0 < S ? v[k0 * ld + cc * 16 + n] : 0, hi = k1 < S ? v[k1 * ld + cc * 16 + n] : 0;
          t[p * 16 + n] = lo | (hi << 16);
        }
      }
    }
}

// 2^t for 16 lanes of t <= kAttnLazyMax, the attention's softmax in base 2 (scores times log2 e): t clamped at -126
// (2^-126, the smallest normal: no denormal operands downstream), n = round(t), 2^(t - n) by a degree-4 polynomial,
// scaled by 2^n (VSCALEFPS). The polynomial is a least-squares fit in relative error on 2000 Chebyshev nodes of
// [-1/2, 1/2] (numpy.polyfit, weights 2^-f): max relative error 2.7e-6, far inside the probabilities' bf16 rounding
// (2^-9); 8 operations a vector against exp_fast's 14 (degree 6, a two-sided clamp, exponent-bit arithmetic).
constexpr float kAttnExp2Poly[5] = {9.56051021e-3f, 5.59170392e-2f, 2.40249811e-1f, 6.93121968e-1f, 9.99999191e-1f};
TIERED_AVX512 TIERED_FORCE_INLINE __m512 exp2_512(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kAttnExp2Poly[0]);
  for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kAttnExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// Row srow's 64 scores (fp32) times vscale into x, masks mk of its keys from..vi - 1 (those it sees: its first vi,
// less the first `from` a sliding window leaves behind), and their max.
TIERED_AVX512 TIERED_FORCE_INLINE float attn_row_max(const float* srow, int64_t vi, __m512 vscale, __m512 x[4],
                                                  __mmask16 mk[4], int64_t from = 0) {
  __m512 mxv = _mm512_set1_ps(-INFINITY);
  for (int q = 0; q < 4; ++q) {
    const int64_t n = std::min<int64_t>(16, std::max<int64_t>(0, vi - 16 * q));
    const int64_t lo = std::min<int64_t>(16, std::max<int64_t>(0, from - 16 * q));
    mk[q] = (n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1)) & __mmask16(~((1u << lo) - 1));
    x[q] = _mm512_mul_ps(_mm512_load_ps(srow + 16 * q), vscale);
    mxv = _mm512_mask_max_ps(mxv, mk[q], mxv, x[q]);
  }
  return _mm512_reduce_max_ps(mxv);
}

// attn_block's online softmax of key block j's scores sc [kAttnQ][kAttnK] (fp32, unscaled) for its queries q0.. (nq
// of them, the rows past nq given zero probabilities): pb [kAttnQ][kAttnK] the probabilities in bf16, with `pl` what
// that rounding left (p - pb, in bf16: p to ~2^-17 of itself as pb + pl), and each row's running outputs o
// [kAttnQ][hd], sum l (16 lanes a row) and max m (base 2) moved on.
TIERED_AVX512 TIERED_FORCE_INLINE void attn_softmax_block(const float* sc, uint16_t* pb, float* o, float* l, float* m,
                                                          int64_t q0, int64_t nq, int64_t j, int64_t hd,
                                                          int64_t window, __m512 vscale, uint16_t* pl = nullptr) {
  // the online softmax in base 2, a row at a time in 4 vectors: the keys it sees (causal) masked, their max; where
  // it passed the row's running max by more than kAttnLazyMax, what the row has (its outputs, its sum) rescaled by
  // 2^(old - new) and the max moved; this block's exponentials against the running max into the row's sum (16
  // lanes, reduced once at the end), P rounded to bf16 (VCVTNE2PS2BF16: nearest even)
  const auto visible = [&](int64_t i) {  // the keys of this block row i sees: below this ...
    return i < nq ? std::max<int64_t>(0, std::min<int64_t>(kAttnK, q0 + i - j * kAttnK + 1)) : 0;
  };
  const auto from = [&](int64_t i) {  // ... and from this one (its window's first)
    return window > 0 ? std::max<int64_t>(0, std::min<int64_t>(kAttnK, q0 + i - window + 1 - j * kAttnK)) : 0;
  };
  for (int64_t i = 0; i < kAttnQ; ++i) {
    const int64_t vi = visible(i), lo = from(i);
    uint16_t* prow = pb + i * kAttnK;
    if (vi <= lo) {
      std::memset(prow, 0, kAttnK * sizeof(uint16_t));
      if (pl) std::memset(pl + i * kAttnK, 0, kAttnK * sizeof(uint16_t));
      continue;
    }
    __mmask16 mk[4];
    __m512 x[4];
    const float mx = attn_row_max(sc + i * kAttnK, vi, vscale, x, mk, lo);
    float* lrow = l + i * 16;
    if (m[i] == -INFINITY) {  // the row's first keys: its max is this block's, nothing to rescale
      m[i] = mx;
    } else if (mx > m[i] + kAttnLazyMax) {
      const __m512 a = exp2_512(_mm512_set1_ps(m[i] - mx));
      _mm512_store_ps(lrow, _mm512_mul_ps(_mm512_load_ps(lrow), a));
      float* orow = o + i * hd;
      for (int64_t t = 0; t < hd; t += 16) _mm512_store_ps(orow + t, _mm512_mul_ps(_mm512_load_ps(orow + t), a));
      m[i] = mx;
    }
    const __m512 mb = _mm512_set1_ps(m[i]);
    __m512 sum = _mm512_load_ps(lrow);
    for (int q = 0; q < 4; ++q) {
      x[q] = _mm512_maskz_mov_ps(mk[q], exp2_512(_mm512_sub_ps(x[q], mb)));
      sum = _mm512_add_ps(sum, x[q]);
    }
    _mm512_store_ps(lrow, sum);
    for (int h = 0; h < 2; ++h) {
      const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(x[2 * h + 1], x[2 * h]);
      _mm512_store_si512(prow + 32 * h, hi);
      if (pl) {  // x - hi, rounded: hi's 32 values widened (lanes 0-15 from x[2h], 16-31 from x[2h + 1])
        const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
        const __m512 h1 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16));
        _mm512_store_si512(pl + i * kAttnK + 32 * h, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x[2 * h + 1], h1),
                                                                                  _mm512_sub_ps(x[2 * h], h0)));
      }
    }
  }
}

// attn_block's outputs: each of its nq rows of o divided by its sum (l's 16 lanes), rounded to bf16 into out (rows
// `ldo` apart).
TIERED_AVX512 TIERED_FORCE_INLINE void attn_block_out(float* o, const float* l, int64_t nq, int64_t hd, uint16_t* out,
                                                      int64_t ldo) {
  for (int64_t i = 0; i < nq; ++i) {
    float* orow = o + i * hd;
    const __m512 r = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(l + i * 16)));
    for (int64_t t = 0; t < hd; t += 16) _mm512_store_ps(orow + t, _mm512_mul_ps(_mm512_load_ps(orow + t), r));
    round_row(orow, hd, out + i * ldo);
  }
}

// One block of up to 32 queries (rows q0.., `nq` of them, qa: their tiles [2][hd / 32][16][32] bf16, zero past nq)
// of one head against its kv head's packed keys, 64 keys at a time: out rows (bf16, `ldo` apart) = softmax(scale q
// k^T) v, query q0 + i over keys 0..q0 + i, or with a sliding `window` (> 0) over its last `window` of them only: the
// key blocks no query of the block sees are skipped.
TIERED_AMX void attn_block(const uint16_t* qa, int64_t q0, int64_t nq, const uint32_t* kp, const uint32_t* vp,
                           int64_t hd, float scale, uint16_t* out, int64_t ldo, int64_t window = 0) {
  const int64_t C = hd / 32, CC = hd / 16;
  alignas(64) float sc[kAttnQ * kAttnK];
  alignas(64) uint16_t pb[kAttnQ * kAttnK];
  alignas(64) float tmp[kAttnQ * 32];
  alignas(64) float o[kAttnQ * 256];  // the running outputs, hd <= 256
  alignas(64) float l[kAttnQ * 16];  // each row's running sum, 16 lanes
  float m[kAttnQ];                     // each row's running max (base 2)
  std::fill(o, o + kAttnQ * hd, 0.f);
  std::fill(l, l + kAttnQ * 16, 0.f);
  std::fill(m, m + kAttnQ, -INFINITY);
  const __m512 vscale = _mm512_set1_ps(scale * kLog2e);
  const int64_t last = q0 + nq - 1, nkb = last / kAttnK + 1;  // key blocks any of these queries sees
  const int64_t jlo = attn_first_key(q0, window) / kAttnK;  // ... from this one
  for (int64_t j = jlo; j < nkb; ++j) {
    for (int64_t hk = 0; hk < 2; ++hk) {  // the block's two halves of 32 keys: 2 x 2 score tiles each
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const int64_t kb = 4 * j + 2 * hk;  // its first 16-key tile
      for (int64_t c = 0; c < C; ++c) {
        _tile_loadd(4, qa + c * 512, 64);
        _tile_loadd(5, qa + (C + c) * 512, 64);
        _tile_loadd(6, kp + (kb * C + c) * 256, 64);
        _tile_loadd(7, kp + ((kb + 1) * C + c) * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* s0 = sc + hk * 32;
      _tile_stored(0, s0, kAttnK * 4);
      _tile_stored(1, s0 + 16, kAttnK * 4);
      _tile_stored(2, s0 + 16 * kAttnK, kAttnK * 4);
      _tile_stored(3, s0 + 16 * kAttnK + 16, kAttnK * 4);
    }
    attn_softmax_block(sc, pb, o, l, m, q0, nq, j, hd, window, vscale);
    for (int64_t cc = 0; cc < CC; cc += 2) {  // o += P v, 32 features at a time over the block's 64 keys
      const bool two = cc + 1 < CC;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t hk = 0; hk < 2; ++hk) {
        _tile_loadd(4, pb + hk * 32, kAttnK * 2);
        _tile_loadd(5, pb + 16 * kAttnK + hk * 32, kAttnK * 2);
        _tile_loadd(6, vp + ((2 * j + hk) * CC + cc) * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
          _tile_loadd(7, vp + ((2 * j + hk) * CC + cc + 1) * 256, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, tmp, 32 * 4);
      _tile_stored(2, tmp + 16 * 32, 32 * 4);
      if (two) {
        _tile_stored(1, tmp + 16, 32 * 4);
        _tile_stored(3, tmp + 16 * 32 + 16, 32 * 4);
      }
      for (int64_t i = 0; i < nq; ++i) {
        float* orow = o + i * hd + cc * 16;
        const float* trow = tmp + i * 32;
        _mm512_store_ps(orow, _mm512_add_ps(_mm512_load_ps(orow), _mm512_load_ps(trow)));
        if (two) _mm512_store_ps(orow + 16, _mm512_add_ps(_mm512_load_ps(orow + 16), _mm512_load_ps(trow + 16)));
      }
    }
  }
  attn_block_out(o, l, nq, hd, out, ldo);
}

// attn_block without AMX, on AVX512-BF16 (Zen 4 / 5, Cooper Lake): the same packed keys and values, online softmax
// and rounding, the products by vdpbf16ps with 16 keys (or features) in a vector's lanes and each query's feature
// pair (or probability pair) broadcast: 8 queries x 32 keys of scores in 16 accumulators, then 8 queries x 32
// features of outputs in 16. Where the native step's prompt rows had attended in fp32 FMAs over keys widened into
// fp32 (DecodeStep::attention_runs' transpose_keys), each vdpbf16ps does two multiply-adds a lane.
TIERED_AVX512 void attn_block_avx512(const uint16_t* qa, int64_t q0, int64_t nq, const uint32_t* kp, const uint32_t* vp,
                                     int64_t hd, float scale, uint16_t* out, int64_t ldo, int64_t window = 0) {
  constexpr int kRows = 8;  // queries a pass
  const int64_t C = hd / 32, CC = hd / 16;
  alignas(64) float sc[kAttnQ * kAttnK];
  alignas(64) uint16_t pb[kAttnQ * kAttnK], pl[kAttnQ * kAttnK];  // P = pb + pl
  alignas(64) float o[kAttnQ * 256];  // the running outputs, hd <= 256
  alignas(64) float l[kAttnQ * 16];
  float m[kAttnQ];
  std::fill(o, o + kAttnQ * hd, 0.f);
  std::fill(l, l + kAttnQ * 16, 0.f);
  std::fill(m, m + kAttnQ, -INFINITY);
  const __m512 vscale = _mm512_set1_ps(scale * kLog2e);
  const int64_t last = q0 + nq - 1, nkb = last / kAttnK + 1;
  const int64_t jlo = attn_first_key(q0, window) / kAttnK;
  // query row i's feature pair p of chunk c: qd[((i / 16) C + c) 256 + (i % 16) 16 + p]; its probabilities' key
  // pair p of the block: pd[i kAttnK / 2 + p]
  const uint32_t* qd = reinterpret_cast<const uint32_t*>(qa);
  const uint32_t *pd = reinterpret_cast<const uint32_t*>(pb), *ld = reinterpret_cast<const uint32_t*>(pl);
  for (int64_t j = jlo; j < nkb; ++j) {
    for (int64_t i0 = 0; i0 < nq; i0 += kRows)  // (rows past nq are the tiles' zeros: their scores unused)
      for (int64_t t = 0; t < 4; t += 2) {     // the block's 16-key tiles t and t + 1
        __m512 acc[kRows][2];
        for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const int64_t kb = 4 * j + t;
        for (int64_t c = 0; c < C; ++c) {
          const uint32_t* k0 = kp + (kb * C + c) * 256;
          const uint32_t* qc = qd + ((i0 / 16) * C + c) * 256 + (i0 % 16) * 16;
          for (int p = 0; p < 16; ++p) {
            const __m512i a = _mm512_load_si512(k0 + p * 16), b = _mm512_load_si512(k0 + C * 256 + p * 16);
            for (int r = 0; r < kRows; ++r) {
              const __m512i qp = _mm512_set1_epi32(int(qc[r * 16 + p]));
              acc[r][0] = dot_bf16(acc[r][0], a, qp);
              acc[r][1] = dot_bf16(acc[r][1], b, qp);
            }
          }
        }
        for (int r = 0; r < kRows; ++r) {
          _mm512_store_ps(sc + (i0 + r) * kAttnK + t * 16, acc[r][0]);
          _mm512_store_ps(sc + (i0 + r) * kAttnK + t * 16 + 16, acc[r][1]);
        }
      }
    attn_softmax_block(sc, pb, o, l, m, q0, nq, j, hd, window, vscale, pl);
    for (int64_t i0 = 0; i0 < nq; i0 += kRows)
      for (int64_t cc = 0; cc < CC; cc += 2) {  // o += P v, features cc * 16 .. + 32 (CC is even: hd % 32 == 0)
        __m512 acc[kRows][2];
        for (int r = 0; r < kRows; ++r) {
          acc[r][0] = _mm512_load_ps(o + (i0 + r) * hd + cc * 16);
          acc[r][1] = _mm512_load_ps(o + (i0 + r) * hd + cc * 16 + 16);
        }
        for (int64_t hk = 0; hk < 2; ++hk) {  // the block's halves of 32 keys
          const uint32_t* v0 = vp + ((2 * j + hk) * CC + cc) * 256;  // (features cc + 1's tile next to it)
          const uint32_t* pr = pd + i0 * (kAttnK / 2) + hk * 16;
          const uint32_t* lr = ld + i0 * (kAttnK / 2) + hk * 16;
          for (int p = 0; p < 16; ++p) {
            const __m512i a = _mm512_load_si512(v0 + p * 16), b = _mm512_load_si512(v0 + 256 + p * 16);
            for (int r = 0; r < kRows; ++r) {  // P's bf16 pair and what its rounding left: P to ~2^-17
              const __m512i pp = _mm512_set1_epi32(int(pr[r * (kAttnK / 2) + p]));
              const __m512i pq = _mm512_set1_epi32(int(lr[r * (kAttnK / 2) + p]));
              acc[r][0] = dot_bf16(dot_bf16(acc[r][0], a, pp), a, pq);
              acc[r][1] = dot_bf16(dot_bf16(acc[r][1], b, pp), b, pq);
            }
          }
        }
        for (int r = 0; r < kRows; ++r) {
          _mm512_store_ps(o + (i0 + r) * hd + cc * 16, acc[r][0]);
          _mm512_store_ps(o + (i0 + r) * hd + cc * 16 + 16, acc[r][1]);
        }
      }
  }
  attn_block_out(o, l, nq, hd, out, ldo);
}

// The block of 32 queries that item k of a (sequence, head)'s QB blocks computes: the causal work grows with the
// block, so items alternate from the two ends (0, QB-1, 1, QB-2, ...) and each thread's contiguous share of the
// items holds long and short blocks alike.
inline int64_t alternate_block(int64_t k, int64_t QB) { return k % 2 == 0 ? k / 2 : QB - 1 - k / 2; }

// qa = a block's nq query rows as two tiles' [hd / 32][16][32] bf16, zero past nq: row(i, c, dst) writes row i's
// 32 features from c * 32 to dst.
template <typename Row>
TIERED_AVX512 TIERED_FORCE_INLINE void load_query_tiles(uint16_t* qa, int64_t nq, int64_t C, Row&& row) {
  for (int64_t i = 0; i < kAttnQ; ++i)
    for (int64_t c = 0; c < C; ++c) {
      uint16_t* dst = qa + ((i / 16) * C + c) * 512 + (i % 16) * 32;
      if (i < nq) row(i, c, dst);
      else std::memset(dst, 0, 64);
    }
}

struct AttnJob {  // bf16_prompt_attention's operands for attn_items
  const uint16_t* q;
  int64_t sqb, sqh, sqt;
  const uint32_t* packed;  // each (sequence, kv head)'s kp then vp, kv_dwords each
  int64_t kv_dwords;
  uint16_t* out;
  int64_t sob, soh, sot;
  int64_t H, Hkv, T, hd, QB;
  float scale;
  int64_t past;    // the queries' first position in the packed keys: query i sees keys 0 .. past + i
  int64_t window;  // > 0: ... the last `window` of them only
};

// items w0..w1 of B x H x QB (sequence, head, block of 32 queries) on this thread: on AMX (attn_block) or AVX512-BF16
// (attn_block_avx512)
template <bool Amx>
TIERED_AVX512 TIERED_FORCE_INLINE void attn_loop(const AttnJob& j, int64_t w0, int64_t w1) {
  const int64_t C = j.hd / 32;
  thread_local std::vector<uint16_t> qa_;
  uint16_t* const qa = aligned64(qa_, 2 * C * 512);
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t bh = w / j.QB, qb = alternate_block(w % j.QB, j.QB);
    const int64_t b = bh / j.H, h = bh % j.H, g = h / (j.H / j.Hkv), q0 = qb * kAttnQ, nq = std::min(kAttnQ, j.T - q0);
    const uint16_t* qrow = j.q + b * j.sqb + h * j.sqh;
    load_query_tiles(qa, nq, C, [&](int64_t i, int64_t c, uint16_t* dst) TIERED_AVX512 {
      std::memcpy(dst, qrow + (q0 + i) * j.sqt + c * 32, 64);
    });
    const uint32_t* kv = j.packed + (b * j.Hkv + g) * 2 * j.kv_dwords;
    (Amx ? attn_block : attn_block_avx512)(qa, j.past + q0, nq, kv, kv + j.kv_dwords, j.hd, j.scale,
                                           j.out + b * j.sob + h * j.soh + q0 * j.sot, j.sot, j.window);
  }
}

TIERED_AMX void attn_items(const AttnJob& j, int64_t w0, int64_t w1) {
  amx_load_tiles();
  attn_loop<true>(j, w0, w1);
  _tile_release();
}

TIERED_AVX512 void attn_items_avx512(const AttnJob& j, int64_t w0, int64_t w1) { attn_loop<false>(j, w0, w1); }

bool amx_step();

// Whether a prompt's bf16 attention (bf16_prompt_attention, bf16_runs_attention) has a kernel here: on AMX tiles where
// the native step's AMX calls run (amx_step: AMX granted, amx_rows on), else on AVX512-BF16 (attn_block_avx512: this
// build's AVX-512 path, which needs BF16, with bf16_attention_avx512 on).
std::atomic<bool> g_bf16_attention_avx512{true};
enum class AttnPath { kNone, kAvx512, kAmx };
AttnPath bf16_attention_path() {
  if (amx_step()) return AttnPath::kAmx;
  return current_isa() == kAvx512 && g_bf16_attention_avx512.load(std::memory_order_relaxed) ? AttnPath::kAvx512
                                                                                             : AttnPath::kNone;
}

// q [B, H, T, hd], k / v [B, Hkv, S, hd] bf16 (rows contiguous), S >= past + T, H % Hkv == 0, hd % 32 == 0 -> out [B,
// H, T, hd] bf16 (its memory [B, T, H, hd]: o_proj's rows) = causal softmax(scale q k^T) v, query i over keys
// 0..past + i (past > 0: a prefill chunk after `past` cached positions; keys past past + T - 1 never read), or with a
// sliding `window` (> 0: a sliding layer's) over keys past + i - window + 1..past + i.
at::Tensor bf16_prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                 int64_t past, int64_t window) {
  const AttnPath path = bf16_attention_path();
  TIERED_CHECK(path != AttnPath::kNone, "bf16_prompt_attention: needs AMX or AVX512-BF16 (bf16_attention_available())");
  TIERED_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.scalar_type() == at::kBFloat16 &&
                   k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 && q.stride(3) == 1 &&
                   k.stride(3) == 1 && v.stride(3) == 1 && k.sizes() == v.sizes() && k.stride(2) == v.stride(2),
               "bf16_prompt_attention: q [B, H, T, hd], k and v [B, Hkv, S, hd] bf16 with contiguous rows");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), hd = q.size(3), Hkv = k.size(1), S = k.size(2);
  TIERED_CHECK(k.size(0) == B && k.size(3) == hd && Hkv > 0 && H % Hkv == 0 && past >= 0 && S >= past + T &&
                   hd % 32 == 0 && hd <= 256 && window >= 0,
               "bf16_prompt_attention: k / v [", B, ", Hkv | ", H, ", S >= ", past + T, ", ", hd,
               "] with head_dim % 32 == 0, window >= 0");
  at::Tensor out = at::empty({B, T, H, hd}, q.options()).transpose(1, 2);
  // the keys any query sees, from k0 (a long prompt's sliding layer packs its window, not every cached key: 2048 of a
  // chunk's 8192 at Gemma's 1024)
  const int64_t k0 = attn_first_key(past, window);
  const int64_t Sk = past + T - k0;
  const int64_t Sp = attn_padded_keys(Sk), QB = attn_query_blocks(T);
  const int64_t kv_dwords = Sp * hd / 2;  // kp's and vp's each
  std::vector<uint32_t> packed;
  uint32_t* const pk = aligned64(packed, 2 * B * Hkv * kv_dwords);
  const uint16_t *kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                 *vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()),
                 *qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, B * Hkv, 1, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t b = a / Hkv, g = a % Hkv;
      attn_pack_kv(kd + b * k.stride(0) + g * k.stride(1) + k0 * k.stride(2),
                   vd + b * v.stride(0) + g * v.stride(1) + k0 * v.stride(2), k.stride(2), Sk, Sp, hd,
                   pk + a * 2 * kv_dwords, pk + a * 2 * kv_dwords + kv_dwords);
    }
  });
  const AttnJob job{qd, q.stride(0), q.stride(1), q.stride(2), pk, kv_dwords, od, out.stride(0), out.stride(1),
                    out.stride(2), H, Hkv, T, hd, QB, float(scale), past - k0, window};
  at::parallel_for(0, B * H * QB, 1, [&](int64_t w0, int64_t w1) {
    if (path == AttnPath::kAmx) attn_items(job, w0, w1);
    else attn_items_avx512(job, w0, w1);
  });
  return out;
}

// x [B, K] fp32 rounded to bf16 (kernel.h: torch's rounding) into this thread's buffer, over the threads: on one,
// SmolLM2's 512-token prompt as rows spent ~5% of its time here while the other thread waited. The AMX GEMM's rows.
const uint16_t* rows_bf16(const float* x, int64_t B, int64_t K) {
  thread_local std::vector<uint16_t> xb;
  xb.resize(B * K);
  uint16_t* const xp = xb.data();  // (this thread's: the lambda's `xb` would be each worker's own)
  at::parallel_for(0, B, std::max<int64_t>(1, (int64_t(1) << 15) / K), [&](int64_t b0, int64_t b1) {
    round_row(x + b0 * K, (b1 - b0) * K, xp + b0 * K);
  });
  return xp;
}

// Rows from which the native step's call of a tiled int4 or int8 kernel (Int4TGemv::run_step, Int8Gemv::run_step: a
// batched decode step's sequences, a prompt's rows) takes the AMX GEMM, and whether it does here: AMX granted and amx_rows on
// (tiered.kernels.load turns it off where TIERED_AMX=0, as quant/int4.amx_kernels reads it; tests and A/Bs too).
constexpr int64_t kAmxStepRows = 24;
std::atomic<bool> g_amx_rows{true};
bool amx_step() { return amx_ready() && g_amx_rows.load(std::memory_order_relaxed); }

// The native step's prompt runs (DecodeStep::attention_runs) on attn_block: each run's keys and values packed per kv
// head from its cache rows, its query rows rounded to bf16 into tiles (torch's cast of an fp32 query: nearest even),
// each (run, head, block of 32 queries) an item, the queries at positions p0.. masked against keys 0..p0 + i, the
// output rows' bf16 widened into `out`. Items alternate from both ends of each (run, head)'s blocks, as attn_items'.
struct RunsJob {
  const std::vector<Bf16AttnRun>& runs;
  const std::vector<int64_t>& at;     // run r's packed kp / vp from at[r], 2 x kvd(r) dwords a kv head
  const std::vector<int64_t>& first;  // run r's first item
  const uint32_t* packed;
  int64_t ldq, ldo, H, Hkv, hd;
  float scale;
  int64_t kvd(int64_t r) const { return (at[r + 1] - at[r]) / (2 * Hkv); }
};

template <bool Amx>
TIERED_AVX512 TIERED_FORCE_INLINE void runs_loop(const RunsJob& j, int64_t w0, int64_t w1) {
  const int64_t C = j.hd / 32, hd = j.hd;
  thread_local std::vector<uint16_t> qa_, ob_;
  uint16_t* const qa = aligned64(qa_, 2 * C * 512);
  uint16_t* const ob = aligned64(ob_, kAttnQ * hd);
  for (int64_t w = w0; w < w1; ++w) {
    const int64_t r = std::upper_bound(j.first.begin(), j.first.end(), w) - j.first.begin() - 1;
    const Bf16AttnRun& u = j.runs[r];
    const int64_t QB = attn_query_blocks(u.n), i0 = w - j.first[r], h = i0 / QB;
    const int64_t q0 = alternate_block(i0 % QB, QB) * kAttnQ, nq = std::min(kAttnQ, u.n - q0);
    load_query_tiles(qa, nq, C, [&](int64_t i, int64_t c, uint16_t* dst) TIERED_AVX512 {
      const float* src = u.q + (q0 + i) * j.ldq + h * hd + c * 32;
      _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src)));
    });
    const int64_t g = h / (j.H / j.Hkv), kvd = j.kvd(r);
    const uint32_t* kp = j.packed + j.at[r] + g * 2 * kvd;
    (Amx ? attn_block : attn_block_avx512)(qa, u.p0 - attn_first_key(u.p0, u.window) + q0, nq, kp, kp + kvd, hd,
                                           j.scale, ob, hd, u.window);
    for (int64_t i = 0; i < nq; ++i) {  // bf16 -> fp32: the bits shifted up
      float* dst = u.out + (q0 + i) * j.ldo + h * hd;
      for (int64_t t = 0; t < hd; t += 16) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ob + i * hd + t));
        _mm512_storeu_ps(dst + t, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
    }
  }
}

TIERED_AMX void runs_items(const RunsJob& j, int64_t w0, int64_t w1) {
  amx_load_tiles();
  runs_loop<true>(j, w0, w1);
  _tile_release();
}

TIERED_AVX512 void runs_items_avx512(const RunsJob& j, int64_t w0, int64_t w1) { runs_loop<false>(j, w0, w1); }

// ------------------------------------------------------------------------------------ int8, tiled
// The tiled int8 layout (Int8W::tiled; the host layout of routed int8 experts beside tiled int4,
// kernels/linear.tiled_int8): 16 output rows side by side, as the tiled int4 layout, so that one
// 32-bit lane is one row. Per 16-row tile (N / 16 tiles of 16 K bytes) and per 4 columns c = k / 4,
// 64 bytes: byte 4r + j (row r, j < 4) = q[16 t + r, 4 c + j] + 128, an unsigned byte. Needs
// N % 16 == 0 and K % 32 == 0. Every path reads the int16 activations (Act::xs and its forms): per
// group of 32 the exact int32 dot of q with xs is sum((q + 128) xs) - 128 sum(xs) (Act::xsq), then
// y = scale * sum_g dw_g dot_g, the per-row layout's integer dots and fp32 operations per group;
// int8-g32 (Int8W::gs, GGUF Q8_0's fp16 scale per row and group) y = sum_g (s_g dw_g) dot_g.

inline bool int8_tiles(int64_t N, int64_t K) { return N % kBlock == 0 && K % kGroup == 0; }

inline float half_to_float(uint16_t h) { return float(c10::Half(h, c10::Half::from_bits())); }

inline uint8_t tiled_int8_code(const uint8_t* tile, int64_t r, int64_t k) {  // q + 128 of row r, column k
  return tile[(k / 4) * 64 + r * 4 + (k % 4)];
}

// q8: against the int8 activations (Act::xqt, dxg) instead of the int16 ones (xs, dw), as int8t_avx512's Q8 form.
void int8t_scalar(const Int8W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y,
                  int64_t ldy, bool q8 = false) {
  const int64_t K = a.K, G = K / kGroup;
  const auto* codes = reinterpret_cast<const uint8_t*>(w.q);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* tile = codes + (n / kBlock) * kBlock * K;
    for (int64_t b = b0; b < b0 + nb; ++b) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t d = 0;
        for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k)
          d += (int32_t(tiled_int8_code(tile, n % kBlock, k)) - 128) * (q8 ? int32_t(a.xqt[b * K + k]) : int32_t(a.xs[b * K + k]));
        const float dx = q8 ? a.dxg[b * G + g] : a.dw[b * G + g];
        const float f = w.gs ? half_to_float(w.gs[((n / kBlock) * G + g) * kBlock + n % kBlock]) * dx : dx;
        acc += f * float(d);
      }
      y[b * ldy + n] = Int8Rows::out(w, n, acc);
    }
  }
}

// The 16 rows' scales of the tile at row m0 as fp32 (1 for int8-g32, scaled per group).
TIERED_AVX512 inline __m512 int8t_scales16(const Int8W& w, int64_t m0) {
  if (w.gs) return _mm512_set1_ps(1.f);
  if (w.scale) return _mm512_loadu_ps(w.scale + m0);
  const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scale_bf16 + m0));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s), 16));
}

// AVX2: per chunk and 8-row half (32 bytes), the bytes 0 and 2 of each row's dword masked with
// 0x00FF00FF, and bytes 1 and 3 shifted down by 8, are int16 pairs (0..255) that one vpmaddwd each
// multiplies by the broadcast xw words (x0, x2) and (x1, x3) of those 4 columns (Act::xw keeps
// per 8 columns (x0, x2), (x4, x6), (x1, x3), (x5, x7)). Pair sums <= 2 * 255 * 32639: exact.
template <int NB>
TIERED_AVX2 void int8t_avx2(const Int8W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                            int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  const auto* codes = reinterpret_cast<const uint8_t*>(w.q);
  const __m256i m = _mm256_set1_epi32(0x00FF00FF);
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const uint8_t* tile = codes + m0 * K;
    __m256 acc[NB][2];
    for (int j = 0; j < NB; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* grp = tile + g * 512;  // 8 chunks of 4 columns x 16 rows
      for (int l = 0; l < 8; ++l) prefetch_stream(grp + kPrefetchAhead + 64 * l);
      __m256i t[NB][2];
      for (int j = 0; j < NB; ++j) t[j][0] = t[j][1] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int c = 0; c < 8; ++c) {
        __m256i e[2], o[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 64 * c + 32 * h));
          e[h] = _mm256_and_si256(d, m), o[h] = _mm256_srli_epi16(d, 8);
        }
        const int64_t i = (c / 2) * 4 + c % 2;  // xw word of columns (4c, 4c + 2); + 2: (4c + 1, 4c + 3)
        for (int j = 0; j < NB; ++j) {
          const uint32_t* xw = a.xw + (b0 + j) * (K / 2) + g * (kGroup / 2);
          const __m256i xe = _mm256_set1_epi32(int32_t(xw[i])), xo = _mm256_set1_epi32(int32_t(xw[i + 2]));
          for (int h = 0; h < 2; ++h)
            t[j][h] = _mm256_add_epi32(t[j][h], _mm256_add_epi32(_mm256_madd_epi16(e[h], xe), _mm256_madd_epi16(o[h], xo)));
        }
      }
      __m256 gs[2] = {_mm256_set1_ps(1.f), _mm256_set1_ps(1.f)};  // int8-g32: the 16 rows' scales of group g
      if (w.gs)
        for (int h = 0; h < 2; ++h)
          gs[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.gs + ((m0 / kBlock) * G + g) * kBlock + 8 * h)));
      for (int j = 0; j < NB; ++j) {
        const int64_t bg = (b0 + j) * G + g;
        const __m256i off = _mm256_set1_epi32(128 * a.xsq[bg]);
        const __m256 dw = _mm256_set1_ps(a.dw[bg]);
        for (int h = 0; h < 2; ++h)
          acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(t[j][h], off)),
                                      w.gs ? _mm256_mul_ps(gs[h], dw) : dw, acc[j][h]);
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) {
        float out[8];
        _mm256_storeu_ps(out, acc[j][h]);
        for (int r = 0; r < 8; ++r) y[(b0 + j) * ldy + m0 + 8 * h + r] = Int8Rows::out(w, m0 + 8 * h + r, out[r]);
      }
  }
}

// AVX-512 (VNNI): a chunk's 64 bytes are the 16 rows' 4 unsigned weights, and one vpdpbusd against
// a broadcast of 4 bytes of xh, one of xl (xs = 256 xh + xl, signed bytes), add 4 products per row
// lane: 2 multiply-adds per 64 weights and no conversions, where the per-row layout's int16 path
// (int8_w16_avx512) needs a sign extension, a vpmaddwd, a conversion and an FMA per 32. Per group
// the row's dot is 256 sum(h) + sum(l) - 128 sum(xs), exact. Two chains per part and row (even
// and odd chunks) up to 2 rows, one from 3 rows on.
// Q8: on int8 activations (Act::xqt, dxg, xqs; calls of at least Int8Gemv::q8_from rows, a batched
// step where Plan.batch_act is "q8"): one vpdpbusd per chunk and row against a broadcast of 4 bytes of
// xqt; the row's dot per group is sum((q + 128) xq) - 128 sum(xq), exact in int32 (|.| <= 32 * 255 *
// 127), y = scale * sum_g dx_g dot_g (int8-g32: sum_g s_g dx_g dot_g). Two chains up to 4 rows.
template <int NB, bool Q8 = false>
TIERED_AVX512 void int8t_avx512(const Int8W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                                int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  const auto* codes = reinterpret_cast<const uint8_t*>(w.q);
  constexpr int C = NB <= (Q8 ? 4 : 2) ? 2 : 1;
  constexpr int P = Q8 ? 1 : 2;  // the activations' byte parts: xq alone, or xh and xl
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const uint8_t* tile = codes + m0 * K;
    __m512 acc[NB];
    for (int j = 0; j < NB; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* grp = tile + g * 512;  // 8 chunks of 4 columns x 16 rows
      for (int l = 0; l < 8; ++l) prefetch_stream(grp + kPrefetchAhead + 64 * l);
      __m512i t[NB][P][C];
      for (int j = 0; j < NB; ++j)
        for (int p = 0; p < P; ++p)
          for (int c = 0; c < C; ++c) t[j][p][c] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) {
        const __m512i d = _mm512_loadu_si512(grp + 64 * c);
        for (int j = 0; j < NB; ++j) {
          const int64_t k = (b0 + j) * K + g * kGroup + 4 * c;
          const int8_t* parts[2] = {Q8 ? a.xqt + k : a.xh + k, Q8 ? nullptr : a.xl + k};
          for (int p = 0; p < P; ++p) {
            int32_t v;
            std::memcpy(&v, parts[p], 4);
            t[j][p][c % C] = _mm512_dpbusd_epi32(t[j][p][c % C], d, _mm512_set1_epi32(v));
          }
        }
      }
      const __m512 gs = w.gs ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                   w.gs + ((m0 / kBlock) * G + g) * kBlock)))
                             : _mm512_set1_ps(1.f);  // int8-g32: the 16 rows' scales of group g
      for (int j = 0; j < NB; ++j) {
        const int64_t bg = (b0 + j) * G + g;
        __m512i s = C == 2 ? _mm512_add_epi32(t[j][0][0], t[j][0][C - 1]) : t[j][0][0];
        if constexpr (!Q8) {
          s = _mm512_add_epi32(_mm512_slli_epi32(s, 8), C == 2 ? _mm512_add_epi32(t[j][P - 1][0], t[j][P - 1][C - 1])
                                                               : t[j][P - 1][0]);
        }
        s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * (Q8 ? a.xqs[bg] : a.xsq[bg])));
        const __m512 dx = _mm512_set1_ps(Q8 ? a.dxg[bg] : a.dw[bg]);
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), w.gs ? _mm512_mul_ps(gs, dx) : dx, acc[j]);
      }
    }
    const __m512 sv = int8t_scales16(w, m0);
    for (int j = 0; j < NB; ++j) {
      __m512 out = _mm512_mul_ps(acc[j], sv);
      if (w.bias) out = _mm512_add_ps(out, _mm512_loadu_ps(w.bias + m0));
      _mm512_storeu_ps(y + (b0 + j) * ldy + m0, out);
    }
  }
}

// ------------------------------------------------------------------------------------ q6k
// GGUF Q6_K weights on their own bits (Q6KW): w[n, k] = (d[n, k/256] sc[n, k/16]) (u[n, k] - 32) with u the 6-bit
// code (0..63), sc int8 and d fp16, Q6_K's arithmetic, at 6.5625 bits a weight (210 bytes per 256) where the int8-g32
// copy (q6k_blocks_tiled: the codes re-quantized per 32) reads 8.5. A Q4_K_M file's attn_v, ffn_down (half its
// layers) and head are Q6_K; a Q6_K file is all of it.
// Layout (q6k_blocks_q6t): qt uint8 [N/16, K/32, 384], per tile t (rows 16t .. 16t + 15) and group g of 32 columns,
// in the tiled int8 layout's chunks (chunk c: columns 4c .. 4c + 3 of the group, byte 4r + j of a chunk's 64 = row r,
// column 4c + j):
//   bytes 0..255: four 64-byte nibble vectors, vector i = chunk 2i's u & 15 in its bytes' low nibbles and chunk
//     2i + 1's in their high ones;
//   bytes 256..383: two 64-byte high vectors, vector h = u >> 4 of chunk 4h + m in its bytes' bits 2m, 2m + 1.
// So a chunk's 64 u bytes are one or two shifts and one ternary logic op from two loads, and vpdpbusd takes them as
// the tiled int8 kernels take their codes. Scales: sc int8 [N/16, K/16, 16], d fp16 [N/16, K/256, 16], a tile's 16
// rows side by side. Per row and 16 columns the integer dot of u against the quantized x, less 32 x the sum of those
// x (Act::s16w / s16q), times d sc and the group's dx, accumulates in fp32.
constexpr int64_t kQ6Group = 384;  // bytes of a group of a tile (16 rows x 32 columns)

struct Q6KW {
  const uint8_t* q;
  const int8_t* sc;
  const uint16_t* d;
  const float* bias;
};

// u of row r, column k (< 32) of a group's 384 bytes
inline int q6k_code(const uint8_t* grp, int64_t r, int64_t k) {
  const int64_t c = k / 4, j = k % 4;
  const uint8_t lo = grp[(c / 2) * 64 + 4 * r + j], hi = grp[256 + (c / 4) * 64 + 4 * r + j];
  return ((c % 2 ? lo >> 4 : lo) & 15) | (((hi >> (2 * (c % 4))) & 3) << 4);
}

// d sc of row n's 16 columns from s (a 16-column sub-block), in fp32 (gguf's (d * scales) first)
inline float q6k_scale(const Q6KW& w, int64_t n, int64_t s, int64_t K) {
  const int64_t t = n / kBlock, r = n % kBlock;
  return half_to_float(w.d[(t * (K / 256) + s / 16) * kBlock + r]) * float(w.sc[(t * (K / 16) + s) * kBlock + r]);
}

// q8: against the int8 activations (Act::xqt, dxg) instead of the int16 ones (xs, dw).
void q6k_scalar(const Q6KW& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy,
                bool q8) {
  const int64_t K = a.K, G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* tile = w.q + (n / kBlock) * G * kQ6Group;
    for (int64_t b = b0; b < b0 + nb; ++b) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const float dx = q8 ? a.dxg[b * G + g] : a.dw[b * G + g];
        for (int64_t s = 0; s < 2; ++s) {
          int32_t dot = 0;
          for (int64_t k = 16 * s; k < 16 * s + 16; ++k) {
            const int64_t col = b * K + g * kGroup + k;
            dot += (q6k_code(tile + g * kQ6Group, n % kBlock, k) - 32) * (q8 ? int32_t(a.xqt[col]) : int32_t(a.xs[col]));
          }
          acc += float(dot) * (q6k_scale(w, n, 2 * g + s, K) * dx);
        }
      }
      y[b * ldy + n] = acc + (w.bias ? w.bias[n] : 0.f);
    }
  }
}

// The k-quant kernels' weight-stream prefetch: into the L2 on every machine, whatever the tuning says for the other kernels
// (g_stream_prefetch, g_prefetch_l2). Their loop computes about twice the int8 one's vector ops per weight (the 6-bit
// codes' unpacking, a scale per 16), and without prefetches the L2 stream prefetcher did not keep it fed: on the
// 2-core Zen 4 VM (2026-12-07, 4096 x 14336 at batch 1, 8 weights cycled past the L3, alternated) 2.31 ms a call
// without, 2.04 with prefetcht0, 1.70 with prefetcht1 (the int8-g32 copy of the same weight 2.06-2.16 any way).
TIERED_FORCE_INLINE void kquant_prefetch(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// ------------------------------------------------------------------------------------ q5k
// GGUF Q5_K weights on their own bits (Q5KW): w = (d sc) u - (dmin m) per 32 weights, u the 5-bit code (0..31), sc and
// m 6-bit, d and dmin fp16 per 256: Q5_K's arithmetic at 5.5 bits a weight (176 bytes per 256), where the int8-g32
// copy it replaces (the codes dequantized and re-quantized) read 8.5. A Q5_K_M file is Q5_K but for its Q6_K tensors.
// Layout (q5k_blocks_q5t): qt uint8 [N/16, K/32, 320], per tile and group of 32 columns the four nibble vectors of the
// q6k layout (bytes 0..255) and one 64-byte high vector (bytes 256..319): chunk c's u >> 4 in its bytes' bit c.
// sm uint8 [N/16, K/32, 2, 16]: per group the 16 rows' sc, then their m; dd fp16 [N/16, K/256, 2, 16]: per super-block
// the 16 rows' d, then their dmin. Per row and group the integer dot of u against the quantized x times d sc, less the
// x's sum (Act::xsq / xqs) times dmin m, times the group's dx, accumulates in fp32.
constexpr int64_t kQ5Group = 320;  // bytes of a group of a tile

struct Q5KW {
  const uint8_t* q;
  const uint8_t* sm;
  const uint16_t* dd;
  const float* bias;
};

// u of row r, column k (< 32) of a group's 320 bytes
inline int q5k_code(const uint8_t* grp, int64_t r, int64_t k) {
  const int64_t c = k / 4, j = k % 4;
  const uint8_t lo = grp[(c / 2) * 64 + 4 * r + j], hi = grp[256 + 4 * r + j];
  return ((c % 2 ? lo >> 4 : lo) & 15) | (((hi >> c) & 1) << 4);
}

// (d sc, dmin m) of row n's group g in fp32 (gguf's products)
inline std::pair<float, float> q5k_scales(const Q5KW& w, int64_t n, int64_t g, int64_t K) {
  const int64_t t = n / kBlock, r = n % kBlock, G = K / kGroup;
  const uint16_t* dd = w.dd + (t * (K / 256) + g / 8) * 2 * kBlock + r;
  const uint8_t* sm = w.sm + (t * G + g) * 2 * kBlock + r;
  return {half_to_float(dd[0]) * float(sm[0]), half_to_float(dd[kBlock]) * float(sm[kBlock])};
}

// The scalar path of a format with one (scale, min) pair per row and group of 32 (Q5_K's (d sc, dmin m), IQ4_XS's
// (d (ls - 32), 128 times it)): per row and group the integer dot of u (Code) against x, times the scale, less the
// min times sum(x), times the group's dx. q8: against the int8 activations (Act::xqt, dxg, xqs) instead of the int16
// ones (xs, dw, xsq).
template <class W, int (*Code)(const uint8_t*, int64_t, int64_t), std::pair<float, float> (*Scales)(const W&, int64_t,
                                                                                                     int64_t, int64_t),
          int64_t GroupBytes>
void group_scalar(const W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy,
                  bool q8) {
  const int64_t K = a.K, G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* tile = w.q + (n / kBlock) * G * GroupBytes;
    for (int64_t b = b0; b < b0 + nb; ++b) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t dot = 0, sum = 0;
        for (int64_t k = 0; k < kGroup; ++k) {
          const int64_t col = b * K + g * kGroup + k;
          const int32_t x = q8 ? int32_t(a.xqt[col]) : int32_t(a.xs[col]);
          dot += Code(tile + g * GroupBytes, n % kBlock, k) * x;
          sum += x;
        }
        const auto [fs, fm] = Scales(w, n, g, K);
        acc += (float(dot) * fs - fm * float(sum)) * (q8 ? a.dxg[b * G + g] : a.dw[b * G + g]);
      }
      y[b * ldy + n] = acc + (w.bias ? w.bias[n] : 0.f);
    }
  }
}

// ------------------------------------------------------------------------------------ k-quant kernels
// A k-quant layout's tensor for T tiles and K columns (its name in errors, dtype, shape): each format's `parts`, which
// kquant_blocks allocates (or checks given outputs against) and check_layout checks the kernels' tensors against.
struct KQuantPart {
  const char* name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

// The formats' repacking passes over tiles [t0, t1) (defined with their layouts' readers below).
void q6k_pack_tiles(const uint8_t* src, uint8_t* qt, int8_t* sc, uint16_t* d, int64_t t0, int64_t t1, int64_t K);
void q5k_pack_tiles(const uint8_t* src, uint8_t* qt, uint8_t* sm, uint16_t* dd, int64_t t0, int64_t t1, int64_t K);
void iq4xs_pack_tiles(const uint8_t* src, uint8_t* qt, int8_t* sc, uint16_t* d, int64_t t0, int64_t t1, int64_t K);

inline uint16_t* half_ptr(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::Half>()); }
// The q6k and q5k formats' SIMD kernels, one loop each (kquant_avx2, kquant_avx512) over a format's traits (Q6KFormat,
// Q5KFormat): a group's bytes, how its chunks' high bits sit (their vector for half h of the group's 8 chunks, and
// chunk 4h + m's bits moved onto the bits above the nibble), and how a row's integer dot becomes its fp32 term:
// per half of a group (Q6_K's scale per 16 columns, less 32 sum(x) per 16) or per group (Q5_K's, less its min
// times sum(x) per 32).

// Chunks 4h .. 4h + 3 of a group as u bytes: nibble vectors 2h, 2h + 1 (the odd chunk's nibble shifted down 4) or'ed
// with the format's high bits (one vpternlog each, 0xEA: (A & B) | C). AVX2: the 32 bytes of row half `off` / 32.
// A codebook format (F::kLut: IQ4_XS) has no high bits: each nibble goes through its table (one vpshufb, the table in
// every 128-bit lane) to u.
template <class F>
TIERED_AVX512 TIERED_FORCE_INLINE void kquant_unpack512(const uint8_t* grp, int h, __m512i* u) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i l0 = _mm512_loadu_si512(grp + 128 * h), l1 = _mm512_loadu_si512(grp + 128 * h + 64);
  if constexpr (F::kLut) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(F::kTable)));
    u[0] = _mm512_shuffle_epi8(lut, _mm512_and_si512(l0, m4));
    u[1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(l0, 4), m4));
    u[2] = _mm512_shuffle_epi8(lut, _mm512_and_si512(l1, m4));
    u[3] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(l1, 4), m4));
    return;
  }
  const __m512i hv = _mm512_loadu_si512(grp + F::high_offset(h));
  u[0] = _mm512_ternarylogic_epi64(l0, m4, F::high512(hv, h, 0), 0xEA);
  u[1] = _mm512_ternarylogic_epi64(_mm512_srli_epi16(l0, 4), m4, F::high512(hv, h, 1), 0xEA);
  u[2] = _mm512_ternarylogic_epi64(l1, m4, F::high512(hv, h, 2), 0xEA);
  u[3] = _mm512_ternarylogic_epi64(_mm512_srli_epi16(l1, 4), m4, F::high512(hv, h, 3), 0xEA);
}

template <class F>
TIERED_AVX2 TIERED_FORCE_INLINE void kquant_unpack256(const uint8_t* grp, int h, int off, __m256i* u) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 128 * h + off));
  const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 128 * h + 64 + off));
  if constexpr (F::kLut) {
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(F::kTable)));
    u[0] = _mm256_shuffle_epi8(lut, _mm256_and_si256(l0, m4));
    u[1] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4));
    u[2] = _mm256_shuffle_epi8(lut, _mm256_and_si256(l1, m4));
    u[3] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4));
    return;
  }
  const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + F::high_offset(h) + off));
  u[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), F::high256(hv, h, 0));
  u[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), F::high256(hv, h, 1));
  u[2] = _mm256_or_si256(_mm256_and_si256(l1, m4), F::high256(hv, h, 2));
  u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), F::high256(hv, h, 3));
}

// x shifted left by n (> 0) or right by -n bits in each 16-bit lane, then masked (the shift counts are constants once
// the kernels' loops are unrolled)
TIERED_AVX512 TIERED_FORCE_INLINE __m512i shift_mask512(__m512i x, int n, __m512i mask) {
  return _mm512_and_si512(n > 0 ? _mm512_slli_epi16(x, n) : n < 0 ? _mm512_srli_epi16(x, -n) : x, mask);
}

TIERED_AVX2 TIERED_FORCE_INLINE __m256i shift_mask256(__m256i x, int n, __m256i mask) {
  return _mm256_and_si256(n > 0 ? _mm256_slli_epi16(x, n) : n < 0 ? _mm256_srli_epi16(x, -n) : x, mask);
}

// 16 (8) unsigned bytes or fp16 numbers as fp32 lanes
TIERED_AVX512 TIERED_FORCE_INLINE __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
TIERED_AVX512 TIERED_FORCE_INLINE __m512 f16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
TIERED_AVX2 TIERED_FORCE_INLINE __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
TIERED_AVX2 TIERED_FORCE_INLINE __m256 f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Q6_K: high vector h holds chunk 4h + m's two bits at bits 2m; a half's 16 columns share one scale d sc; the row's
// dot over them less 32 sum(x) (Act::s16w / s16q) times d sc dx.
struct Q6KFormat {
  using W = Q6KW;
  static constexpr const char* kName = "q6k";
  static constexpr const char* kPack = "q6k_blocks_q6t";  // its repacking pass's binding
  static constexpr const char* kFile = "Q6_K";
  static constexpr int64_t kFileBytes = 210;  // a super-block of 256 weights in the file
  static std::vector<KQuantPart> parts(int64_t T, int64_t K) {
    return {{"qt", at::kByte, {T, K / kGroup, kQ6Group}}, {"sc", at::kChar, {T, K / 16, kBlock}},
            {"d", at::kHalf, {T, K / 256, kBlock}}};
  }
  static void pack(const uint8_t* src, const std::vector<at::Tensor>& o, int64_t t0, int64_t t1, int64_t K) {
    q6k_pack_tiles(src, o[0].data_ptr<uint8_t>(), o[1].data_ptr<int8_t>(), half_ptr(o[2]), t0, t1, K);
  }
  // row n's (row r of its tile) group g's 32 weights from the group's bytes: (d sc) (u - 32), gguf's arithmetic
  static void values(const W& w, const uint8_t* grp, int64_t n, int64_t r, int64_t g, int64_t K, float* v) {
    const float s0 = q6k_scale(w, n, 2 * g, K), s1 = q6k_scale(w, n, 2 * g + 1, K);
    for (int64_t k = 0; k < kGroup; ++k) v[k] = (k < 16 ? s0 : s1) * float(q6k_code(grp, r, k) - 32);
  }
  static constexpr int64_t kBytes = kQ6Group;
  static constexpr int64_t kCopyBytes = 210;  // per 256 weights
  static constexpr bool kPerHalf = true;
  static constexpr bool kLut = false;
  static constexpr const uint8_t* kTable = nullptr;
  static W weights(const at::Tensor& qt, const at::Tensor& sc, const at::Tensor& d, const float* bias) {
    return {qt.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), bias};
  }
  // the weights over raw segments (an expert slot's: ExpertSpec::bind_kquant), no bias
  static W at(const uint8_t* qt, const uint8_t* sc, const uint8_t* d) {
    return {qt, reinterpret_cast<const int8_t*>(sc), reinterpret_cast<const uint16_t*>(d), nullptr};
  }
  static void scalar(const W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy,
                     bool q8) {
    q6k_scalar(w, a, b0, nb, n0, n1, y, ldy, q8);
  }
  // int16 x (split into xh / xl on AVX-512) or int8 x, each with its sums per 16 columns
  static ActNeeds int16_needs() {
    ActNeeds n = ActNeeds::only_w16(current_isa() == kAvx512);
    n.s16 = true;
    return n;
  }
  static ActNeeds int8_needs() {
    ActNeeds n = ActNeeds::only_q8();
    n.s16 = true;
    return n;
  }
  static constexpr int64_t high_offset(int h) { return 256 + 64 * h; }
  static TIERED_AVX512 TIERED_FORCE_INLINE __m512i high512(__m512i hv, int, int m) {
    return shift_mask512(hv, 4 - 2 * m, _mm512_set1_epi8(0x30));
  }
  static TIERED_AVX2 TIERED_FORCE_INLINE __m256i high256(__m256i hv, int, int m) {
    return shift_mask256(hv, 4 - 2 * m, _mm256_set1_epi8(0x30));
  }
  struct S512 {
    __m512 f[2];  // d sc of the group's halves, 16 rows
  };
  static TIERED_AVX512 TIERED_FORCE_INLINE S512 scales512(const W& w, int64_t t, int64_t g, int64_t K) {
    const __m512 d = f16x16(w.d + (t * (K / 256) + g / 8) * kBlock);
    S512 s;
    for (int h = 0; h < 2; ++h)
      s.f[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + (t * (K / 16) + 2 * g + h) * kBlock)))));
    return s;
  }
  // 16 codes' weights (u as fp32, lanes of rows `perm`): (u - 32) (d sc), as kquant_dequantize_tiles computes them
  static TIERED_AVX512 TIERED_FORCE_INLINE __m512 weights512(const S512& s, int h, __m512 u, __m512i perm) {
    return _mm512_mul_ps(_mm512_sub_ps(u, _mm512_set1_ps(32.f)), _mm512_permutexvar_ps(perm, s.f[h]));
  }
  static TIERED_AVX512 TIERED_FORCE_INLINE __m512 add512(__m512 acc, const S512& s, __m512i v, const Act& a, int64_t b,
                                                         int64_t g, int h, bool q8) {
    const int64_t bs = b * (a.K / 16) + 2 * g + h, bg = b * (a.K / kGroup) + g;
    v = _mm512_sub_epi32(v, _mm512_set1_epi32(32 * (q8 ? a.s16q[bs] : a.s16w[bs])));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(s.f[h], _mm512_set1_ps(q8 ? a.dxg[bg] : a.dw[bg])), acc);
  }
  struct S256 {
    __m256 f[2][2];  // [half][row half]
  };
  static TIERED_AVX2 TIERED_FORCE_INLINE S256 scales256(const W& w, int64_t t, int64_t g, int64_t K) {
    S256 s;
    for (int r = 0; r < 2; ++r) {
      const __m256 d = f16x8(w.d + (t * (K / 256) + g / 8) * kBlock + 8 * r);
      for (int h = 0; h < 2; ++h)
        s.f[h][r] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                         reinterpret_cast<const __m128i*>(w.sc + (t * (K / 16) + 2 * g + h) * kBlock + 8 * r)))));
    }
    return s;
  }
  static TIERED_AVX2 TIERED_FORCE_INLINE __m256 add256(__m256 acc, const S256& s, __m256i v, const Act& a, int64_t b,
                                                       int64_t g, int h, int r) {
    v = _mm256_sub_epi32(v, _mm256_set1_epi32(32 * a.s16w[b * (a.K / 16) + 2 * g + h]));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(s.f[h][r], _mm256_set1_ps(a.dw[b * (a.K / kGroup) + g])),
                           acc);
  }
};

// The fp32 terms of the formats with one (scale, min) pair per row and group of 32 (Q5_K's (d sc, dmin m), IQ4_XS's
// (d (ls - 32), 128 times it)): a row's dot of u times the scale, less sum(x) (Act::xsq / xqs) times the min, times
// the group's dx. They read int16 x with its sums per group (split: xsq, and AVX-512's xh / xl), or int8 x with theirs.
struct GroupMinTerms {
  static constexpr bool kPerHalf = false;
  static ActNeeds int16_needs() { return ActNeeds::only_w16(true); }
  static ActNeeds int8_needs() { return ActNeeds::only_q8(); }
  struct S512 {
    __m512 fs, fm;  // the scales and mins of 16 rows
  };
  static TIERED_AVX512 TIERED_FORCE_INLINE __m512 add512(__m512 acc, const S512& s, __m512i v, const Act& a, int64_t b,
                                                         int64_t g, int, bool q8) {
    const int64_t bg = b * (a.K / kGroup) + g;
    const __m512 sum = _mm512_set1_ps(float(q8 ? a.xqs[bg] : a.xsq[bg]));
    return _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(v), s.fs, _mm512_mul_ps(s.fm, sum)),
                           _mm512_set1_ps(q8 ? a.dxg[bg] : a.dw[bg]), acc);
  }
  struct S256 {
    __m256 fs[2], fm[2];  // [row half]
  };
  static TIERED_AVX2 TIERED_FORCE_INLINE __m256 add256(__m256 acc, const S256& s, __m256i v, const Act& a, int64_t b,
                                                       int64_t g, int, int r) {
    const int64_t bg = b * (a.K / kGroup) + g;
    const __m256 sum = _mm256_set1_ps(float(a.xsq[bg]));
    return _mm256_fmadd_ps(_mm256_fmsub_ps(_mm256_cvtepi32_ps(v), s.fs[r], _mm256_mul_ps(s.fm[r], sum)),
                           _mm256_set1_ps(a.dw[bg]), acc);
  }
};

// Q5_K: one high vector holds chunk c's fifth bit at bit c; the group's 32 columns share d sc and dmin m; the row's dot
// times d sc, less sum(x) (Act::xsq / xqs) times dmin m, times dx.
struct Q5KFormat : GroupMinTerms {
  using W = Q5KW;
  static constexpr const char* kName = "q5k";
  static constexpr const char* kPack = "q5k_blocks_q5t";
  static constexpr const char* kFile = "Q5_K";
  static constexpr int64_t kFileBytes = 176;
  static std::vector<KQuantPart> parts(int64_t T, int64_t K) {
    return {{"qt", at::kByte, {T, K / kGroup, kQ5Group}}, {"sm", at::kByte, {T, K / kGroup, 2, kBlock}},
            {"dd", at::kHalf, {T, K / 256, 2, kBlock}}};
  }
  static void pack(const uint8_t* src, const std::vector<at::Tensor>& o, int64_t t0, int64_t t1, int64_t K) {
    q5k_pack_tiles(src, o[0].data_ptr<uint8_t>(), o[1].data_ptr<uint8_t>(), half_ptr(o[2]), t0, t1, K);
  }
  // (d sc) u - (dmin m), gguf's products (no fused multiply-add)
  static void values(const W& w, const uint8_t* grp, int64_t n, int64_t r, int64_t g, int64_t K, float* v) {
    const auto [fs, fm] = q5k_scales(w, n, g, K);
    for (int64_t k = 0; k < kGroup; ++k) {
      volatile float p = fs * float(q5k_code(grp, r, k));
      v[k] = p - fm;
    }
  }
  static constexpr int64_t kBytes = kQ5Group;
  static constexpr int64_t kCopyBytes = 180;  // per 256 weights: the file's 176, its 6-bit sc and m a byte each
  static constexpr bool kLut = false;
  static constexpr const uint8_t* kTable = nullptr;
  static W weights(const at::Tensor& qt, const at::Tensor& sm, const at::Tensor& dd, const float* bias) {
    return {qt.data_ptr<uint8_t>(), sm.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dd.data_ptr<at::Half>()), bias};
  }
  static W at(const uint8_t* qt, const uint8_t* sm, const uint8_t* dd) {
    return {qt, sm, reinterpret_cast<const uint16_t*>(dd), nullptr};
  }
  static void scalar(const W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy,
                     bool q8) {
    group_scalar<Q5KW, q5k_code, q5k_scales, kQ5Group>(w, a, b0, nb, n0, n1, y, ldy, q8);
  }
  static constexpr int64_t high_offset(int) { return 256; }
  static TIERED_AVX512 TIERED_FORCE_INLINE __m512i high512(__m512i hv, int h, int m) {
    return shift_mask512(hv, 4 - (4 * h + m), _mm512_set1_epi8(0x10));
  }
  static TIERED_AVX2 TIERED_FORCE_INLINE __m256i high256(__m256i hv, int h, int m) {
    return shift_mask256(hv, 4 - (4 * h + m), _mm256_set1_epi8(0x10));
  }
  static TIERED_AVX512 TIERED_FORCE_INLINE S512 scales512(const W& w, int64_t t, int64_t g, int64_t K) {
    const uint16_t* dd = w.dd + (t * (K / 256) + g / 8) * 2 * kBlock;
    const uint8_t* sm = w.sm + (t * (K / kGroup) + g) * 2 * kBlock;
    return {_mm512_mul_ps(f16x16(dd), u8x16(sm)), _mm512_mul_ps(f16x16(dd + kBlock), u8x16(sm + kBlock))};
  }
  // 16 codes' weights: (d sc) u - (dmin m), the product rounded before the difference (kquant_dequantize_tiles')
  static TIERED_AVX512 TIERED_FORCE_INLINE __m512 weights512(const S512& s, int, __m512 u, __m512i perm) {
    return _mm512_sub_ps(_mm512_mul_ps(u, _mm512_permutexvar_ps(perm, s.fs)), _mm512_permutexvar_ps(perm, s.fm));
  }
  static TIERED_AVX2 TIERED_FORCE_INLINE S256 scales256(const W& w, int64_t t, int64_t g, int64_t K) {
    const uint16_t* dd = w.dd + (t * (K / 256) + g / 8) * 2 * kBlock;
    const uint8_t* sm = w.sm + (t * (K / kGroup) + g) * 2 * kBlock;
    S256 s;
    for (int r = 0; r < 2; ++r) {
      s.fs[r] = _mm256_mul_ps(f16x8(dd + 8 * r), u8x8(sm + 8 * r));
      s.fm[r] = _mm256_mul_ps(f16x8(dd + kBlock + 8 * r), u8x8(sm + kBlock + 8 * r));
    }
    return s;
  }
};

// ------------------------------------------------------------------------------------ iq4xs
// GGUF IQ4_XS weights on their own bits (IQ4XSW): w = (d (ls - 32)) v per 32 weights, v = kvalues_iq4nl[i] of the
// 4-bit index i (int8 values -127..113), ls 6-bit, d fp16 per 256: llama.cpp's IQ4_XS arithmetic (gguf's: d (ls - 32)
// in fp32, exact, then times v) at 4.3125 bits a weight (138 bytes per 256: the file's 136, its 6-bit ls a byte each),
// where the int8-g32 copy of its codebook values read 8.5.
// Layout (iq4xs_blocks_q4t): qt uint8 [N/16, K/32, 256], per tile and group the four nibble vectors of the q6k / q5k
// layouts (vector i: chunk 2i's indices in the low nibbles, chunk 2i + 1's in the high ones); sc int8 [N/16, K/32, 16]
// (ls - 32 of the tile's 16 rows); d fp16 [N/16, K/256, 16]. The kernels take u = v + 128 (kIq4U: one vpshufb per
// chunk) as vpdpbusd's unsigned operand, less 128 sum(x) (Act::xsq / xqs) per group, times d (ls - 32) and dx.
constexpr int64_t kIq4Group = 256;  // bytes of a group of a tile: 16 rows x 32 indices
alignas(16) constexpr uint8_t kIq4U[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

struct IQ4XSW {
  const uint8_t* q;
  const int8_t* sc;
  const uint16_t* d;
  const float* bias;
};

// u (the codebook value + 128) of row r, column k (< 32) of a group's 256 bytes
inline int iq4xs_code(const uint8_t* grp, int64_t r, int64_t k) {
  const int64_t c = k / 4, j = k % 4;
  const uint8_t b = grp[(c / 2) * 64 + 4 * r + j];
  return kIq4U[c % 2 ? b >> 4 : b & 15];
}

// (d (ls - 32), 128 times it) of row n's group g in fp32 (exact: an 11-bit significand times a 6-bit integer)
inline std::pair<float, float> iq4xs_scales(const IQ4XSW& w, int64_t n, int64_t g, int64_t K) {
  const int64_t t = n / kBlock, r = n % kBlock;
  const float fs = half_to_float(w.d[(t * (K / 256) + g / 8) * kBlock + r]) * float(w.sc[(t * (K / kGroup) + g) * kBlock + r]);
  return {fs, 128.f * fs};
}

// IQ4_XS: its nibbles through kIq4U (kLut); the group's 32 columns share d (ls - 32); the row's dot of u times it,
// less 128 sum(x) times it, times dx (Q5_K's form with dmin m = 128 d (ls - 32)).
struct IQ4XSFormat : GroupMinTerms {
  using W = IQ4XSW;
  static constexpr const char* kName = "iq4xs";
  static constexpr const char* kPack = "iq4xs_blocks_q4t";
  static constexpr const char* kFile = "IQ4_XS";
  static constexpr int64_t kFileBytes = 136;
  static std::vector<KQuantPart> parts(int64_t T, int64_t K) {
    return {{"qt", at::kByte, {T, K / kGroup, kIq4Group}}, {"sc", at::kChar, {T, K / kGroup, kBlock}},
            {"d", at::kHalf, {T, K / 256, kBlock}}};
  }
  static void pack(const uint8_t* src, const std::vector<at::Tensor>& o, int64_t t0, int64_t t1, int64_t K) {
    iq4xs_pack_tiles(src, o[0].data_ptr<uint8_t>(), o[1].data_ptr<int8_t>(), half_ptr(o[2]), t0, t1, K);
  }
  // (d (ls - 32)) v: the scale exact, one product (gguf's order)
  static void values(const W& w, const uint8_t* grp, int64_t n, int64_t r, int64_t g, int64_t K, float* v) {
    const float fs = iq4xs_scales(w, n, g, K).first;
    for (int64_t k = 0; k < kGroup; ++k) v[k] = fs * float(iq4xs_code(grp, r, k) - 128);
  }
  static constexpr int64_t kBytes = kIq4Group;
  static constexpr int64_t kCopyBytes = 138;  // per 256 weights: the file's 136, its 6-bit ls a byte each
  static constexpr bool kLut = true;
  static constexpr const uint8_t* kTable = kIq4U;
  static W weights(const at::Tensor& qt, const at::Tensor& sc, const at::Tensor& d, const float* bias) {
    return {qt.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()), bias};
  }
  // the weights over raw segments (an expert slot's: ExpertSpec::bind_kquant), no bias
  static W at(const uint8_t* qt, const uint8_t* sc, const uint8_t* d) {
    return {qt, reinterpret_cast<const int8_t*>(sc), reinterpret_cast<const uint16_t*>(d), nullptr};
  }
  static void scalar(const W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy,
                     bool q8) {
    group_scalar<IQ4XSW, iq4xs_code, iq4xs_scales, kIq4Group>(w, a, b0, nb, n0, n1, y, ldy, q8);
  }
  static constexpr int64_t high_offset(int) { return 0; }  // (no high bits: kLut)
  static TIERED_AVX512 TIERED_FORCE_INLINE __m512i high512(__m512i, int, int) { return _mm512_setzero_si512(); }
  static TIERED_AVX2 TIERED_FORCE_INLINE __m256i high256(__m256i, int, int) { return _mm256_setzero_si256(); }
  static TIERED_AVX512 TIERED_FORCE_INLINE S512 scales512(const W& w, int64_t t, int64_t g, int64_t K) {
    const __m512 fs = _mm512_mul_ps(f16x16(w.d + (t * (K / 256) + g / 8) * kBlock), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + (t * (K / kGroup) + g) * kBlock)))));
    return {fs, _mm512_mul_ps(fs, _mm512_set1_ps(128.f))};
  }
  // 16 codes' weights (u as fp32): (u - 128) (d (ls - 32)), the codebook value exact before the one product (gguf's)
  static TIERED_AVX512 TIERED_FORCE_INLINE __m512 weights512(const S512& s, int, __m512 u, __m512i perm) {
    return _mm512_mul_ps(_mm512_sub_ps(u, _mm512_set1_ps(128.f)), _mm512_permutexvar_ps(perm, s.fs));
  }
  static TIERED_AVX2 TIERED_FORCE_INLINE S256 scales256(const W& w, int64_t t, int64_t g, int64_t K) {
    S256 s;
    for (int r = 0; r < 2; ++r) {
      s.fs[r] = _mm256_mul_ps(f16x8(w.d + (t * (K / 256) + g / 8) * kBlock + 8 * r),
                              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                  reinterpret_cast<const __m128i*>(w.sc + (t * (K / kGroup) + g) * kBlock + 8 * r)))));
      s.fm[r] = _mm256_mul_ps(s.fs[r], _mm256_set1_ps(128.f));
    }
    return s;
  }
};

// AVX2 (int16 x, Act::xw): per chunk and 8-row half, u's bytes 0 and 2 of each row's dword and bytes 1 and 3 as int16
// pairs against the broadcast xw words, as int8t_avx2 does with its codes (pair sums <= 2 * 63 * 32639: exact).
template <int NB, class F>
TIERED_AVX2 void kquant_avx2(const typename F::W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                             int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  const __m256i m = _mm256_set1_epi32(0x00FF00FF);
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const int64_t t = m0 / kBlock;
    const uint8_t* tile = w.q + t * G * F::kBytes;
    __m256 acc[NB][2];
    for (int j = 0; j < NB; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* grp = tile + g * F::kBytes;
      for (int l = 0; l < F::kBytes / 64; ++l) kquant_prefetch(grp + kPrefetchAhead + 64 * l);
      const typename F::S256 sc = F::scales256(w, t, g, K);
      __m256i tt[NB][2];
      for (int h = 0; h < 2; ++h) {
        if (h == 0 || F::kPerHalf)
          for (int j = 0; j < NB; ++j) tt[j][0] = tt[j][1] = _mm256_setzero_si256();
        __m256i u[2][4];  // [row half][chunk 4h + cm]
        for (int r = 0; r < 2; ++r) kquant_unpack256<F>(grp, h, 32 * r, u[r]);
#pragma GCC unroll 4
        for (int cm = 0; cm < 4; ++cm) {
          const int c = 4 * h + cm;
          __m256i e[2], o[2];
          for (int r = 0; r < 2; ++r) e[r] = _mm256_and_si256(u[r][cm], m), o[r] = _mm256_srli_epi16(u[r][cm], 8);
          const int64_t i = (c / 2) * 4 + c % 2;  // xw word of columns (4c, 4c + 2); + 2: (4c + 1, 4c + 3)
          for (int j = 0; j < NB; ++j) {
            const uint32_t* xw = a.xw + (b0 + j) * (K / 2) + g * (kGroup / 2);
            const __m256i xe = _mm256_set1_epi32(int32_t(xw[i])), xo = _mm256_set1_epi32(int32_t(xw[i + 2]));
            for (int r = 0; r < 2; ++r)
              tt[j][r] = _mm256_add_epi32(tt[j][r], _mm256_add_epi32(_mm256_madd_epi16(e[r], xe), _mm256_madd_epi16(o[r], xo)));
          }
        }
        if (F::kPerHalf || h == 1)
          for (int j = 0; j < NB; ++j)
            for (int r = 0; r < 2; ++r) acc[j][r] = F::add256(acc[j][r], sc, tt[j][r], a, b0 + j, g, h, r);
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int r = 0; r < 2; ++r) {
        __m256 out = acc[j][r];
        if (w.bias) out = _mm256_add_ps(out, _mm256_loadu_ps(w.bias + m0 + 8 * r));
        _mm256_storeu_ps(y + (b0 + j) * ldy + m0 + 8 * r, out);
      }
  }
}

// AVX-512 (VNNI), as int8t_avx512: one vpdpbusd per chunk against a broadcast of 4 bytes of xh and one of xl (xs =
// 256 xh + xl) per activation row, or of xqt (Q8: calls of q8_from+ rows, Plan.batch_act "q8"); a row's dot is
// 256 sum(h) + sum(l), exact in int32 (|.| <= 32 * 63 * 128 * 257), then the format's fp32 term. Two chains per part
// and row up to 2 rows (Q8: 4), one beyond.
template <int NB, class F, bool Q8 = false>
TIERED_AVX512 void kquant_avx512(const typename F::W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y,
                                 int64_t ldy) {
  const int64_t K = a.K, G = K / kGroup;
  constexpr int C = NB <= (Q8 ? 4 : 2) ? 2 : 1;
  constexpr int P = Q8 ? 1 : 2;  // the activations' byte parts: xq alone, or xh and xl
  for (int64_t m0 = n0; m0 < n1; m0 += kBlock) {
    const int64_t t = m0 / kBlock;
    const uint8_t* tile = w.q + t * G * F::kBytes;
    __m512 acc[NB];
    for (int j = 0; j < NB; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* grp = tile + g * F::kBytes;
      for (int l = 0; l < F::kBytes / 64; ++l) kquant_prefetch(grp + kPrefetchAhead + 64 * l);
      const typename F::S512 sc = F::scales512(w, t, g, K);
      __m512i tt[NB][P][C];
      for (int h = 0; h < 2; ++h) {
        if (h == 0 || F::kPerHalf)
          for (int j = 0; j < NB; ++j)
            for (int p = 0; p < P; ++p)
              for (int c = 0; c < C; ++c) tt[j][p][c] = _mm512_setzero_si512();
        __m512i u[4];
        kquant_unpack512<F>(grp, h, u);
#pragma GCC unroll 4
        for (int cm = 0; cm < 4; ++cm) {
          for (int j = 0; j < NB; ++j) {
            const int64_t k = (b0 + j) * K + g * kGroup + 4 * (4 * h + cm);
            const int8_t* parts[2] = {Q8 ? a.xqt + k : a.xh + k, Q8 ? nullptr : a.xl + k};
            for (int p = 0; p < P; ++p) {
              int32_t v;
              std::memcpy(&v, parts[p], 4);
              tt[j][p][cm % C] = _mm512_dpbusd_epi32(tt[j][p][cm % C], u[cm], _mm512_set1_epi32(v));
            }
          }
        }
        if (F::kPerHalf || h == 1)
          for (int j = 0; j < NB; ++j) {
            __m512i v = C == 2 ? _mm512_add_epi32(tt[j][0][0], tt[j][0][C - 1]) : tt[j][0][0];
            if constexpr (!Q8) {
              v = _mm512_add_epi32(_mm512_slli_epi32(v, 8), C == 2 ? _mm512_add_epi32(tt[j][P - 1][0], tt[j][P - 1][C - 1])
                                                                   : tt[j][P - 1][0]);
            }
            acc[j] = F::add512(acc[j], sc, v, a, b0 + j, g, h, Q8);
          }
      }
    }
    for (int j = 0; j < NB; ++j) {
      __m512 out = acc[j];
      if (w.bias) out = _mm512_add_ps(out, _mm512_loadu_ps(w.bias + m0));
      _mm512_storeu_ps(y + (b0 + j) * ldy + m0, out);
    }
  }
}

// A k-quant weight's tiles [t0, t1) to bf16 rows out [N, K] with AVX-512: per chunk its 64 u bytes (kquant_unpack512)
// as four vectors of 16 (rows 4q .. 4q + 3, 4 columns each), their weights by the format's arithmetic on its rows'
// scales, rounded to bf16 (vcvtneps2bf16: nearest even, as to_bf16) and stored 8 bytes a row: the values of
// kquant_dequantize_tiles, bit for bit, at ~5x its speed.
template <class F>
TIERED_AVX512 void kquant_bf16_avx512(const typename F::W& w, uint16_t* out, int64_t t0, int64_t t1, int64_t K) {
  const int64_t G = K / kGroup;
  __m512i perm[4];
  for (int q = 0; q < 4; ++q)
    perm[q] = _mm512_setr_epi32(4 * q, 4 * q, 4 * q, 4 * q, 4 * q + 1, 4 * q + 1, 4 * q + 1, 4 * q + 1, 4 * q + 2,
                                4 * q + 2, 4 * q + 2, 4 * q + 2, 4 * q + 3, 4 * q + 3, 4 * q + 3, 4 * q + 3);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* grp = w.q + (t * G + g) * F::kBytes;
      const typename F::S512 sc = F::scales512(w, t, g, K);
      for (int h = 0; h < 2; ++h) {
        __m512i u[4];
        kquant_unpack512<F>(grp, h, u);
        for (int cm = 0; cm < 4; ++cm)
          for (int q = 0; q < 4; ++q) {
            const __m512 v = F::weights512(sc, h, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(u[cm], q))),
                                           perm[q]);
            const __m256i b = (__m256i)_mm512_cvtneps_pbh(v);
            const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
            uint16_t* o = out + (t * kBlock + 4 * q) * K + g * kGroup + 4 * (4 * h + cm);
            _mm_storel_epi64(reinterpret_cast<__m128i*>(o), lo);
            _mm_storeh_pd(reinterpret_cast<double*>(o + K), _mm_castsi128_pd(lo));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(o + 2 * K), hi);
            _mm_storeh_pd(reinterpret_cast<double*>(o + 3 * K), _mm_castsi128_pd(hi));
          }
      }
    }
}

// ------------------------------------------------------------------------------------ fp8
// FP8 E4M3 weights with a fp32 scale per 128 x 128 block (DeepSeek-V3 / Qwen3-FP8 checkpoints' "weight"
// and "weight_scale_inv"; Fp8W): q uint8 [N, K] the float8_e4m3fn bit patterns, bs fp32
// [ceil(N/128), ceil(K/128)], w[n, k] = e4m3(q[n, k]) * bs[n / 128, k / 128]; any N and K (a last
// partial block in either direction). Against the fp32 activations as given (Act::x, unrounded).
// The same kernel takes scales per output channel (Fp8W::rb 1) or per tensor (rb >= N), over 128
// columns or over all of them (Fp8W::cs 0: bs [ceil(N/rb), 1]): compressed-tensors' and fbgemm's
// "channel" and "tensor" FP8 (Llama-3.1-70B/405B-FP8); each 128-column block's dot is still scaled
// once, by the one scale (fp8_row_scales).
// A code b (sign, 4 exponent bits e with bias 7, 3 mantissa bits m) becomes the fp16 number with bits
// ((b & 0x80) << 8) | ((b & 0x7f) << 7): e and m land in fp16's exponent (bias 15) and top mantissa
// bits, so its value is e4m3(b) / 256 exactly, subnormals too (e = 0: 2^-14 m/8 = 2^-6 m/8 / 256), and
// vcvtph2ps makes it fp32 exactly; the factor 256 goes into the block scale (kFp8Unit). In SIMD: the byte
// sign-extended to int16, shifted left by 7 (the sign lands on bit 15, a copy on bit 14) and ANDed
// with 0xBFFF. e4m3fn has no infinities, and its NaN codes 0x7f / 0xff (exponent 15, a number in fp16)
// read as +-480 on every path: a checkpoint's weights hold none.
// Per row and 128-column block, each activation row's products are summed in fp32 vector accumulators
// (U of them, so that short passes still have independent FMA chains), then multiply-added by the
// block's scale into the row's total: one FMA per block and activation row beyond the products. One
// byte per weight streamed, read once per pass of up to kMaxNB activation rows. The work is the
// conversion (4 vector ops per 16 weights) and one FMA per 16 weights and activation row: on the 2-core
// Zen 4 VM one thread computed ~33 GB/s of weights from cache at batch 1, and two read ~40-45 GB/s from
// DRAM, near the tiled int8 kernel (2026-11-27, [2048, 7168] and [768, 2048]).
constexpr int64_t kFp8Block = 128;
constexpr float kFp8Unit = 256.f;  // e4m3(b) = 256 x the fp16 form's value

// Row n's scales: bs[(n / rb) * KB + c * cs] for 128-column block c (KB = ceil(K/128)).
inline const float* fp8_row_scales(const Fp8W& w, int64_t n, int64_t KB) { return w.bs + (n / w.rb) * (w.cs ? KB : 1); }

inline uint16_t fp8_half_bits(uint8_t b) { return uint16_t(((b & 0x80) << 8) | ((b & 0x7f) << 7)); }

// e4m3(b) / 256 for every code b (the fp16 form above): the scalar path's table.
const float* fp8_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> v{};
    for (int b = 0; b < 256; ++b) v[b] = half_to_float(fp8_half_bits(uint8_t(b)));
    return v;
  }();
  return t.data();
}

void fp8_scalar(const Fp8W& w, const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t K = a.K, KB = (K + kFp8Block - 1) / kFp8Block;
  const float* lut = fp8_table();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* r = w.q + n * K;
    const float* bs = fp8_row_scales(w, n, KB);
    const int64_t cs = w.cs;
    for (int64_t j = 0; j < nb; ++j) {
      const float* x = a.x + (b0 + j) * K;
      float acc = 0.f;
      for (int64_t c = 0; c < KB; ++c) {
        float blk = 0.f;
        for (int64_t k = c * kFp8Block; k < std::min(K, (c + 1) * kFp8Block); ++k) blk += lut[r[k]] * x[k];
        acc += blk * (bs[c * cs] * kFp8Unit);
      }
      y[(b0 + j) * ldy + n] = acc + (w.bias ? w.bias[n] : 0.f);
    }
  }
}

// AVX2 + F16C: 16 codes -> their values / 256, two vectors of 8.
TIERED_AVX2 inline __attribute__((always_inline)) void fp8_load16_avx2(const uint8_t* q, __m256& w0, __m256& w1) {
  const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(int16_t(0xBFFF)));
  w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

template <int NB>
TIERED_AVX2 void fp8_avx2(const Fp8W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int U = NB <= 2 ? 4 : (NB <= 4 ? 2 : 1);  // accumulators per activation row
  const int64_t K = a.K, KB = (K + kFp8Block - 1) / kFp8Block, full = K / kFp8Block;
  const float* lut = fp8_table();
  const float* x[NB];
  for (int j = 0; j < NB; ++j) x[j] = a.x + (b0 + j) * K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* r = w.q + n * K;
    const float* bs = fp8_row_scales(w, n, KB);
    const int64_t cs = w.cs;
    __m256 tot[NB];
    float rest[NB];  // the last block's columns past its whole 16s, scaled
    for (int j = 0; j < NB; ++j) tot[j] = _mm256_setzero_ps(), rest[j] = 0.f;
    for (int64_t c = 0; c < full; ++c) {
      const uint8_t* q = r + c * kFp8Block;
      prefetch_stream(q + kPrefetchAhead);
      prefetch_stream(q + kPrefetchAhead + 64);
      __m256 acc[NB][U];
      for (int j = 0; j < NB; ++j)
        for (int u = 0; u < U; ++u) acc[j][u] = _mm256_setzero_ps();
      for (int i = 0; i < kFp8Block / 16; ++i) {
        __m256 w0, w1;
        fp8_load16_avx2(q + 16 * i, w0, w1);
        for (int j = 0; j < NB; ++j) {
          const float* xk = x[j] + c * kFp8Block + 16 * i;
          acc[j][(2 * i) % U] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xk), acc[j][(2 * i) % U]);
          acc[j][(2 * i + 1) % U] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xk + 8), acc[j][(2 * i + 1) % U]);
        }
      }
      const __m256 s = _mm256_set1_ps(bs[c * cs] * kFp8Unit);
      for (int j = 0; j < NB; ++j) {
        __m256 t = acc[j][0];
        for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, acc[j][u]);
        tot[j] = _mm256_fmadd_ps(t, s, tot[j]);
      }
    }
    if (full < KB) {  // the last block, K % 128 columns
      __m256 acc[NB];
      float tail[NB];
      for (int j = 0; j < NB; ++j) acc[j] = _mm256_setzero_ps(), tail[j] = 0.f;
      int64_t k = full * kFp8Block;
      for (; k + 16 <= K; k += 16) {
        __m256 w0, w1;
        fp8_load16_avx2(r + k, w0, w1);
        for (int j = 0; j < NB; ++j) {
          acc[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[j] + k), acc[j]);
          acc[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[j] + k + 8), acc[j]);
        }
      }
      for (; k < K; ++k)
        for (int j = 0; j < NB; ++j) tail[j] += lut[r[k]] * x[j][k];
      const float sc = bs[full * cs] * kFp8Unit;
      for (int j = 0; j < NB; ++j) tot[j] = _mm256_fmadd_ps(acc[j], _mm256_set1_ps(sc), tot[j]), rest[j] = tail[j] * sc;
    }
    for (int j = 0; j < NB; ++j) y[(b0 + j) * ldy + n] = hsum256(tot[j]) + rest[j] + (w.bias ? w.bias[n] : 0.f);
  }
}

// AVX-512 (F/BW): 32 codes per load, sign-extended to 32 int16 in one vector; the last block's columns
// in masked loads of 16 (masked-off codes 0 and x 0: no scalar tail). R weight rows at a time (R > 1 from
// two activation rows on; AVX2's 16 registers keep one): each x vector loaded feeds R rows' FMAs. A
// pass of 8 activation rows holds 32 K bytes of x, more than L1 from K = 1024: one weight row at a
// time, it streamed all of x from L2 per row, and 8 rows of a [2048, 7168] weight took 4.0 ms on one
// Zen 4 thread where two rows at a time take 1.9 ms (about the FMA bound); at batch 1 two rows at a
// time only slowed the stream (24 -> 17-20 GB/s from DRAM).
template <int NB, int R>
TIERED_AVX512 inline __attribute__((always_inline)) void fp8_rows_avx512(const Fp8W& w, const float* const* x,
                                                                          int64_t K, int64_t n, float* y, int64_t b0,
                                                                          int64_t ldy) {
  constexpr int U = NB * R >= 4 ? 1 : 4 / (NB * R);  // accumulators per weight and activation row
  const int64_t KB = (K + kFp8Block - 1) / kFp8Block, full = K / kFp8Block;
  const __m512i keep = _mm512_set1_epi16(int16_t(0xBFFF));
  const uint8_t* q0 = w.q + n * K;  // row n + r's codes at q0 + r K
  const float* bs[R];
  for (int r = 0; r < R; ++r) bs[r] = fp8_row_scales(w, n + r, KB);
  const int64_t cs = w.cs;
  __m512 tot[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) tot[r][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < full; ++c) {
    const uint8_t* q = q0 + c * kFp8Block;
    for (int r = 0; r < R; ++r) {
      prefetch_stream(q + r * K + kPrefetchAhead);
      prefetch_stream(q + r * K + kPrefetchAhead + 64);
    }
    __m512 acc[R][NB][U];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j)
        for (int u = 0; u < U; ++u) acc[r][j][u] = _mm512_setzero_ps();
    for (int i = 0; i < kFp8Block / 32; ++i) {
      __m512 wv[R][2];
      for (int r = 0; r < R; ++r) {
        const __m512i s = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + 32 * i)));
        const __m512i h = _mm512_and_si512(_mm512_slli_epi16(s, 7), keep);
        wv[r][0] = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        wv[r][1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
      }
      for (int j = 0; j < NB; ++j) {
        const float* xk = x[j] + c * kFp8Block + 32 * i;
        const __m512 x0 = _mm512_loadu_ps(xk), x1 = _mm512_loadu_ps(xk + 16);
        for (int r = 0; r < R; ++r) {
          acc[r][j][(2 * i) % U] = _mm512_fmadd_ps(wv[r][0], x0, acc[r][j][(2 * i) % U]);
          acc[r][j][(2 * i + 1) % U] = _mm512_fmadd_ps(wv[r][1], x1, acc[r][j][(2 * i + 1) % U]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sc = _mm512_set1_ps(bs[r][c * cs] * kFp8Unit);
      for (int j = 0; j < NB; ++j) {
        __m512 t = acc[r][j][0];
        for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, acc[r][j][u]);
        tot[r][j] = _mm512_fmadd_ps(t, sc, tot[r][j]);
      }
    }
  }
  if (full < KB) {  // the last block, K % 128 columns
    __m512 acc[R][NB];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = full * kFp8Block; k < K; k += 16) {
      const __mmask16 m = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
      __m512 wv[R];
      for (int r = 0; r < R; ++r) {
        const __m256i s = _mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(m, q0 + r * K + k));
        wv[r] = _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(s, 7), _mm512_castsi512_si256(keep)));
      }
      for (int j = 0; j < NB; ++j) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, x[j] + k);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm512_fmadd_ps(wv[r], xv, acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sc = _mm512_set1_ps(bs[r][full * cs] * kFp8Unit);
      for (int j = 0; j < NB; ++j) tot[r][j] = _mm512_fmadd_ps(acc[r][j], sc, tot[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j)
      y[(b0 + j) * ldy + n + r] = _mm512_reduce_add_ps(tot[r][j]) + (w.bias ? w.bias[n + r] : 0.f);
}

template <int NB>
TIERED_AVX512 void fp8_avx512(const Fp8W& w, const Act& a, int64_t b0, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  constexpr int R = NB == 1 ? 1 : (NB <= 4 ? 4 : 2);  // weight rows at a time: 8 to 16 accumulators
  const float* x[NB];
  for (int j = 0; j < NB; ++j) x[j] = a.x + (b0 + j) * a.K;
  int64_t n = n0;
  for (; n + R <= n1; n += R) fp8_rows_avx512<NB, R>(w, x, a.K, n, y, b0, ldy);
  for (; n < n1; ++n) fp8_rows_avx512<NB, 1>(w, x, a.K, n, y, b0, ldy);
}

// ------------------------------------------------------------------------------------ dispatch
// Runs fn<NB, extra template arguments...> over activation rows [b0, b0 + nb) in passes of at most
// kMaxNB rows.
#define TIERED_DISPATCH_NB(FN, W, ...)                                                \
  for (int64_t j0 = b0; j0 < b0 + nb; j0 += kMaxNB) {                                 \
    switch (std::min<int64_t>(kMaxNB, b0 + nb - j0)) {                                \
      case 1: FN<1, ##__VA_ARGS__>(W, a, j0, n0, n1, y, ldy); break;                  \
      case 2: FN<2, ##__VA_ARGS__>(W, a, j0, n0, n1, y, ldy); break;                  \
      case 3: FN<3, ##__VA_ARGS__>(W, a, j0, n0, n1, y, ldy); break;                  \
      case 4: FN<4, ##__VA_ARGS__>(W, a, j0, n0, n1, y, ldy); break;                  \
      case 5: FN<5, ##__VA_ARGS__>(W, a, j0, n0, n1, y, ldy); break;                  \
      case 6: FN<6, ##__VA_ARGS__>(W, a, j0, n0, n1, y, ldy); break;                  \
      case 7: FN<7, ##__VA_ARGS__>(W, a, j0, n0, n1, y, ldy); break;                  \
      default: FN<8, ##__VA_ARGS__>(W, a, j0, n0, n1, y, ldy); break;                 \
    }                                                                                 \
  }

const char* isa_name(int isa) { return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "scalar"; }

std::vector<float> bias_vector(const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias) return {};
  TIERED_CHECK(bias->numel() == N, "gemv: bias must have ", N, " elements, got ", bias->numel());
  auto b = bias->to(at::kFloat).contiguous();
  return std::vector<float>(b.data_ptr<float>(), b.data_ptr<float>() + N);
}

const uint16_t* bf16_ptr(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }

// ------------------------------------------------------------------------------------ kernels
struct Int4Gemv : Gemv {
  at::Tensor codes, s, z, zr;  // held so the pointers in w stay valid
  std::vector<float> bias;
  Int4W w{};
  void rows(const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) const override {
    switch (current_isa()) {
      case kAvx512: TIERED_DISPATCH_NB(int4_avx512, w) break;
      case kAvx2: TIERED_DISPATCH_NB(int4_avx2, w) break;
      default: int4_scalar(w, a, b0, nb, n0, n1, y, ldy);
    }
  }
  int64_t weight_bytes() const override {
    return out_features * (in_features / 2 + in_features / kGroup * 2 * (w.zr ? 3 : 2));
  }
  std::string name() const override { return std::string("int4(tiered,") + isa_name(current_isa()) + ")"; }
};

// The same weights on int8-quantized activations (see "int4 x q8" above): 2 vpdpbusd per 128
// weights instead of a bf16 dot per 32, at the cost of rounding x to 8 bits per group of 32.
struct Int4Q8Gemv : Int4Gemv {
  ActNeeds needs(int64_t) const override { return ActNeeds::only_q8(); }
  void rows(const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) const override {
    switch (current_isa()) {
      case kAvx512: TIERED_DISPATCH_NB(int4q8_avx512, w) break;
      case kAvx2: TIERED_DISPATCH_NB(int4q8_avx2, w) break;
      default: int4q8_scalar(w, a, b0, nb, n0, n1, y, ldy);
    }
  }
  std::string name() const override { return std::string("int4q8(tiered,") + isa_name(current_isa()) + ")"; }
};

// The tiled layout (see "int4, tiled"): rows in whole tiles of 16 (N % 16 == 0). Calls of at least
// q8_from activation rows read int8-quantized x (vpdpbusd), smaller ones bf16 x (vdpbf16ps):
// q8_from = 1 is always q8, kNeverQ8 never, 2 keeps batch 1 on bf16 and batched decode on q8.
constexpr int64_t kNeverQ8 = INT64_MAX;
// Calls of at most this many rows on int8 activations stream on AVX2 (int4tq8s_avx2: passes of up to 4
// rows over each tile); larger ones unpack each tile once (int4tq8_avx2). On 2 Zen 3 cores (2026-11-30,
// weights cycled past the cache) streaming took 0.69x the unpacking kernel's time at 5 rows, 0.87x at 8,
// ~1.0x at 16 and 0.80-0.85x the other way at 32 and 64 (576 x 576 to 4096 x 4096).
constexpr int64_t kQ8StreamRows = 12;

struct Int4TGemv : Int4Gemv {
  int64_t q8_from = kNeverQ8;
  // AVX2 and AVX-512 without VBMI read int16 activations below q8_from (more exact than int8, and
  // at batch 1 bound by memory either way), int8 from it (int4tq8_avx2, int4tq8s_avx2 / int4tq8s_avx512).
  static bool int16_below_q8() {
    const int isa = current_isa();
    return isa == kAvx2 || (isa == kAvx512 && (!has_vbmi() || g_int4_w16));
  }
  bool w16(int64_t B) const { return B < q8_from && int16_below_q8(); }
  ActNeeds needs(int64_t B) const override {
    if (w16(B)) return ActNeeds::only_w16(current_isa() == kAvx512);  // int4t_w16_avx512 reads xh, xl
    if (B >= q8_from) return ActNeeds::only_q8();
    return {true, false, current_isa() == kAvx512, false};  // AVX-512 here has VBMI: bf16 pairs
  }
  void rows(const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) const override {
    const int isa = current_isa();
    const int64_t B = a.rows_for_format();  // (needs() was asked with the same)
    if (w16(B)) {
      if (isa == kAvx512) {
        TIERED_DISPATCH_NB(int4t_w16_avx512, w)
      } else {
        TIERED_DISPATCH_NB(int4t_w16_avx2, w)
      }
    } else if (B >= q8_from && w.e2m1) {  // MXFP4: q8_from is 1 (Int4W::e2m1)
      if (isa == kAvx512) {
        TIERED_DISPATCH_NB(int4tq8s_avx512, w, true)
      } else if (isa >= kAvx2 && nb <= kQ8StreamRows) {
        int4tq8s_avx2<true>(w, a, b0, nb, n0, n1, y, ldy);
      } else if (isa >= kAvx2) {
        int4tq8_avx2<true>(w, a, b0, nb, n0, n1, y, ldy);
      } else {
        int4t_scalar(w, a, b0, nb, n0, n1, y, ldy, true);
      }
    } else if (B >= q8_from) {
      if (isa == kAvx512) {
        TIERED_DISPATCH_NB(int4tq8s_avx512, w)
      } else if (isa == kAvx2 && nb <= kQ8StreamRows) {
        int4tq8s_avx2<false>(w, a, b0, nb, n0, n1, y, ldy);
      } else if (isa == kAvx2) {
        int4tq8_avx2<false>(w, a, b0, nb, n0, n1, y, ldy);
      } else {
        int4t_scalar(w, a, b0, nb, n0, n1, y, ldy, true);
      }
    } else if (isa == kAvx512) {
      TIERED_DISPATCH_NB(int4t_avx512, w)
    } else {
      int4t_scalar(w, a, b0, nb, n0, n1, y, ldy, false);
    }
  }
  // The native step's call of kAmxStepRows+ rows (a batched decode step's sequences, a prompt's rows) on a CPU with
  // AMX runs the AMX GEMM (int4t_amx_gemm) on the rows rounded to bf16 instead of the int8-row kernels (`run`, what
  // other callers get, keeps them): on 2 Sapphire Rapids cores SmolLM2's weights at 48 / 64 / 128 rows took
  // 0.73-0.95x / 0.61-0.84x / 0.45-0.70x their time, and its batched decode of 64 / 128 sequences ran
  // 1262-1298 -> 1413-1431 / 1347-1380 -> 1539-1540 tok/s (2026-12-06). From 24 rows (was 48): its gate/up, down
  // and qkv weights at 16 / 24 / 32 rows took 0.87-1.05x / 0.72-0.99x / 0.56-0.68x the q8 kernels' time (warm), its
  // prompts of 32 / 40 / 47 tokens 15.5 / 18.8 / 21.4 -> 12.6 / 15.3 / 15.3 ms and its batched decode of 24 / 32
  // sequences 1062 -> 1116 / 1125 -> 1294 tok/s (16 within noise either way; 2026-12-06, session 95).
  void run_step(const float* x, int64_t B, float* y) const override {
    if (B < kAmxStepRows || !run_amx(x, B, y)) Gemv::run(x, B, y);
  }
  bool run_amx(const float* x, int64_t B, float* y) const override {
    if (current_isa() != kAvx512 || !amx_step()) return false;
    return run_amx_bf16(rows_bf16(x, B, in_features), B, y, nullptr);
  }
  bool run_amx_bf16(const uint16_t* x, int64_t B, float* yf, uint16_t* yb) const override {
    if (current_isa() != kAvx512 || !amx_step()) return false;
    int4t_amx_gemm(w, x, in_features, B, in_features, out_features, yf, yb, out_features);
    return true;
  }
  std::string name() const override {  // "int16 x": the int16-activation path (int4t_w16_avx2 / _avx512)
    const int isa = current_isa();
    if (w.e2m1) return std::string("mxfp4tq8(tiered,") + isa_name(isa) + ")";
    if (q8_from == 1) return std::string("int4tq8(tiered,") + isa_name(isa) + ")";
    std::string n = std::string("int4t(tiered,") + isa_name(isa);
    if (int16_below_q8()) n += "; int16 x";
    if (q8_from != kNeverQ8) n += (int16_below_q8() ? ", q8 from " : "; q8 from ") + std::to_string(q8_from) + " rows";
    return n + ")";
  }
};

struct Int8Gemv : Gemv {
  at::Tensor q, st;
  std::vector<float> scale, bias;
  Int8W w{};
  // The tiled layout's calls from this many rows read int8 activations (int8t_avx512<NB, true>: one vpdpbusd per
  // 4 weights and row where the int16 ones take two) on AVX-512 and the scalar path; AVX2 keeps int16
  // (vpmaddubsw's int16 pair sums would saturate on the unsigned codes). kNeverQ8: never.
  int64_t q8_from = kNeverQ8;
  bool has_q8() const { return w.tiled && q8_from != kNeverQ8 && current_isa() != kAvx2; }
  bool q8(int64_t B) const { return has_q8() && B >= q8_from; }
  // The native step's call of kAmxStepRows+ rows over a tiled weight (a Q8_0 / Q6_K head's: a batched decode step's
  // sequences) on a CPU with AMX runs the AMX GEMM on the rows rounded to bf16 and the weights as (u - 128) s rounded
  // to bf16 (int8t_vnni_tile) instead of the int8-row kernels; `run` (every other caller: the experts' kernels, the
  // modules) keeps them. SmolLM2's Q8_0 head (49152 x 576) at 24 / 32 / 48 rows took 2.22 / 2.90 / 4.32 -> 2.04 / 2.03 /
  // 2.07 ms, its error to the fp32 product 5.6e-3 -> 2.3e-3; its batched decode of 24 / 48 sequences 1082-1119 ->
  // 1140-1184 / 1254-1336 -> 1385-1431 tok/s, 32 within noise (2 AMX cores, 2026-12-06, alternated processes).
  void run_step(const float* x, int64_t B, float* y) const override {
    if (B < kAmxStepRows || !w.tiled || current_isa() != kAvx512 || !amx_step()) return Gemv::run(x, B, y);
    amx_gemm(w, rows_bf16(x, B, in_features), in_features, B, in_features, out_features, y, nullptr, out_features);
  }
  void rows(const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) const override {
    if (w.tiled) {
      const bool x8 = q8(a.rows_for_format());  // (needs() was asked with the same)
      switch (current_isa()) {
        case kAvx512:
          if (x8) {
            TIERED_DISPATCH_NB(int8t_avx512, w, true)
          } else {
            TIERED_DISPATCH_NB(int8t_avx512, w)
          }
          break;
        case kAvx2: TIERED_DISPATCH_NB(int8t_avx2, w) break;
        default: int8t_scalar(w, a, b0, nb, n0, n1, y, ldy, x8);
      }
      return;
    }
    switch (current_isa()) {
      case kAvx512:
        if (a.xs) {
          TIERED_DISPATCH_NB(int8_w16_avx512, w)
        } else {
          TIERED_DISPATCH_NB(int8_avx512, w)
        }
        break;
      case kAvx2:
        if (a.xs) {
          TIERED_DISPATCH_NB(int8_w16_avx2, w)
        } else {
          TIERED_DISPATCH_NB(rows_avx2, w, Int8Rows)
        }
        break;
      default: rows_scalar<Int8Rows>(w, a, b0, nb, n0, n1, y, ldy);
    }
  }
  // Reads int16 x (per group of 32) on AVX2 and AVX-512 when K % 32 == 0, else fp32 x; the tiled
  // layout (K % 32 == 0) on every path.
  bool w16() const { return (w.tiled || current_isa() >= kAvx2) && in_features % kGroup == 0; }
  ActNeeds needs(int64_t B) const override {
    if (q8(B)) return ActNeeds::only_q8();
    return {false, false, false, w16(), w.tiled};
  }
  int64_t weight_bytes() const override {
    return out_features * (in_features + (w.gs ? in_features / kGroup * 2 : 2));
  }
  std::string name() const override {
    std::string n = std::string(w.gs ? "int8g32t(tiered," : w.tiled ? "int8t(tiered," : "int8(tiered,") + isa_name(current_isa());
    if (w16()) n += "; int16 x";
    if (has_q8()) n += (w16() ? ", q8 from " : "; q8 from ") + std::to_string(q8_from) + " rows";
    return n + ")";
  }
};

// GGUF Q6_K / Q5_K / IQ4_XS weights as stored (see "q6k", "q5k", "iq4xs"; F: Q6KFormat, Q5KFormat, IQ4XSFormat): a
// Q4_K_M file's Q6_K tensors', a Q5_K_M file's Q5_K ones' and an IQ4_XS file's decode copies (quant/kquant.py).
template <class F>
struct KQuantGemv : Gemv {
  at::Tensor qt, scales, supers;  // held: w points into them
  std::vector<float> bias;
  typename F::W w{};
  // calls from this many rows read int8 activations (Int8Gemv::q8_from's rule: AVX-512 and scalar; AVX2 keeps int16)
  int64_t q8_from = kNeverQ8;
  bool q8(int64_t B) const { return q8_from != kNeverQ8 && current_isa() != kAvx2 && B >= q8_from; }
  void rows(const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) const override {
    const bool x8 = q8(a.rows_for_format());  // (needs() was asked with the same)
    switch (current_isa()) {
      case kAvx512:
        if (x8) {
          TIERED_DISPATCH_NB(kquant_avx512, w, F, true)
        } else {
          TIERED_DISPATCH_NB(kquant_avx512, w, F)
        }
        break;
      case kAvx2: TIERED_DISPATCH_NB(kquant_avx2, w, F) break;
      default: F::scalar(w, a, b0, nb, n0, n1, y, ldy, x8);
    }
  }
  ActNeeds needs(int64_t B) const override { return q8(B) ? F::int8_needs() : F::int16_needs(); }
  int64_t weight_bytes() const override { return out_features * in_features / 256 * F::kCopyBytes; }
  std::string name() const override {
    std::string n = std::string(F::kName) + "(tiered," + isa_name(current_isa()) + "; int16 x";
    if (q8_from != kNeverQ8 && current_isa() != kAvx2) n += ", q8 from " + std::to_string(q8_from) + " rows";
    return n + ")";
  }
};

struct Bf16Gemv : Gemv {
  at::Tensor wt;
  std::vector<float> bias;
  Bf16W w{};
  void rows(const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) const override {
    switch (current_isa()) {
      case kAvx512: TIERED_DISPATCH_NB(bf16_avx512, w) break;
      case kAvx2: TIERED_DISPATCH_NB(rows_avx2, w, Bf16Rows) break;
      default: rows_scalar<Bf16Rows>(w, a, b0, nb, n0, n1, y, ldy);
    }
  }
  int64_t weight_bytes() const override { return out_features * in_features * 2; }
  std::string name() const override { return std::string("bf16(tiered,") + isa_name(current_isa()) + ")"; }
};

// fp32 weights: the AVX2 row loop (AVX-512 machines run it too: the loop is bound by the weight
// stream, not the vector width). at::linear (MKL's sgemm) reads fp32 weights at batch 1 at 10-18
// GB/s where this loop reads 19-23 (SmolLM2's shapes and 2048 x 2048 on the 2-core EPYC, AVX2),
// and at 4-16 rows the gap widens to 1.2-4x. From 32 rows on they trade places: a call of more
// than kF32GemvRows rows (a prefill chunk, a wide batch) goes to at::linear's blocked GEMM.
constexpr int64_t kF32GemvRows = 16;

struct F32Gemv : Gemv {
  at::Tensor wt;
  c10::optional<at::Tensor> bias_t;
  std::vector<float> bias;
  F32W w{};
  void rows(const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) const override {
    if (current_isa() == kScalar) {
      rows_scalar<F32Rows>(w, a, b0, nb, n0, n1, y, ldy);
      return;
    }
    TIERED_DISPATCH_NB(rows_avx2, w, F32Rows)
  }
  ActNeeds needs(int64_t) const override { return {false, false, false, false}; }  // reads x as given
  void run(const float* x, int64_t B, float* y) const override {
    if (B <= kF32GemvRows) return Gemv::run(x, B, y);
    auto xin = at::from_blob(const_cast<float*>(x), {B, in_features}, at::TensorOptions().dtype(at::kFloat));
    auto out = at::from_blob(y, {B, out_features}, at::TensorOptions().dtype(at::kFloat));
    at::linear_out(out, xin, wt, bias_t);
  }
  int64_t weight_bytes() const override { return out_features * in_features * 4; }
  std::string name() const override { return std::string("fp32(tiered,") + isa_name(current_isa()) + ")"; }
};

// fp8 E4M3 weights with 128 x 128 block scales, or scales per channel or tensor (see "fp8").
struct Fp8Gemv : Gemv {
  at::Tensor q, bs;  // held so the pointers in w stay valid (none when bound to an expert's slot)
  std::vector<float> bias;
  Fp8W w{};
  void rows(const Act& a, int64_t b0, int64_t nb, int64_t n0, int64_t n1, float* y, int64_t ldy) const override {
    switch (current_isa()) {
      case kAvx512: TIERED_DISPATCH_NB(fp8_avx512, w) break;
      case kAvx2: TIERED_DISPATCH_NB(fp8_avx2, w) break;
      default: fp8_scalar(w, a, b0, nb, n0, n1, y, ldy);
    }
  }
  ActNeeds needs(int64_t) const override { return {false, false, false, false}; }  // reads x as given
  int64_t weight_bytes() const override {
    return out_features * in_features +
           (out_features + w.rb - 1) / w.rb * (w.cs ? (in_features + kFp8Block - 1) / kFp8Block : 1) * 4;
  }
  std::string name() const override { return std::string("fp8(tiered,") + isa_name(current_isa()) + ")"; }
};

// ------------------------------------------------------------------------------------ running
// Several kernels reading one Act, their row blocks spread over one parallel region.
// One kernel's share of a parallel region: output rows y [., ldy] from activation rows [b0, b0 + nb)
// of its Act.
struct Part {
  const Gemv* k;
  float* y;
  int64_t ldy;
  const Act* a = nullptr;  // run_parts sets these from its call's Act
  int64_t b0 = 0, nb = 0;
};

// Every part's row blocks in one parallel region, split between threads in order: each thread
// streams a contiguous run of blocks (one part's rows, then the next part's).
void run_region(const Part* parts, int64_t n_parts) {
  std::vector<int64_t> first(n_parts + 1, 0);
  int64_t bytes = 0;
  for (int64_t i = 0; i < n_parts; ++i) {
    const int64_t R = parts[i].k->block_rows();
    first[i + 1] = first[i] + (parts[i].nb > 0 ? (parts[i].k->out_features + R - 1) / R : 0);
    bytes += parts[i].k->weight_bytes();
  }
  const int64_t total = first[n_parts];
  if (total == 0) return;
  // >= 64 KB of weights per work item: a fork costs a few microseconds
  const int64_t grain = std::max<int64_t>(1, (int64_t(64) << 10) * total / std::max<int64_t>(1, bytes));
  at::parallel_for(0, total, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = 0; i < n_parts; ++i) {
      const int64_t s = std::max(lo, first[i]), e = std::min(hi, first[i + 1]);
      if (s < e) {
        const Part& p = parts[i];
        const int64_t R = p.k->block_rows();
        t_rows_call = p.nb > 1;  // the stream prefetches' second switch (g_stream_prefetch_rows)
        // and their format's (g_stream_prefetch_bytes): a weight of a byte or more a weight
        t_byte_call = p.k->weight_bytes() >= p.k->out_features * p.k->in_features;
        p.k->rows(*p.a, p.b0, p.nb, (s - first[i]) * R, std::min(p.k->out_features, (e - first[i]) * R), p.y, p.ldy);
        t_rows_call = t_byte_call = false;
      }
    }
  });
}

// Several kernels reading one Act (at most 4), in passes of activation rows.
void run_parts(const Part* parts, int n_parts, const Act& a) {
  // activation rows per pass: the pass's bf16 rows stay in L2 (prefill-sized calls re-read weights)
  const int64_t tile = std::max<int64_t>(kMaxNB, ((int64_t(256) << 10) / std::max<int64_t>(1, 2 * a.K)) / kMaxNB * kMaxNB);
  for (int64_t b0 = 0; b0 < a.B; b0 += tile) {
    Part ps[4];
    for (int i = 0; i < n_parts; ++i) ps[i] = parts[i], ps[i].a = &a, ps[i].b0 = b0, ps[i].nb = std::min(tile, a.B - b0);
    run_region(ps, n_parts);
  }
}

// Routed SwiGLU experts of one layer, expert e on rows [r[e], r[e + 1]) of xs [M, D] fp32 (at most
// kMaxNB rows each; none: skipped), k its (gate, up, down) kernels (3 E of them, the same shapes):
// every gate and up projection in one parallel region, then every down projection in a second, so
// a layer pays two forks and joins instead of two per expert. ys [M, D] fp32: each row's expert
// output, the same values as swiglu on that expert's rows. With `glu` (gpt-oss's biased experts,
// gemv.h): xs [M, Db] each row with its 1 and zeros appended, gate / up F wide, down's input [F | 1 |
// zeros] Fb wide, the clamped GLU between them; ys [M, D] with D down's out-features.
// swiglu_group's rows (over all its experts) from which the activations' preparation and the GLU between the
// projections run across the threads
constexpr int64_t kParallelPrepareRows = 16;

// format_rows: the call size every expert's rows take their activation formats from (Act::format_rows; a MoE
// step's tokens, moe_experts); 0: each expert's own rows.
void swiglu_group(const Gemv* const* k, int64_t E, const float* xs, const int64_t* r, float* ys,
                  const Glu* glu = nullptr, int64_t format_rows = 0) {
  thread_local std::vector<ActBuffers> bufs_;
  thread_local std::vector<float> gu_, h_;
  // this thread's buffers by reference: the worker threads below must see these, not their own thread_locals
  std::vector<ActBuffers>& bufs = bufs_;
  std::vector<float>&gu = gu_, &h = h_;
  const int64_t D = k[0]->in_features, F = k[0]->out_features, M = r[E];
  const int64_t Fin = k[2]->in_features, Dout = k[2]->out_features;  // Fb and D with glu, else F and D
  if (int64_t(bufs.size()) < E) bufs.resize(E);
  gu.resize(M * 2 * F);
  if (glu) h.assign(M * Fin, 0.f);  // down's input: [a | 1 | zeros]
  else h.resize(M * Fin);
  std::vector<Act> acts(E);
  std::vector<Part> parts;
  parts.reserve(2 * E);
  // each expert's activations (a prompt's: M rows over up to E experts) prepared in one parallel region, whole
  // experts a thread, where one fork / join an expert (and the GLU between the projections on this thread alone)
  // had left the other threads waiting: a Qwen3-30B-A3B-width Q4_0 prompt of 128 / 512 tokens 0.97x / 0.96x the
  // time on 2 Zen 4 cores (2026-12-02, 7 alternated rounds in one process, the same tokens)
  const bool parallel = M >= kParallelPrepareRows;
  auto prepare_all = [&](const float* x, int64_t width, int proj) {
    auto one = [&](int64_t e) {
      const int64_t n = r[e + 1] - r[e];
      if (n == 0) return;
      const int64_t f = format_rows ? std::max(format_rows, n) : n;
      ActNeeds needs = k[3 * e + proj]->needs(f);
      if (proj == 0) needs = needs | k[3 * e + 1]->needs(f);
      acts[e] = bufs[e].prepare(x + r[e] * width, n, width, needs);
      acts[e].format_rows = f;
    };
    if (!parallel) {
      for (int64_t e = 0; e < E; ++e) one(e);
      return;
    }
    at::parallel_for(0, E, 1, [&](int64_t e0, int64_t e1) {
      for (int64_t e = e0; e < e1; ++e) one(e);
    });
  };
  prepare_all(xs, D, 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = r[e + 1] - r[e];
    if (n == 0) continue;
    float* o = gu.data() + r[e] * 2 * F;
    parts.push_back({k[3 * e], o, 2 * F, &acts[e], 0, n});
    parts.push_back({k[3 * e + 1], o + F, 2 * F, &acts[e], 0, n});
  }
  run_region(parts.data(), int64_t(parts.size()));
  auto glu_rows = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* g = gu.data() + m * 2 * F;
      float* a = h.data() + m * Fin;
      if (!glu) {
        silu_mul(g, g + F, a, F);
        continue;
      }
      clamped_glu(g, g + F, a, F, glu->alpha, glu->limit);
      a[F] = 1.f;  // down's bias column
    }
  };
  if (parallel) at::parallel_for(0, M, 16, glu_rows);
  else glu_rows(0, M);
  prepare_all(h.data(), Fin, 2);
  parts.clear();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = r[e + 1] - r[e];
    if (n == 0) continue;
    parts.push_back({k[3 * e + 2], ys + r[e] * Dout, Dout, &acts[e], 0, n});
  }
  run_region(parts.data(), int64_t(parts.size()));
}

// GGUF Q4_0 / Q4_1 blocks -> the tiled int4 layout (see q4_blocks_tiled's binding). Block: fp16 d,
// (Q4_1: fp16 m,) 16 bytes of codes, element j in byte j's low nibble and element 16 + j in its high
// one; w = d (q - 8) (Q4_0) or d q + m = d (q - 8) + (m + 8 d) (Q4_1). scale = d and zero = m + 8 d
// in fp32, each rounded to bf16, the zero's rounding error kept as the residual (rounded to bf16).
// `out` when given (checked: CPU, contiguous, the shape and dtype asked for; e.g. a view of an
// expert's slot, written in place with no temporary), else a new tensor.
at::Tensor out_or_empty(const c10::optional<at::Tensor>& out, at::IntArrayRef shape, at::ScalarType dtype,
                        const char* what) {
  if (!out) return at::empty(shape, at::TensorOptions().dtype(dtype));
  TIERED_CHECK(out->device().is_cpu() && out->is_contiguous() && out->scalar_type() == dtype && out->sizes() == shape,
              what, ": must be a contiguous CPU ", c10::toString(dtype), " tensor of shape ", shape, ", got ",
              out->scalar_type(), " ", out->sizes());
  return *out;
}

// GGUF blocks for a native repacking pass: `what`'s raw checked (CPU uint8 [N, K/per * block], N % 16
// == 0) and made contiguous, with its N rows, G groups of 32 and K columns.
struct BlockRows {
  at::Tensor raw;
  int64_t N, G, K;
};

// Sub-block j's 6-bit (scale, min) of a Q4_K / Q5_K super-block's 12 scale bytes `sc`: gguf's get_scale_min.
inline std::pair<int, int> kquant_scale_min(const uint8_t* sc, int j) {
  return j < 4 ? std::pair<int, int>{sc[j] & 63, sc[j + 4] & 63}
               : std::pair<int, int>{(sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)};
}

BlockRows checked_blocks(const at::Tensor& raw0, int64_t block, int64_t per, const char* what) {
  TIERED_CHECK(raw0.device().is_cpu() && raw0.scalar_type() == at::kByte && raw0.dim() == 2 && raw0.size(1) % block == 0,
              what, ": raw must be CPU uint8 [N, K/", per, " * ", block, "], got ", raw0.sizes());
  BlockRows b{raw0.contiguous(), raw0.size(0), raw0.size(1) / block * (per / kGroup), 0};
  b.K = b.G * kGroup;
  TIERED_CHECK(b.N % kBlock == 0 && b.G > 0, what, ": needs N % 16 == 0, got N = ", b.N);
  return b;
}

// The tiled int8-g32 outputs of a repacking pass: qt uint8 [N, K] and st fp16 [N/16, K/32, 16], given
// (written in place, checked) or new.
std::pair<at::Tensor, at::Tensor> tiled_int8_outputs(const BlockRows& b, const c10::optional<at::Tensor>& qt_out,
                                                     const c10::optional<at::Tensor>& st_out, const char* what) {
  return {out_or_empty(qt_out, {b.N, b.K}, at::kByte, (std::string(what) + ": qt_out").c_str()),
          out_or_empty(st_out, {b.N / kBlock, b.G, kBlock}, at::kHalf, (std::string(what) + ": st_out").c_str())};
}

// q4_tile_avx512's group of 16 rows stored: its (s, z) bf16 pairs, the zeros' bf16 residuals and its 4 chunks of codes
TIERED_AVX512 inline void q4_store_group(uint8_t* codes, uint16_t* sz, uint16_t* zr, __m512 d, __m512 zero,
                                         const __m512i* packed) {
  const __m512i zb = bf16_lanes(zero);
  _mm512_storeu_si512(sz, _mm512_or_si512(bf16_lanes(d), _mm512_slli_epi32(zb, 16)));
  const __m512 res = _mm512_sub_round_ps(zero, _mm512_castsi512_ps(_mm512_slli_epi32(zb, 16)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(zr), _mm512_cvtepi32_epi16(bf16_lanes(res)));
  for (int c = 0; c < 4; ++c) _mm512_storeu_si512(codes + c * 64, packed[c]);
}

TIERED_AVX512 inline __m512i q4_byte(const __m512i* w, int k) {  // byte k of the words w, in each lane
  return _mm512_and_si512(_mm512_srli_epi32(w[k / 4], 8 * (k % 4)), _mm512_set1_epi32(255));
}

// q4_blocks_tiled's pass over one tile of 16 rows with AVX-512, the 16 rows a vector's lanes (each group's
// scales, zeros and code words gathered from the rows' blocks): the same bytes as the scalar loop below (the
// same fp32 products and sums, each rounded, and the same round-to-nearest-even bf16 conversion of finite
// values). rows: the tile's first row of blocks, `stride` bytes a row; group g's codes at codes + g * cstride
// (bytes), its 16 (s, z) bf16 pairs at sz + g * sstride and residuals at zr + 16 g (uint16). A 768 x 2048 Q4_0
// projection (a Qwen3-30B-A3B expert's) 0.45 -> 0.14 ms on 2 Sapphire Rapids-class cores (its pages mapped).
TIERED_AVX512 void q4_tile_avx512(const uint8_t* rows, int64_t stride, int64_t G, int64_t block, uint8_t* codes,
                                  int64_t cstride, uint16_t* sz, int64_t sstride, uint16_t* zr) {
  const __m512i vidx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(int32_t(stride)));
  const __m512i lo4 = _mm512_set1_epi32(0x0F0F0F0F), hi4 = _mm512_set1_epi32(int32_t(0xF0F0F0F0u));
  const __m512 eight = _mm512_set1_ps(8.f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512i packed[4];
  if (block != 144) {  // Q4_0 / Q4_1: one block a group
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = rows + g * block;
      const __m512i dv = gather_lanes(vidx, b);
      const __m512 d = fp16_lo_lanes(dv);
      __m512 zero = _mm512_setzero_ps();
      if (block == 20) zero = _mm512_add_round_ps(fp16_lo_lanes(_mm512_srli_epi32(dv, 16)),
                                                  _mm512_mul_round_ps(eight, d, kRound), kRound);
      const uint8_t* qs = b + block - 16;
      const __m512i a = gather_lanes(vidx, qs), a4 = gather_lanes(vidx, qs + 4), a8 = gather_lanes(vidx, qs + 8), a12 = gather_lanes(vidx, qs + 12);
      packed[0] = _mm512_or_si512(_mm512_and_si512(a, lo4), _mm512_slli_epi32(_mm512_and_si512(a4, lo4), 4));
      packed[1] = _mm512_or_si512(_mm512_and_si512(a8, lo4), _mm512_slli_epi32(_mm512_and_si512(a12, lo4), 4));
      packed[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a, 4), lo4), _mm512_and_si512(a4, hi4));
      packed[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a8, 4), lo4), _mm512_and_si512(a12, hi4));
      q4_store_group(codes + g * cstride, sz + g * sstride, zr + g * 16, d, zero, packed);
    }
    return;
  }
  const __m512i b63 = _mm512_set1_epi32(63), b15 = _mm512_set1_epi32(15);
  for (int64_t sb = 0; sb < G / 8; ++sb) {  // Q4_K: a super-block's 8 groups (gguf's get_scale_min per lane)
    const uint8_t* b = rows + sb * block;
    const __m512i dv = gather_lanes(vidx, b);
    const __m512 sd = fp16_lo_lanes(dv), sm = fp16_lo_lanes(_mm512_srli_epi32(dv, 16));
    const __m512i w[3] = {gather_lanes(vidx, b + 4), gather_lanes(vidx, b + 8), gather_lanes(vidx, b + 12)};
    for (int j = 0; j < 8; ++j) {
      __m512i s6, m6;
      if (j < 4) {
        s6 = _mm512_and_si512(q4_byte(w, j), b63);
        m6 = _mm512_and_si512(q4_byte(w, j + 4), b63);
      } else {
        s6 = _mm512_or_si512(_mm512_and_si512(q4_byte(w, j + 4), b15), _mm512_slli_epi32(_mm512_srli_epi32(q4_byte(w, j - 4), 6), 4));
        m6 = _mm512_or_si512(_mm512_srli_epi32(q4_byte(w, j + 4), 4), _mm512_slli_epi32(_mm512_srli_epi32(q4_byte(w, j), 6), 4));
      }
      const __m512 scale = _mm512_mul_round_ps(sd, _mm512_cvtepi32_ps(s6), kRound);
      const __m512 dm = _mm512_mul_round_ps(sm, _mm512_cvtepi32_ps(m6), kRound);
      const __m512 zero = _mm512_sub_round_ps(_mm512_mul_round_ps(eight, scale, kRound), dm, kRound);
      const uint8_t* qs = b + 16 + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      for (int c = 0; c < 4; ++c) {
        const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(gather_lanes(vidx, qs + 8 * c), shift), lo4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(gather_lanes(vidx, qs + 8 * c + 4), shift), lo4);
        packed[c] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
      }
      const int64_t g = 8 * sb + j;
      q4_store_group(codes + g * cstride, sz + g * sstride, zr + g * 16, scale, zero, packed);
    }
  }
}

std::vector<at::Tensor> q4_blocks_tiled(const at::Tensor& raw0, int64_t block, const c10::optional<at::Tensor>& codes_out,
                                        const c10::optional<at::Tensor>& sz_out, const c10::optional<at::Tensor>& zr_out,
                                        bool inline_sz, const c10::optional<at::Tensor>& inline_out) {
  TIERED_CHECK(block == 18 || block == 20 || block == 144,
              "q4_blocks_tiled: block must be 18 (Q4_0), 20 (Q4_1) or 144 (Q4_K)");
  const int64_t per = block == 144 ? 256 : kGroup;  // weights per block: Q4_K's super-blocks hold 8 groups
  const BlockRows br = checked_blocks(raw0, block, per, "q4_blocks_tiled");
  const at::Tensor& raw = br.raw;
  const int64_t N = br.N, G = br.G, K = br.K;
  inline_sz = inline_sz || inline_out.has_value();
  TIERED_CHECK(!inline_sz || (!codes_out && !sz_out),
              "q4_blocks_tiled: with the scales inline, codes and scales go to inline_out");
  at::Tensor codes, sz, gw;
  constexpr int64_t GS = 320;  // inline: a group-tile's codes, then its (s, z) pairs
  if (inline_sz) {
    gw = out_or_empty(inline_out, {N / kBlock, G, GS}, at::kByte, "q4_blocks_tiled: inline_out");
  } else {
    codes = out_or_empty(codes_out, {N, K / 2}, at::kByte, "q4_blocks_tiled: codes_out");
    sz = out_or_empty(sz_out, {N / kBlock, G, kBlock, 2}, at::kBFloat16, "q4_blocks_tiled: sz_out");
  }
  at::Tensor zr = out_or_empty(zr_out, {N / kBlock, G, kBlock}, at::kBFloat16, "q4_blocks_tiled: zr_out");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  // group g of tile t: its 256 code bytes, 16 (s, z) pairs and 16 residuals (apart, or inline in gw)
  uint8_t* const base = inline_sz ? gw.data_ptr<uint8_t>() : codes.data_ptr<uint8_t>();
  uint16_t* const szb = inline_sz ? nullptr : reinterpret_cast<uint16_t*>(sz.data_ptr<at::BFloat16>());
  uint16_t* const zrb = reinterpret_cast<uint16_t*>(zr.data_ptr<at::BFloat16>());
  auto group_codes = [&](int64_t t, int64_t g) { return inline_sz ? base + (t * G + g) * GS : base + t * kBlock * (K / 2) + g * 256; };
  auto group_sz = [&](int64_t t, int64_t g) {
    return inline_sz ? reinterpret_cast<uint16_t*>(base + (t * G + g) * GS + 256) : szb + (t * G + g) * 32;
  };
  auto group_zr = [&](int64_t t, int64_t g) { return zrb + (t * G + g) * 16; };
  auto half = [](const uint8_t* p) {  // the fp16 at p (unaligned)
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half_to_float(h);
  };
  auto load_u32 = [](const uint8_t* p) {  // four bytes, little-endian (x86), unaligned
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  };
  if (current_isa() == kAvx512) {
    const int64_t stride = (K / per) * block;
    at::parallel_for(0, N / kBlock, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        q4_tile_avx512(src + t * kBlock * stride, stride, G, block, group_codes(t, 0), inline_sz ? GS : 256,
                       group_sz(t, 0), inline_sz ? GS / 2 : 32, group_zr(t, 0));
    });
    if (inline_sz) return {gw, zr};
    return {codes, sz, zr};
  }
  at::parallel_for(0, N / kBlock, 1, [&](int64_t t0, int64_t t1) {
    uint32_t packed[4];  // a row's group of 32 codes q[e] in 4 bytes per chunk c: q[8c + j] | q[8c + 4 + j] << 4
    float kd[8], kz[8];  // Q4_K: the current super-block's scales and zeros
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < kBlock; ++r) {
        const uint8_t* row = src + (t * kBlock + r) * (K / per) * block;
        for (int64_t g = 0; g < G; ++g) {
          float d, zero;
          if (block == 144) {  // Q4_K: group g is sub-block j of super-block g / 8 (gguf's get_scale_min)
            const uint8_t* b = row + (g / 8) * block;
            const int j = int(g % 8);
            if (j == 0) {  // the super-block's 8 (scale, zero) pairs at once: its d and dmin read once
              const uint8_t* sc = b + 4;
              const float sd = half(b), sm = half(b + 2);
              for (int i = 0; i < 8; ++i) {
                const auto [s6, m6] = kquant_scale_min(sc, i);
                volatile float scale = sd * float(s6);  // each product rounded, as numpy's (no FMA)
                volatile float dm = sm * float(m6);
                volatile float s8 = 8.f * scale;
                kd[i] = scale;
                kz[i] = s8 - dm;  // w = d*sc*q - dmin*m = (q - 8) * scale + zero
              }
            }
            d = kd[j];
            zero = kz[j];
            const uint8_t* qs = b + 16 + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int c = 0; c < 4; ++c) {  // q[e] = (qs[e] >> shift) & 15, four bytes at a time
              const uint32_t lo = (load_u32(qs + 8 * c) >> shift) & 0x0F0F0F0Fu;
              const uint32_t hi = (load_u32(qs + 8 * c + 4) >> shift) & 0x0F0F0F0Fu;
              packed[c] = lo | (hi << 4);
            }
          } else {
            const uint8_t* b = row + g * block;
            d = half(b);
            volatile float e = 8.f * d;  // two roundings, as numpy's m + 8.0 * d (no fused multiply-add)
            zero = block == 20 ? half(b + 2) + e : 0.f;
            const uint8_t* qs = b + block - 16;
            // q[j] = qs[j] & 15, q[16 + j] = qs[j] >> 4 (j < 16), four bytes at a time
            const uint32_t a = load_u32(qs), a4 = load_u32(qs + 4), a8 = load_u32(qs + 8), a12 = load_u32(qs + 12);
            packed[0] = (a & 0x0F0F0F0Fu) | ((a4 & 0x0F0F0F0Fu) << 4);
            packed[1] = (a8 & 0x0F0F0F0Fu) | ((a12 & 0x0F0F0F0Fu) << 4);
            packed[2] = ((a >> 4) & 0x0F0F0F0Fu) | (a4 & 0xF0F0F0F0u);
            packed[3] = ((a8 >> 4) & 0x0F0F0F0Fu) | (a12 & 0xF0F0F0F0u);
          }
          const uint16_t zb = to_bf16(zero);
          uint16_t* szp = group_sz(t, g);
          szp[2 * r] = to_bf16(d);
          szp[2 * r + 1] = zb;
          group_zr(t, g)[r] = to_bf16(zero - bf16f(zb));
          uint8_t* gc = group_codes(t, g);
          // the group's 4 chunks of 8 columns: byte 4r + j of chunk c = q[8c + j] | q[8c + 4 + j] << 4 (packed[c])
          for (int c = 0; c < 4; ++c) std::memcpy(gc + c * 64 + 4 * r, &packed[c], 4);
        }
      }
    }
  });
  if (inline_sz) return {gw, zr};
  return {codes, sz, zr};
}

// GGUF Q8_0 blocks (fp16 d, 32 int8 q: w = d q) -> int8-g32 in the tiled int8 layout: qt uint8
// [N, K] (byte 4r + j of chunk c = q[16 t + r, 4 c + j] + 128) and st fp16 [N/16, K/32, 16] (d as
// stored), one pass per 16-row tile in parallel.
// q8_rows_int8's codes of one row on AVX-512: round half to even of (q d) / s, clamped, 32 a block (the same
// fp32 product, quotient and rounding as the scalar loop)
TIERED_AVX512 void q8_row_int8_avx512(const uint8_t* row, int64_t G, float s, int8_t* out) {
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int64_t g = 0; g < G; ++g) {
    uint16_t h;
    std::memcpy(&h, row + g * 34, 2);
    const __m512 d = _mm512_set1_ps(half_to_float(h));
    for (int half = 0; half < 2; ++half) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 34 + 2 + 16 * half));
      const __m512 w = _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), d,
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m512 v = _mm512_div_round_ps(w, vs, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + g * kGroup + 16 * half), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
  }
}

// GGUF Q8_0 blocks -> per-row int8 (quant/int8.quantize_int8 of the dequantized rows, bit for bit): each row's
// scale = max over its blocks of |d| max |q|, / 127 (at least 1e-12; the products d q are exact in fp32), and
// q' = round half to even of (q d) / scale, clamped to [-127, 127]. One pass a row, the rows across the threads
// (an lm_head's copy: quant/linear.quantize_int8_blocks, which took ~5 torch passes over each 4096-row chunk).
std::vector<at::Tensor> q8_rows_int8(const at::Tensor& raw0) {
  constexpr int64_t block = 34;
  TIERED_CHECK(raw0.device().is_cpu() && raw0.scalar_type() == at::kByte && raw0.dim() == 2 && raw0.size(1) % block == 0,
              "q8_rows_int8: raw must be CPU uint8 [N, K/32 * 34], got ", raw0.sizes());
  const at::Tensor raw = raw0.contiguous();
  const int64_t N = raw.size(0), G = raw.size(1) / block, K = G * kGroup;
  at::Tensor q = at::empty({N, K}, at::TensorOptions().dtype(at::kChar));
  at::Tensor scale = at::empty({N}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* src = raw.data_ptr<uint8_t>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  const bool avx512 = current_isa() == kAvx512;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = src + n * G * block;
      float amax = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        uint16_t h;
        std::memcpy(&h, row + g * block, 2);
        const auto* c = reinterpret_cast<const int8_t*>(row + g * block + 2);
        int m = 0;
        for (int j = 0; j < kGroup; ++j) m = std::max(m, std::abs(int(c[j])));
        amax = std::max(amax, std::fabs(half_to_float(h)) * float(m));
      }
      volatile float sc = amax / 127.f;  // rounded as torch's division, before the clamp
      const float s = std::max(float(sc), 1e-12f);
      sp[n] = s;
      int8_t* out = qp + n * K;
      if (avx512) {
        q8_row_int8_avx512(row, G, s, out);
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        uint16_t h;
        std::memcpy(&h, row + g * block, 2);
        const float d = half_to_float(h);
        const auto* c = reinterpret_cast<const int8_t*>(row + g * block + 2);
        for (int j = 0; j < kGroup; ++j) {
          const float v = std::nearbyint(float(c[j]) * d / s);
          out[g * kGroup + j] = int8_t(std::min(127.f, std::max(-127.f, v)));
        }
      }
    }
  });
  return {q, scale};
}

// q8_blocks_tiled's pass over one tile of 16 rows with AVX-512, the rows a vector's lanes: each group's 16
// fp16 scales and its 8 chunks of 4 codes a row gathered and stored whole (the same bytes as the scalar loop).
// rows: the tile's first row of blocks, G groups a row; qt: the tile's codes; st: its groups' 16 scales each.
TIERED_AVX512 void q8_tile_avx512(const uint8_t* rows, int64_t G, uint8_t* qt, uint16_t* st) {
  constexpr int64_t block = 34;
  const __m512i vidx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(int32_t(G * block)));
  const __m512i flip = _mm512_set1_epi32(int32_t(0x80808080u));  // int8 q + 128
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = rows + g * block;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(st + g * kBlock), _mm512_cvtepi32_epi16(gather_lanes(vidx, b)));
    for (int c = 0; c < 8; ++c)
      _mm512_storeu_si512(qt + (8 * g + c) * 64, _mm512_xor_si512(gather_lanes(vidx, b + 2 + 4 * c), flip));
  }
}

std::vector<at::Tensor> q8_blocks_tiled(const at::Tensor& raw0, const c10::optional<at::Tensor>& qt_out,
                                        const c10::optional<at::Tensor>& st_out) {
  constexpr int64_t block = 34;
  const BlockRows br = checked_blocks(raw0, block, kGroup, "q8_blocks_tiled");
  const int64_t N = br.N, G = br.G, K = br.K;
  auto [qt, st] = tiled_int8_outputs(br, qt_out, st_out, "q8_blocks_tiled");
  const uint8_t* src = br.raw.data_ptr<uint8_t>();
  uint8_t* dst = qt.data_ptr<uint8_t>();
  uint16_t* stp = reinterpret_cast<uint16_t*>(st.data_ptr<at::Half>());
  if (current_isa() == kAvx512) {
    at::parallel_for(0, N / kBlock, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        q8_tile_avx512(src + t * kBlock * G * block, G, dst + t * kBlock * K, stp + t * G * kBlock);
    });
    return {qt, st};
  }
  at::parallel_for(0, N / kBlock, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < kBlock; ++r) {
        const uint8_t* row = src + (t * kBlock + r) * G * block;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* b = row + g * block;
          std::memcpy(stp + (t * G + g) * kBlock + r, b, 2);
          for (int c = 0; c < 8; ++c) {  // the group's 8 chunks of 4 columns
            uint8_t* out = dst + t * kBlock * K + (8 * g + c) * 64 + 4 * r;
            for (int j = 0; j < 4; ++j) out[j] = uint8_t(b[2 + 4 * c + j] ^ 0x80);  // int8 q + 128
          }
        }
      }
  });
  return {qt, st};
}

// GGUF IQ4_NL blocks (fp16 d, qs[16]: 32 4-bit indices into kvalues_iq4nl) or IQ4_XS super-blocks (fp16 d, uint16
// scales_h, scales_l[4], qs[128]: 8 groups of 32, each scale d (ls - 32) with ls = 4 bits of scales_l and 2 of
// scales_h) -> int8-g32 in the tiled int8 layout (as q8_blocks_tiled): q = the index's codebook value, exactly;
// the scale per group d (IQ4_NL's bits as stored) or fp32 d (ls - 32) rounded to fp16 (nearest even): the bytes of
// quant/gguf_experts.unpack_iq4_blocks then kernels/linear.tiled_int8 / tiled_group_scales (~30x their numpy time:
// 1.35 s for a 4096 x 14336 weight there). A group's 16 qs bytes hold its weights 0..15 in their low nibbles, 16..31
// in their high ones (gguf's IQ4_NL / IQ4_XS.dequantize_blocks).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

std::vector<at::Tensor> iq4_blocks_tiled(const at::Tensor& raw0, bool xs, const c10::optional<at::Tensor>& qt_out,
                                         const c10::optional<at::Tensor>& st_out) {
  const int64_t block = xs ? 136 : 18, per = xs ? 256 : kGroup;
  const BlockRows br = checked_blocks(raw0, block, per, "iq4_blocks_tiled");
  const int64_t N = br.N, G = br.G, K = br.K;
  auto [qt, st] = tiled_int8_outputs(br, qt_out, st_out, "iq4_blocks_tiled");
  const uint8_t* src = br.raw.data_ptr<uint8_t>();
  uint8_t* dst = qt.data_ptr<uint8_t>();
  at::Half* stp = st.data_ptr<at::Half>();
  uint8_t lut[16];  // the codebook value + 128: the tiled layout's unsigned byte
  for (int i = 0; i < 16; ++i) lut[i] = uint8_t(kIq4Values[i] + 128);
  at::parallel_for(0, N / kBlock, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t r = 0; r < kBlock; ++r) {
        const uint8_t* row = src + (t * kBlock + r) * (K / per) * block;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* b = row + (g * kGroup / per) * block;  // the group's block (IQ4_XS: its super-block)
          uint16_t d;
          std::memcpy(&d, b, 2);
          const uint8_t* qs = b + 2;
          if (xs) {
            const int i = int(g % 8);
            uint16_t sh;
            std::memcpy(&sh, b + 2, 2);
            const int ls = ((b[4 + i / 2] >> (4 * (i % 2))) & 15) | (((sh >> (2 * i)) & 3) << 4);
            stp[(t * G + g) * kBlock + r] = at::Half(half_to_float(d) * float(ls - 32));
            qs = b + 8 + 16 * i;
          } else {
            std::memcpy(stp + (t * G + g) * kBlock + r, &d, 2);
          }
          for (int c = 0; c < 8; ++c) {  // the group's 8 chunks of 4 columns
            uint8_t* out = dst + t * kBlock * K + (8 * g + c) * 64 + 4 * r;
            for (int j = 0; j < 4; ++j) {
              const int l = 4 * c + j;
              out[j] = lut[l < 16 ? qs[l] & 15 : qs[l - 16] >> 4];
            }
          }
        }
      }
  });
  return {qt, st};
}

// GGUF Q6_K super-blocks (ql[128] low nibbles, qh[64] high 2 bits, int8 scales[16], fp16 d: w = d sc (q -
// 32) per 16 weights) -> int8-g32 in the tiled int8 layout (as q8_blocks_tiled): each group of 32 weights
// dequantized with gguf's arithmetic (fp32 d * sc, then * (q - 32)) and re-quantized symmetric, s = max |w|
// / 127 (at least 1e-12) rounded to fp16, q = round-half-even(w / s) in [-127, 127]: quant/gguf_dequant.
// dequantize_blocks then quant/int8.quantize_int8_g32 and the tiled layout, bit for bit.
//
// Tiles [t0, t1). Group g of a super-block holds its elements 32 (g % 8) .. + 31: one half h of the
// block (128 elements), the low or high nibble of 32 consecutive ql bytes, one 2-bit field of 32
// consecutive qh bytes, and two scales (16 weights each). Written so that the compiler vectorizes the
// 32-wide loops (one multiply each: no contraction to change a rounding); compiled for AVX2 where
// present (AVX-512 too), whose vroundps rounds half to even as nearbyint does (the baseline calls libm
// per element).
inline __attribute__((always_inline)) void q6k_tiles(const uint8_t* src, uint8_t* dst, at::Half* stp, int64_t t0,
                                                     int64_t t1, int64_t G, int64_t K) {
  constexpr int64_t block = 210;
  float w[kGroup];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < kBlock; ++r) {
      const uint8_t* row = src + (t * kBlock + r) * (K / 256) * block;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = row + (g / 8) * block;
        const int base = int(g % 8) * kGroup, h = base / 128, r0 = base % 128;
        const uint8_t* lq = b + h * 64 + r0 % 64;          // ql bytes of elements base .. base + 31
        const uint8_t* hq = b + 128 + h * 32;              // qh bytes of the same elements
        const int ls = 4 * (r0 / 64), hs = 2 * (r0 / 32);  // their bit offsets
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + base / 16;
        uint16_t dh;
        std::memcpy(&dh, b + 208, 2);
        const float d = half_to_float(dh);
        const float d0 = d * float(sc[0]), d1 = d * float(sc[1]);  // gguf: (d * scales) first, then * q
        for (int e = 0; e < kGroup; ++e) {
          const int q = (((lq[e] >> ls) & 0x0F) | (((hq[e] >> hs) & 0x03) << 4)) - 32;
          w[e] = (e < 16 ? d0 : d1) * float(q);
        }
        float amax = 0.f;
        for (int e = 0; e < kGroup; ++e) amax = std::max(amax, std::fabs(w[e]));
        const at::Half sh(std::max(amax / 127.f, 1e-12f));
        stp[(t * G + g) * kBlock + r] = sh;
        const float s = float(sh);
        uint8_t q8[kGroup];
        for (int e = 0; e < kGroup; ++e)
          q8[e] = uint8_t(int(std::min(127.f, std::max(-127.f, std::nearbyint(w[e] / s)))) + 128);
        for (int c = 0; c < 8; ++c)  // the group's 8 chunks of 4 columns
          std::memcpy(dst + t * kBlock * K + (8 * g + c) * 64 + 4 * r, q8 + 4 * c, 4);
      }
    }
}

TIERED_AVX512 void q6k_tiles_avx512(const uint8_t* src, uint8_t* dst, at::Half* stp, int64_t t0, int64_t t1, int64_t G,
                                    int64_t K) {
  q6k_tiles(src, dst, stp, t0, t1, G, K);
}

TIERED_AVX2 void q6k_tiles_avx2(const uint8_t* src, uint8_t* dst, at::Half* stp, int64_t t0, int64_t t1, int64_t G,
                                int64_t K) {
  q6k_tiles(src, dst, stp, t0, t1, G, K);
}

void q6k_tiles_base(const uint8_t* src, uint8_t* dst, at::Half* stp, int64_t t0, int64_t t1, int64_t G, int64_t K) {
  q6k_tiles(src, dst, stp, t0, t1, G, K);
}

std::vector<at::Tensor> q6k_blocks_tiled(const at::Tensor& raw0, const c10::optional<at::Tensor>& qt_out,
                                         const c10::optional<at::Tensor>& st_out) {
  const BlockRows br = checked_blocks(raw0, 210, 256, "q6k_blocks_tiled");
  const int64_t N = br.N, G = br.G, K = br.K;
  auto [qt, st] = tiled_int8_outputs(br, qt_out, st_out, "q6k_blocks_tiled");
  const uint8_t* src = br.raw.data_ptr<uint8_t>();
  uint8_t* dst = qt.data_ptr<uint8_t>();
  at::Half* stp = st.data_ptr<at::Half>();
  const int isa = current_isa();
  const auto tiles = isa == kAvx512 ? q6k_tiles_avx512 : isa == kAvx2 ? q6k_tiles_avx2 : q6k_tiles_base;
  at::parallel_for(0, N / kBlock, 1, [&](int64_t t0, int64_t t1) { tiles(src, dst, stp, t0, t1, G, K); });
  return {qt, st};
}

// GGUF Q4_K super-blocks uint8 [N, K / 256 * 144] (fp16 d, dmin; 12 bytes of 6-bit sub-block scales and mins; qs[128],
// sub-blocks 2c and 2c + 1 in the low and high nibbles of qs[32c .. 32c + 31]) -> fp32 [N, K]: gguf's values bit for bit
// (its get_scale_min, then (d sc) q - (dmin m), the products first). A Q4_K_M file's Q4_K ffn_down layer re-quantizes
// from it into the expert format's q6k (quant/gguf_experts.dequantized): torch's dequantization took ~4-5 ms a
// Qwen3-30B-A3B-width projection on 2 Zen 4 cores.
at::Tensor q4k_dequantize_rows(const at::Tensor& raw0) {
  const BlockRows br = checked_blocks(raw0, 144, 256, "q4k_dequantize_rows");
  const int64_t N = br.N, K = br.K, SB = K / 256;
  auto out = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* src = br.raw.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, N * SB, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* blk = src + b * 144;
      const uint8_t* sc = blk + 4;
      uint16_t hd, hm;
      std::memcpy(&hd, blk, 2), std::memcpy(&hm, blk + 2, 2);
      const float d = half_to_float(hd), dmin = half_to_float(hm);
      float* y = dst + b * 256;
      for (int j = 0; j < 8; ++j) {
        const auto [s, m] = kquant_scale_min(sc, j);
        const float ds = d * float(s), dm = dmin * float(m);
        const uint8_t* q = blk + 16 + 32 * (j / 2);
        for (int l = 0; l < 32; ++l) {
          volatile float p = ds * float(j % 2 ? q[l] >> 4 : q[l] & 15);  // (no fused multiply-add: gguf's rounding)
          y[32 * j + l] = p - dm;
        }
      }
    }
  });
  return out;
}

// fp32 rows w [N, K % 256 == 0] -> GGUF Q6_K super-blocks uint8 [N, K / 256 * 210] by quant/gguf_encode.quantize_q6_k's
// absmax fit, bit for bit (its fp32 arithmetic; rounding half to even, as numpy's and torch's): per 16 weights scale =
// max|w| / 31, d = fp16(max scale / 127), sc = round(scale / d) in [-128, 127], u = round(w / (d sc)) in [-32, 31] +
// 32 (32 where d sc is 0). What a layer stored otherwise than the expert format's q6k re-quantizes through (a Q4_K_M
// file's Q4_K ffn_down layers): ~3.5 ms a Qwen3-30B-A3B-width projection on 2 Zen 4 cores, where torch took ~6.
at::Tensor q6k_fit_rows(const at::Tensor& w0) {
  TIERED_CHECK(w0.dim() == 2 && w0.size(1) % 256 == 0 && w0.device().is_cpu(),
              "q6k_fit_rows: w must be a CPU tensor [N, K], K a multiple of 256, got ", w0.sizes());
  const auto w = w0.to(at::kFloat).contiguous();
  const int64_t N = w.size(0), SB = w.size(1) / 256;
  auto out = at::empty({N, SB * 210}, w.options().dtype(at::kByte));
  const float* src = w.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N * SB, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* x = src + b * 256;
      uint8_t* o = dst + b * 210;
      float scale[16], top = 0.f;
      for (int s = 0; s < 16; ++s) {
        float m = 0.f;
        for (int j = 0; j < 16; ++j) m = std::max(m, std::fabs(x[16 * s + j]));
        scale[s] = m / 31.f;
        top = std::max(top, scale[s]);
      }
      const c10::Half dh(top / 127.f);
      const float df = float(dh);
      uint8_t q[256];
      for (int s = 0; s < 16; ++s) {
        const float sc = df > 0.f ? std::min(127.f, std::max(-128.f, std::nearbyint(scale[s] / df))) : 0.f;
        o[192 + s] = uint8_t(int8_t(sc));
        const float step = df * sc;
        for (int j = 0; j < 16; ++j) {
          const float u = step != 0.f ? std::min(31.f, std::max(-32.f, std::nearbyint(x[16 * s + j] / step))) : 0.f;
          q[16 * s + j] = uint8_t(int(u) + 32);
        }
      }
      for (int h = 0; h < 2; ++h) {
        const uint8_t* qh = q + 128 * h;
        for (int j = 0; j < 64; ++j) o[64 * h + j] = uint8_t((qh[j] & 15) | ((qh[j + 64] & 15) << 4));
        for (int j = 0; j < 32; ++j)
          o[128 + 32 * h + j] = uint8_t((qh[j] >> 4) | ((qh[j + 32] >> 4) << 2) | ((qh[j + 64] >> 4) << 4) |
                                        ((qh[j + 96] >> 4) << 6));
      }
      std::memcpy(o + 208, &dh.x, 2);
    }
  });
  return out;
}

// GGUF Q6_K super-blocks (ql[128] low nibbles, qh[64] high 2 bits, int8 scales[16], fp16 d) -> the q6k layout (see
// "q6k"): qt uint8 [N/16, K/32, 384], sc int8 [N/16, K/16, 16], d fp16 [N/16, K/256, 16], the same codes and scales
// bit for bit. Tiles [t0, t1); element e of a super-block: half h = e / 128, w = e % 128, its low nibble in ql byte
// 64 h + w % 64 (bits 4 (w / 64)..), its high bits in qh byte 128 + 32 h + w % 32 (bits 2 (w / 32)..), its scale
// scales[e / 16]. A group gg of the super-block (its 32 elements l = 0..31: h = gg / 4, w = 32 (gg % 4) + l) has its
// nibbles in 32 consecutive ql bytes and its high bits in 32 consecutive qh bytes, so both vectors' 4-byte words
// (row r's columns 4c .. 4c + 3) come from 32-bit loads, shifts and masks (kquant_nibble_words; 4 weights an op
// where a byte-by-byte pass took ~12 cycles a weight: 87-109 ms for a 4096 x 14336 weight on the 2-core Zen 4 VM).
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// A group's four nibble words of row r (grp + 64 i + 4r, see "q6k": chunk 2i's nibbles low, chunk 2i + 1's high) from
// its 32 consecutive code bytes `lo` whose nibble sits at bit `shift`.
inline void kquant_nibble_words(const uint8_t* lo, int shift, uint8_t* grp_r) {
  constexpr uint32_t m4 = 0x0F0F0F0Fu;
  for (int i = 0; i < 4; ++i)
    store_u32(grp_r + 64 * i, ((load_u32(lo + 8 * i) >> shift) & m4) | (((load_u32(lo + 8 * i + 4) >> shift) & m4) << 4));
}

void q6k_pack_tiles(const uint8_t* src, uint8_t* qt, int8_t* sc, uint16_t* d, int64_t t0, int64_t t1, int64_t K) {
  constexpr int64_t block = 210;
  const int64_t G = K / kGroup, S = K / 16, SB = K / 256;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < kBlock; ++r) {
      const uint8_t* row = src + (t * kBlock + r) * SB * block;
      for (int64_t sb = 0; sb < SB; ++sb) {
        const uint8_t* b = row + sb * block;
        std::memcpy(d + (t * SB + sb) * kBlock + r, b + 208, 2);
        for (int64_t s = 0; s < 16; ++s) sc[(t * S + sb * 16 + s) * kBlock + r] = int8_t(b[192 + s]);
        for (int gg = 0; gg < 8; ++gg) {  // the super-block's groups: 4 nibble words and 2 high words of row r
          const int h = gg / 4, q = gg % 4;
          uint8_t* grp = qt + (t * G + sb * 8 + gg) * kQ6Group + 4 * r;
          kquant_nibble_words(b + 64 * h + 32 * (q % 2), 4 * (q / 2), grp);
          const uint8_t* hb = b + 128 + 32 * h;  // the group's 32 high-bit bytes, its bits at 2q
          for (int hv = 0; hv < 2; ++hv) {  // chunk 4 hv + m's two bits at bits 2m of high word hv
            uint32_t x = 0;
            for (int m = 0; m < 4; ++m) x |= ((load_u32(hb + 16 * hv + 4 * m) >> (2 * q)) & 0x03030303u) << (2 * m);
            store_u32(grp + 256 + 64 * hv, x);
          }
        }
      }
    }
}


// GGUF Q5_K super-blocks (fp16 d, fp16 dmin, scales[12]: 6-bit sc and m of 8 sub-blocks as Q4_K's, qh[32]: the codes'
// fifth bits, qs[128]: their low nibbles) -> the q5k layout (see "q5k"): qt uint8 [N/16, K/32, 320], sm uint8 [N/16,
// K/32, 2, 16], dd fp16 [N/16, K/256, 2, 16], the same codes and scales bit for bit. Element e of a super-block: sub-
// block s = e / 32, l = e % 32, its low nibble in qs byte 32 (s / 2) + l (bits 4 (s % 2)..), its fifth bit bit s of qh
// byte l (gguf's Q5_K.dequantize_blocks): a group (= sub-block) has its nibbles in 32 consecutive qs bytes and its fifth
// bits in all 32 qh bytes, so its words come from 32-bit loads, shifts and masks as q6k_pack_tiles' do.
void q5k_pack_tiles(const uint8_t* src, uint8_t* qt, uint8_t* sm, uint16_t* dd, int64_t t0, int64_t t1, int64_t K) {
  constexpr int64_t block = 176;
  const int64_t G = K / kGroup, SB = K / 256;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < kBlock; ++r) {
      const uint8_t* row = src + (t * kBlock + r) * SB * block;
      for (int64_t sb = 0; sb < SB; ++sb) {
        const uint8_t* b = row + sb * block;
        std::memcpy(dd + ((t * SB + sb) * 2) * kBlock + r, b, 2);
        std::memcpy(dd + ((t * SB + sb) * 2 + 1) * kBlock + r, b + 2, 2);
        const uint8_t* sc = b + 4;
        for (int i = 0; i < 8; ++i) {
          const auto [s6, m6] = kquant_scale_min(sc, i);
          sm[((t * G + sb * 8 + i) * 2) * kBlock + r] = uint8_t(s6);
          sm[((t * G + sb * 8 + i) * 2 + 1) * kBlock + r] = uint8_t(m6);
        }
        for (int gg = 0; gg < 8; ++gg) {  // the super-block's groups: 4 nibble words and the high word of row r
          uint8_t* grp = qt + (t * G + sb * 8 + gg) * kQ5Group + 4 * r;
          kquant_nibble_words(b + 48 + 32 * (gg / 2), 4 * (gg % 2), grp);
          uint32_t x = 0;  // chunk c's fifth bits at bit c
          for (int c = 0; c < 8; ++c) x |= ((load_u32(b + 16 + 4 * c) >> gg) & 0x01010101u) << c;
          store_u32(grp + 256, x);
        }
      }
    }
}


// GGUF IQ4_XS super-blocks (fp16 d, uint16 scales_h, scales_l[4], qs[128]) -> the iq4xs layout (see "iq4xs"): qt uint8
// [N/16, K/32, 256], sc int8 [N/16, K/32, 16] (ls - 32), d fp16 [N/16, K/256, 16], the same indices and scales bit for
// bit. Group gg of a super-block: ls = 4 bits of scales_l[gg / 2] (at 4 (gg % 2)) and 2 of scales_h (at 2 gg), its
// 16 qs bytes at 8 + 16 gg holding its weights 0..15 in their low nibbles and 16..31 in their high ones (gguf's
// IQ4_XS.dequantize_blocks): nibble vector i (chunks 2i, 2i + 1: columns 8i .. 8i + 7) from 32-bit words of those
// bytes, as q6k_pack_tiles' (kquant_nibble_words' form).
void iq4xs_pack_tiles(const uint8_t* src, uint8_t* qt, int8_t* sc, uint16_t* d, int64_t t0, int64_t t1, int64_t K) {
  constexpr int64_t block = 136;
  constexpr uint32_t m4 = 0x0F0F0F0Fu;
  const int64_t G = K / kGroup, SB = K / 256;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < kBlock; ++r) {
      const uint8_t* row = src + (t * kBlock + r) * SB * block;
      for (int64_t sb = 0; sb < SB; ++sb) {
        const uint8_t* b = row + sb * block;
        std::memcpy(d + (t * SB + sb) * kBlock + r, b, 2);
        uint16_t sh;
        std::memcpy(&sh, b + 2, 2);
        for (int gg = 0; gg < 8; ++gg) {
          const int ls = ((b[4 + gg / 2] >> (4 * (gg % 2))) & 15) | (((sh >> (2 * gg)) & 3) << 4);
          sc[(t * G + sb * 8 + gg) * kBlock + r] = int8_t(ls - 32);
          const uint8_t* qs = b + 8 + 16 * gg;
          uint8_t* grp = qt + (t * G + sb * 8 + gg) * kIq4Group + 4 * r;
          for (int i = 0; i < 4; ++i) {  // columns 8i .. 8i + 7: qs bytes 8 (i % 2) .., their nibble 4 (i / 2)
            const uint8_t* lo = qs + 8 * (i % 2);
            const int shift = 4 * (i / 2);
            store_u32(grp + 64 * i, ((load_u32(lo) >> shift) & m4) | (((load_u32(lo + 4) >> shift) & m4) << 4));
          }
        }
      }
    }
}


// dtype names as torch prints them, for the layouts' errors
inline const char* torch_dtype_name(at::ScalarType t) {
  return t == at::kByte ? "uint8" : t == at::kChar ? "int8" : t == at::kHalf ? "float16" : c10::toString(t);
}

// A format's GGUF blocks uint8 [N, K/256 * F::kFileBytes] (N % 16 == 0) -> its layout's three tensors (F::parts), the
// same codes and scales bit for bit, in one pass over the tiles (F::pack); written into qt_out / scales_out /
// supers_out where given (checked: a fused group's parts write their own tiles of one weight, and huge-page memory is
// written once, KQuantLinear.from_blocks), else new.
template <class F>
std::vector<at::Tensor> kquant_blocks(const at::Tensor& raw0, const c10::optional<at::Tensor>& qt_out,
                                      const c10::optional<at::Tensor>& scales_out,
                                      const c10::optional<at::Tensor>& supers_out) {
  const BlockRows br = checked_blocks(raw0, F::kFileBytes, 256, F::kPack);
  const int64_t N = br.N, K = br.K;
  const auto parts = F::parts(N / kBlock, K);
  const c10::optional<at::Tensor>* outs[3] = {&qt_out, &scales_out, &supers_out};
  const char* names[3] = {"qt_out", "scales_out", "supers_out"};
  std::vector<at::Tensor> o;
  for (int i = 0; i < 3; ++i)
    o.push_back(out_or_empty(*outs[i], parts[i].shape, parts[i].dtype, (std::string(F::kPack) + ": " + names[i]).c_str()));
  const uint8_t* src = br.raw.data_ptr<uint8_t>();
  at::parallel_for(0, N / kBlock, 1, [&](int64_t t0, int64_t t1) { F::pack(src, o, t0, t1, K); });
  return o;
}

// A format's layout (qt, scales, supers) checked for the weight qt's shape says (F::parts); `what` names the caller in
// errors.
template <class F>
void check_layout(const at::Tensor& qt, const at::Tensor& scales, const at::Tensor& supers, const char* what) {
  TIERED_CHECK(qt.device().is_cpu() && qt.scalar_type() == at::kByte && qt.dim() == 3 && qt.size(2) == F::kBytes &&
                  qt.is_contiguous(),
              what, ": qt must be a contiguous CPU uint8 [N/16, K/32, ", F::kBytes, "], got ", qt.scalar_type(), " ",
              qt.sizes());
  const int64_t T = qt.size(0), K = qt.size(1) * kGroup;
  TIERED_CHECK(K % 256 == 0 && K > 0, what, ": K must be a positive multiple of 256 (", F::kFile,
               "'s super-blocks), got ", K);
  const auto parts = F::parts(T, K);
  const at::Tensor* ts[2] = {&scales, &supers};
  for (int i = 0; i < 2; ++i) {
    const at::Tensor& t = *ts[i];
    const KQuantPart& p = parts[i + 1];
    TIERED_CHECK(t.device().is_cpu() && t.scalar_type() == p.dtype && t.is_contiguous() &&
                    t.sizes() == at::IntArrayRef(p.shape),
                what, ": ", p.name, " must be a contiguous CPU ", torch_dtype_name(p.dtype), " ", at::IntArrayRef(p.shape),
                ", got ", t.scalar_type(), " ", t.sizes());
  }
}

// A k-quant weight's tiles [t0, t1) dequantized to rows of `out` [N, K] in fp32 or rounded to bf16 (nearest even), each
// group's 32 weights by the format's arithmetic in fp32, gguf's order (F::values): the prefill path of a weight held
// only so where AVX-512's bf16 rows (kquant_bf16_avx512) do not run, and their reference.
template <class F, typename T>
void kquant_dequantize_tiles(const typename F::W& w, T* out, int64_t t0, int64_t t1, int64_t K) {
  const int64_t G = K / kGroup;
  float v[kGroup];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t r = 0; r < kBlock; ++r) {
      const int64_t n = t * kBlock + r;
      T* o = out + n * K;
      for (int64_t g = 0; g < G; ++g) {
        F::values(w, w.q + (t * G + g) * F::kBytes, n, r, g, K, v);
        for (int64_t k = 0; k < kGroup; ++k) {
          if constexpr (std::is_same_v<T, float>) o[g * kGroup + k] = v[k];
          else o[g * kGroup + k] = to_bf16(v[k]);
        }
      }
    }
}

// A k-quant weight (the format's tensors, checked) dequantized to [N, K] in fp32 or bf16 (see kquant_dequantize_tiles;
// AVX-512's bf16 rows: kquant_bf16_avx512, the same values); `out` when given, else a new tensor.
template <class F>
at::Tensor kquant_tiled_dequantize(const at::Tensor& qt, const at::Tensor& scales, const at::Tensor& supers, bool bf16,
                                   const c10::optional<at::Tensor>& out_) {
  const std::string what = std::string(F::kName) + "_tiled_dequantize";
  check_layout<F>(qt, scales, supers, what.c_str());
  const int64_t N = qt.size(0) * kBlock, K = qt.size(1) * kGroup;
  at::Tensor out = out_or_empty(out_, {N, K}, bf16 ? at::kBFloat16 : at::kFloat, (what + ": out").c_str());
  const typename F::W w = F::weights(qt, scales, supers, nullptr);
  const bool avx512 = bf16 && current_isa() == kAvx512;
  at::parallel_for(0, N / kBlock, 1, [&](int64_t t0, int64_t t1) {
    if (avx512) kquant_bf16_avx512<F>(w, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), t0, t1, K);
    else if (bf16) kquant_dequantize_tiles<F>(w, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), t0, t1, K);
    else kquant_dequantize_tiles<F>(w, out.data_ptr<float>(), t0, t1, K);
  });
  return out;
}

// A tiled int8-g32 weight (qt uint8 [N, K]: byte 4r + j of chunk c of tile t = q[16 t + r, 4 c + j] + 128;
// st fp16 [N/16, K/32, 16]) dequantized to bf16 [N, K]: w = (qt - 128) * s in fp32, rounded to nearest
// even. The prefill path of a weight held only so (quant/int8.Int8G32Linear.dense): the same w as
// quant/experts.dequantize_projection, rounded to bf16 for oneDNN's bf16 GEMM.
inline __attribute__((always_inline)) void int8g32_bf16_tiles(const uint8_t* qt, const at::Half* st, uint16_t* out,
                                                               int64_t t0, int64_t t1, int64_t K) {
  const int64_t G = K / kGroup;
  float sc[64];        // a chunk's 64 bytes are 16 rows x 4 columns: each row's scale 4 times
  uint16_t w[64];
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = qt + t * kBlock * K;
    uint16_t* rows = out + t * kBlock * K;
    for (int64_t g = 0; g < G; ++g) {
      for (int i = 0; i < 64; ++i) sc[i] = float(st[(t * G + g) * kBlock + i / 4]);
      for (int64_t c = 8 * g; c < 8 * g + 8; ++c) {  // the group's 8 chunks of 4 columns
        const uint8_t* p = tile + c * 64;
        for (int i = 0; i < 64; ++i) w[i] = to_bf16(float(int(p[i]) - 128) * sc[i]);
        for (int r = 0; r < kBlock; ++r) std::memcpy(rows + r * K + 4 * c, w + 4 * r, 8);
      }
    }
  }
}

TIERED_AVX512 void int8g32_bf16_avx512(const uint8_t* qt, const at::Half* st, uint16_t* out, int64_t t0, int64_t t1,
                                       int64_t K) {
  int8g32_bf16_tiles(qt, st, out, t0, t1, K);
}

void int8g32_bf16_base(const uint8_t* qt, const at::Half* st, uint16_t* out, int64_t t0, int64_t t1, int64_t K) {
  int8g32_bf16_tiles(qt, st, out, t0, t1, K);
}

at::Tensor int8g32_tiled_dequantize_bf16(const at::Tensor& qt, const at::Tensor& st, const c10::optional<at::Tensor>& out_) {
  TIERED_CHECK(qt.device().is_cpu() && qt.scalar_type() == at::kByte && qt.dim() == 2 && qt.is_contiguous(),
              "int8g32_tiled_dequantize: qt must be a contiguous CPU uint8 [N, K], got ", qt.sizes());
  const int64_t N = qt.size(0), K = qt.size(1);
  TIERED_CHECK(N % kBlock == 0 && K % kGroup == 0, "int8g32_tiled_dequantize: needs N % 16 == 0 and K % 32 == 0, got ",
              qt.sizes());
  TIERED_CHECK(st.device().is_cpu() && st.scalar_type() == at::kHalf && st.is_contiguous() &&
                  st.sizes() == at::IntArrayRef({N / kBlock, K / kGroup, kBlock}),
              "int8g32_tiled_dequantize: st must be a contiguous CPU Half [", N / kBlock, ", ", K / kGroup, ", 16], got ",
              st.sizes());
  at::Tensor out = out_or_empty(out_, {N, K}, at::kBFloat16, "int8g32_tiled_dequantize: out");
  const uint8_t* q = qt.data_ptr<uint8_t>();
  const at::Half* s = st.data_ptr<at::Half>();
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto fn = current_isa() == kAvx512 ? int8g32_bf16_avx512 : int8g32_bf16_base;
  at::parallel_for(0, N / kBlock, 1, [&](int64_t t0, int64_t t1) { fn(q, s, o, t0, t1, K); });
  return out;
}

// The hidden size D of experts with gate kernel `gate` and down kernel `down` (down's out-features),
// checked against `glu`: gpt-oss's biased experts (gate's input Db > D: the bias column, zeros) need it,
// SiLU's (gate's input D) refuse it.
int64_t expert_width(const Gemv* gate, const Gemv* down, const Glu* glu, const char* what) {
  const int64_t D = down->out_features;
  TIERED_CHECK(glu ? gate->in_features > D : gate->in_features == D, what, glu ?
              ": the clamped GLU is for gpt-oss's biased experts (gate [F, Db], down [D, Fb], Db > D)" :
              ": biased experts (gate [F, Db], down [D, Fb]) need swiglu_limit");
  return D;
}

// swiglu_group's checks and call from Python: xs [M, D] any float dtype, D the experts' hidden size
// (their down projection's out-features), bounds [E + 1] (expert e's rows bounds[e]..bounds[e + 1], any
// number: each work item passes over them kMaxNB at a time, its block of the weights read once for all
// of them) -> ys [M, D] fp32. With `glu` (gpt-oss's biased experts) each row gets its bias column's 1 and
// zeros appended here (the gate's input width Db), and the clamped GLU runs between the projections.
// `format_rows`: swiglu_group's (0: each expert's own rows).
at::Tensor run_swiglu_group(const std::vector<const Gemv*>& k, const at::Tensor& xs0, const std::vector<int64_t>& bounds,
                            const char* what, const Glu* glu = nullptr, int64_t format_rows = 0) {
  const int64_t E = int64_t(k.size()) / 3;
  TIERED_CHECK(E >= 1 && int64_t(bounds.size()) == E + 1 && bounds[0] == 0, what, ": bounds must be [E + 1] from 0");
  for (int64_t e = 0; e < E; ++e)
    TIERED_CHECK(bounds[e + 1] >= bounds[e], what, ": bounds must not decrease (expert ", e, ")");
  const int64_t Din = k[0]->in_features, D = expert_width(k[0], k[2], glu, what), M = bounds[E];
  TIERED_CHECK(xs0.dim() == 2 && xs0.size(0) == M && xs0.size(1) == D, what, ": xs must be [", M, ", ", D, "], got ",
              xs0.sizes());
  at::Tensor xs;
  if (glu) {  // [x | 1 | zeros]: each projection's bias is its input column D
    xs = at::zeros({M, Din}, at::TensorOptions().dtype(at::kFloat));
    xs.narrow(1, 0, D).copy_(xs0);
    xs.select(1, D).fill_(1.f);
  } else {
    xs = xs0.to(at::kFloat).contiguous();
  }
  auto ys = at::empty({M, D}, xs.options());
  {
    pybind11::gil_scoped_release nogil;
    swiglu_group(k.data(), E, xs.data_ptr<float>(), bounds.data(), ys.data_ptr<float>(), glu, format_rows);
  }
  return ys;
}

// The clamped GLU of gpt-oss's experts from Python's (swiglu_limit, swiglu_alpha): none where the limit is 0
// (SiLU's SwiGLU), else checked finite and positive.
c10::optional<Glu> glu_of(double limit, double alpha, const char* what) {
  if (limit == 0) return c10::nullopt;
  TIERED_CHECK(std::isfinite(limit) && limit > 0 && std::isfinite(alpha), what, ": bad swiglu_limit / swiglu_alpha ",
              limit, " / ", alpha);
  return Glu{float(limit), float(alpha)};
}

}  // namespace

bool bf16_runs_attention(const std::vector<Bf16AttnRun>& runs, int64_t ldq, int64_t ldo, int64_t head_ld, int64_t H,
                         int64_t Hkv, int64_t hd, float scale) {
  const AttnPath path = bf16_attention_path();
  if (path == AttnPath::kNone || hd % 32 != 0 || hd > 256 || Hkv <= 0 || H % Hkv != 0 || runs.empty()) return false;
  const int64_t R = int64_t(runs.size());
  std::vector<int64_t> at(R + 1, 0), first(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t keys = runs[r].p0 + runs[r].n - attn_first_key(runs[r].p0, runs[r].window);
    at[r + 1] = at[r] + Hkv * attn_padded_keys(keys) * hd;  // kp, vp: keys * hd / 2 dwords each
    first[r + 1] = first[r] + H * attn_query_blocks(runs[r].n);
  }
  std::vector<uint32_t> packed;
  uint32_t* const pk = aligned64(packed, at[R]);
  const RunsJob job{runs, at, first, pk, ldq, ldo, H, Hkv, hd, scale};
  at::parallel_for(0, R * Hkv, 1, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t r = a / Hkv, g = a % Hkv, kvd = job.kvd(r);
      const Bf16AttnRun& u = runs[r];
      const int64_t k0 = attn_first_key(u.p0, u.window);
      uint32_t* kp = pk + at[r] + g * 2 * kvd;
      attn_pack_kv(u.k + g * head_ld + k0 * hd, u.v + g * head_ld + k0 * hd, hd, u.p0 + u.n - k0, kvd * 2 / hd, hd,
                   kp, kp + kvd);
    }
  });
  at::parallel_for(0, first[R], 1, [&](int64_t w0, int64_t w1) {
    if (path == AttnPath::kAmx) runs_items(job, w0, w1);
    else runs_items_avx512(job, w0, w1);
  });
  return true;
}

bool amx_swiglu(const Gemv& gate, const Gemv& up, const Gemv& down, const float* x, int64_t D, int64_t n, float* y,
                const Glu* glu) {
  const int64_t Din = gate.in_features, F = gate.out_features, Fin = down.in_features;  // (Db, Fb with glu)
  constexpr uint16_t kOne = 0x3F80;  // bf16 1.0: the bias column's input
  thread_local std::vector<uint16_t> xb_, g_, u_, h_;
  thread_local std::vector<float> f_;
  std::vector<uint16_t>&xb = xb_, &g = g_, &u = u_, &h = h_;  // (this thread's, for the workers below)
  std::vector<float>& f = f_;
  xb.resize(n * Din), g.resize(n * F), u.resize(n * F);
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // x, then (glu) its 1 and zeros: models/gpt_oss.with_one
      uint16_t* r = xb.data() + i * Din;
      round_row(x + i * D, D, r);
      if (Din > D) std::fill(r + D, r + Din, uint16_t(0)), r[D] = glu ? kOne : 0;
    }
  });
  if (!gate.run_amx_bf16(xb.data(), n, nullptr, g.data())) return false;
  // (a projection of another format, Q4_K_M's Q6_K down as tiled int8: its own kernel over the rows in fp32)
  auto widened = [&](const std::vector<uint16_t>& b, int64_t count) {
    f.resize(count);
    for (int64_t i = 0; i < count; ++i) f[i] = bf16_to_float(b[i]);
    return f.data();
  };
  if (!up.run_amx_bf16(xb.data(), n, nullptr, u.data())) {
    std::vector<float> uf(n * F);
    up.run(widened(xb, n * Din), n, uf.data());
    round_row(uf.data(), n * F, u.data());
  }
  std::vector<uint16_t>& hb = glu ? h : g;  // down's rows: SiLU's SwiGLU in place, gpt-oss's with its 1 and zeros
  if (glu) {
    h.resize(n * Fin);
    at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        uint16_t* r = h.data() + i * Fin;
        clamped_glu_bf16(g.data() + i * F, u.data() + i * F, r, F, glu->alpha, glu->limit);
        std::fill(r + F, r + Fin, uint16_t(0));
        r[F] = kOne;
      }
    });
  } else {
    at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
      swiglu_bf16(g.data() + i0 * F, u.data() + i0 * F, g.data() + i0 * F, (i1 - i0) * F);
    });
  }
  if (!down.run_amx_bf16(hb.data(), n, y, nullptr)) down.run(widened(hb, n * Fin), n, y);
  return true;
}

// moe_experts' experts on the AMX GEMM (amx_swiglu): where the call has amx_rows entries an expert on average (N
// top_k >= amx_rows amx_experts: a prompt's rows, a large batch's; the native step passes its experts'
// ExpertFormat.group_rows, past which the modules' prefill computes an expert on the AMX GEMM) every expert it
// computes; below that, or without amx_rows, each expert of more than `amx_own` entries (the modules' prefill:
// ExpertSpec.forward_layer's amx_rows, its experts' group_rows). The AMX GEMM runs tiled int4 and mxfp4 on a CPU
// with AMX (Kernel::run_amx, amx_rows() on), one call a projection over an expert's rows where the int8-row kernels
// ran groups of kMaxNB rows, each re-reading the expert's weights. A 2-layer Mixtral-width Q4_0 prompt as rows of
// the native step (2 Sapphire Rapids cores, 2026-12-06, alternated in one process with the modules' prefill, whose
// experts past group_rows then took the AMX GEMM through torch ops and `given`): 512 tokens 1.48 s where the prefill
// took 0.81, now 0.92 against 0.91; 128 tokens (32 rows an expert) 0.32-0.43 s against 0.45-0.50 on the row
// kernels; 64 tokens (16) 0.34-0.35 against 0.25-0.26 with the AMX GEMM from 16 rows (its conversion of each
// weight outweighs the rows). The average decides by N, not by an expert's own rows, as the activation formats do
// (Act::format_rows): a token's output does not depend on how the other tokens routed; `amx_own` decides by the
// expert's rows, as the modules' prefill always has. gpt-oss's biased experts (glu) too, with their bias columns and
// clamped GLU (amx_swiglu); experts `given` keep their outputs. Returns, per expert id, its outputs fp32 [its rows,
// D] in its entries' flat order (held in a thread_local buffer until the next call), nullptr where not computed
// here; empty: none.
std::vector<const float*> moe_experts_amx(const Gemv* const* k, const float* x, int64_t N, int64_t D,
                                          const int64_t* idx, int64_t top_k, const std::vector<int64_t>& entry,
                                          const Glu* glu, const float* const* given, int64_t amx_experts,
                                          int64_t amx_rows, int64_t amx_own) {
  const int64_t M = N * top_k;
  const bool all = amx_experts > 0 && amx_rows > 0 && M >= amx_rows * amx_experts;
  if ((!all && amx_own <= 0) || !amx_step()) return {};
  struct Run {
    int64_t e, m0, n, at;  // expert, its first sorted entry, rows, its first row in ya
  };
  std::vector<Run> runs;
  int64_t rows = 0;
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t e = idx[entry[m0]];
    int64_t m1 = m0 + 1;
    while (m1 < M && idx[entry[m1]] == e) ++m1;
    if (!(given && given[e]) && (all || m1 - m0 > amx_own)) runs.push_back({e, m0, m1 - m0, rows}), rows += m1 - m0;
    m0 = m1;
  }
  if (runs.empty()) return {};
  thread_local std::vector<float> xa_, ya_;
  std::vector<float>&xa = xa_, &ya = ya_;  // (this thread's, for the workers below)
  ya.resize(rows * D);
  std::vector<const float*> done(*std::max_element(idx, idx + M) + 1, nullptr);
  for (const Run& r : runs) {
    xa.resize(r.n * D);
    at::parallel_for(0, r.n, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) std::memcpy(xa.data() + i * D, x + (entry[r.m0 + i] / top_k) * D, D * sizeof(float));
    });
    // (no AMX path: every expert keeps the row kernels)
    if (!amx_swiglu(*k[3 * r.e], *k[3 * r.e + 1], *k[3 * r.e + 2], xa.data(), D, r.n, ya.data() + r.at * D, glu))
      return {};
    done[r.e] = ya.data() + r.at * D;
  }
  return done;
}

// A MoE layer's routed experts and their weighted sum for N tokens (gemv.h). Entries grouped by
// expert, ascending, flat (token-major) order within an expert, as argsort(flat, stable) orders
// them; an expert with more than kMaxNB entries runs as several groups of at most kMaxNB (the same
// rows in the same order: the same sums).
void moe_experts(const Gemv* const* k, const float* x, int64_t N, int64_t D, const int64_t* idx, const float* wt,
                 int64_t top_k, bool bf16, float* out, const Glu* glu, const float* const* given,
                 int64_t amx_experts, int64_t amx_rows, int64_t amx_own) {
  const int64_t M = N * top_k;
  std::vector<int64_t> entry(M), bounds{0};
  std::iota(entry.begin(), entry.end(), int64_t(0));
  std::stable_sort(entry.begin(), entry.end(), [&](int64_t a, int64_t b) { return idx[a] < idx[b]; });
  const std::vector<const float*> amx =
      moe_experts_amx(k, x, N, D, idx, top_k, entry, glu, given, amx_experts, amx_rows, amx_own);
  // each sorted entry's output: a row of ys (computed here, rows C in order) or of its expert's `given` rows
  std::vector<const float*> from(M, nullptr);
  std::vector<int64_t> row(M, -1);
  std::vector<const Gemv*> ks;
  int64_t C = 0, seen = 0;  // computed rows; the current expert's entries so far
  for (int64_t m = 0; m < M; ++m) {
    const int64_t e = idx[entry[m]];
    const bool first = m == 0 || e != idx[entry[m - 1]];
    seen = first ? 0 : seen + 1;
    const float* done = given && given[e] ? given[e] : amx.empty() ? nullptr : amx[e];
    if (done) {
      from[m] = done + seen * D;
      continue;
    }
    // a new group at each computed expert's first entry and every kMaxNB entries
    if (first || C - bounds.back() == kMaxNB) {
      if (C > 0) bounds.push_back(C);
      ks.insert(ks.end(), k + 3 * e, k + 3 * e + 3);
    }
    row[m] = C++;
  }
  bounds.push_back(C);
  const int64_t Din = k[0]->in_features;  // D, or gpt-oss's Db: x, its bias column's 1, zeros
  // the gathered rows and their outputs, kept between calls: new ones each layer (a prompt's: 2 x 32 MB for a
  // Qwen3-30B-A3B-width chunk of 512 tokens) were mapped and faulted in every time. A Qwen3-30B-A3B-width Q4_0
  // prompt of 32 / 96 tokens (rows of the native step) took 0.94x / 0.98x the time on 2 Sapphire Rapids cores
  // (2026-12-02, 7 alternated rounds in one process, the same tokens)
  thread_local std::vector<float> xs, ys;
  xs.resize(C * Din), ys.resize(C * D);
  float* const xsp = xs.data();
  float* const ysp = ys.data();
  // the gather and the weighted sum across the threads from a prompt's rows on (a decode step's few run inline):
  // serial, they were ~7 ms a layer of a 512-token Qwen3-30B-A3B-width prompt on 2 Sapphire Rapids cores
  at::parallel_for(0, M, 256, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      if (row[m] < 0) continue;
      float* r = xsp + row[m] * Din;
      std::memcpy(r, x + (entry[m] / top_k) * D, D * sizeof(float));
      if (glu) r[D] = 1.f;
      std::fill(r + D + (glu ? 1 : 0), r + Din, 0.f);
      from[m] = ysp + row[m] * D;
    }
  });
  if (C > 0) swiglu_group(ks.data(), int64_t(bounds.size()) - 1, xsp, bounds.data(), ysp, glu, N);
  std::vector<int64_t> at_(M);  // entry -> its place m in the expert order
  for (int64_t m = 0; m < M; ++m) at_[entry[m]] = m;
  auto rd = [bf16](float v) { return bf16 ? bf16f(to_bf16(v)) : v; };
  // each token's sum over its entries in the expert order (its places m ascending), as one pass over m adds them
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    std::vector<int64_t> ms(top_k);
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t j = 0; j < top_k; ++j) ms[j] = at_[n * top_k + j];
      std::sort(ms.begin(), ms.end());
      float* o = out + n * D;
      std::fill(o, o + D, 0.f);
      for (const int64_t m : ms) {
        const float w = wt[entry[m]];
        const float* y = from[m];
        if (bf16) {
          for (int64_t d = 0; d < D; ++d) o[d] = rd(o[d] + rd(rd(y[d]) * w));
        } else {  // (each product rounded, then added: no contraction under ISO C++)
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += y[d] * w;
        }
      }
    }
  });
}

namespace {

// A CPU-only MoE layer's routed experts and their weighted sum in one call (a decode step's layer:
// runtime/moe_runner._resident_layer; a prompt's, _all_on_fast: any rows an expert, moe_experts runs them in
// groups of kMaxNB, as forward_group's _row_groups do): x [N, D] (float32 or bfloat16), topk_idx int64 [N, k],
// topk_weight [N, k] in x's dtype, experts: the ids routed to, ascending, k[3 i..3 i + 2] expert
// experts[i]'s kernels. Returns out [N, D] in x's dtype, bit for bit what the per-expert path
// computes with torch ops:
//     rows of expert e = the (n, j) with topk_idx[n, j] == e in flat order (argsort(stable))
//     ys = experts(x[rows]).to(x.dtype);  out = zeros; out.index_add_(0, n, ys * topk_weight[n, j])
// i.e. each product rounded to x's dtype, then added to its token's row in expert order, rounded
// after every add (torch's bf16 ops compute in float and round to nearest even; fp32 needs none).
// `given` (empty, or one per expert): an expert's outputs computed elsewhere, [its rows, D] in x's dtype in its
// rows' flat order (the `ys` above for that expert: a prompt's expert past the kernels' rows), or None to compute
// it here.
at::Tensor run_swiglu_layer(const std::vector<const Gemv*>& k, const at::Tensor& x0, const at::Tensor& topk_idx,
                            const at::Tensor& topk_weight, const std::vector<int64_t>& experts, const char* what,
                            const Glu* glu = nullptr, const std::vector<c10::optional<at::Tensor>>& given = {},
                            int64_t amx_own = 0) {
  const int64_t E = int64_t(experts.size());
  TIERED_CHECK(E >= 1 && int64_t(k.size()) == 3 * E, what, ": three kernels per routed expert");
  const int64_t D = expert_width(k[0], k[2], glu, what);
  const bool bf16 = x0.scalar_type() == at::kBFloat16;
  TIERED_CHECK(x0.device().is_cpu() && x0.dim() == 2 && x0.size(1) == D && (bf16 || x0.scalar_type() == at::kFloat),
              what, ": x must be a CPU float32 or bfloat16 [N, ", D, "] tensor, got ", x0.scalar_type(), " ", x0.sizes());
  const int64_t N = x0.size(0);
  TIERED_CHECK(topk_idx.scalar_type() == at::kLong && topk_idx.dim() == 2 && topk_idx.size(0) == N, what,
              ": topk_idx must be int64 [", N, ", k]");
  const int64_t K = topk_idx.size(1);
  TIERED_CHECK(topk_weight.scalar_type() == x0.scalar_type() && topk_weight.sizes() == topk_idx.sizes(), what,
              ": topk_weight must be [", N, ", ", K, "] in x's dtype");
  auto idx = topk_idx.contiguous();
  auto wt = topk_weight.to(at::kFloat).contiguous();  // exact: bf16 and fp32 widen to fp32
  auto x = x0.to(at::kFloat).contiguous();
  // topk_idx as positions in `experts` (moe_experts indexes kernels by them)
  std::vector<int64_t> pos(N * K);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < E; ++i)
    TIERED_CHECK(i == 0 || experts[i] > experts[i - 1], what, ": experts must be ascending and distinct");
  std::vector<int64_t> count(E, 0);
  for (int64_t f = 0; f < N * K; ++f) {
    const auto it = std::lower_bound(experts.begin(), experts.end(), ip[f]);
    TIERED_CHECK(it != experts.end() && *it == ip[f], what, ": topk_idx routes to an expert not in `experts`");
    pos[f] = it - experts.begin();
    ++count[pos[f]];
  }
  TIERED_CHECK(given.empty() || int64_t(given.size()) == E, what, ": given must be empty or one entry per expert");
  std::vector<at::Tensor> held;  // the given outputs as fp32 (exact), alive through the call
  std::vector<const float*> from(given.empty() ? 0 : E, nullptr);
  for (size_t i = 0; i < given.size(); ++i) {
    if (!given[i].has_value()) continue;
    const at::Tensor& g = *given[i];
    TIERED_CHECK(g.device().is_cpu() && g.scalar_type() == x0.scalar_type() && g.dim() == 2 &&
                    g.size(0) == count[i] && g.size(1) == D,
                what, ": given[", i, "] must be a CPU ", c10::toString(x0.scalar_type()), " tensor [", count[i], ", ",
                D, "] (expert ", experts[i], "'s rows), got ", g.scalar_type(), " ", g.sizes());
    held.push_back(g.to(at::kFloat).contiguous());
    from[i] = held.back().data_ptr<float>();
  }
  auto out = at::empty({N, D}, at::TensorOptions().dtype(at::kFloat));
  {
    pybind11::gil_scoped_release nogil;
    moe_experts(k.data(), x.data_ptr<float>(), N, D, pos.data(), wt.data_ptr<float>(), K, bf16, out.data_ptr<float>(),
                glu, from.empty() ? nullptr : from.data(), 0, 0, amx_own);
  }
  return out.to(x0.scalar_type());  // exact: every value is already one of x's dtype
}

// One routed SwiGLU expert: y [B, D] = W_down (silu(W_gate x) * W_up x), gate and up in one
// parallel region, no tensor or Python between the projections.
void swiglu(const Gemv& gate, const Gemv& up, const Gemv& down, const float* x, int64_t B, float* y) {
  thread_local ActBuffers buf;
  thread_local std::vector<float> gu, h;
  const int64_t F = gate.out_features;
  gu.resize(B * 2 * F);
  h.resize(B * F);
  const Act a = buf.prepare(x, B, gate.in_features, gate.needs(B) | up.needs(B));
  const Part parts[2] = {{&gate, gu.data(), 2 * F}, {&up, gu.data() + F, 2 * F}};
  run_parts(parts, 2, a);
  for (int64_t b = 0; b < B; ++b) silu_mul(gu.data() + b * 2 * F, gu.data() + b * 2 * F + F, h.data() + b * F, F);
  down.run(h.data(), B, y);
}

struct ExpertGemv : Kernel {
  std::shared_ptr<Gemv> gate, up, down;
  void run(const float* x, int64_t B, float* y) const override { swiglu(*gate, *up, *down, x, B, y); }
  int64_t weight_bytes() const override { return gate->weight_bytes() + up->weight_bytes() + down->weight_bytes(); }
  std::string name() const override { return "swiglu_expert(" + gate->name() + ", " + down->name() + ")"; }
};

// An ExpertFormat's layout (per projection: kind and byte offsets of its segments in the flat
// slot), so that one call computes an expert straight from any slot holding it.
struct ExpertSpec {
  // kMxfp4: gpt-oss's MXFP4 (quant/mxfp4.py), laid out as tiled int4 with the scales inline and no residual,
  // its codes FP4 e2m1 (Int4W::e2m1), always on int8 activations
  // kQ6K, kQ5K, kIQ4XS: a GGUF file's Q6_K / Q5_K / IQ4_XS experts as stored, in the k-quant layouts ("q6k", "q5k",
  // "iq4xs": qt, then its scales, then its super-block scales, each a segment of the slot), the tiled host layout only
  enum Kind { kBf16 = 0, kInt8 = 1, kInt4 = 2, kInt8G32 = 3, kFp8 = 4, kFp8Row = 5, kMxfp4 = 6, kQ6K = 7, kQ5K = 8,
              kIQ4XS = 9 };
  struct Proj {
    int kind;
    int64_t N, K;
    // bf16: w; int8: q, scale; int4: codes, sz, zr (-1: zeros exact, no residual read); int4 tiled with the
    // scales inline ([N/16, K/32, 320] then zr): its offset, + 256, zr's (or -1); int8-g32 (tiled): qt, st;
    // fp8: q uint8 [N, K], bs fp32 [ceil(N/128), ceil(K/128)]; fp8-row: q uint8 [N, K], s fp32 [N]; the k-quants:
    // qt, scales, supers (their Format::parts)
    int64_t off[3];
  };
  Proj p[3];
  int64_t nbytes = 0;
  bool int4_q8 = false;  // int4 projections on int8 activations (Int4Q8Gemv)
  bool int4_tiled = false;  // int4 codes in the tiled layout (Int4TGemv)
  int64_t q8_from = kNeverQ8;  // the tiled layout's calls from this many rows read int8 activations
  // ... its int8 and int8-g32 projections' calls (Int8Gemv::q8_from): 2 where the batches read int8 activations
  // (int4_batch_act "q8"), so one row keeps its int16 activations whatever int4_act says
  int64_t int8_q8_from = kNeverQ8;
  bool biased = false;  // gpt-oss's experts (gemv.h's Glu): forward_group / forward_layer with their swiglu_limit

  // A k-quant projection's kernel over its three segments (no copy), its rows of two or more on int8 activations as
  // the tiled int8 projections' (int8_q8_from).
  template <class F>
  void bind_kquant(const Proj& pr, const uint8_t* buf, KQuantGemv<F>& k, const Gemv*& out) const {
    k.in_features = pr.K, k.out_features = pr.N;
    k.w = F::at(buf + pr.off[0], buf + pr.off[1], buf + pr.off[2]);
    k.q8_from = int8_q8_from;
    out = &k;
  }

  void bind(const Proj& pr, const uint8_t* buf, Int4Gemv& k4, Int8Gemv& k8, Bf16Gemv& kb, Fp8Gemv& kf,
            const Gemv*& out) const {
    if (pr.kind == kFp8 || pr.kind == kFp8Row) {  // fp8-row: one scale a row across the columns
      kf.in_features = pr.K, kf.out_features = pr.N;
      kf.w = {buf + pr.off[0], reinterpret_cast<const float*>(buf + pr.off[1]), nullptr,
              pr.kind == kFp8 ? kFp8Block : 1, pr.kind == kFp8 ? 1 : 0};
      out = &kf;
    } else if (pr.kind == kInt4 || pr.kind == kMxfp4) {
      k4.in_features = pr.K, k4.out_features = pr.N;
      const auto* sz = reinterpret_cast<const uint16_t*>(buf + pr.off[1]);
      k4.w = {buf + pr.off[0], pr.K / 2, sz, sz + 1,
              pr.off[2] < 0 ? nullptr : reinterpret_cast<const uint16_t*>(buf + pr.off[2]), 2, 2 * pr.N, 2, 2 * pr.N, 1,
              pr.N, nullptr};
      k4.w.tiled = int4_tiled;  // then sz is [N/16, G, 16, 2] and zr [N/16, G, 16]
      k4.w.tstride = kBlock * pr.K / 2;
      if (int4_tiled && pr.off[1] == pr.off[0] + 256) {  // the scales inline (ExpertFormat's tiled int4)
        k4.w.inline_sz = true;
        k4.w.gstride = 320, k4.w.tstride = (pr.K / kGroup) * 320;
      }
      k4.w.e2m1 = pr.kind == kMxfp4;
      out = &k4;
    } else if (pr.kind == kInt8 || pr.kind == kInt8G32) {
      k8.in_features = pr.K, k8.out_features = pr.N;
      const auto* s = reinterpret_cast<const uint16_t*>(buf + pr.off[1]);
      k8.w = {reinterpret_cast<const int8_t*>(buf + pr.off[0]), nullptr, pr.kind == kInt8 ? s : nullptr, nullptr};
      k8.w.tiled = int4_tiled && int8_tiles(pr.N, pr.K);  // the tiled host layout tiles int8 too
      if (pr.kind == kInt8G32) k8.w.gs = s;  // fp16 [N/16, K/32, 16]
      out = &k8;
    } else {
      kb.in_features = pr.K, kb.out_features = pr.N;
      kb.w = {reinterpret_cast<const uint16_t*>(buf + pr.off[0]), nullptr};
      out = &kb;
    }
  }

  // One slot's three projections bound as kernels (g: gate, up, down).
  struct Bound {
    Int4Gemv k4[3];
    Int4Q8Gemv k4q[3];
    Int4TGemv k4t[3];
    Int8Gemv k8[3];
    Bf16Gemv kb[3];
    Fp8Gemv kf[3];
    KQuantGemv<Q6KFormat> kq6[3];
    KQuantGemv<Q5KFormat> kq5[3];
    KQuantGemv<IQ4XSFormat> kiq[3];
    const Gemv* g[3];
  };

  void bind_slot(const at::Tensor& buf, Bound& b) const {
    TIERED_CHECK(buf.device().is_cpu() && buf.scalar_type() == at::kByte && buf.is_contiguous() && buf.numel() >= nbytes,
                "expert spec: the slot must be a contiguous CPU uint8 tensor of ", nbytes, " bytes");
    const uint8_t* base = buf.data_ptr<uint8_t>();
    for (int i = 0; i < 3; ++i) {
      b.k4t[i].q8_from = p[i].kind == kMxfp4 ? 1 : q8_from;
      b.k8[i].q8_from = int8_q8_from;  // (has_q8: the tiled layout only)
      Int4Gemv& k = int4_tiled ? static_cast<Int4Gemv&>(b.k4t[i]) : int4_q8 ? b.k4q[i] : b.k4[i];
      if (p[i].kind == kQ6K) bind_kquant(p[i], base, b.kq6[i], b.g[i]);
      else if (p[i].kind == kQ5K) bind_kquant(p[i], base, b.kq5[i], b.g[i]);
      else if (p[i].kind == kIQ4XS) bind_kquant(p[i], base, b.kiq[i], b.g[i]);
      else bind(p[i], base, k, b.k8[i], b.kb[i], b.kf[i], b.g[i]);
    }
  }

  // x [B, D] any float dtype; buf uint8 [nbytes] (one slot) -> y [B, D] fp32.
  at::Tensor forward(const at::Tensor& buf, const at::Tensor& x0) const {
    TIERED_CHECK(!biased, "expert spec: gpt-oss's biased experts compute through forward_group (their clamped GLU)");
    TIERED_CHECK(x0.dim() == 2 && x0.size(1) == p[0].K, "expert spec: x must be [B, ", p[0].K, "], got ", x0.sizes());
    Bound b;
    bind_slot(buf, b);
    auto x = x0.to(at::kFloat).contiguous();
    auto y = at::empty({x.size(0), p[2].N}, x.options());
    {
      pybind11::gil_scoped_release nogil;
      swiglu(*b.g[0], *b.g[1], *b.g[2], x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
    }
    return y;
  }

  // x [B, D] any float dtype; buf uint8 [nbytes] (one slot) -> y [B, D] fp32 on the AMX GEMM (amx_swiglu: what
  // forward_layer's amx_rows computes an expert past them with), or None where it has no AMX path here.
  // gpt-oss's biased experts need swiglu_limit (> 0) and swiglu_alpha, x then [B, D] without its bias columns.
  c10::optional<at::Tensor> forward_amx(const at::Tensor& buf, const at::Tensor& x0, double swiglu_limit,
                                        double swiglu_alpha) const {
    const auto glu = glu_of(swiglu_limit, swiglu_alpha, "expert spec forward_amx");
    TIERED_CHECK(biased == bool(glu), "expert spec forward_amx: gpt-oss's biased experts, and only they, take a "
                 "swiglu_limit");
    const int64_t D = p[2].N;  // the hidden width (gate's K is Db, D's biased width, for gpt-oss)
    TIERED_CHECK(x0.dim() == 2 && x0.size(1) == D, "expert spec: x must be [B, ", D, "], got ", x0.sizes());
    Bound b;
    bind_slot(buf, b);
    auto x = x0.to(at::kFloat).contiguous();
    auto y = at::empty({x.size(0), D}, x.options());
    bool ran;
    {
      pybind11::gil_scoped_release nogil;
      ran = amx_swiglu(*b.g[0], *b.g[1], *b.g[2], x.data_ptr<float>(), D, x.size(0), y.data_ptr<float>(),
                       glu ? &*glu : nullptr);
    }
    if (!ran) return c10::nullopt;
    return y;
  }

  // Several slots bound at once: `b` owns their kernels, `ptrs` lists them (gate, up, down per slot).
  struct BoundSlots {
    std::unique_ptr<Bound[]> b;
    std::vector<const Gemv*> ptrs;
  };

  BoundSlots bind_slots(const std::vector<at::Tensor>& slots) const {
    BoundSlots s{std::unique_ptr<Bound[]>(new Bound[slots.size()]), {}};
    for (size_t e = 0; e < slots.size(); ++e) {
      bind_slot(slots[e], s.b[e]);
      s.ptrs.insert(s.ptrs.end(), s.b[e].g, s.b[e].g + 3);
    }
    return s;
  }

  // Several experts in this format at once (swiglu_group): slots [E] uint8, xs [M, D], bounds [E + 1].
  // gpt-oss's biased experts need swiglu_limit (> 0) and swiglu_alpha: their clamped GLU (gemv.h's Glu).
  at::Tensor forward_group(const std::vector<at::Tensor>& slots, const at::Tensor& xs, const std::vector<int64_t>& bounds,
                           double swiglu_limit, double swiglu_alpha, int64_t format_rows) const {
    TIERED_CHECK(format_rows >= 0, "expert spec forward_group: format_rows must be >= 0");
    const auto glu = glu_of(swiglu_limit, swiglu_alpha, "expert spec forward_group");
    const BoundSlots s = bind_slots(slots);
    return run_swiglu_group(s.ptrs, xs, bounds, "expert spec forward_group", glu ? &*glu : nullptr, format_rows);
  }

  // Every expert of a layer bound once (a decode step's native MoE layer): slots [E], expert e's at e.
  std::shared_ptr<BoundExperts> bind_layer(const std::vector<at::Tensor>& slots) const {
    auto s = std::make_shared<std::pair<BoundSlots, std::vector<at::Tensor>>>(bind_slots(slots), slots);
    auto b = std::make_shared<BoundExperts>();
    b->k = s->first.ptrs;
    b->owner = s;
    return b;
  }

  // A layer's routed experts and their weighted sum (run_swiglu_layer): slots [E], one per routed expert.
  at::Tensor forward_layer(const std::vector<at::Tensor>& slots, const at::Tensor& x, const at::Tensor& topk_idx,
                           const at::Tensor& topk_weight, const std::vector<int64_t>& experts, double swiglu_limit,
                           double swiglu_alpha, const std::vector<c10::optional<at::Tensor>>& given,
                           int64_t amx_rows) const {
    TIERED_CHECK(slots.size() == experts.size(), "expert spec forward_layer: one slot per routed expert");
    TIERED_CHECK(amx_rows >= 0, "expert spec forward_layer: amx_rows must be >= 0");
    const auto glu = glu_of(swiglu_limit, swiglu_alpha, "expert spec forward_layer");
    const BoundSlots s = bind_slots(slots);
    return run_swiglu_layer(s.ptrs, x, topk_idx, topk_weight, experts, "expert spec forward_layer",
                            glu ? &*glu : nullptr, given, amx_rows);
  }
};

// ------------------------------------------------------------------------------------ factories
void check_rows(const at::Tensor& t, at::ScalarType dt, int64_t N, int64_t K, const char* what) {
  TIERED_CHECK(t.device().is_cpu() && t.scalar_type() == dt && t.dim() == 2 && t.size(0) == N && t.size(1) == K &&
                  t.is_contiguous(),
              what, " must be a contiguous CPU ", c10::toString(dt), " tensor [", N, ", ", K, "], got ",
              t.scalar_type(), " ", t.sizes());
}

// One bf16 expert's kernels k[0..2] over w[0..2] = w_gate, w_up [F, D], w_down [D, F] (contiguous
// bf16, checked).
// With `biased` (gpt-oss's experts, gemv.h's Glu): w_down [D', F'] with D' < D and F' > F (D, F the
// gate's input width and rows: the bias columns pad each input to a multiple of 32).
void bind_bf16_expert(const at::Tensor* w, int64_t F, int64_t D, Bf16Gemv* k, const std::string& what,
                      bool biased = false) {
  check_rows(w[0], at::kBFloat16, F, D, (what + ": w_gate").c_str());
  check_rows(w[1], at::kBFloat16, F, D, (what + ": w_up").c_str());
  const int64_t Dd = biased ? w[2].size(0) : D, Fd = biased ? w[2].size(1) : F;
  TIERED_CHECK(!biased || (w[2].dim() == 2 && Dd < D && Fd > F), what, ": a biased expert's w_down must be [D, Fb] "
              "with D below the gate's and Fb above its rows, got ", w[2].sizes());
  check_rows(w[2], at::kBFloat16, Dd, Fd, (what + ": w_down").c_str());
  for (int i = 0; i < 3; ++i) {
    k[i].out_features = w[i].size(0), k[i].in_features = w[i].size(1);
    k[i].w = {bf16_ptr(w[i]), nullptr};
  }
}

// Several bf16 experts' kernels from their weights [3 E] (w_gate, w_up, w_down per expert), checked:
// `k` owns them, `ptrs` lists them in order (the grouped calls' kernel list).
struct Bf16Experts {
  std::unique_ptr<Bf16Gemv[]> k;
  std::vector<const Gemv*> ptrs;
  Bf16Experts(const std::vector<at::Tensor>& ws, const std::string& what) {
    TIERED_CHECK(!ws.empty() && ws.size() % 3 == 0, what, ": weights are (gate, up, down) per expert");
    const int64_t F = ws[0].size(0), D = ws[0].size(1);
    const bool biased = ws[2].dim() == 2 && ws[2].size(1) != F;  // gpt-oss's [D, Fb] down projections
    k.reset(new Bf16Gemv[ws.size()]);
    for (size_t i = 0; i < ws.size(); i += 3) {
      bind_bf16_expert(&ws[i], F, D, &k[i], what, biased);
      for (size_t j = i; j < i + 3; ++j) ptrs.push_back(&k[j]);
    }
  }
};

void check_ng(const at::Tensor& t, int64_t N, int64_t G, const char* what) {
  TIERED_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.size(0) == N &&
                  t.size(1) == G,
              "int4_kernel: ", what, " must be a bf16 [N, K/32] = [", N, ", ", G, "] view (any strides), got ",
              t.scalar_type(), " ", t.sizes());
}

template <class T>  // Int4Gemv or Int4Q8Gemv
std::shared_ptr<Gemv> make_int4(at::Tensor codes, at::Tensor scale, at::Tensor zero, c10::optional<at::Tensor> residual,
                                c10::optional<at::Tensor> bias) {
  TIERED_CHECK(codes.dim() == 2, "int4_kernel: codes must be uint8 [N, K/2]");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, G = K / kGroup;
  TIERED_CHECK(K % kGroup == 0, "int4_kernel: in-features must be a multiple of 32, got ", K);
  check_rows(codes, at::kByte, N, K / 2, "int4_kernel: codes");
  check_ng(scale, N, G, "scale");
  check_ng(zero, N, G, "zero");
  auto k = std::make_shared<T>();
  k->in_features = K, k->out_features = N;
  k->codes = codes, k->s = scale, k->z = zero;
  k->w.codes = codes.data_ptr<uint8_t>();
  k->w.ldc = K / 2;
  k->w.s = bf16_ptr(scale), k->w.s_n = scale.stride(0), k->w.s_g = scale.stride(1);
  k->w.z = bf16_ptr(zero), k->w.z_n = zero.stride(0), k->w.z_g = zero.stride(1);
  if (residual) {
    check_ng(*residual, N, G, "zero residual");
    k->zr = *residual;
    k->w.zr = bf16_ptr(k->zr), k->w.zr_n = k->zr.stride(0), k->w.zr_g = k->zr.stride(1);
  }
  k->bias = bias_vector(bias, N);
  k->w.bias = k->bias.empty() ? nullptr : k->bias.data();
  return k;
}

// The tiled layout: codes uint8 [N, K/2] (tiles), sz bf16 [N/16, G, 16, 2], zr bf16 [N/16, G, 16] or none.
// Scales inline (Int4W::inline_sz): codes uint8 [N/16, G, 320] (each group-tile's 256 code bytes, then its
// 16 (s, z) bf16 pairs), no sz; the residual as above.
// e2m1: MXFP4 codes (Int4W::e2m1), which read int8 activations at every call size (q8_from 1).
std::shared_ptr<Int4TGemv> make_int4_tiled(at::Tensor codes, c10::optional<at::Tensor> sz_, c10::optional<at::Tensor> residual,
                                           c10::optional<at::Tensor> bias, int64_t q8_from, bool e2m1 = false) {
  auto k = std::make_shared<Int4TGemv>();
  k->q8_from = e2m1 ? 1 : q8_from;
  k->w.tiled = true;
  k->w.e2m1 = e2m1;
  int64_t N, K;
  if (codes.dim() == 3) {
    const int64_t T = codes.size(0), G = codes.size(1), GS = codes.size(2);
    N = T * kBlock, K = G * kGroup;
    TIERED_CHECK(!sz_, "int4_tiled_kernel: codes with the scales inline [N/16, K/32, 320] take no sz");
    TIERED_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.is_contiguous() && GS == 320 &&
                    T > 0 && G > 0,
                "int4_tiled_kernel: codes with the scales inline must be a contiguous CPU uint8 [N/16, K/32, 320] "
                "tensor, got ", codes.scalar_type(), " ", codes.sizes());
    k->codes = codes;
    const uint8_t* base = codes.data_ptr<uint8_t>();
    k->w.codes = base;
    k->w.ldc = K / 2;
    k->w.inline_sz = true;
    k->w.gstride = GS, k->w.tstride = G * GS;
    k->w.s = reinterpret_cast<const uint16_t*>(base + 256), k->w.z = k->w.s + 1;
  } else {
    TIERED_CHECK(codes.dim() == 2, "int4_tiled_kernel: codes must be uint8 [N, K/2] (or [N/16, K/32, 320])");
    TIERED_CHECK(sz_.has_value(), "int4_tiled_kernel: codes [N, K/2] need sz [N/16, K/32, 16, 2]");
    const at::Tensor& sz = *sz_;
    N = codes.size(0), K = codes.size(1) * 2;
    const int64_t G = K / kGroup;
    TIERED_CHECK(K % kGroup == 0 && N % kBlock == 0,
                "int4_tiled_kernel: needs in-features % 32 == 0 and out-features % 16 == 0, got ", N, " x ", K);
    check_rows(codes, at::kByte, N, K / 2, "int4_tiled_kernel: codes");
    TIERED_CHECK(sz.device().is_cpu() && sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() &&
                    sz.sizes() == at::IntArrayRef({N / kBlock, G, kBlock, 2}),
                "int4_tiled_kernel: sz must be a contiguous CPU bf16 [N/16, K/32, 16, 2] = [", N / kBlock, ", ", G,
                ", 16, 2] tensor, got ", sz.scalar_type(), " ", sz.sizes());
    k->codes = codes, k->s = sz;
    k->w.codes = codes.data_ptr<uint8_t>();
    k->w.ldc = K / 2;
    k->w.tstride = kBlock * K / 2;
    k->w.s = bf16_ptr(sz), k->w.z = k->w.s + 1;
  }
  if (residual) {
    TIERED_CHECK(residual->device().is_cpu() && residual->scalar_type() == at::kBFloat16 && residual->is_contiguous() &&
                    residual->sizes() == at::IntArrayRef({N / kBlock, K / kGroup, kBlock}),
                "int4_tiled_kernel: the zero residual must be a contiguous CPU bf16 [N/16, K/32, 16] tensor, got ",
                residual->scalar_type(), " ", residual->sizes());
    k->zr = *residual;
    k->w.zr = bf16_ptr(k->zr);
  }
  k->in_features = K, k->out_features = N;
  k->bias = bias_vector(bias, N);
  k->w.bias = k->bias.empty() ? nullptr : k->bias.data();
  return k;
}

std::shared_ptr<Gemv> make_int8(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> bias) {
  TIERED_CHECK(q.dim() == 2, "int8_kernel: q must be int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  check_rows(q, at::kChar, N, K, "int8_kernel: q");
  TIERED_CHECK(scale.numel() == N, "int8_kernel: scale must have N = ", N, " elements, got ", scale.numel());
  auto k = std::make_shared<Int8Gemv>();
  k->in_features = K, k->out_features = N;
  k->q = q;
  auto s = scale.to(at::kFloat).contiguous();
  k->scale.assign(s.data_ptr<float>(), s.data_ptr<float>() + N);
  k->bias = bias_vector(bias, N);
  k->w = {q.data_ptr<int8_t>(), k->scale.data(), nullptr, k->bias.empty() ? nullptr : k->bias.data()};
  return k;
}

// The tiled int8 kernels' q8_from for a binding's batch_act: "q8" from 2 rows (a batched step), "bf16" never.
int64_t int8_q8_from(const std::string& batch_act, const char* what) {
  TIERED_CHECK(batch_act == "bf16" || batch_act == "q8", what, ": batch_act must be 'bf16' or 'q8', got '", batch_act, "'");
  return batch_act == "q8" ? 2 : kNeverQ8;
}

// The tiled int8 layout (qt uint8 [N, K], see "int8, tiled"): scale [N], w = (qt - 128) * scale.
// batch_act: what calls of 2+ rows read (int8_q8_from); `what` names the binding in errors.
std::shared_ptr<Int8Gemv> make_int8_tiled(at::Tensor qt, at::Tensor scale, c10::optional<at::Tensor> bias,
                                          const std::string& batch_act = "bf16",
                                          const std::string& what = "int8_tiled_kernel") {
  TIERED_CHECK(qt.dim() == 2, what, ": qt must be uint8 [N, K]");
  const int64_t N = qt.size(0), K = qt.size(1);
  TIERED_CHECK(int8_tiles(N, K), what, ": the tiled int8 layout needs N % 16 == 0 and K % 32 == 0, got ", N, " x ", K);
  check_rows(qt, at::kByte, N, K, (what + ": qt").c_str());
  auto k = std::static_pointer_cast<Int8Gemv>(make_int8(qt.view(at::kChar), scale, bias));
  k->w.tiled = true;
  k->q8_from = int8_q8_from(batch_act, what.c_str());
  return k;
}

// int8-g32 in the tiled layout: qt uint8 [N, K] as make_int8_tiled, st fp16 [N/16, K/32, 16] (each
// tile's per-group scales, 16 rows side by side): w = (qt - 128) * st.
std::shared_ptr<Int8Gemv> make_int8g32_tiled(at::Tensor qt, at::Tensor st, c10::optional<at::Tensor> bias,
                                             const std::string& batch_act = "bf16") {
  auto k = make_int8_tiled(qt, at::ones({qt.dim() == 2 ? qt.size(0) : 0}), bias, batch_act, "int8g32_tiled_kernel");
  const int64_t N = k->out_features, K = k->in_features;
  TIERED_CHECK(st.scalar_type() == at::kHalf && st.is_contiguous() && st.dim() == 3 && st.size(0) == N / kBlock &&
                  st.size(1) == K / kGroup && st.size(2) == kBlock,
              "int8g32_tiled_kernel: st must be contiguous float16 [N/16, K/32, 16] = [", N / kBlock, ", ", K / kGroup,
              ", 16], got ", st.scalar_type(), " ", st.sizes());
  k->st = st;
  k->w.gs = reinterpret_cast<const uint16_t*>(st.data_ptr<at::Half>());
  return k;
}

// k-quant weights (see "q6k", "q5k", "iq4xs"): the format's (qt, scales, supers), checked (check_layout) and held (no copy);
// batch_act as make_int8_tiled's.
template <class F>
std::shared_ptr<KQuantGemv<F>> make_kquant(at::Tensor qt, at::Tensor scales, at::Tensor supers,
                                           c10::optional<at::Tensor> bias, const std::string& batch_act) {
  const std::string what = std::string(F::kName) + "_kernel";
  check_layout<F>(qt, scales, supers, what.c_str());
  auto k = std::make_shared<KQuantGemv<F>>();
  k->out_features = qt.size(0) * kBlock, k->in_features = qt.size(1) * kGroup;
  k->qt = qt, k->scales = scales, k->supers = supers;
  k->bias = bias_vector(bias, k->out_features);
  k->w = F::weights(qt, scales, supers, k->bias.empty() ? nullptr : k->bias.data());
  k->q8_from = int8_q8_from(batch_act, what.c_str());
  return k;
}

// fp8 weights (see "fp8"): q uint8 (or float8_e4m3fn) [N, K] and bs fp32 [ceil(N/rb), ceil(K/128)] or
// [ceil(N/rb), 1] (one scale across the columns) for `row_block` rb rows a scale (128, 1, or >= N),
// contiguous, held (no copy).
std::shared_ptr<Fp8Gemv> make_fp8(at::Tensor q, at::Tensor bs, c10::optional<at::Tensor> bias, int64_t row_block = kFp8Block) {
  TIERED_CHECK(q.dim() == 2 && q.size(0) > 0 && q.size(1) > 0 &&
                  (q.scalar_type() == at::kByte || q.scalar_type() == at::kFloat8_e4m3fn),
              "fp8_kernel: q must be uint8 (the e4m3fn bit patterns) or float8_e4m3fn [N, K], N, K >= 1, got ",
              q.scalar_type(), " ", q.sizes());
  if (q.scalar_type() == at::kFloat8_e4m3fn) q = q.view(at::kByte);
  const int64_t N = q.size(0), K = q.size(1);
  check_rows(q, at::kByte, N, K, "fp8_kernel: q");
  TIERED_CHECK(row_block >= 1, "fp8_kernel: row_block must be >= 1, got ", row_block);
  const int64_t NB = (N + row_block - 1) / row_block, KB = (K + kFp8Block - 1) / kFp8Block;
  TIERED_CHECK(bs.device().is_cpu() && bs.scalar_type() == at::kFloat && bs.is_contiguous() && bs.dim() == 2 &&
                  bs.size(0) == NB && (bs.size(1) == KB || bs.size(1) == 1),
              "fp8_kernel: bs must be a contiguous CPU float32 [ceil(N/", row_block, "), ceil(K/128)] = [", NB, ", ", KB,
              "] or [", NB, ", 1] tensor, got ", bs.scalar_type(), " ", bs.sizes());
  auto k = std::make_shared<Fp8Gemv>();
  k->in_features = K, k->out_features = N;
  k->q = q, k->bs = bs;
  k->bias = bias_vector(bias, N);
  k->w = {q.data_ptr<uint8_t>(), bs.data_ptr<float>(), k->bias.empty() ? nullptr : k->bias.data(), row_block,
          bs.size(1) == KB ? 1 : 0};
  return k;
}

// A kernel G over dense weight rows w [N, K] of dtype dt (contiguous, checked; `ptr` its data).
template <class G, class Ptr>
std::shared_ptr<G> make_rows(at::Tensor w, c10::optional<at::Tensor> bias, at::ScalarType dt, const char* what, Ptr ptr) {
  TIERED_CHECK(w.dim() == 2, what, " must be ", c10::toString(dt), " [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  check_rows(w, dt, N, K, what);
  auto k = std::make_shared<G>();
  k->in_features = K, k->out_features = N;
  k->wt = w;
  k->bias = bias_vector(bias, N);
  k->w = {ptr(w), k->bias.empty() ? nullptr : k->bias.data()};
  return k;
}

std::shared_ptr<Gemv> make_bf16(at::Tensor w, c10::optional<at::Tensor> bias) {
  return make_rows<Bf16Gemv>(w, bias, at::kBFloat16, "bf16_kernel: w", bf16_ptr);
}

std::shared_ptr<Gemv> make_f32(at::Tensor w, c10::optional<at::Tensor> bias) {
  auto k = make_rows<F32Gemv>(w, bias, at::kFloat, "f32_kernel: w", [](const at::Tensor& t) { return t.data_ptr<float>(); });
  if (bias) k->bias_t = bias->to(at::kFloat).contiguous();  // at::linear's, above kF32GemvRows rows
  return k;
}

std::shared_ptr<Gemv> as_gemv(const KernelPtr& k, const char* what) {
  auto g = std::dynamic_pointer_cast<Gemv>(k);
  TIERED_CHECK(g, "expert_kernel: ", what, " must be one of tiered's own kernels (int4/int8/bf16/fp8_kernel), got ",
              k ? k->name() : std::string("None"));
  return g;
}

}  // namespace

// ------------------------------------------------------------------------------------ public
Isa best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return kAvx2;
  return kScalar;
}

Isa current_isa() {
  int v = g_isa.load(std::memory_order_relaxed);
  if (v < 0) {
    v = best_isa();
    g_isa.store(v, std::memory_order_relaxed);
  }
  return Isa(v);
}

// One group of 32 x -> max |x|, the sum, and round(x * levels / max|x|) half to even as 4 vectors
// of int32 (vcvtps2dq in the default rounding mode: the scalar paths' 1.5 * 2^23 addition, bit for bit).
static TIERED_AVX2 inline __attribute__((always_inline)) void quantize_group_avx2(const float* p, float levels,
                                                                                 __m256i q[4], float& amax,
                                                                                 float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(p + 8 * i);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  sum = hsum256(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? levels / amax : 0.f);
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
}

// One row of the q8 fields (gemv.h): xq (chunked), xqt, dxg, dx16, xsum, m8, xqs of row b.
static void q8_row_scalar(const float* x, int64_t K, int64_t Gp, int8_t* xq, int8_t* xqt, float* dxg, float* dx16,
                   float* xsum, float* m8, int32_t* xqs) {
  constexpr float kRound = 12582912.f;
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* p = x + g * kGroup;
    float amax = 0.f, sum = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(p[i])), sum += p[i];
    const float inv = amax > 0.f ? 127.f / amax : 0.f, dx = amax / 127.f;
    int8_t* o = xq + (g / 4) * 128 + (g % 4) * 16;
    int32_t s = 0;
    for (int64_t i = 0; i < kGroup / 2; ++i) {
      const int32_t e = int32_t((p[2 * i] * inv + kRound) - kRound), od = int32_t((p[2 * i + 1] * inv + kRound) - kRound);
      o[i] = int8_t(e), o[64 + i] = int8_t(od), s += e + od;
      xqt[g * kGroup + 2 * i] = int8_t(e), xqt[g * kGroup + 2 * i + 1] = int8_t(od);
    }
    dxg[g] = dx;
    dx16[g * 4] = dx16[g * 4 + 1] = dx16[g * 4 + 2] = dx16[g * 4 + 3] = dx;
    xsum[g] = sum;
    m8[g] = -8.f * dx * float(s);
    xqs[g] = s;
  }
}

static TIERED_AVX2 void q8_row_avx2(const float* x, int64_t K, int64_t Gp, int8_t* xq, int8_t* xqt, float* dxg, float* dx16,
                             float* xsum, float* m8, int32_t* xqs) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // per 128-bit lane: its 8 even bytes, then its 8 odd ones
  const __m256i eo = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                      0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    __m256i q[4];
    float amax, sum;
    quantize_group_avx2(x + g * kGroup, 127.f, q, amax, sum);
    const float dx = amax / 127.f;
    const __m256i q8 = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);  // column order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xqt + g * kGroup), q8);
    // xq's chunk: the group's 16 even columns, and 64 bytes on its 16 odd ones
    const __m256i split = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q8, eo), 0xD8);
    int8_t* o = xq + (g / 4) * 128 + (g % 4) * 16;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(split));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 64), _mm256_extracti128_si256(split, 1));
    const __m256i qs = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(qs), _mm256_extracti128_si256(qs, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    dxg[g] = dx;
    dx16[g * 4] = dx16[g * 4 + 1] = dx16[g * 4 + 2] = dx16[g * 4 + 3] = dx;
    xsum[g] = sum;
    xqs[g] = _mm_cvtsi128_si32(t);
    m8[g] = -8.f * dx * float(xqs[g]);
  }
}

// One row of the w16 fields (gemv.h): xw, xs, dw, wsum of row b.
static void w16_row_scalar(const float* x, int64_t K, uint32_t* xw, int16_t* xs, float* dw, float* wsum) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding and subtracting rounds half to even
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* p = x + g * kGroup;
    float amax = 0.f, sum = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(p[i])), sum += p[i];
    const float inv = amax > 0.f ? kW16Levels / amax : 0.f;
    dw[g] = amax / kW16Levels, wsum[g] = sum;
    uint32_t* o = xw + g * kGroup / 2;
    for (int64_t c = 0; c < kGroup; c += 8) {
      int32_t q[8];
      for (int i = 0; i < 8; ++i) {
        q[i] = int32_t((p[c + i] * inv + kRound) - kRound);
        xs[g * kGroup + c + i] = int16_t(q[i]);
      }
      const int pairs_of[4][2] = {{0, 2}, {4, 6}, {1, 3}, {5, 7}};
      for (int i = 0; i < 4; ++i)
        o[c / 2 + i] = uint32_t(uint16_t(int16_t(q[pairs_of[i][0]]))) | (uint32_t(uint16_t(int16_t(q[pairs_of[i][1]]))) << 16);
    }
  }
}

static TIERED_AVX2 void w16_row_avx2(const float* x, int64_t K, uint32_t* xw, int16_t* xs, float* dw, float* wsum) {
  // per 128-bit lane (8 columns as int16): words 0, 2, 4, 6, 1, 3, 5, 7 = pairs (0, 2), (4, 6), (1, 3), (5, 7)
  const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    __m256i q[4];
    float amax, sum;
    quantize_group_avx2(x + g * kGroup, kW16Levels, q, amax, sum);
    dw[g] = amax / kW16Levels, wsum[g] = sum;
    for (int h = 0; h < 2; ++h) {  // 16 columns: packs interleaves 4-column runs across lanes
      const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xs + g * kGroup + 16 * h), w);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xw + (g * kGroup + 16 * h) / 2), _mm256_shuffle_epi8(w, pairs));
    }
  }
}

// xs [n] int16 -> xh, xl [n] signed bytes with xs = 256 xh + xl (int4t_w16_avx512's split activations).
// A function of its own, built for AVX-512 and vectorized: inline in ActBuffers::prepare the byte
// stores (which may alias anything) made the compiler reload the vectors' data pointers and the bound
// at every element, a scalar loop that took ~10% of the calling thread's time in a SmolLM2 decode
// step on the 2-core EPYC (perf, 2026-11-26).
static TIERED_AVX512 void split_w16_avx512(const int16_t* __restrict xs, int64_t n, int8_t* __restrict xh,
                                           int8_t* __restrict xl) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const int8_t l = int8_t(uint8_t(uint16_t(xs[i]) & 0xFF));
    xl[i] = l;
    xh[i] = int8_t((int32_t(xs[i]) - l) >> 8);
  }
}

// Rows of x per parallel work item when quantizing activations (one row of K = 576 is ~1 us).
constexpr int64_t kQuantGrain = 4;

// x fp32 [B, K] -> the Act's q8 fields (gemv.h): per group of 32, dx = max|x| / 127 and
// xq = round(x * (127 / max|x|)), half to even; rows in parallel, AVX2 where the CPU has it.
void ActBuffers::quantize_q8(const float* x, int64_t B, int64_t K, Act& a) {
  const int64_t G = K / kGroup, Gp = (G + 3) / 4 * 4;
  // no fill: each row zeroes its own padding groups (a fill of the buffers here ran on this thread alone
  // while the others waited, ~0.6 MB at 512 rows of 576)
  xq.resize(B * Gp * kGroup);
  xqt.resize(B * K);
  dxg.resize(B * G);
  dx16.resize(B * Gp * 4);
  xsum.resize(B * Gp);
  m8.resize(B * Gp);
  xqs.resize(B * G);
  const bool avx2 = current_isa() >= kAvx2;
  at::parallel_for(0, B, kQuantGrain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int8_t* q = xq.data() + b * Gp * kGroup;
      float *d16 = dx16.data() + b * Gp * 4, *xs = xsum.data() + b * Gp, *m = m8.data() + b * Gp;
      for (int64_t g = G; g < Gp; ++g) {  // the padding groups: zero codes, scales and sums
        int8_t* o = q + (g / 4) * 128 + (g % 4) * 16;
        std::memset(o, 0, 16), std::memset(o + 64, 0, 16);
        std::fill(d16 + g * 4, d16 + g * 4 + 4, 0.f);
        xs[g] = m[g] = 0.f;
      }
      (avx2 ? q8_row_avx2 : q8_row_scalar)(x + b * K, K, Gp, q, xqt.data() + b * K, dxg.data() + b * G, d16, xs, m,
                                           xqs.data() + b * G);
    }
  });
  a.xq = xq.data(), a.dx16 = dx16.data(), a.xsum = xsum.data(), a.m8 = m8.data(), a.Gp = Gp;
  a.xqt = xqt.data(), a.dxg = dxg.data(), a.xqs = xqs.data();
}

Act ActBuffers::prepare(const float* x, int64_t B, int64_t K, ActNeeds needs) {
  const int64_t n = B * K, G = K / kGroup;
  Act a;
  a.x = x, a.B = B, a.K = K;
  if (needs.bf16 || needs.pairs) {
    xr.resize(n);
    xb.resize(n);
    gsum.resize(B * G);
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t h = to_bf16(x[i]);
      xb[i] = h;
      xr[i] = bf16f(h);
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < G; ++g) {
        const float* p = xr.data() + b * K + g * kGroup;
        float s = 0.f;
        for (int64_t i = 0; i < kGroup; ++i) s += p[i];
        gsum[b * G + g] = s;
      }
    a.xr = xr.data(), a.xb = xb.data(), a.gsum = gsum.data();
  }
  if (needs.q8) quantize_q8(x, B, K, a);
  if (needs.pairs) {
    xp.resize(B * K / 2);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t k = 0; k + 8 <= K; k += 8)
        for (int64_t j = 0; j < 4; ++j)
          xp[(b * K + k) / 2 + j] = uint32_t(xb[b * K + k + j]) | (uint32_t(xb[b * K + k + 4 + j]) << 16);
    a.xp = xp.data();
  }
  if (needs.w16) {
    xw.resize(B * K / 2);
    xs.resize(B * K);
    dw.resize(B * G);
    wsum.resize(B * G);
    const bool avx2 = current_isa() >= kAvx2;
    at::parallel_for(0, B, kQuantGrain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        (avx2 ? w16_row_avx2 : w16_row_scalar)(x + b * K, K, xw.data() + b * K / 2, xs.data() + b * K,
                                               dw.data() + b * G, wsum.data() + b * G);
    });
    a.xw = xw.data(), a.xs = xs.data(), a.dw = dw.data(), a.wsum = wsum.data();
  }
  if (needs.w16 && needs.split) {  // only the tiled kernels read these: not on the per-row int8 path
    xsq.resize(B * G);
    for (int64_t i = 0; i < B * G; ++i) {
      int32_t s = 0;
      for (int64_t k = 0; k < kGroup; ++k) s += xs[i * kGroup + k];
      xsq[i] = s;
    }
    a.xsq = xsq.data();
    if (current_isa() == kAvx512) {  // xs = 256 xh + xl, both signed bytes (|xs| <= kW16Levels)
      xh.resize(B * K);
      xl.resize(B * K);
      split_w16_avx512(xs.data(), B * K, xh.data(), xl.data());
      a.xh = xh.data(), a.xl = xl.data();
    }
  }
  if (needs.s16 && K % 16 == 0) {  // the q6k kernels' offset terms: sums per 16 columns
    auto sums = [&](std::vector<int32_t>& out, auto* q) {
      out.resize(B * K / 16);
      for (int64_t i = 0; i < B * K / 16; ++i) {
        int32_t s = 0;
        for (int64_t k = 0; k < 16; ++k) s += q[i * 16 + k];
        out[i] = s;
      }
      return out.data();
    };
    if (a.xs) a.s16w = sums(s16w, a.xs);
    if (a.xqt) a.s16q = sums(s16q, a.xqt);
  }
  return a;
}

void Gemv::run(const float* x, int64_t B, float* y) const {
  thread_local ActBuffers buf;
  const Act a = buf.prepare(x, B, in_features, needs(B));
  const Part part{this, y, out_features};
  run_parts(&part, 1, a);
}

}  // namespace gemv

// m.def(name): a process-wide switch `flag`, returning its setting before the call and set first to `enabled` where
// given (amx_rows, bf16_attention_avx512).
static void def_flag(pybind11::module& m, const char* name, std::atomic<bool>& flag, const char* doc) {
  m.def(name, [&flag](c10::optional<bool> enabled) {
          const bool was = flag.load();
          if (enabled) flag.store(*enabled);
          return was;
        },
        pybind11::arg("enabled") = pybind11::none(), doc);
}

// A k-quant format's three bindings: <kName>_kernel (its GEMV over the layout's tensors, named qt, `scales`, `supers`;
// held, no copy), <kPack> (its repacking pass, kquant_blocks) and <kName>_tiled_dequantize (kquant_tiled_dequantize,
// `formula` in float32 as gguf computes it).
template <class F>
void def_kquant(pybind11::module& m, const char* scales, const char* supers, const std::string& kernel_doc,
                const std::string& pack_doc, const std::string& formula) {
  namespace py = pybind11;
  using namespace gemv;
  const std::string name(F::kName);
  m.def((name + "_kernel").c_str(),
        [](at::Tensor qt, at::Tensor sc, at::Tensor d, c10::optional<at::Tensor> bias, const std::string& batch_act)
            -> KernelPtr { return make_kquant<F>(qt, sc, d, bias, batch_act); },
        py::arg("qt"), py::arg(scales), py::arg(supers), py::arg("bias") = py::none(), py::arg("batch_act") = "bf16",
        (kernel_doc + " batch_act as int8_tiled_kernel's. Holds the tensors (no copy).").c_str());
  m.def(F::kPack, &kquant_blocks<F>, py::call_guard<py::gil_scoped_release>(), py::arg("raw"),
        py::arg("qt_out") = py::none(), py::arg("scales_out") = py::none(), py::arg("supers_out") = py::none(),
        (pack_doc + " qt_out, scales_out, supers_out: write into these (contiguous, those dtypes and shapes) instead of "
                    "new tensors.").c_str());
  m.def((name + "_tiled_dequantize").c_str(), &kquant_tiled_dequantize<F>, py::call_guard<py::gil_scoped_release>(),
        py::arg("qt"), py::arg(scales), py::arg(supers), py::arg("bf16") = true, py::arg("out") = py::none(),
        ("A " + name + " weight (" + name + "_kernel's tensors) -> [N, K]: " + formula + " in float32 (gguf's "
         "arithmetic), as float32 or rounded to bfloat16 (nearest even); out: write into it (contiguous, that dtype and "
         "shape) instead of a new tensor.").c_str());
}

void register_gemv(pybind11::module& m) {
  namespace py = pybind11;
  using namespace gemv;
  m.def("int4_kernel", [](at::Tensor codes, at::Tensor scale, at::Tensor zero, c10::optional<at::Tensor> residual,
                          c10::optional<at::Tensor> bias, const std::string& act) -> KernelPtr {
          TIERED_CHECK(act == "bf16" || act == "q8", "int4_kernel: act must be 'bf16' or 'q8', got '", act, "'");
          return act == "q8" ? make_int4<Int4Q8Gemv>(codes, scale, zero, residual, bias)
                             : make_int4<Int4Gemv>(codes, scale, zero, residual, bias);
        },
        py::arg("codes"), py::arg("scale"), py::arg("zero"), py::arg("residual") = py::none(),
        py::arg("bias") = py::none(), py::arg("act") = "bf16",
        "tiered's int4 GEMV. codes uint8 [N, K/2] (column 2i low nibble, 2i+1 high), scale / zero / residual "
        "bf16 [N, K/32] views (any strides): w = (q - 8) * scale + zero + residual. Holds the tensors (no copy). "
        "act: the activations it reads, 'bf16' (x rounded to bf16, vdpbf16ps) or 'q8' (x quantized to int8 per "
        "group of 32, vpdpbusd: faster, less exact).");
  m.def("int4_tiled_kernel", [](at::Tensor codes, c10::optional<at::Tensor> sz, c10::optional<at::Tensor> residual,
                                c10::optional<at::Tensor> bias, const std::string& act,
                                c10::optional<std::string> batch_act, bool e2m1) -> KernelPtr {
          const std::string batch = batch_act ? *batch_act : act;
          TIERED_CHECK((act == "bf16" || act == "q8") && (batch == "bf16" || batch == "q8"),
                      "int4_tiled_kernel: act and batch_act must be 'bf16' or 'q8', got '", act, "', '", batch, "'");
          const int64_t q8_from = act == "q8" ? 1 : batch == "q8" ? 2 : kNeverQ8;
          return make_int4_tiled(codes, sz, residual, bias, q8_from, e2m1);
        },
        py::arg("codes"), py::arg("sz"), py::arg("residual") = py::none(), py::arg("bias") = py::none(),
        py::arg("act") = "bf16", py::arg("batch_act") = py::none(), py::arg("e2m1") = false,
        "tiered's int4 GEMV over the tiled layout (kernels/linear.py tiled_codes / tiled_scales): codes uint8 "
        "[N, K/2], sz bf16 [N/16, K/32, 16, 2] (scale, zero), residual bf16 [N/16, K/32, 16]; or the scales "
        "inline (kernels/linear.py tiled_inline): codes uint8 [N/16, K/32, 320], sz None, the residual as before: "
        "w = (q - 8) * scale + zero + residual; N % 16 == 0. act as int4_kernel's, for calls of one "
        "activation row; batch_act for calls of two or more (default: act). e2m1: MXFP4 codes (FP4 e2m1, "
        "quant/mxfp4.py): w = (E2M1_U[q] - 12) * scale + zero + residual, on int8 activations at every call "
        "size (act and batch_act ignored).");
  m.def("int4_tiled_dequantize", [](at::Tensor codes, c10::optional<at::Tensor> sz, c10::optional<at::Tensor> residual,
                                    int64_t n0, int64_t n1, bool fp32, c10::optional<at::Tensor> out_, bool e2m1) {
          auto k = make_int4_tiled(codes, sz, residual, c10::nullopt, kNeverQ8, e2m1);
          const int64_t N = k->out_features, K = k->in_features;
          if (n1 < 0) n1 = N;
          TIERED_CHECK(0 <= n0 && n0 <= n1 && n1 <= N && n0 % kBlock == 0 && (n1 % kBlock == 0 || n1 == N),
                      "int4_tiled_dequantize: rows [", n0, ", ", n1, ") must be whole tiles of 16 within [0, ", N, ")");
          const auto dt = fp32 ? at::kFloat : at::kBFloat16;
          if (out_) {
            TIERED_CHECK(out_->device().is_cpu() && out_->scalar_type() == dt && out_->is_contiguous() &&
                            out_->sizes() == at::IntArrayRef({n1 - n0, K}),
                        "int4_tiled_dequantize: out must be a contiguous CPU ", c10::toString(dt), " [", n1 - n0, ", ", K,
                        "] tensor, got ", out_->scalar_type(), " ", out_->sizes());
          }
          auto out = out_ ? *out_ : at::empty({n1 - n0, K}, dt);
          {
            py::gil_scoped_release nogil;
            int4t_dequantize(k->w, K, n0, n1, fp32 ? out.data_ptr<float>() : nullptr,
                             fp32 ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
          }
          return out;
        },
        py::arg("codes"), py::arg("sz"), py::arg("residual") = py::none(), py::arg("n0") = 0,
        py::arg("n1") = -1, py::arg("fp32") = false, py::arg("out") = py::none(), py::arg("e2m1") = false,
        "Rows [n0, n1) of a tiled int4 weight (int4_tiled_kernel's arguments) as bf16 (fp32 with fp32=True) "
        "[n1 - n0, K]: w = (q - 8) * scale + zero + residual, rounded once (the prefill path of a tiled-only weight). "
        "out: a tensor of that dtype and shape to write (a reused buffer: no fresh pages per call); returned. "
        "e2m1: MXFP4 codes, w = (E2M1_U[q] - 12) * scale + zero + residual (as int4_tiled_kernel's).");
  def_flag(m, "amx_rows", g_amx_rows,
        "Whether the native decode step's calls of tiled int4 and int8 kernels over 24+ rows take the AMX GEMM "
        "where it runs "
        "(True by default; tiered.kernels.load sets it off under TIERED_AMX=0); with `enabled`, set it for the process. Returns the "
        "setting before the call.");
  m.def("bf16_prompt_attention", &bf16_prompt_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"),
        py::arg("past") = 0, py::arg("window") = 0,
        "q [B, H, T, hd], k / v [B, Hkv, S, hd] bf16 (rows contiguous; S >= past + T, H % Hkv == 0, head_dim % 32 == "
        "0) -> causal softmax(scale q k^T) v [B, H, T, hd] bf16 (its memory [B, T, H, hd]), query i over keys "
        "0..past + i (past 0: SDPA's top-left causal mask; past > 0: a prefill chunk after past cached positions), or "
        "with window > 0 over keys past + i - window + 1..past + i (a sliding layer's), on AMX tiles where the native step's "
        "AMX calls run, else on AVX512-BF16 (bf16_attention_available())",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_attention_available", [] { return bf16_attention_path() != AttnPath::kNone; },
        "Whether bf16_prompt_attention (and the native step's bf16 prompt rows) have a kernel here: AMX where the "
        "native step's AMX calls run (amx_available() and amx_rows()), else AVX512-BF16 with bf16_attention_avx512() on.");
  def_flag(m, "bf16_attention_avx512", g_bf16_attention_avx512,
        "Whether a prompt's bf16 attention runs on AVX512-BF16 where AMX does not (True by default; off: A/Bs and "
        "tests); with `enabled`, set it for the process. Returns the setting before the call.");
  m.def("amx_available", &amx_ready,
        "Whether int4_tiled_gemm can run here: the CPU has AMX-TILE and AMX-BF16 and Linux granted this process the "
        "tile data (arch_prctl ARCH_REQ_XCOMP_PERM, asked once).");
  m.def("int4_tiled_gemm", [](at::Tensor codes, c10::optional<at::Tensor> sz, c10::optional<at::Tensor> residual,
                              at::Tensor x, c10::optional<at::Tensor> bias, bool fp32, bool e2m1) {
          TIERED_CHECK(amx_ready(), "int4_tiled_gemm: needs AMX (AMX-TILE and AMX-BF16, granted by the kernel)");
          auto k = make_int4_tiled(codes, sz, residual, bias, kNeverQ8, e2m1);
          const int64_t N = k->out_features, K = k->in_features;
          TIERED_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == K &&
                          x.stride(1) == 1 && x.stride(0) >= K,
                      "int4_tiled_gemm: x must be a CPU bf16 [M, ", K, "] with contiguous rows, got ", x.scalar_type(),
                      " ", x.sizes(), " strides ", x.strides());
          const int64_t M = x.size(0);
          auto out = at::empty({M, N}, fp32 ? at::kFloat : at::kBFloat16);
          if (M > 0) {
            py::gil_scoped_release nogil;
            int4t_amx_gemm(k->w, reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), x.stride(0), M, K, N,
                           fp32 ? out.data_ptr<float>() : nullptr,
                           fp32 ? nullptr : reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), N);
          }
          return out;
        },
        py::arg("codes"), py::arg("sz"), py::arg("residual") = py::none(), py::arg("x"), py::arg("bias") = py::none(),
        py::arg("fp32") = false, py::arg("e2m1") = false,
        "x [M, K] bf16 @ W^T (+ bias) -> [M, N] bf16 (fp32 with fp32=True) for a tiled int4 weight (int4_tiled_kernel's "
        "codes, sz, residual, e2m1) on AMX: W as int4_tiled_dequantize rounds it to bf16, the products summed in fp32 "
        "by TDPBF16PS, each thread's 32-row blocks of W dequantized into AMX's tile layout in its cache. Needs "
        "amx_available().");
  m.def("int8_kernel", [](at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> bias) -> KernelPtr {
          return make_int8(q, scale, bias);
        },
        py::arg("q"), py::arg("scale"), py::arg("bias") = py::none(),
        "tiered's int8 GEMV. q int8 [N, K] contiguous, scale [N] any float dtype: w = q * scale.");
  m.def("int8_tiled_kernel", [](at::Tensor qt, at::Tensor scale, c10::optional<at::Tensor> bias, const std::string& batch_act) -> KernelPtr {
          return make_int8_tiled(qt, scale, bias, batch_act);
        },
        py::arg("qt"), py::arg("scale"), py::arg("bias") = py::none(), py::arg("batch_act") = "bf16",
        "tiered's int8 GEMV over the tiled layout (kernels/linear.tiled_int8). qt uint8 [N, K] contiguous "
        "(N % 16 == 0, K % 32 == 0), scale [N] any float dtype: w = (q - 128) * scale. batch_act: what calls of "
        "two or more rows read, 'bf16' (x quantized to int16 per group of 32, as one row) or 'q8' (int8 per group "
        "of 32: one vpdpbusd per 4 weights where int16 takes two; AVX-512 and scalar paths, AVX2 keeps int16).");
  m.def("int8g32_tiled_kernel", [](at::Tensor qt, at::Tensor st, c10::optional<at::Tensor> bias, const std::string& batch_act) -> KernelPtr {
          return make_int8g32_tiled(qt, st, bias, batch_act);
        },
        py::arg("qt"), py::arg("st"), py::arg("bias") = py::none(), py::arg("batch_act") = "bf16",
        "tiered's int8 GEMV with fp16 scales per group of 32 (GGUF Q8_0's), tiled layout "
        "(kernels/linear.tiled_int8, tiled_group_scales). qt uint8 [N, K] contiguous (N % 16 == 0, K % 32 == 0), "
        "st float16 [N/16, K/32, 16]: w = (q - 128) * s. batch_act as int8_tiled_kernel's.");
  def_kquant<Q6KFormat>(m, "sc", "d",
                        "tiered's GEMV over GGUF Q6_K weights as stored (q6k_blocks_q6t's layout): qt uint8 [N/16, K/32, "
                        "384], sc int8 [N/16, K/16, 16], d float16 [N/16, K/256, 16] (K % 256 == 0): w = d sc (u - 32).",
                        "GGUF Q6_K blocks uint8 [N, K/256 * 210] (N % 16 == 0) -> (qt uint8 [N/16, K/32, 384], sc int8 "
                        "[N/16, K/16, 16], d float16 [N/16, K/256, 16]): the q6k kernel's layout of the same codes and "
                        "scales, bit for bit.",
                        "(d sc) (u - 32)");
  def_kquant<Q5KFormat>(m, "sm", "dd",
                        "tiered's GEMV over GGUF Q5_K weights as stored (q5k_blocks_q5t's layout): qt uint8 [N/16, K/32, "
                        "320], sm uint8 [N/16, K/32, 2, 16] (sc, then m), dd float16 [N/16, K/256, 2, 16] (d, then "
                        "dmin), K % 256 == 0: w = d sc u - dmin m.",
                        "GGUF Q5_K blocks uint8 [N, K/256 * 176] (N % 16 == 0) -> (qt uint8 [N/16, K/32, 320], sm uint8 "
                        "[N/16, K/32, 2, 16], dd float16 [N/16, K/256, 2, 16]): the q5k kernel's layout of the same codes "
                        "and scales, bit for bit.",
                        "(d sc) u - (dmin m)");
  def_kquant<IQ4XSFormat>(m, "sc", "d",
                          "tiered's GEMV over GGUF IQ4_XS weights as stored (iq4xs_blocks_q4t's layout): qt uint8 [N/16, "
                          "K/32, 256] (the 4-bit codebook indices), sc int8 [N/16, K/32, 16] (ls - 32), d float16 [N/16, "
                          "K/256, 16], K % 256 == 0: w = d (ls - 32) kvalues_iq4nl[i].",
                          "GGUF IQ4_XS super-blocks uint8 [N, K/256 * 136] (N % 16 == 0) -> (qt uint8 [N/16, K/32, 256], "
                          "sc int8 [N/16, K/32, 16], d float16 [N/16, K/256, 16]): the iq4xs kernel's layout of the same "
                          "indices and scales, bit for bit.",
                          "(d (ls - 32)) v");
  m.def("fp8_kernel", [](at::Tensor q, at::Tensor bs, c10::optional<at::Tensor> bias, int64_t row_block) -> KernelPtr {
          return make_fp8(q, bs, bias, row_block);
        },
        py::arg("q"), py::arg("bs"), py::arg("bias") = py::none(), py::arg("row_block") = kFp8Block,
        "tiered's fp8 GEMV: FP8 E4M3 weights with a float32 scale per 128 x 128 block (DeepSeek-V3 / Qwen3-FP8's "
        "weight and weight_scale_inv). q uint8 [N, K] contiguous, the float8_e4m3fn bit patterns (or that "
        "float8_e4m3fn tensor itself), bs float32 [ceil(N/128), ceil(K/128)] contiguous: w[n, k] = e4m3(q[n, k]) * "
        "bs[n // 128, k // 128]; any N, K >= 1. row_block rb: rows per scale (1: per output channel; >= N: per "
        "tensor), bs [ceil(N/rb), ceil(K/128)], or [ceil(N/rb), 1] for one scale across the columns "
        "(compressed-tensors' / fbgemm's channel and tensor FP8). Reads x in fp32 as given, accumulates in fp32. "
        "Holds the tensors (no copy).");
  m.def("bf16_kernel", [](at::Tensor w, c10::optional<at::Tensor> bias) -> KernelPtr { return make_bf16(w, bias); },
        py::arg("w"), py::arg("bias") = py::none(), "tiered's bf16 GEMV. w bf16 [N, K] contiguous.");
  m.def("f32_kernel", [](at::Tensor w, c10::optional<at::Tensor> bias) -> KernelPtr { return make_f32(w, bias); },
        py::arg("w"), py::arg("bias") = py::none(),
        "tiered's fp32 GEMV (calls of more than 16 rows: at::linear). w float32 [N, K] contiguous.");
  m.def("expert_kernel", [](KernelPtr gate, KernelPtr up, KernelPtr down) -> KernelPtr {
          auto k = std::make_shared<ExpertGemv>();
          k->gate = as_gemv(gate, "gate"), k->up = as_gemv(up, "up"), k->down = as_gemv(down, "down");
          TIERED_CHECK(k->gate->in_features == k->up->in_features && k->gate->out_features == k->up->out_features &&
                          k->down->in_features == k->gate->out_features &&
                          k->down->out_features == k->gate->in_features,
                      "expert_kernel: shapes do not make a SwiGLU expert: gate ", k->gate->out_features, "x",
                      k->gate->in_features, ", up ", k->up->out_features, "x", k->up->in_features, ", down ",
                      k->down->out_features, "x", k->down->in_features);
          k->in_features = k->gate->in_features, k->out_features = k->down->out_features;
          return k;
        },
        py::arg("gate"), py::arg("up"), py::arg("down"),
        "A fused SwiGLU expert y [B, D] = down(silu(gate x) * up x) over three of tiered's own kernels.");
  py::class_<BoundExperts, std::shared_ptr<BoundExperts>>(m, "BoundExperts",
      "Every expert of one MoE layer bound as kernels to its resident weights (ExpertSpec.bind_layer, "
      "bf16_experts_bind): DecodeStep.set_moe's experts.")
      .def_property_readonly("num_experts", &BoundExperts::num_experts)
      .def_property_readonly("hidden", &BoundExperts::hidden);
  py::class_<ExpertSpec, std::shared_ptr<ExpertSpec>>(m, "ExpertSpec",
      "A quantized expert format's flat layout: forward(slot uint8 [nbytes], x [B, D]) -> y [B, D] fp32.")
      .def("forward", &ExpertSpec::forward, py::arg("slot"), py::arg("x"))
      .def("forward_amx", &ExpertSpec::forward_amx, py::arg("slot"), py::arg("x"), py::arg("swiglu_limit") = 0.0,
           py::arg("swiglu_alpha") = 1.702,
           "One expert on the AMX GEMM: slot uint8, x [B, D] -> y [B, D] fp32 (gate and up over x rounded to bf16 into "
           "bf16, their SwiGLU in fp32 rounded to bf16, down over it: forward_layer's experts past amx_rows), or None "
           "where it has no AMX path here (no AMX, amx_rows off, a gate of another kind). swiglu_limit > 0: gpt-oss's "
           "biased experts (their bias columns and clamped GLU with swiglu_alpha; x without the bias columns).")
      .def("forward_group", &ExpertSpec::forward_group, py::arg("slots"), py::arg("xs"), py::arg("bounds"),
           py::arg("swiglu_limit") = 0.0, py::arg("swiglu_alpha") = 1.702, py::arg("format_rows") = 0,
           "Experts of one layer in two parallel regions: slots [E] (one uint8 slot each), xs [M, D] (expert e's "
           "rows bounds[e]..bounds[e + 1], any number each: the weights are read once for all of them) -> ys [M, D] "
           "fp32, each row its expert's output. swiglu_limit > 0: gpt-oss's biased experts (their bias columns "
           "and clamped GLU with swiglu_alpha; xs without the bias columns). format_rows > 0: every expert's rows "
           "take the activation formats of a call of at least that many rows (a MoE step's tokens, as "
           "forward_layer's: a token's output then does not depend on how many tokens its expert took); 0: each "
           "expert's own rows.")
      .def("bind_layer", &ExpertSpec::bind_layer, py::arg("slots"),
           "Every expert of one layer bound as kernels once (slots [E], expert e's at e), for DecodeStep.set_moe.")
      .def("forward_layer", &ExpertSpec::forward_layer, py::arg("slots"), py::arg("x"), py::arg("topk_idx"),
           py::arg("topk_weight"), py::arg("experts"), py::arg("swiglu_limit") = 0.0, py::arg("swiglu_alpha") = 1.702,
           py::arg("given") = std::vector<c10::optional<at::Tensor>>{}, py::arg("amx_rows") = 0,
           "A layer's routed experts and their weighted sum: slots [E] (one per id in experts, ascending), x [N, D] "
           "float32 or bfloat16, topk_idx int64 [N, k], topk_weight [N, k] in x's dtype -> out [N, D] in x's dtype, "
           "bit for bit the per-expert path's index_add_ of ys * weight in expert order (each expert's rows in groups "
           "of 8, as forward_group's). swiglu_limit > 0: gpt-oss's biased experts, as forward_group. given: [] or one "
           "per expert, None or that expert's outputs [its rows, D] in x's dtype (flat order) computed elsewhere. "
           "amx_rows > 0: an expert of more rows (not given) runs on the AMX GEMM, as forward_amx computes it.");
  // The load's repacks (q4 / q6k / q8 blocks, the Q8_0 head) run without the GIL: LLM() loads the tokenizer
  // on a thread of its own meanwhile (engine/llm._in_background).
  m.def("q4_blocks_tiled", &q4_blocks_tiled, py::call_guard<py::gil_scoped_release>(), py::arg("raw"), py::arg("block"), py::arg("codes_out") = py::none(),
        py::arg("sz_out") = py::none(), py::arg("zr_out") = py::none(), py::arg("inline_sz") = false,
        py::arg("inline_out") = py::none(),
        "GGUF Q4_0 (block 18) / Q4_1 (block 20) blocks uint8 [N, K/32 * block], or Q4_K super-blocks (block 144) uint8 "
        "[N, K/256 * 144], -> (codes uint8 [N, K/2] in the tiled "
        "layout, sz bf16 [N/16, K/32, 16, 2], zero residual bf16 [N/16, K/32, 16]): quant/int4.unpack_q4_blocks (Q4_K: "
        "quant/gguf_experts.unpack_q4k_blocks) then "
        "kernels/linear.tiled_codes / tiled_scales / tiled_residual, bit for bit. *_out: write into these (contiguous, "
        "those shapes and dtypes, e.g. views of an expert's slot) instead of new tensors. inline_sz (or inline_out "
        "given): (codes and scales inline, uint8 [N/16, K/32, 320] as kernels/linear.tiled_inline, and the residual).");
  m.def("q6k_blocks_tiled", &q6k_blocks_tiled, py::call_guard<py::gil_scoped_release>(), py::arg("raw"), py::arg("qt_out") = py::none(),
        py::arg("st_out") = py::none(),
        "GGUF Q6_K blocks uint8 [N, K/256 * 210] -> (qt uint8 [N, K] in the tiled int8 layout, st float16 [N/16, K/32, "
        "16]): quant/gguf_dequant.dequantize_blocks, quant/int8.quantize_int8_g32 and kernels/linear.tiled_int8 / "
        "tiled_group_scales, bit for bit. *_out: write into these (contiguous, those shapes and dtypes) instead of "
        "new tensors.");
  m.def("int8g32_tiled_dequantize", &int8g32_tiled_dequantize_bf16, py::call_guard<py::gil_scoped_release>(), py::arg("qt"), py::arg("st"),
        py::arg("out") = py::none(),
        "A tiled int8-g32 weight (qt uint8 [N, K], st float16 [N/16, K/32, 16]) -> bf16 [N, K]: (qt - 128) * s "
        "rounded to nearest even; out: write into it (contiguous bf16 [N, K]) instead of a new tensor.");
  m.def("q8_rows_int8", &q8_rows_int8, py::call_guard<py::gil_scoped_release>(), py::arg("raw"),
        "GGUF Q8_0 blocks uint8 [N, K/32 * 34] -> (q int8 [N, K], scale float32 [N]): per-row int8 of the dequantized "
        "rows, bit for bit quant/int8.quantize_int8's.");
  m.def("iq4_blocks_tiled", &iq4_blocks_tiled, py::call_guard<py::gil_scoped_release>(), py::arg("raw"),
        py::arg("xs"), py::arg("qt_out") = py::none(), py::arg("st_out") = py::none(),
        "GGUF IQ4_NL blocks uint8 [N, K/32 * 18] (xs False) or IQ4_XS super-blocks uint8 [N, K/256 * 136] (xs True), N % "
        "16 == 0 -> int8-g32 in the tiled int8 layout (qt uint8 [N, K], st float16 [N/16, K/32, 16]): q the codebook's "
        "int8 values exactly, the scale per 32 IQ4_NL's d or IQ4_XS's d (ls - 32) rounded to float16. qt_out, st_out: "
        "write into these instead of new tensors.");
  m.def("q4k_dequantize_rows", &q4k_dequantize_rows, py::call_guard<py::gil_scoped_release>(), py::arg("raw"),
        "GGUF Q4_K super-blocks uint8 [N, K / 256 * 144] -> fp32 [N, K]: gguf.quants.dequantize's values bit for bit.");
  m.def("q6k_fit_rows", &q6k_fit_rows, py::call_guard<py::gil_scoped_release>(), py::arg("w"),
        "fp32 rows w [N, K % 256 == 0] -> GGUF Q6_K super-blocks uint8 [N, K / 256 * 210]: quant/gguf_encode.quantize_q6_k's "
        "absmax fit, bit for bit.");
  m.def("q8_blocks_tiled", &q8_blocks_tiled, py::call_guard<py::gil_scoped_release>(), py::arg("raw"), py::arg("qt_out") = py::none(), py::arg("st_out") = py::none(),
        "GGUF Q8_0 blocks uint8 [N, K/32 * 34] -> (qt uint8 [N, K] in the tiled int8 layout, st float16 [N/16, K/32, 16]): "
        "quant/gguf_experts.unpack_q8_blocks then quant/experts.int8_g32_segments(layout='tiled'), bit for bit. *_out: "
        "write into these (contiguous, those shapes and dtypes) instead of new tensors.");
  m.def("expert_spec", [](std::vector<std::string> kinds, std::vector<std::vector<int64_t>> shapes,
                          std::vector<std::vector<int64_t>> offsets, int64_t nbytes, const std::string& int4_act,
                          const std::string& int4_layout, const std::string& int4_batch_act) {
          TIERED_CHECK((int4_act == "bf16" || int4_act == "q8") && (int4_batch_act.empty() || int4_batch_act == "bf16" ||
                                                                    int4_batch_act == "q8"),
                      "expert_spec: int4_act and int4_batch_act must be 'bf16' or 'q8'");
          TIERED_CHECK(int4_layout == "plain" || int4_layout == "tiled", "expert_spec: int4_layout must be 'plain' or 'tiled'");
          TIERED_CHECK(kinds.size() == 3 && shapes.size() == 3 && offsets.size() == 3, "expert_spec: three projections");
          auto sp = std::make_shared<ExpertSpec>();
          sp->nbytes = nbytes;
          sp->int4_q8 = int4_act == "q8";
          sp->q8_from = int4_act == "q8" ? 1 : int4_batch_act == "q8" ? 2 : kNeverQ8;
          sp->int4_tiled = int4_layout == "tiled";
          sp->int8_q8_from = int8_q8_from(int4_batch_act.empty() ? "bf16" : int4_batch_act, "expert_spec");
          for (int i = 0; i < 3; ++i) {
            auto& pr = sp->p[i];
            const auto& k = kinds[i];
            pr.kind = k == "int4" ? ExpertSpec::kInt4 : k == "int8" ? ExpertSpec::kInt8 : k == "bf16" ? ExpertSpec::kBf16
                      : k == "int8-g32" ? ExpertSpec::kInt8G32 : k == "fp8" ? ExpertSpec::kFp8
                      : k == "fp8-row" ? ExpertSpec::kFp8Row : k == "mxfp4" ? ExpertSpec::kMxfp4
                      : k == "q6k" ? ExpertSpec::kQ6K : k == "q5k" ? ExpertSpec::kQ5K : k == "iq4xs" ? ExpertSpec::kIQ4XS : -1;
            TIERED_CHECK(pr.kind >= 0, "expert_spec: no native kernel for kind ", k);
            TIERED_CHECK(shapes[i].size() == 2, "expert_spec: shapes are (N, K)");
            pr.N = shapes[i][0], pr.K = shapes[i][1];
            TIERED_CHECK(pr.kind != ExpertSpec::kInt8G32 || (sp->int4_tiled && int8_tiles(pr.N, pr.K)),
                        "expert_spec: int8-g32 has a native kernel in the tiled layout only, N % 16 == 0 and K % 32 == 0");
            TIERED_CHECK(pr.kind != ExpertSpec::kInt4 || pr.K % kGroup == 0, "expert_spec: int4 needs K % 32 == 0");
            TIERED_CHECK(pr.kind != ExpertSpec::kInt4 || !sp->int4_tiled || pr.N % kBlock == 0,
                        "expert_spec: the tiled int4 layout needs N % 16 == 0");
            for (size_t j = 0; j < 3; ++j) pr.off[j] = j < offsets[i].size() ? offsets[i][j] : 0;
            for (size_t j = 0; j < 3; ++j)
              TIERED_CHECK(pr.off[j] >= 0 ? pr.off[j] < nbytes
                                          : (pr.kind == ExpertSpec::kInt4 || pr.kind == ExpertSpec::kMxfp4) && j == 2,
                          "expert_spec: offset ", pr.off[j], " out of the slot's ", nbytes,
                          " bytes (only an int4 residual may be -1: not read)");
            TIERED_CHECK(pr.kind != ExpertSpec::kMxfp4 || (sp->int4_tiled && pr.K % kGroup == 0 && pr.N % kBlock == 0 &&
                                                          pr.off[1] == pr.off[0] + 256 &&
                                                          pr.off[0] + pr.N / kBlock * (pr.K / kGroup) * 320 <= nbytes),
                        "expert_spec: mxfp4 has a native kernel in the tiled layout only, its scales inline (offsets "
                        "codes, codes + 256), N % 16 == 0 and K % 32 == 0");
            if (pr.kind == ExpertSpec::kQ6K || pr.kind == ExpertSpec::kQ5K || pr.kind == ExpertSpec::kIQ4XS) {
              const auto parts = pr.kind == ExpertSpec::kQ6K ? Q6KFormat::parts(pr.N / kBlock, pr.K)
                                 : pr.kind == ExpertSpec::kQ5K ? Q5KFormat::parts(pr.N / kBlock, pr.K)
                                                               : IQ4XSFormat::parts(pr.N / kBlock, pr.K);
              TIERED_CHECK(sp->int4_tiled && pr.N % kBlock == 0 && pr.K % 256 == 0, "expert_spec: ", k, " has a native "
                          "kernel in the tiled layout only, N % 16 == 0 and K % 256 == 0");
              for (size_t j = 0; j < 3; ++j) {
                const auto& part = parts[j];
                int64_t bytes = c10::elementSize(part.dtype);
                for (int64_t d : part.shape) bytes *= d;
                TIERED_CHECK(pr.off[j] + bytes <= nbytes && pr.off[j] % int64_t(c10::elementSize(part.dtype)) == 0,
                            "expert_spec: ", k, "'s ", part.name, " (", bytes, " bytes) must lie in the slot's ", nbytes,
                            " bytes, aligned to its element");
              }
            }
            if (pr.kind == ExpertSpec::kFp8 || pr.kind == ExpertSpec::kFp8Row) {
              const int64_t bs_bytes = pr.kind == ExpertSpec::kFp8Row ? pr.N * 4 :
                  (pr.N + kFp8Block - 1) / kFp8Block * ((pr.K + kFp8Block - 1) / kFp8Block) * 4;
              TIERED_CHECK(pr.N > 0 && pr.K > 0 && pr.off[0] + pr.N * pr.K <= nbytes && pr.off[1] % 4 == 0 &&
                              pr.off[1] + bs_bytes <= nbytes,
                          "expert_spec: ", k, "'s q [N, K] and scales float32 ",
                          pr.kind == ExpertSpec::kFp8Row ? "[N]" : "[ceil(N/128), ceil(K/128)]",
                          " (4-byte aligned) must lie in the slot's ", nbytes, " bytes");
            }
          }
          // gpt-oss's biased experts (gemv.h's Glu): gate / up [F, Db], down [D, Fb], Db > D and Fb > F
          sp->biased = sp->p[2].K > sp->p[0].N && sp->p[2].N < sp->p[0].K;
          TIERED_CHECK(sp->p[0].K == sp->p[1].K && sp->p[0].N == sp->p[1].N &&
                          ((sp->p[2].K == sp->p[0].N && sp->p[2].N == sp->p[0].K) || sp->biased),
                      "expert_spec: shapes do not make a SwiGLU expert");
          return sp;
        },
        py::arg("kinds"), py::arg("shapes"), py::arg("offsets"), py::arg("nbytes"), py::arg("int4_act") = "bf16",
        py::arg("int4_layout") = "plain", py::arg("int4_batch_act") = "",
        "An ExpertSpec from per-projection kinds ('bf16', 'int8', 'int4' in int4_layout 'plain' or 'tiled', 'int8-g32' "
        "in the tiled layout, 'fp8'), (N, K) shapes and segment byte offsets (bf16: w; int8: q, scale bf16 [N]; int4: "
        "codes, sz bf16 [G, N, 2], zr bf16 [G, N]; fp8: q uint8 [N, K] e4m3fn bits, bs float32 [ceil(N/128), "
        "ceil(K/128)], as fp8_kernel); "
        "int4_act as int4_kernel's act; int4_batch_act (tiled layout, '' = int4_act) for calls of two or more rows, "
        "as int4_tiled_kernel's batch_act; 'q8' there also gives the tiled int8 and int8-g32 projections int8 "
        "activations in calls of two or more rows (int8_tiled_kernel's batch_act; one row keeps int16). 'mxfp4' (tiled layout only): tiled int4 with the scales inline and no "
        "residual (offsets: codes, codes + 256, -1), the codes FP4 e2m1 (int4_tiled_kernel's e2m1), int8 "
        "activations at every call size whatever int4_act says. 'q6k', 'q5k', 'iq4xs' (tiled layout only, N % 16 == 0, "
        "K % 256 == 0): a GGUF file's k-quant blocks in quant/kquant's layouts (offsets: qt, its scales, its super-block "
        "scales), as q6k_kernel & co.; their calls of two or more rows read int8 activations where int4_batch_act is "
        "'q8'.");
  m.def("bf16_expert_forward", [](at::Tensor wg, at::Tensor wu, at::Tensor wd, at::Tensor x0) {
          const int64_t F = wg.size(0), D = wg.size(1);
          const at::Tensor ws[3] = {wg, wu, wd};
          Bf16Gemv k[3];
          bind_bf16_expert(ws, F, D, k, "bf16_expert_forward");
          TIERED_CHECK(x0.dim() == 2 && x0.size(1) == D, "bf16_expert_forward: x must be [B, ", D, "]");
          auto x = x0.to(at::kFloat).contiguous();
          auto y = at::empty({x.size(0), D}, x.options());
          {
            py::gil_scoped_release nogil;
            swiglu(k[0], k[1], k[2], x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
          }
          return y;
        },
        py::arg("w_gate"), py::arg("w_up"), py::arg("w_down"), py::arg("x"),
        "A bf16 SwiGLU expert in one call: w_gate, w_up bf16 [F, D], w_down bf16 [D, F] contiguous, "
        "x [B, D] any float dtype -> y [B, D] fp32.");
  m.def("bf16_experts_forward_group", [](const std::vector<at::Tensor>& ws, const at::Tensor& xs,
                                         const std::vector<int64_t>& bounds, double swiglu_limit, double swiglu_alpha) {
          const auto glu = glu_of(swiglu_limit, swiglu_alpha, "bf16_experts_forward_group");
          const Bf16Experts k(ws, "bf16_experts_forward_group");
          return run_swiglu_group(k.ptrs, xs, bounds, "bf16_experts_forward_group", glu ? &*glu : nullptr);
        },
        py::arg("weights"), py::arg("xs"), py::arg("bounds"), py::arg("swiglu_limit") = 0.0,
        py::arg("swiglu_alpha") = 1.702,
        "bf16 SwiGLU experts of one layer in two parallel regions: weights [3 E] (w_gate, w_up [F, D], w_down [D, F] "
        "per expert), xs [M, D] (expert e's rows bounds[e]..bounds[e + 1], any number each) -> ys [M, D] fp32. "
        "swiglu_limit > 0: gpt-oss's biased experts (w_gate, w_up [F, Db], w_down [D, Fb]), as ExpertSpec's.");
  m.def("bf16_experts_bind", [](const std::vector<at::Tensor>& ws) {
          auto s = std::make_shared<std::pair<Bf16Experts, std::vector<at::Tensor>>>(Bf16Experts(ws, "bf16_experts_bind"), ws);
          auto b = std::make_shared<BoundExperts>();
          b->k = s->first.ptrs;
          b->owner = s;
          return b;
        },
        py::arg("weights"), "bf16 SwiGLU experts of one layer bound once (weights [3 E]: gate, up, down per expert).");
  m.def("bf16_experts_forward_layer", [](const std::vector<at::Tensor>& ws, const at::Tensor& x, const at::Tensor& topk_idx,
                                         const at::Tensor& topk_weight, const std::vector<int64_t>& experts,
                                         double swiglu_limit, double swiglu_alpha,
                                         const std::vector<c10::optional<at::Tensor>>& given) {
          const auto glu = glu_of(swiglu_limit, swiglu_alpha, "bf16_experts_forward_layer");
          const Bf16Experts k(ws, "bf16_experts_forward_layer");
          return run_swiglu_layer(k.ptrs, x, topk_idx, topk_weight, experts, "bf16_experts_forward_layer",
                                  glu ? &*glu : nullptr, given);
        },
        py::arg("weights"), py::arg("x"), py::arg("topk_idx"), py::arg("topk_weight"), py::arg("experts"),
        py::arg("swiglu_limit") = 0.0, py::arg("swiglu_alpha") = 1.702,
        py::arg("given") = std::vector<c10::optional<at::Tensor>>{},
        "bf16 SwiGLU experts of one layer and their weighted sum (ExpertSpec.forward_layer): weights [3 E].");
  m.def("set_isa", [](const std::string& name) {
          const int want = name == "avx512" ? kAvx512 : name == "avx2" ? kAvx2 : name == "scalar" ? kScalar : -1;
          TIERED_CHECK(want >= 0, "set_isa: unknown ISA '", name, "' (use avx512, avx2, scalar or best)");
          TIERED_CHECK(want <= best_isa(), "set_isa: this CPU has no ", name, " path (best: ", isa_name(best_isa()), ")");
          g_isa.store(want);
        },
        py::arg("name"), "Force tiered's GEMV kernels onto a lower ISA path: 'avx512', 'avx2' or 'scalar'.");
  m.def("reset_isa", []() { g_isa.store(best_isa()); }, "Use the best ISA path this CPU has again.");
  m.def("tuning", []() {
          pybind11::dict d;
          d["stream_prefetch"] = g_stream_prefetch;
          d["int4_int16_act"] = g_int4_w16;
          d["prefetch_l2"] = g_prefetch_l2;
          d["attend_wide"] = ::tiered::g_attend_wide;
          d["stream_prefetch_rows"] = g_stream_prefetch_rows;
          d["stream_prefetch_bytes"] = g_stream_prefetch_bytes;
          return d;
        }, "This machine's kernel tuning (tiered/kernels/tune.py): stream_prefetch, int4_int16_act, prefetch_l2, "
           "attend_wide, stream_prefetch_rows, stream_prefetch_bytes.");
  m.def("set_tuning", [](c10::optional<bool> stream_prefetch, c10::optional<bool> int4_int16_act,
                         c10::optional<bool> prefetch_l2, c10::optional<bool> attend_wide,
                         c10::optional<bool> stream_prefetch_rows, c10::optional<bool> stream_prefetch_bytes) {
          if (stream_prefetch) g_stream_prefetch = *stream_prefetch;
          if (int4_int16_act) g_int4_w16 = *int4_int16_act;
          if (prefetch_l2) g_prefetch_l2 = *prefetch_l2;
          if (attend_wide) ::tiered::g_attend_wide = *attend_wide && best_isa() >= kAvx512;  // AVX-512 only
          if (stream_prefetch_rows) g_stream_prefetch_rows = *stream_prefetch_rows;
          if (stream_prefetch_bytes) g_stream_prefetch_bytes = *stream_prefetch_bytes;
        }, pybind11::arg("stream_prefetch") = pybind11::none(), pybind11::arg("int4_int16_act") = pybind11::none(),
        pybind11::arg("prefetch_l2") = pybind11::none(), pybind11::arg("attend_wide") = pybind11::none(),
        pybind11::arg("stream_prefetch_rows") = pybind11::none(), pybind11::arg("stream_prefetch_bytes") = pybind11::none(),
        "Set the kernel tuning (between calls, not during one): software prefetch of the weight streams, "
        "int16 activations for tiled int4 at batch 1 on AVX-512, whether the stream prefetches fill the L2 "
        "rather than the L1, whether the native step's attention runs 16-float vectors (AVX-512 only), and "
        "whether calls of 2+ activation rows prefetch their weight streams where batch 1 does not, and whether "
        "batch-1 calls of weights of a byte or more a weight prefetch them (stream_prefetch: the sub-byte formats').");
  m.def("has_vbmi", []() { return has_vbmi(); }, "Whether this CPU has AVX-512 VBMI (the tiled int4 bf16 path).");
  m.def("gemv_isa", []() { return std::string(isa_name(current_isa())); }, "The ISA path tiered's GEMV kernels use now.");
  m.def("best_gemv_isa", []() { return std::string(isa_name(best_isa())); }, "The best ISA path this CPU supports.");
}

}  // namespace tiered
