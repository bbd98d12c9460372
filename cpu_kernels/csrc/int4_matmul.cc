// A few activation rows times an int4 weight, for CPUs, as an XLA FFI custom call
// (cpu_kernels/int4_matmul.py registers the handler; cpu_kernels/build.py builds it).
//
//   x      f32[T, K]        activations
//   q      u8[K / 2, N]     the logical [K, N] weight's rows 2i / 2i+1 in the low / high nibble
//   scale  f16[G, N]        (as u16 bits) one per group of K / G input rows and output column
//   zero   u8[G, N]         the group's zero point in sixteenths of a step
//   out    f32[T, N]        out[t, n] = sum_k x[t, k] * (q[k, n] - zero[g(k), n] / 16) * scale
//
// The layout and format are models/quant.py's int4 (asymmetric groups along the contraction,
// as GPTQ/AWQ store them). Per group the nibbles are summed against x in float32 and the scale
// and zero point are applied once: sum_k x q s - (s z / 16) sum_k x, where sum_k x per (row,
// group) is computed once per call. XLA:CPU instead dequantises the whole weight to float32
// and then runs the dot, writing and reading 8x the bytes it loaded; at one to a few rows that
// dominated an int4 decode step. Work items are runs of whole groups (contiguous bytes of q),
// shared between the calling thread and tasks on XLA's intra-op thread pool through an atomic
// counter (as attention.cc does); each writes its own partial sums, added at the end.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 8;
typedef float v8f __attribute__((vector_size(32)));

inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }

// IEEE binary16 bits -> float32, every class (normal, subnormal, zero, inf, NaN).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 31u, m = h & 1023u;
  uint32_t bits;
  if (e == 0) {
    const float f = static_cast<float>(m) * (1.0f / 16777216.0f);  // m * 2^-24, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (m << 13);
  } else {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline v8f load_scales(const uint16_t* p) {
#if defined(__F16C__)
  v8f out;
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &v, sizeof(out));
  return out;
#else
  v8f out;
  for (int i = 0; i < kLanes; ++i) out[i] = half_to_float(p[i]);
  return out;
#endif
}

// a + b * c as one fused multiply-add (GCC otherwise forms x1 * hi, an FMA and an add).
inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
  __m256 av, bv, cv;
  std::memcpy(&av, &a, 32);
  std::memcpy(&bv, &b, 32);
  std::memcpy(&cv, &c, 32);
  const __m256 r = _mm256_fmadd_ps(bv, cv, av);
  v8f out;
  std::memcpy(&out, &r, 32);
  return out;
#else
  return a + b * c;
#endif
}

// 8 bytes -> their low and high nibbles as floats. GCC scalarises a u8 -> f32
// __builtin_convertvector (one vpextrb and vcvtsi2ss per lane), so AVX2 gets intrinsics.
inline void unpack8(const uint8_t* p, v8f& lo, v8f& hi) {
#if defined(__AVX2__)
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 l = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  const __m256 h = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  std::memcpy(&lo, &l, sizeof(lo));
  std::memcpy(&hi, &h, sizeof(hi));
#else
  for (int i = 0; i < kLanes; ++i) {
    lo[i] = static_cast<float>(p[i] & 15);
    hi[i] = static_cast<float>(p[i] >> 4);
  }
#endif
}

inline v8f load_zeros(const uint8_t* p) {
  v8f z;
#if defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&z, &f, sizeof(z));
#else
  for (int i = 0; i < kLanes; ++i) z[i] = static_cast<float>(p[i]);
#endif
  return z * splat(1.0f / 16.0f);
}

struct Shapes {
  int64_t rows, k, n, groups, group_size;
};

