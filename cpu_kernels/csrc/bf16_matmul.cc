// Activation rows times one layer of a stacked, packed bfloat16 weight, as an XLA FFI custom call
// for XLA:CPU (cpu_kernels/bf16_matmul.py registers the handler; cpu_kernels/build.py builds
// this file ahead of serving, once per ISA variant: `vdpbf16ps` in the avx512bf16 one).
//
//   x       f32[M, K]            activations, rounded to bfloat16 (to nearest even) as XLA's
//                                convert does
//   packed  bf16[L, NB, KP, 32]  (or [NB, KP, 32]) the weight w[l] (bf16[K, N]) of each layer l
//                                with NB = ceil(N / 16) blocks of 16 columns and KP = ceil(K / 2)
//                                row pairs: packed[l, b, p, 2c + j] = w[l, 2p + j, 16b + c],
//                                zero beyond K and N (cpu_kernels.bf16_matmul.pack)
//   layer   s32[]                which l (0 for an unstacked weight)
//   out     f32[M, N]            sum_k bf16(x[m, k]) * w[layer, k, n], accumulated in float32
//
// Why: in the model's scan over layers XLA:CPU copies each layer's slice of a stacked weight
// before its dot, and its bfloat16 dot packs the weight again for small row counts, so a decode
// step moved each weight byte ~3 times. Here the kernel reads the layer's slice where it lies,
// already in the layout AVX512-BF16's `vdpbf16ps` takes (a 64-byte load holds one row pair of 16
// columns): 1-8 activation rows' (k, k + 1) pairs are broadcast against 2 column blocks, with the
// 8 x 2 accumulators in registers over all of K. Tasks of 2 column blocks are shared between the
// calling thread and XLA's intra-op pool through an atomic counter, as in
// attention.cc. Without AVX512-BF16 the same sums run in scalar float32 (correct, slow:
// the engine packs weights only where `JaxserveBf16MatmulVectorized()` is 1).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define JAXSERVE_BF16_DOT 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTaskBlocks = 2;  // 16-column blocks per task

inline uint16_t to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Tasks [0, conv_tasks) convert kConvRows activation rows each to bfloat16 pairs; the rest
// multiply 2 column blocks each, once every row is converted.
struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> converted{0};
  std::atomic<int64_t> done{0};
  int64_t conv_tasks = 0, total = 0;
};

constexpr int64_t kConvRows = 64;  // activation rows per conversion task

// Rows [m0, m0 + MR) of xp (bf16 pairs as uint32, KP per row) times column blocks
// [b0, b0 + CG) of the layer's packed weight wp into out (f32[M, N]).
template <int MR, int CG>
void tile(const uint32_t* xp, int64_t kp, const uint16_t* wp, int64_t m0, int64_t b0,
          int64_t n_len, float* out) {
#ifdef JAXSERVE_BF16_DOT
  __m512 acc[MR][CG];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < CG; ++g) acc[r][g] = _mm512_setzero_ps();
  const uint16_t* wg[CG];
  for (int g = 0; g < CG; ++g) wg[g] = wp + (b0 + g) * kp * 32;
  const uint32_t* xr = xp + m0 * kp;
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh w[CG];
    for (int g = 0; g < CG; ++g) w[g] = (__m512bh)_mm512_loadu_si512(wg[g] + p * 32);
    for (int r = 0; r < MR; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xr[r * kp + p]));
      for (int g = 0; g < CG; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], xb, w[g]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* o = out + (m0 + r) * n_len;
    for (int g = 0; g < CG; ++g) {
      const int64_t c0 = (b0 + g) * 16, left = n_len - c0;
      const __mmask16 mask = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1u);
      _mm512_mask_storeu_ps(o + c0, mask, acc[r][g]);
    }
  }
#else
  for (int r = 0; r < MR; ++r) {
    const uint16_t* xr = reinterpret_cast<const uint16_t*>(xp + (m0 + r) * kp);
    for (int g = 0; g < CG; ++g) {
      float acc[16] = {};
      const uint16_t* w = wp + (b0 + g) * kp * 32;
      for (int64_t p = 0; p < kp; ++p) {
        const float x0 = from_bf16(xr[2 * p]), x1 = from_bf16(xr[2 * p + 1]);
        for (int c = 0; c < 16; ++c) {
          acc[c] += x0 * from_bf16(w[p * 32 + 2 * c]) + x1 * from_bf16(w[p * 32 + 2 * c + 1]);
        }
      }
      const int64_t c0 = (b0 + g) * 16;
      for (int c = 0; c < 16 && c0 + c < n_len; ++c) out[(m0 + r) * n_len + c0 + c] = acc[c];
    }
  }
#endif
}

