// Cycles a TDPBF16PS on one core with its tiles loaded from the L1 or the L2: x 2 tiles x gx groups reused, W nb
// pairs of 2 tiles x gx groups streamed. g++ -O3 -mamx-tile -mamx-bf16 -mavx512f tile_loads.cpp -o t && ./t 8 1 0; ./t 8 32 0
#include <immintrin.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cstdint>
struct Cfg { uint8_t palette = 1, start_row = 0, reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
// x: 2 tiles x gx groups (reused), W: nb pairs of 2 tiles x gx groups (streamed). pf: prefetch next W group's 2 KB into L1
int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  int64_t gx = atoi(argv[1]), nb = atoi(argv[2]); int pf = atoi(argv[3]);
  Cfg c; for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64; _tile_loadconfig(&c);
  std::vector<uint16_t> a(2 * gx * 512, 0x3f80), b(nb * 2 * gx * 512, 0x3f80);
  int64_t iters = 40000000 / (gx * nb) + 1;
  auto t = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters / 4; ++it)
    for (int64_t p = 0; p < nb; ++p) {
      const uint16_t *a0 = a.data(), *a1 = a0 + gx * 512, *b0 = b.data() + p * 2 * gx * 512, *b1 = b0 + gx * 512;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t g = 0; g < gx; ++g) {
        if (pf) for (int l = 0; l < 1024; l += 64) { _mm_prefetch((const char*)(b0 + (g + pf) * 512) + l, _MM_HINT_T0); _mm_prefetch((const char*)(b1 + (g + pf) * 512) + l, _MM_HINT_T0); }
        _tile_loadd(4, a0 + g * 512, 64); _tile_loadd(6, b0 + g * 512, 64); _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, a1 + g * 512, 64); _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, b1 + g * 512, 64); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7);
      }
      static float cc[4096]; _tile_stored(0, cc, 64); _tile_stored(1, cc+1024, 64); _tile_stored(2, cc+2048, 64); _tile_stored(3, cc+3072, 64);
    }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  double tdp = double(iters / 4) * nb * gx * 4;
  printf("x %ld KB, W %ld KB (%ld pairs), pf %d: %.1f cycles/TDP, %.2f TF/core\n", 2 * gx, nb * 2 * gx, nb, pf, s * 2.6e9 / tdp, tdp * 16384 / s / 1e12);
  _tile_release();
}