// y[t0 : t0 + RT, c0 : c0 + NV * 8] += group g's share: the nibbles summed against x in
// registers over the group's rows, then the scale and zero point applied once.
template <int RT, int NV>
inline void group_tile(const Shapes& sh, const float* x, const uint8_t* q,
                       const uint16_t* scale, const uint8_t* zero, const float* xsum, int64_t g,
                       int64_t t0, int64_t c0, float* y) {
  const int64_t n = sh.n, half_group = sh.group_size / 2;
  v8f a[RT][NV];
  for (int t = 0; t < RT; ++t)
    for (int v = 0; v < NV; ++v) a[t][v] = splat(0.0f);
  const uint8_t* qg = q + g * half_group * n + c0;
  const float* xg = x + t0 * sh.k + g * sh.group_size;
  for (int64_t r = 0; r < half_group; ++r) {
    const uint8_t* qr = qg + r * n;
    v8f lo[NV], hi[NV];
    for (int v = 0; v < NV; ++v) unpack8(qr + v * kLanes, lo[v], hi[v]);
    for (int t = 0; t < RT; ++t) {
      const v8f x0 = splat(xg[t * sh.k + 2 * r]), x1 = splat(xg[t * sh.k + 2 * r + 1]);
      for (int v = 0; v < NV; ++v) a[t][v] = fma8(fma8(a[t][v], x0, lo[v]), x1, hi[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const v8f s = load_scales(scale + g * n + c0 + v * kLanes);
    const v8f sz = s * load_zeros(zero + g * n + c0 + v * kLanes);
    for (int t = 0; t < RT; ++t) {
      float* yp = y + (t0 + t) * n + c0 + v * kLanes;
      v8f acc;
      std::memcpy(&acc, yp, sizeof(acc));
      acc += s * a[t][v] - sz * splat(xsum[(t0 + t) * sh.groups + g]);
      std::memcpy(yp, &acc, sizeof(acc));
    }
  }
}

// The same for columns [c0, c1) one at a time (fewer than 8 left).
void group_columns_scalar(const Shapes& sh, const float* x, const uint8_t* q,
                          const uint16_t* scale, const uint8_t* zero, const float* xsum,
                          int64_t g, int64_t c0, int64_t c1, float* y) {
  const int64_t n = sh.n, half_group = sh.group_size / 2;
  for (int64_t t = 0; t < sh.rows; ++t) {
    for (int64_t c = c0; c < c1; ++c) {
      float a = 0.0f;
      for (int64_t r = 0; r < half_group; ++r) {
        const uint8_t b = q[(g * half_group + r) * n + c];
        const int64_t k = g * sh.group_size + 2 * r;
        a += x[t * sh.k + k] * static_cast<float>(b & 15) +
             x[t * sh.k + k + 1] * static_cast<float>(b >> 4);
      }
      const float s = half_to_float(scale[g * n + c]);
      y[t * n + c] += s * a - s * (static_cast<float>(zero[g * n + c]) / 16.0f) *
                                  xsum[t * sh.groups + g];
    }
  }
}

// Every column of rows [t0, t0 + RT) for group g, in blocks of NV vectors, then single vectors.
template <int RT, int NV>
void group_rows(const Shapes& sh, const float* x, const uint8_t* q, const uint16_t* scale,
                const uint8_t* zero, const float* xsum, int64_t g, int64_t t0, float* y) {
  int64_t c = 0;
  for (; c + NV * kLanes <= sh.n; c += NV * kLanes)
    group_tile<RT, NV>(sh, x, q, scale, zero, xsum, g, t0, c, y);
  for (; c + kLanes <= sh.n; c += kLanes)
    group_tile<RT, 1>(sh, x, q, scale, zero, xsum, g, t0, c, y);
}

// Groups [g0, g1) (a contiguous run of the packed weight) into y (f32[T, N], zeroed here):
// rows in tiles of 4 (16-column blocks), then 2 (32), then 1 (64): 8 accumulators each.
void item(const Shapes& sh, const float* x, const uint8_t* q, const uint16_t* scale,
          const uint8_t* zero, const float* xsum, int64_t g0, int64_t g1, float* y) {
  std::memset(y, 0, sizeof(float) * sh.rows * sh.n);
  const int64_t vec_cols = sh.n / kLanes * kLanes;
  for (int64_t g = g0; g < g1; ++g) {
    int64_t t = 0;
    for (; t + 4 <= sh.rows; t += 4) group_rows<4, 2>(sh, x, q, scale, zero, xsum, g, t, y);
    for (; t + 2 <= sh.rows; t += 2) group_rows<2, 4>(sh, x, q, scale, zero, xsum, g, t, y);
    for (; t < sh.rows; ++t) group_rows<1, 8>(sh, x, q, scale, zero, xsum, g, t, y);
    if (vec_cols < sh.n)
      group_columns_scalar(sh, x, q, scale, zero, xsum, g, vec_cols, sh.n, y);
  }
}

struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

// Bytes of packed weight per work item: runs of whole groups, each contiguous in memory, so
// every thread streams its own part of the weight (a split by columns reads each row's few
// bytes at a stride of N, and ran at ~1.4 GB/s from memory).
constexpr int64_t kItemBytes = 16 * 1024;
constexpr int64_t kItemsPerThread = 4;

ffi::Error Int4MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                          ffi::AnyBuffer scale, ffi::Buffer<ffi::U8> zero,
                          ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(),
             zd = zero.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || zd.size() != 2) {
    return ffi::Error::InvalidArgument("int4 matmul: x, q, scale and zero must be 2-D");
  }
  if (scale.element_type() != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("int4 matmul: scale must be float16");
  }
  Shapes sh{xd[0], xd[1], qd[1], sd[0], 0};
  if (qd[0] * 2 != sh.k || sd[1] != sh.n || zd[0] != sh.groups || zd[1] != sh.n ||
      sh.groups <= 0 || sh.k % sh.groups != 0 || (sh.k / sh.groups) % 2 != 0) {
    return ffi::Error::InvalidArgument("int4 matmul: shapes of x, q, scale and zero disagree");
  }
  sh.group_size = sh.k / sh.groups;
  const float* xp = x.typed_data();
  const uint8_t* qp = q.typed_data();
  const auto* sp = static_cast<const uint16_t*>(scale.untyped_data());
  const uint8_t* zp = zero.typed_data();
  float* op = out->typed_data();
  if (sh.rows == 0 || sh.n == 0) return ffi::Error::Success();
  if (sh.k == 0) {  // an empty contraction
    std::memset(op, 0, sizeof(float) * sh.rows * sh.n);
    return ffi::Error::Success();
  }
  // per (row, group) sums of x, shared by every column
  std::vector<float> xsum(static_cast<size_t>(sh.rows * sh.groups));
  for (int64_t t = 0; t < sh.rows; ++t) {
    for (int64_t g = 0; g < sh.groups; ++g) {
      const float* xg = xp + t * sh.k + g * sh.group_size;
      float s = 0.0f;
      for (int64_t i = 0; i < sh.group_size; ++i) s += xg[i];
      xsum[t * sh.groups + g] = s;
    }
  }
  // items of whole groups: about kItemBytes each, at least one per thread where there are
  // enough groups, and at most kItemsPerThread per thread (each item has its own partial sums)
  const int64_t group_bytes = sh.group_size / 2 * sh.n;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t per_item = std::max<int64_t>(1, kItemBytes / group_bytes);
  per_item = std::max(per_item, (sh.groups + kItemsPerThread * threads - 1) /
                                    (kItemsPerThread * threads));
  per_item = std::min(per_item, std::max<int64_t>(1, sh.groups / threads));
  auto job = std::make_shared<Job>();
  job->total = (sh.groups + per_item - 1) / per_item;
  // item 0 writes the output; the others write partial sums, added at the end
  std::shared_ptr<float[]> partial(new float[(job->total - 1) * sh.rows * sh.n]);
  const float* xs = xsum.data();
  auto work = [=]() {
    for (;;) {
      const int64_t i = job->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job->total) return;
      float* y = i == 0 ? op : partial.get() + (i - 1) * sh.rows * sh.n;
      item(sh, xp, qp, sp, zp, xs, i * per_item, std::min(sh.groups, (i + 1) * per_item), y);
      job->done.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work]() { work(); });
  work();
  while (job->done.load(std::memory_order_acquire) < job->total) std::this_thread::yield();
  const int64_t size = sh.rows * sh.n;
  for (int64_t i = 1; i < job->total; ++i) {
    const float* p = partial.get() + (i - 1) * size;
    for (int64_t j = 0; j < size; ++j) op[j] += p[j];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuInt4Matmul, Int4MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()   // q
                                  .Arg<ffi::AnyBuffer>()         // scale (f16)
                                  .Arg<ffi::Buffer<ffi::U8>>()   // zero
                                  .Ret<ffi::Buffer<ffi::F32>>());