template <int CG>
void all_rows(const uint32_t* xp, int64_t kp, const uint16_t* wp, int64_t m_len, int64_t b0,
              int64_t n_len, float* out) {
  int64_t m0 = 0;
  for (; m_len - m0 >= 8; m0 += 8) tile<8, CG>(xp, kp, wp, m0, b0, n_len, out);
  switch (m_len - m0) {
    case 7: tile<7, CG>(xp, kp, wp, m0, b0, n_len, out); break;
    case 6: tile<6, CG>(xp, kp, wp, m0, b0, n_len, out); break;
    case 5: tile<5, CG>(xp, kp, wp, m0, b0, n_len, out); break;
    case 4: tile<4, CG>(xp, kp, wp, m0, b0, n_len, out); break;
    case 3: tile<3, CG>(xp, kp, wp, m0, b0, n_len, out); break;
    case 2: tile<2, CG>(xp, kp, wp, m0, b0, n_len, out); break;
    case 1: tile<1, CG>(xp, kp, wp, m0, b0, n_len, out); break;
    default: break;
  }
}

ffi::Error Bf16MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::BF16> packed, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions();
  const auto wd = packed.dimensions();
  const auto od = out->dimensions();
  if (xd.size() != 2 || (wd.size() != 3 && wd.size() != 4) || wd[wd.size() - 1] != 32 ||
      od.size() != 2 || od[0] != xd[0]) {
    return ffi::Error::InvalidArgument(
        "bf16 matmul: x must be [M, K], packed [L, NB, KP, 32] or [NB, KP, 32], out [M, N]");
  }
  const int64_t m_len = xd[0], k_len = xd[1], n_len = od[1];
  const int64_t nb = wd[wd.size() - 3], kp = wd[wd.size() - 2];
  const int64_t num_layers = wd.size() == 4 ? wd[0] : 1;
  if (kp != (k_len + 1) / 2 || nb != (n_len + 15) / 16) {
    return ffi::Error::InvalidArgument("bf16 matmul: packed does not match x's K or out's N");
  }
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= num_layers) {
    return ffi::Error::InvalidArgument("bf16 matmul: layer out of range");
  }
  float* op = out->typed_data();
  if (m_len == 0 || n_len == 0) return ffi::Error::Success();
  // The activations as bf16 pairs (K padded to even with a zero), in a buffer each calling
  // thread keeps, converted by tasks shared like the column blocks. A fresh buffer per call,
  // converted by the calling thread alone, made 1024-row matmuls 2-20% slower (the most at
  // N = 192), measured interleaved in one process.
  static thread_local std::vector<uint32_t> xbuf;
  if (xbuf.size() < static_cast<size_t>(m_len * kp)) xbuf.resize(static_cast<size_t>(m_len * kp));
  uint32_t* xs = xbuf.data();
  const float* xf = x.typed_data();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.typed_data()) + li * nb * kp * 32;
  auto job = std::make_shared<Job>();
  job->conv_tasks = (m_len + kConvRows - 1) / kConvRows;
  job->total = job->conv_tasks + (nb + kTaskBlocks - 1) / kTaskBlocks;
  // The caller returns only when every task is done, so a task can use xs, xf, wp and op; a
  // helper that starts later finds no task left and touches nothing but the job.
  auto work = [=]() {
    for (;;) {
      const int64_t i = job->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job->total) return;
      if (i < job->conv_tasks) {
        uint16_t* xh = reinterpret_cast<uint16_t*>(xs);
        for (int64_t m = i * kConvRows; m < std::min(m_len, (i + 1) * kConvRows); ++m) {
          for (int64_t k = 0; k < k_len; ++k) xh[m * kp * 2 + k] = to_bf16(xf[m * k_len + k]);
          if (k_len % 2 == 1) xh[m * kp * 2 + k_len] = 0;
        }
        job->converted.fetch_add(1, std::memory_order_acq_rel);
      } else {
        while (job->converted.load(std::memory_order_acquire) < job->conv_tasks) {
          std::this_thread::yield();
        }
        const int64_t b0 = (i - job->conv_tasks) * kTaskBlocks;
        if (nb - b0 >= 2) {
          all_rows<2>(xs, kp, wp, m_len, b0, n_len, op);
        } else {
          all_rows<1>(xs, kp, wp, m_len, b0, n_len, op);
        }
      }
      job->done.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work]() { work(); });
  work();
  while (job->done.load(std::memory_order_acquire) < job->total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

// 1 where the kernel was compiled with AVX512-BF16 (the fast path), else 0.
extern "C" int JaxserveBf16MatmulVectorized() {
#ifdef JAXSERVE_BF16_DOT
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // packed
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>());
