// Paged decode attention for CPUs, as an XLA FFI custom call (pallas_kernels/cpu_attention.py
// builds this file with the machine's C++ compiler and registers the handler).
//
// One query row per sequence (decode) attends to its context through the block table:
//   q        f32[T, num_q_heads, head_dim]        (already scaled by sm_scale and the K scale)
//   k, v     [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
//            f32, bf16, int8 or uint8 (float8_e4m3fn bit patterns)
//   layer    s32[]                                 the layer to read
//   tables   s32[S, max_blocks]   seq_lens s32[S]   query_start_loc s32[S + 1]   num_seqs s32[1]
//   v_scale  f32[num_kv_heads]                     multiplies the output (1 for a float cache)
//   window   s32[]                                 last `window` positions only; 0: none
//   attrs    soft_cap (f32, 0: none)
//   out      f32[T, num_q_heads, head_dim]: the row of each sequence whose query length is 1;
//            every other row is 0 (the caller's prefill path fills multi-row sequences).
//
// Work item = (sequence, kv head): the group's query heads share each key and value read.
// Exact softmax in three passes over the item's keys (scores into a per-thread buffer, the
// maximum and exp-sum, then the values), the standard definition (Vaswani et al., 2017) read
// through a block table as in vLLM's PagedAttention (Kwon et al., 2023, arXiv:2309.06180).
// Items are shared between the calling thread and tasks on XLA's intra-op thread pool through
// an atomic counter; the caller waits only for items some thread has claimed, so a pool with
// no free thread cannot deadlock it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// exp(x) for x <= 0 (scores minus their maximum), vectorisable: 2^n * p(r) with
// x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial (relative error < 2e-7).
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

struct Fp8Table {
  float v[256];
  Fp8Table() {  // float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7f/0xff NaN
    for (int b = 0; b < 256; ++b) {
      const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
      float x = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) x = NAN;
      v[b] = s ? -x : x;
    }
  }
};
const Fp8Table kFp8;

