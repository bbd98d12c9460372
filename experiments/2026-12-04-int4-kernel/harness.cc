// One thread, no XLA: the kernel's work items over 30 distinct weights of [K=576, N] (13 MB for
// N=1536, more than L2), T rows. Built against the kernel source with the library's flags:
//   g++ -O3 -march=native -fno-math-errno -fassociative-math -freciprocal-math \
//     -fno-signed-zeros -fno-trapping-math -std=c++17 \
//     -I$(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") \
//     experiments/2026-12-04-int4-kernel/harness.cc -o /tmp/int4_harness
//   /tmp/int4_harness N T
#include "../../pallas_kernels/csrc/cpu_int4_matmul.cc"
#include <chrono>
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  const int64_t L = 30, K = 576, N = argc > 1 ? atoi(argv[1]) : 1536, T = argc > 2 ? atoi(argv[2]) : 1, G = K / 32;
  std::vector<std::vector<uint8_t>> q(L, std::vector<uint8_t>(K / 2 * N)), z(L, std::vector<uint8_t>(G * N));
  std::vector<std::vector<uint16_t>> s(L, std::vector<uint16_t>(G * N, 0x3c00));
  for (auto& v : q) for (auto& b : v) b = rand();
  std::vector<float> x(T * K, 0.5f), xs(T * G, 16.f), y(T * N);
  Shapes sh{T, K, N, G, 32};
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int l = 0; l < L; ++l) item(sh, x.data(), q[l].data(), s[l].data(), z[l].data(), xs.data(), 0, G, y.data());
    auto t1 = std::chrono::steady_clock::now();
    double ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    printf("N=%ld T=%ld: %.2f ms, %.2f GB/s\n", N, T, ms, L * K / 2.0 * N / ms / 1e6);
  }
}