template <typename T>
struct Load;
template <>
struct Load<float> {
  static inline float at(const float* p, int64_t i) { return p[i]; }
};
template <>
struct Load<uint16_t> {  // bfloat16 bits
  static inline float at(const uint16_t* p, int64_t i) {
    const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
template <>
struct Load<int8_t> {
  static inline float at(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
};
template <>
struct Load<uint8_t> {  // float8_e4m3fn bits
  static inline float at(const uint8_t* p, int64_t i) { return kFp8.v[p[i]]; }
};

struct Shapes {
  int64_t num_tokens, num_q_heads, head_dim, num_blocks, block_size, num_kv_heads, group;
  int64_t num_slots, max_blocks;
};

template <typename T, int D>
void attend_item(const Shapes& sh, int64_t layer, const float* q, const T* kc, const T* vc,
                 const int32_t* tables, int64_t s, int64_t h, int64_t row, int64_t ctx,
                 int64_t window, float soft_cap, const float* v_scale, float* out,
                 std::vector<float>& buf) {
  const int64_t d_len = D > 0 ? D : sh.head_dim;
  const int64_t g_len = sh.group, bs = sh.block_size, hkv = sh.num_kv_heads;
  const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
  const int64_t n = ctx - first;
  if (n <= 0) return;
  buf.resize(static_cast<size_t>(g_len * n + g_len * d_len));
  float* sc = buf.data();            // [g, n] scores, then probabilities
  float* acc = sc + g_len * n;       // [g, d]
  const float* qh = q + (row * sh.num_q_heads + h * g_len) * d_len;  // [g, d]
  const int32_t* table = tables + s * sh.max_blocks;
  const int64_t layer_off = layer * sh.num_blocks * bs;
  // keys: one page at a time (its rows are contiguous per head at stride hkv * d)
  for (int64_t t = first; t < ctx;) {
    const int64_t page = table[t / bs], off = t % bs;
    const int64_t stop = std::min(ctx, t - off + bs);
    for (; t < stop; ++t) {
      const T* k = kc + ((layer_off + page * bs + (t % bs)) * hkv + h) * d_len;
      for (int64_t j = 0; j < g_len; ++j) {
        const float* qj = qh + j * d_len;
        float dot = 0.0f;
        for (int64_t d = 0; d < d_len; ++d) dot += qj[d] * Load<T>::at(k, d);
        sc[j * n + (t - first)] = dot;
      }
    }
  }
  for (int64_t j = 0; j < g_len; ++j) {
    float* sj = sc + j * n;
    if (soft_cap > 0.0f) {
      for (int64_t i = 0; i < n; ++i) sj[i] = soft_cap * std::tanh(sj[i] / soft_cap);
    }
    float m = sj[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, sj[i]);
    float l = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const float p = exp_nonpos(sj[i] - m);
      sj[i] = p;
      l += p;
    }
    const float inv = 1.0f / l;
    for (int64_t i = 0; i < n; ++i) sj[i] *= inv;
    std::fill(acc + j * d_len, acc + (j + 1) * d_len, 0.0f);
  }
  for (int64_t t = first; t < ctx;) {
    const int64_t page = table[t / bs], off = t % bs;
    const int64_t stop = std::min(ctx, t - off + bs);
    for (; t < stop; ++t) {
      const T* v = vc + ((layer_off + page * bs + (t % bs)) * hkv + h) * d_len;
      for (int64_t j = 0; j < g_len; ++j) {
        const float p = sc[j * n + (t - first)];
        float* aj = acc + j * d_len;
        for (int64_t d = 0; d < d_len; ++d) aj[d] += p * Load<T>::at(v, d);
      }
    }
  }
  const float vs = v_scale[h];
  float* o = out + (row * sh.num_q_heads + h * g_len) * d_len;
  for (int64_t i = 0; i < g_len * d_len; ++i) o[i] = acc[i] * vs;
}

template <typename T>
void attend_item_dispatch(const Shapes& sh, int64_t layer, const float* q, const T* kc,
                          const T* vc, const int32_t* tables, int64_t s, int64_t h, int64_t row,
                          int64_t ctx, int64_t window, float soft_cap, const float* v_scale,
                          float* out, std::vector<float>& buf) {
  switch (sh.head_dim) {  // fixed trip counts for the common head sizes
    case 64:
      return attend_item<T, 64>(sh, layer, q, kc, vc, tables, s, h, row, ctx, window, soft_cap,
                                v_scale, out, buf);
    case 128:
      return attend_item<T, 128>(sh, layer, q, kc, vc, tables, s, h, row, ctx, window,
                                 soft_cap, v_scale, out, buf);
    case 256:
      return attend_item<T, 256>(sh, layer, q, kc, vc, tables, s, h, row, ctx, window,
                                 soft_cap, v_scale, out, buf);
    default:
      return attend_item<T, 0>(sh, layer, q, kc, vc, tables, s, h, row, ctx, window, soft_cap,
                               v_scale, out, buf);
  }
}

struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

template <typename T>
void run(ffi::ThreadPool& pool, const Shapes& sh, int64_t layer, const float* q,
         const void* k_raw, const void* v_raw, const int32_t* tables, const int32_t* seq_lens,
         const int32_t* qsl, int64_t num_seqs, int64_t window, float soft_cap,
         const float* v_scale, float* out) {
  const T* kc = static_cast<const T*>(k_raw);
  const T* vc = static_cast<const T*>(v_raw);
  std::memset(out, 0, sizeof(float) * sh.num_tokens * sh.num_q_heads * sh.head_dim);
  // the decode sequences' items, by sequence then kv head
  std::vector<int64_t> seqs;
  seqs.reserve(static_cast<size_t>(num_seqs));
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (qsl[s + 1] - qsl[s] == 1 && seq_lens[s] > 0) seqs.push_back(s);
  }
  auto job = std::make_shared<Job>();
  job->total = static_cast<int64_t>(seqs.size()) * sh.num_kv_heads;
  if (job->total == 0) return;
  auto seqs_p = std::make_shared<std::vector<int64_t>>(std::move(seqs));
  auto work = [=, &sh]() {
    thread_local std::vector<float> buf;
    for (;;) {
      const int64_t i = job->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job->total) return;
      const int64_t s = (*seqs_p)[i / sh.num_kv_heads], h = i % sh.num_kv_heads;
      attend_item_dispatch<T>(sh, layer, q, kc, vc, tables, s, h, qsl[s], seq_lens[s], window,
                              soft_cap, v_scale, out, buf);
      job->done.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    // a task that starts after the caller took every item returns at once; `job` and `seqs_p`
    // are shared so they outlive this call, while `sh` and the buffers are only touched for
    // claimed items, which the caller waits for below
    pool.Schedule([work]() { work(); });
  }
  work();
  while (job->done.load(std::memory_order_acquire) < job->total) std::this_thread::yield();
}

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> tables,
                               ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> qsl,
                               ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Buffer<ffi::S32> window, float soft_cap,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = k_cache.dimensions();
  const auto td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || td.size() != 2) {
    return ffi::Error::InvalidArgument("decode attention: q must be 3-D, caches 5-D, tables 2-D");
  }
  if (k_cache.element_type() != v_cache.element_type()) {
    return ffi::Error::InvalidArgument("decode attention: K and V caches differ in dtype");
  }
  Shapes sh{qd[0], qd[1], qd[2], kd[1], kd[2], kd[3], qd[1] / kd[3], td[0], td[1]};
  if (kd[4] != sh.head_dim || sh.num_q_heads % sh.num_kv_heads != 0) {
    return ffi::Error::InvalidArgument("decode attention: head shapes of q and the cache differ");
  }
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0]) return ffi::Error::InvalidArgument("decode attention: bad layer");
  const int64_t n = std::min<int64_t>(num_seqs.typed_data()[0], sh.num_slots);
  const int64_t w = window.typed_data()[0];
  auto go = [&](auto tag) {
    using T = decltype(tag);
    run<T>(pool, sh, l, q.typed_data(), k_cache.untyped_data(), v_cache.untyped_data(),
           tables.typed_data(), seq_lens.typed_data(), qsl.typed_data(), n, w, soft_cap,
           v_scale.typed_data(), out->typed_data());
  };
  switch (k_cache.element_type()) {
    case ffi::DataType::F32: go(float{}); break;
    case ffi::DataType::BF16: go(uint16_t{}); break;
    case ffi::DataType::S8: go(int8_t{}); break;
    case ffi::DataType::U8: go(uint8_t{}); break;
    default:
      return ffi::Error::InvalidArgument("decode attention: cache dtype must be f32, bf16, s8 "
                                         "or u8 (float8_e4m3fn bits)");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCpuDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_cache
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
