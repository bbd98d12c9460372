// Paged attention for CPUs, decode rows and optionally prefill rows, as an XLA FFI custom call
// (cpu_kernels/attention.py registers the handler; cpu_kernels/build.py builds this file ahead
// of serving, once per ISA variant).
//
// One query row per sequence (decode) attends to its context through the block table:
//   q        f32[T, num_q_heads, head_dim]        (already scaled by sm_scale and the K scale)
//   k, v     [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
//            f32, bf16, int8 or uint8 (float8_e4m3fn bit patterns)
//   layer    s32[]                                 the layer to read
//   tables   s32[S, max_blocks]   seq_lens s32[S]   query_start_loc s32[S + 1]   num_seqs s32[1]
//   v_scale  f32[num_kv_heads]                     multiplies the output (1 for a float cache)
//   window   s32[]                                 last `window` positions only; 0: none
//   attrs    soft_cap (f32, 0: none), prefill (s32: 1 = multi-row sequences' rows too),
//            invariant (s32: 1 = decode rows in the prefill tiles' reduction order, below)
//   out      f32[T, num_q_heads, head_dim]: the row of each sequence whose query length is 1,
//            and with `prefill` every row of the multi-row sequences (row i of a sequence of
//            q_len rows and context ctx sits at position ctx - q_len + i and attends causally);
//            every other row is 0 (without `prefill` the caller's jnp path fills those).
//
// Decode work item = (sequence, kv head): the group's query heads share each key and value
// read. Prefill work item = (sequence, kv head, tile of kTileRows rows): the tile's rows times
// the group's heads share each key block, which is converted to float32 once and transposed so
// the scores are vertical FMAs (no horizontal sums). With AVX-512, for head sizes 64, 128 and
// 256, the tile transposes its queries instead (attend_tile_avx512): 12-16% less time for
// 4 x 256, 1 x 1024 and 16 x 64 prompt tokens (SmolLM2's 64 x 3), measured interleaved in one
// process. Both compute the exact softmax in three passes over the item's keys (scores into a
// per-thread buffer, the maximum and exp-sum, then the values), the standard definition
// (Vaswani et al., 2017) read through a block table as in
// vLLM's PagedAttention (Kwon et al., 2023, arXiv:2309.06180).
// A decode item converts each key and value row to float32 once for the group's heads, and
// prefetches the rows of its next page (pages are scattered, so the hardware prefetchers start
// cold on each: 10-16% less time for 16-64 sequences, measured interleaved in one process).
// With AVX-512, for the common (head_dim, group) pairs, the item keeps the group's queries and
// value sums in registers and sums each block of 16 keys' partial dot products in one
// shuffle-and-add tree instead of a horizontal sum per key and head; the maximum is vectorised
// and the 1 / denominator scales the output instead of every probability. 1.6-2.3x less time
// than the generic item for 1-64 sequences of 300 tokens (SmolLM2's 64 x 3), measured
// interleaved in one process (docs/decisions/0031-vectorised-decode-attention.md).
// Batch invariance (`invariant`, with `prefill`): a decode item and a prefill tile sum in
// different orders, so a token's attention output, and the KV of every later layer, depended on
// whether it was computed in a prompt chunk, as a decode row, or recomputed after preemption.
// With `invariant` every decode row is summed as a one-row tile would sum it, so each query
// row's result is a function of its own query and keys alone: its scores, softmax and value
// sums go in one order whatever tile it is in (rows do not share sums), in prefill, decode and
// recompute alike (the "fixed reduction order per sequence" of He et al., "Defeating
// Nondeterminism in LLM Inference", Thinking Machines Lab, 2025). With AVX-512 a dedicated
// item does it with keys instead of queries in the lanes (attend_row_avx512); elsewhere, and
// for other shapes, the row runs as a one-row tile.
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
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// The maximum of p[0, n) (n >= 1): a float max reduction does not vectorise without
// -ffinite-math-only, and a scalar loop over a long context costs as much as the dot products.
inline float max_of(const float* p, int64_t n) {
#if defined(__AVX512F__)
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(p + i));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, p + i));
  }
  return _mm512_reduce_max_ps(mv);
#else
  float m = p[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, p[i]);
  return m;
#endif
}

// One softmax row in place, unnormalised: s[i] = exp(cap(s[i]) - max) for i < n (n >= 1), with
// cap(x) = soft_cap * tanh(x / soft_cap) when soft_cap > 0; returns the sum (the denominator).
inline float exp_in_place(float* s, int64_t n, float soft_cap) {
  if (soft_cap > 0.0f) {
    for (int64_t i = 0; i < n; ++i) s[i] = soft_cap * std::tanh(s[i] / soft_cap);
  }
  const float m = max_of(s, n);
  float l = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float p = exp_nonpos(s[i] - m);
    s[i] = p;
    l += p;
  }
  return l;
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

// Prefetch head h's rows of the page holding position t (if t < ctx): pages are scattered, so
// the hardware prefetchers start cold on each one.
template <typename T>
inline void prefetch_page(const T* cache, const int32_t* table, int64_t t, int64_t ctx,
                          int64_t layer_off, int64_t bs, int64_t hkv, int64_t h, int64_t d_len) {
  if (t >= ctx) return;
  const int64_t page = table[t / bs];
  const int64_t rows = std::min(bs, ctx - t);
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(
        cache + ((layer_off + page * bs + r) * hkv + h) * d_len);
    for (int64_t b = 0; b < static_cast<int64_t>(d_len * sizeof(T)); b += 64) {
      __builtin_prefetch(p + b);
    }
  }
}

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
  buf.resize(static_cast<size_t>(g_len * n + g_len * d_len + d_len));
  float* sc = buf.data();            // [g, n] scores, then probabilities
  float* acc = sc + g_len * n;       // [g, d]
  float* __restrict__ kf = acc + g_len * d_len;  // [d] one key or value row in float32
  const float* qh = q + (row * sh.num_q_heads + h * g_len) * d_len;  // [g, d]
  const int32_t* table = tables + s * sh.max_blocks;
  const int64_t layer_off = layer * sh.num_blocks * bs;
  // keys: one page at a time (its rows are contiguous per head at stride hkv * d)
  for (int64_t t = first; t < ctx;) {
    const int64_t page = table[t / bs], off = t % bs;
    const int64_t stop = std::min(ctx, t - off + bs);
    prefetch_page(kc, table, t - off + bs, ctx, layer_off, bs, hkv, h, d_len);
    for (; t < stop; ++t) {
      const T* k = kc + ((layer_off + page * bs + (t % bs)) * hkv + h) * d_len;
      for (int64_t d = 0; d < d_len; ++d) kf[d] = Load<T>::at(k, d);  // converted once
      for (int64_t j = 0; j < g_len; ++j) {
        const float* __restrict__ qj = qh + j * d_len;
        float dot = 0.0f;
        for (int64_t d = 0; d < d_len; ++d) dot += qj[d] * kf[d];
        sc[j * n + (t - first)] = dot;
      }
    }
  }
  for (int64_t j = 0; j < g_len; ++j) {
    float* sj = sc + j * n;
    const float inv = 1.0f / exp_in_place(sj, n, soft_cap);
    for (int64_t i = 0; i < n; ++i) sj[i] *= inv;
    std::fill(acc + j * d_len, acc + (j + 1) * d_len, 0.0f);
  }
  for (int64_t t = first; t < ctx;) {
    const int64_t page = table[t / bs], off = t % bs;
    const int64_t stop = std::min(ctx, t - off + bs);
    prefetch_page(vc, table, t - off + bs, ctx, layer_off, bs, hkv, h, d_len);
    for (; t < stop; ++t) {
      const T* v = vc + ((layer_off + page * bs + (t % bs)) * hkv + h) * d_len;
      for (int64_t d = 0; d < d_len; ++d) kf[d] = Load<T>::at(v, d);  // converted once
      for (int64_t j = 0; j < g_len; ++j) {
        const float p = sc[j * n + (t - first)];
        float* __restrict__ aj = acc + j * d_len;
        for (int64_t d = 0; d < d_len; ++d) aj[d] += p * kf[d];
      }
    }
  }
  const float vs = v_scale[h];
  float* o = out + (row * sh.num_q_heads + h * g_len) * d_len;
  for (int64_t i = 0; i < g_len * d_len; ++i) o[i] = acc[i] * vs;
}

#if defined(__AVX512F__)
// One row of D keys or values as D / 16 float32 vectors.
template <int V>
inline void load_row(const float* p, __m512* out) {
  for (int v = 0; v < V; ++v) out[v] = _mm512_loadu_ps(p + 16 * v);
}
template <int V>
inline void load_row(const uint16_t* p, __m512* out) {  // bfloat16: the high half of a float
  for (int v = 0; v < V; ++v) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p + 16 * v)));
    out[v] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}
template <int V>
inline void load_row(const int8_t* p, __m512* out) {
  for (int v = 0; v < V; ++v) {
    out[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v))));
  }
}
template <int V>
inline void load_row(const uint8_t* p, __m512* out) {  // float8_e4m3fn bits, through the table
  for (int v = 0; v < V; ++v) {
    const __m512i idx = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v)));
    out[v] = _mm512_i32gather_ps(idx, kFp8.v, 4);
  }
}

// r[i] = the sum of the 16 lanes of x[i], for 16 vectors: 15 shuffle-and-add steps instead of
// 16 horizontal sums.
inline __m512 sum_lanes16(const __m512* x) {
  __m512 u[8], w[4], y[2];
  for (int i = 0; i < 8; ++i) {  // 128-bit lanes (0, 1) hold x[i]'s halves summed, (2, 3) x[i+8]'s
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 8], 0x44),
                         _mm512_shuffle_f32x4(x[i], x[i + 8], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // lanes: x[i], x[i+8], x[i+4], x[i+12], 4 partial sums each
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[i], u[i + 4], 0x88),
                         _mm512_shuffle_f32x4(u[i], u[i + 4], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // each lane: 2 partial sums of x[a], then 2 of x[a+2]
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(w[i], w[i + 2], 0x44),
                         _mm512_shuffle_ps(w[i], w[i + 2], 0xEE));
  }
  // lane 0: x0 x2 x1 x3, lane 1: x8 x10 x9 x11, lane 2: x4 x6 x5 x7, lane 3: x12 x14 x13 x15
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88),
                                 _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(order, z);
}

// attend_item with AVX-512 intrinsics for head_dim D (a multiple of 16) and group G: the
// group's queries and value sums stay in registers, and each block of 16 keys' scores comes out
// of one sum_lanes16 per head.
template <typename T, int D, int G>
void attend_item_avx512(const Shapes& sh, int64_t layer, const float* q, const T* kc,
                        const T* vc, const int32_t* tables, int64_t s, int64_t h, int64_t row,
                        int64_t ctx, int64_t window, float soft_cap, const float* v_scale,
                        float* out, std::vector<float>& buf) {
  constexpr int V = D / 16;
  const int64_t bs = sh.block_size, hkv = sh.num_kv_heads;
  const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
  const int64_t n = ctx - first;
  if (n <= 0) return;
  const int64_t n16 = (n + 15) / 16 * 16;
  buf.resize(static_cast<size_t>(G * n16));
  float* sc = buf.data();  // [G, n16] scores, then probabilities
  const float* qh = q + (row * sh.num_q_heads + h * G) * D;
  const int32_t* table = tables + s * sh.max_blocks;
  const int64_t layer_off = layer * sh.num_blocks * bs;
  __m512 qv[G][V];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < V; ++v) qv[j][v] = _mm512_loadu_ps(qh + j * D + 16 * v);
  alignas(64) __m512 part[G][16];
  int cnt = 0;
  int64_t t0 = 0;  // index (from `first`) of the block's first key
  for (int64_t t = first; t < ctx;) {
    const int64_t page = table[t / bs], off = t % bs;
    const int64_t stop = std::min(ctx, t - off + bs);
    prefetch_page(kc, table, t - off + bs, ctx, layer_off, bs, hkv, h, D);
    for (; t < stop; ++t) {
      __m512 k[V];
      load_row<V>(kc + ((layer_off + page * bs + (t % bs)) * hkv + h) * D, k);
      for (int j = 0; j < G; ++j) {
        __m512 a = _mm512_mul_ps(qv[j][0], k[0]);
        for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(qv[j][v], k[v], a);
        part[j][cnt] = a;
      }
      if (++cnt == 16) {
        for (int j = 0; j < G; ++j) _mm512_storeu_ps(sc + j * n16 + t0, sum_lanes16(part[j]));
        cnt = 0;
        t0 += 16;
      }
    }
  }
  if (cnt > 0) {
    for (int j = 0; j < G; ++j) {
      for (int i = cnt; i < 16; ++i) part[j][i] = _mm512_setzero_ps();
      _mm512_storeu_ps(sc + j * n16 + t0, sum_lanes16(part[j]));
    }
  }
  float inv[G];  // 1 / the softmax denominator, applied to the value sums at the end
  for (int j = 0; j < G; ++j) {
    inv[j] = 1.0f / exp_in_place(sc + j * n16, n, soft_cap);
  }
  __m512 acc[G][V];
  for (int j = 0; j < G; ++j)
    for (int v = 0; v < V; ++v) acc[j][v] = _mm512_setzero_ps();
  for (int64_t t = first; t < ctx;) {
    const int64_t page = table[t / bs], off = t % bs;
    const int64_t stop = std::min(ctx, t - off + bs);
    prefetch_page(vc, table, t - off + bs, ctx, layer_off, bs, hkv, h, D);
    for (; t < stop; ++t) {
      __m512 x[V];
      load_row<V>(vc + ((layer_off + page * bs + (t % bs)) * hkv + h) * D, x);
      for (int j = 0; j < G; ++j) {
        const __m512 p = _mm512_set1_ps(sc[j * n16 + (t - first)]);
        for (int v = 0; v < V; ++v) acc[j][v] = _mm512_fmadd_ps(p, x[v], acc[j][v]);
      }
    }
  }
  float* o = out + (row * sh.num_q_heads + h * G) * D;
  for (int j = 0; j < G; ++j) {
    const __m512 f = _mm512_set1_ps(inv[j] * v_scale[h]);
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(o + j * D + 16 * v, _mm512_mul_ps(acc[j][v], f));
  }
}
#endif

template <typename T>
void attend_item_dispatch(const Shapes& sh, int64_t layer, const float* q, const T* kc,
                          const T* vc, const int32_t* tables, int64_t s, int64_t h, int64_t row,
                          int64_t ctx, int64_t window, float soft_cap, const float* v_scale,
                          float* out, std::vector<float>& buf) {
#if defined(__AVX512F__)  // the vectorised item where it is built; else the generic one
#define JAXSERVE_ITEM(D, G)                                                                  \
  if (sh.head_dim == D && sh.group == G)                                                     \
    return attend_item_avx512<T, D, G>(sh, layer, q, kc, vc, tables, s, h, row, ctx, window, \
                                       soft_cap, v_scale, out, buf);
  JAXSERVE_ITEM(64, 1) JAXSERVE_ITEM(64, 2) JAXSERVE_ITEM(64, 3) JAXSERVE_ITEM(64, 4)
  JAXSERVE_ITEM(64, 6) JAXSERVE_ITEM(64, 8) JAXSERVE_ITEM(128, 1) JAXSERVE_ITEM(128, 2)
  JAXSERVE_ITEM(128, 3) JAXSERVE_ITEM(128, 4) JAXSERVE_ITEM(256, 1) JAXSERVE_ITEM(256, 2)
#undef JAXSERVE_ITEM
#endif
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

constexpr int64_t kTileRows = 16;  // prefill rows per work item
constexpr int64_t kKeyBlock = 16;  // keys per converted (and transposed) block

// Rows [i0, i1) of multi-row sequence s (query rows row0 + i, positions p0 + i), kv head h.
template <typename T, int D>
void attend_tile(const Shapes& sh, int64_t layer, const float* q, const T* kc, const T* vc,
                 const int32_t* tables, int64_t s, int64_t h, int64_t row0, int64_t p0,
                 int64_t i0, int64_t i1, int64_t window, float soft_cap, const float* v_scale,
                 float* out, std::vector<float>& buf) {
  constexpr int64_t KB = kKeyBlock;
  const int64_t d_len = D > 0 ? D : sh.head_dim;
  const int64_t g_len = sh.group, bs = sh.block_size, hkv = sh.num_kv_heads;
  const int64_t nq = sh.num_q_heads;
  const int64_t last = p0 + i1 - 1;  // the tile's last position
  const int64_t first = window > 0 ? std::max<int64_t>(0, p0 + i0 - window + 1) : 0;
  const int64_t n = last + 1 - first;  // keys first .. last
  const int64_t n_pad = (n + KB - 1) / KB * KB;
  const int64_t m_len = (i1 - i0) * g_len;  // query vectors: m = r * g + j
  const int64_t m_pad = (m_len + 3) / 4 * 4;  // in groups of 4 (the rest: zero probabilities)
  buf.resize(static_cast<size_t>(m_pad * n_pad + m_pad * d_len + 2 * KB * d_len));
  float* sc = buf.data();               // [m_pad, n_pad] scores, then probabilities
  float* acc = sc + m_pad * n_pad;      // [m_pad, d]
  float* kt = acc + m_pad * d_len;      // [d, KB] a key block, transposed
  float* vb = kt + KB * d_len;          // [KB, d] a value block
  const int32_t* table = tables + s * sh.max_blocks;
  const int64_t layer_off = layer * sh.num_blocks * bs;
  auto row_of = [&](const T* cache, int64_t t) {
    return cache + ((layer_off + static_cast<int64_t>(table[t / bs]) * bs + t % bs) * hkv + h) *
                       d_len;
  };
  // keys a vector m may read, as [lo, hi) offsets from `first`
  auto lo_of = [&](int64_t m) {
    const int64_t pos = p0 + i0 + m / g_len;
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) - first : 0;
  };
  auto hi_of = [&](int64_t m) { return p0 + i0 + m / g_len + 1 - first; };

  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    const int64_t nb = std::min(KB, n - t0);
    for (int64_t c = 0; c < KB; ++c) {
      if (c < nb) {
        const T* k = row_of(kc, first + t0 + c);
        for (int64_t d = 0; d < d_len; ++d) kt[d * KB + c] = Load<T>::at(k, d);
      } else {
        for (int64_t d = 0; d < d_len; ++d) kt[d * KB + c] = 0.0f;
      }
    }
    // four query vectors at a time share each load of the transposed block
    for (int64_t m0 = 0; m0 < m_len; m0 += 4) {
      const int64_t mn = std::min<int64_t>(4, m_len - m0);
      bool any = false;
      const float* qm[4];
      for (int64_t u = 0; u < 4; ++u) {
        const int64_t m = m0 + std::min(u, mn - 1);
        any |= u < mn && t0 < hi_of(m) && t0 + KB > lo_of(m);
        qm[u] = q + ((row0 + i0 + m / g_len) * nq + h * g_len + m % g_len) * d_len;
      }
      if (!any) continue;  // every key of the block masked for these vectors
      float s0[KB] = {}, s1[KB] = {}, s2[KB] = {}, s3[KB] = {};
      for (int64_t d = 0; d < d_len; ++d) {
        const float* __restrict__ kd = kt + d * KB;
        const float q0 = qm[0][d], q1 = qm[1][d], q2 = qm[2][d], q3 = qm[3][d];
        for (int64_t c = 0; c < KB; ++c) {
          const float kv = kd[c];
          s0[c] += q0 * kv;
          s1[c] += q1 * kv;
          s2[c] += q2 * kv;
          s3[c] += q3 * kv;
        }
      }
      const float* rows[4] = {s0, s1, s2, s3};
      for (int64_t u = 0; u < 4; ++u) {
        std::memcpy(sc + (m0 + u) * n_pad + t0, rows[u], sizeof(float) * KB);
      }
    }
  }
  // probabilities, 0 outside each vector's keys (and for the padding vectors)
  for (int64_t m = 0; m < m_pad; ++m) {
    float* sm = sc + m * n_pad;
    std::fill(acc + m * d_len, acc + (m + 1) * d_len, 0.0f);
    if (m >= m_len) {
      std::fill(sm, sm + n_pad, 0.0f);
      continue;
    }
    const int64_t lo = lo_of(m), hi = hi_of(m);
    std::fill(sm, sm + lo, 0.0f);
    std::fill(sm + hi, sm + n_pad, 0.0f);
    const float inv = 1.0f / exp_in_place(sm + lo, hi - lo, soft_cap);
    for (int64_t i = lo; i < hi; ++i) sm[i] *= inv;
  }
  // values: four vectors at a time, 16 of the head's dimensions at a time in registers
  constexpr int64_t DC = 16;
  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    const int64_t nb = std::min(KB, n - t0);
    for (int64_t c = 0; c < KB; ++c) {
      float* vr = vb + c * d_len;
      if (c < nb) {
        const T* v = row_of(vc, first + t0 + c);
        for (int64_t d = 0; d < d_len; ++d) vr[d] = Load<T>::at(v, d);
      } else {
        std::fill(vr, vr + d_len, 0.0f);  // its probabilities are 0; no NaN * 0
      }
    }
    for (int64_t m0 = 0; m0 < m_pad; m0 += 4) {
      const int64_t ml = std::min(m0 + 3, m_len - 1);  // hi grows and lo grows with m
      if (m0 >= m_len || t0 >= hi_of(ml) || t0 + KB <= lo_of(m0)) continue;
      const float* __restrict__ p0r = sc + m0 * n_pad + t0;
      const float* __restrict__ p1r = p0r + n_pad;
      const float* __restrict__ p2r = p1r + n_pad;
      const float* __restrict__ p3r = p2r + n_pad;
      for (int64_t dc = 0; dc < d_len; dc += DC) {
        const int64_t de = std::min(DC, d_len - dc);
        float* __restrict__ a0 = acc + m0 * d_len + dc;
        float* __restrict__ a1 = a0 + d_len;
        float* __restrict__ a2 = a1 + d_len;
        float* __restrict__ a3 = a2 + d_len;
        float r0[DC], r1[DC], r2[DC], r3[DC];
        if (de == DC) {
          for (int64_t e = 0; e < DC; ++e) {
            r0[e] = a0[e];
            r1[e] = a1[e];
            r2[e] = a2[e];
            r3[e] = a3[e];
          }
          for (int64_t c = 0; c < KB; ++c) {
            const float* __restrict__ vr = vb + c * d_len + dc;
            const float q0 = p0r[c], q1 = p1r[c], q2 = p2r[c], q3 = p3r[c];
            for (int64_t e = 0; e < DC; ++e) {
              r0[e] += q0 * vr[e];
              r1[e] += q1 * vr[e];
              r2[e] += q2 * vr[e];
              r3[e] += q3 * vr[e];
            }
          }
          for (int64_t e = 0; e < DC; ++e) {
            a0[e] = r0[e];
            a1[e] = r1[e];
            a2[e] = r2[e];
            a3[e] = r3[e];
          }
        } else {  // a head size that is not a multiple of 16
          for (int64_t c = 0; c < KB; ++c) {
            const float* vr = vb + c * d_len + dc;
            for (int64_t e = 0; e < de; ++e) {
              a0[e] += p0r[c] * vr[e];
              a1[e] += p1r[c] * vr[e];
              a2[e] += p2r[c] * vr[e];
              a3[e] += p3r[c] * vr[e];
            }
          }
        }
      }
    }
  }
  const float vs = v_scale[h];
  for (int64_t m = 0; m < m_len; ++m) {
    float* o = out + ((row0 + i0 + m / g_len) * nq + h * g_len + m % g_len) * d_len;
    const float* am = acc + m * d_len;
    for (int64_t d = 0; d < d_len; ++d) o[d] = am[d] * vs;
  }
}

#if defined(__AVX512F__)
// exp_nonpos on 16 lanes, the same steps.
inline __m512 exp_nonpos16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 hi = _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f));
  const __m512 lo = _mm512_mul_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f));
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, hi), lo);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_castsi512_ps(_mm512_add_epi32(
      _mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
}

constexpr int kTileKeys = 8;  // keys per step of the transposed score pass

// Scores of kTileKeys keys (rows of kr, f32[kTileKeys, D]) against MB blocks of 16 query
// vectors (qt, f32[D, m_stride] from column 16 * b0) into st (f32[keys, m_stride]).
template <int D, int MB>
inline void score_keys(const float* kr, const float* qt, int64_t m_stride, int64_t b0,
                       float* st) {
  __m512 acc[kTileKeys][MB];
  for (int c = 0; c < kTileKeys; ++c)
    for (int b = 0; b < MB; ++b) acc[c][b] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m512 qv[MB];
    for (int b = 0; b < MB; ++b) qv[b] = _mm512_loadu_ps(qt + d * m_stride + 16 * (b0 + b));
    for (int c = 0; c < kTileKeys; ++c) {
      const __m512 kv = _mm512_set1_ps(kr[c * D + d]);
      for (int b = 0; b < MB; ++b) acc[c][b] = _mm512_fmadd_ps(kv, qv[b], acc[c][b]);
    }
  }
  for (int c = 0; c < kTileKeys; ++c)
    for (int b = 0; b < MB; ++b) _mm512_storeu_ps(st + c * m_stride + 16 * (b0 + b), acc[c][b]);
}

// Value sums, transposed: ot[d, m] += sum over keys c in [c0, c1) of rows[c - t0, d] * pt[c, m],
// for 8 dimensions from d0 and MB blocks of 16 query vectors from block b0 (ot f32[D, m_stride],
// pt f32[keys, m_stride], rows f32[KB, D] the values of keys t0 ..).
template <int D, int MB>
inline void value_keys(const float* rows, const float* pt, int64_t m_stride, int64_t b0,
                       int64_t d0, int64_t t0, int64_t c0, int64_t c1, float* ot) {
  constexpr int DR = 8;
  __m512 acc[DR][MB];
  for (int i = 0; i < DR; ++i)
    for (int b = 0; b < MB; ++b) {
      acc[i][b] = _mm512_loadu_ps(ot + (d0 + i) * m_stride + 16 * (b0 + b));
    }
  for (int64_t c = c0; c < c1; ++c) {
    __m512 pv[MB];
    for (int b = 0; b < MB; ++b) pv[b] = _mm512_loadu_ps(pt + c * m_stride + 16 * (b0 + b));
    const float* vr = rows + (c - t0) * D + d0;
    for (int i = 0; i < DR; ++i) {
      const __m512 vv = _mm512_set1_ps(vr[i]);
      for (int b = 0; b < MB; ++b) acc[i][b] = _mm512_fmadd_ps(vv, pv[b], acc[i][b]);
    }
  }
  for (int i = 0; i < DR; ++i)
    for (int b = 0; b < MB; ++b) {
      _mm512_storeu_ps(ot + (d0 + i) * m_stride + 16 * (b0 + b), acc[i][b]);
    }
}

// attend_tile with AVX-512 for head_dim D (64, 128 or 256). The scores are computed transposed,
// [key, query vector] with 16 query vectors per register, so that no key is transposed (each
// key's element is broadcast against the transposed queries) and the softmax runs down the
// columns: its maximum, exp and sum are vertical. The value sums are transposed the same way
// (each value element broadcast against 16 vectors' probabilities), so both passes keep 24
// sums in registers and issue 24 FMAs per 11 loads.
template <typename T, int D>
void attend_tile_avx512(const Shapes& sh, int64_t layer, const float* q, const T* kc,
                        const T* vc, const int32_t* tables, int64_t s, int64_t h, int64_t row0,
                        int64_t p0, int64_t i0, int64_t i1, int64_t window, float soft_cap,
                        const float* v_scale, float* out, std::vector<float>& buf) {
  constexpr int V = D / 16;
  constexpr int64_t KB = kKeyBlock;
  const int64_t g_len = sh.group, bs = sh.block_size, hkv = sh.num_kv_heads;
  const int64_t nq = sh.num_q_heads;
  const int64_t first = window > 0 ? std::max<int64_t>(0, p0 + i0 - window + 1) : 0;
  const int64_t n = p0 + i1 - first;  // keys first .. the tile's last position
  const int64_t n_pad = (n + KB - 1) / KB * KB;  // a multiple of kTileKeys too
  const int64_t m_len = (i1 - i0) * g_len;       // query vectors: m = r * g + j
  const int64_t mb_len = (m_len + 15) / 16, ms = mb_len * 16;
  buf.resize(static_cast<size_t>(n_pad * ms + 2 * ms * D + KB * D + 3 * ms));
  float* st = buf.data();       // [n_pad, ms] scores, then (rows < n) probabilities, 0 masked
  float* qt = st + n_pad * ms;  // [D, ms] the queries, transposed
  float* ot = qt + ms * D;      // [D, ms] value sums, transposed
  float* rows = ot + ms * D;    // [KB, D] keys or values as float32
  float* inv = rows + KB * D;   // [ms] 1 / denominator
  int32_t* lo_hi = reinterpret_cast<int32_t*>(inv + ms);  // [2, ms] keys [lo, hi) per vector
  int32_t* lo = lo_hi;
  int32_t* hi = lo_hi + ms;
  for (int64_t m = 0; m < ms; ++m) {
    if (m < m_len) {
      const int64_t pos = p0 + i0 + m / g_len;
      lo[m] = static_cast<int32_t>(window > 0 ? std::max<int64_t>(0, pos - window + 1) - first
                                              : 0);
      hi[m] = static_cast<int32_t>(pos + 1 - first);
    } else {
      lo[m] = hi[m] = 0;  // padding vectors see no key
    }
  }
  // the queries, transposed: 16 vectors' element d in one gather (padding vectors 0)
  const float* qbase = q + (row0 + i0) * nq * D + h * g_len * D;
  for (int64_t b = 0; b < mb_len; ++b) {
    alignas(64) int32_t idx[16];
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t m = std::min(16 * b + l, m_len - 1);
      idx[l] = static_cast<int32_t>((m / g_len * nq + m % g_len) * D);
    }
    const __m512i iv = _mm512_load_si512(idx);
    const int64_t left = m_len - 16 * b;
    const __mmask16 k = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1u);
    for (int64_t d = 0; d < D; ++d) {
      _mm512_storeu_ps(qt + d * ms + 16 * b,
                       _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, iv, qbase + d, 4));
    }
  }
  const int32_t* table = tables + s * sh.max_blocks;
  const int64_t layer_off = layer * sh.num_blocks * bs;
  auto row_of = [&](const T* cache, int64_t t) {
    return cache + ((layer_off + static_cast<int64_t>(table[t / bs]) * bs + t % bs) * hkv + h) * D;
  };
  // KB keys (or values) from t0 as float32 rows, zeros past n
  auto convert = [&](const T* cache, int64_t t0) {
    for (int64_t c = 0; c < KB; ++c) {
      __m512 r[V];
      if (t0 + c < n) {
        load_row<V>(row_of(cache, first + t0 + c), r);
      } else {
        for (int v = 0; v < V; ++v) r[v] = _mm512_setzero_ps();
      }
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(rows + c * D + 16 * v, r[v]);
    }
  };
  // scores, transposed
  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    convert(kc, t0);
    for (int64_t c = 0; c < KB; c += kTileKeys) {
      for (int64_t b0 = 0; b0 < mb_len; b0 += 3) {
        switch (std::min<int64_t>(3, mb_len - b0)) {
          case 3: score_keys<D, 3>(rows + c * D, qt, ms, b0, st + (t0 + c) * ms); break;
          case 2: score_keys<D, 2>(rows + c * D, qt, ms, b0, st + (t0 + c) * ms); break;
          default: score_keys<D, 1>(rows + c * D, qt, ms, b0, st + (t0 + c) * ms); break;
        }
      }
    }
  }
  if (soft_cap > 0.0f) {
    for (int64_t i = 0; i < n * ms; ++i) st[i] = soft_cap * std::tanh(st[i] / soft_cap);
  }
  // softmax down each column: masked entries become 0
  for (int64_t b = 0; b < mb_len; ++b) {
    const __m512i lov = _mm512_loadu_si512(lo + 16 * b), hiv = _mm512_loadu_si512(hi + 16 * b);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < n; ++c) {
      const __m512i cv = _mm512_set1_epi32(static_cast<int32_t>(c));
      const __mmask16 k = _mm512_cmpge_epi32_mask(cv, lov) & _mm512_cmplt_epi32_mask(cv, hiv);
      mx = _mm512_mask_max_ps(mx, k, mx, _mm512_loadu_ps(st + c * ms + 16 * b));
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; ++c) {
      const __m512i cv = _mm512_set1_epi32(static_cast<int32_t>(c));
      const __mmask16 k = _mm512_cmpge_epi32_mask(cv, lov) & _mm512_cmplt_epi32_mask(cv, hiv);
      const __m512 p = _mm512_maskz_mov_ps(
          k, exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(st + c * ms + 16 * b), mx)));
      _mm512_storeu_ps(st + c * ms + 16 * b, p);
      sum = _mm512_add_ps(sum, p);
    }
    // padding lanes sum to 0 and are never written out
    _mm512_storeu_ps(inv + 16 * b, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
  }
  // values, transposed: ot[d, m] = sum_c v[c, d] * p[c, m], over the keys some vector sees
  std::fill(ot, ot + D * ms, 0.0f);
  const int64_t c_lo = lo[0], c_hi = hi[m_len - 1];
  for (int64_t t0 = 0; t0 < n; t0 += KB) {
    const int64_t c0 = std::max<int64_t>(t0, c_lo), c1 = std::min<int64_t>({t0 + KB, n, c_hi});
    if (c0 >= c1) continue;
    convert(vc, t0);
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      for (int64_t b0 = 0; b0 < mb_len; b0 += 3) {
        switch (std::min<int64_t>(3, mb_len - b0)) {
          case 3: value_keys<D, 3>(rows, st, ms, b0, d0, t0, c0, c1, ot); break;
          case 2: value_keys<D, 2>(rows, st, ms, b0, d0, t0, c0, c1, ot); break;
          default: value_keys<D, 1>(rows, st, ms, b0, d0, t0, c0, c1, ot); break;
        }
      }
    }
  }
  const float vs = v_scale[h];
  for (int64_t m = 0; m < m_len; ++m) {
    float* o = out + ((row0 + i0 + m / g_len) * nq + h * g_len + m % g_len) * D;
    const float scale = inv[m] * vs;
    for (int64_t d = 0; d < D; ++d) o[d] = ot[d * ms + m] * scale;
  }
}

// A 16 x 16 transpose of 32-bit lanes in place: x[e] lane c <- x[c] lane e.
inline void transpose16(__m512* x) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // lane L of t[i]: x[i][4L], x[i+1][4L], x[i][4L+1], ...
    t[i] = _mm512_unpacklo_ps(x[i], x[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(x[i], x[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // lane L of x[i + w]: column 4L + w of rows i .. i + 3
    x[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    x[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    x[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    x[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // then the 128-bit lanes, in two steps
    t[i] = _mm512_shuffle_f32x4(x[i], x[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(x[i], x[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(x[i + 8], x[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(x[i + 8], x[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    x[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// acc[j] = FMA(k, head j's element at qd[j * D], acc[j]) for the G heads: one step of their
// score chains.
template <int G, int D>
inline void fma_heads(__m512 k, const float* qd, __m512* acc) {
  for (int j = 0; j < G; ++j) acc[j] = _mm512_fmadd_ps(k, _mm512_set1_ps(qd[j * D]), acc[j]);
}

// The scores of 16 keys (rows[c]; nullptr past the context: a zero row) against G query heads
// (qh, f32[G, D]), keys in the lanes: acc[j] lane c = key c . head j as one FMA chain over
// d = 0 .. D - 1, from 0 (score_keys' order). Each 16 x 16 block of 32-bit lanes is transposed
// in registers and used at once; a bfloat16 block is transposed as pairs of elements and each
// pair split in two (half the shuffles of a float32 block).
template <typename T, int D, int G>
inline void score_rows16(const T* const* rows, const float* qh, __m512* acc) {
  for (int j = 0; j < G; ++j) acc[j] = _mm512_setzero_ps();
  __m512 x[16];
  if constexpr (std::is_same_v<T, uint16_t>) {
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int w = 0; w < D / 32; ++w) {
      for (int c = 0; c < 16; ++c) {
        x[c] = rows[c] ? _mm512_loadu_ps(reinterpret_cast<const float*>(rows[c] + 32 * w))
                       : _mm512_setzero_ps();
      }
      transpose16(x);  // x[e] lane c: key c's elements 32w + 2e (low half) and 32w + 2e + 1
#pragma GCC unroll 16
      for (int e = 0; e < 16; ++e) {
        const __m512i pair = _mm512_castps_si512(x[e]);
        fma_heads<G, D>(_mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)), qh + 32 * w + 2 * e,
                        acc);
        fma_heads<G, D>(_mm512_castsi512_ps(_mm512_and_si512(pair, high)),
                        qh + 32 * w + 2 * e + 1, acc);
      }
    }
  } else {
    for (int v = 0; v < D / 16; ++v) {
      for (int c = 0; c < 16; ++c) {
        if (rows[c]) {
          load_row<1>(rows[c] + 16 * v, x + c);
        } else {
          x[c] = _mm512_setzero_ps();
        }
      }
      transpose16(x);  // x[e] lane c: key c's element 16v + e
#pragma GCC unroll 16
      for (int e = 0; e < 16; ++e) fma_heads<G, D>(x[e], qh + 16 * v + e, acc);
    }
  }
}

// A decode row (sequence s's row `row`, kv head h) in the reduction order its row has in
// attend_tile_avx512, so that with `invariant` it is bit for bit what the same row gives in a
// prompt chunk: each score one FMA chain over d = 0 .. D - 1, the softmax sum and each value
// sum one chain over the keys in order, the same exp, 1 / sum and scaling. The tile gets those
// orders with its query vectors in the lanes, which one row fills only G of 16 of (the
// one-row tile this item replaces took 4.1x its instructions and 3.8x its time for 16 x 300
// tokens, SmolLM2's 64 x 3); here 16 keys are in the lanes (score_rows16), and the value pass
// is the decode item's, which already sums each element key by key, with the softmax sum
// beside it (docs/decisions/0040-batch-invariance.md).
template <typename T, int D, int G>
void attend_row_avx512(const Shapes& sh, int64_t layer, const float* q, const T* kc,
                       const T* vc, const int32_t* tables, int64_t s, int64_t h, int64_t row,
                       int64_t ctx, int64_t window, float soft_cap, const float* v_scale,
                       float* out, std::vector<float>& buf) {
  constexpr int V = D / 16;
  const int64_t bs = sh.block_size, hkv = sh.num_kv_heads;
  const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
  const int64_t n = ctx - first;
  if (n <= 0) return;
  const int64_t n_pad = (n + 15) / 16 * 16;
  buf.resize(static_cast<size_t>(G * n_pad));
  float* sc = buf.data();  // [G, n_pad] scores, then probabilities (0 past n)
  const float* qh = q + (row * sh.num_q_heads + h * G) * D;  // [G, D]
  const int32_t* table = tables + s * sh.max_blocks;
  const int64_t layer_off = layer * sh.num_blocks * bs;
  int64_t page = first / bs, off = first % bs;  // of the next key
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    for (int64_t t = (first + i0 + 16 + bs - 1) / bs * bs; t < first + i0 + 32; t += bs) {
      prefetch_page(kc, table, t, ctx, layer_off, bs, hkv, h, D);  // pages the next keys start
    }
    const T* rows[16];
    for (int c = 0; c < 16; ++c) {
      if (i0 + c >= n) {
        rows[c] = nullptr;
        continue;
      }
      rows[c] = kc + ((layer_off + static_cast<int64_t>(table[page]) * bs + off) * hkv + h) * D;
      if (++off == bs) {
        off = 0;
        ++page;
      }
    }
    __m512 acc[G];
    score_rows16<T, D, G>(rows, qh, acc);
    for (int j = 0; j < G; ++j) _mm512_storeu_ps(sc + j * n_pad + i0, acc[j]);
  }
  for (int j = 0; j < G; ++j) {
    float* sj = sc + j * n_pad;
    if (soft_cap > 0.0f) {
      for (int64_t i = 0; i < n; ++i) sj[i] = soft_cap * std::tanh(sj[i] / soft_cap);
    }
    const __m512 mx = _mm512_set1_ps(max_of(sj, n));
    for (int64_t i = 0; i < n_pad; i += 16) {
      const __mmask16 k = i + 16 <= n ? __mmask16{0xffff}
                          : i < n     ? static_cast<__mmask16>((1u << (n - i)) - 1u)
                                      : __mmask16{0};
      _mm512_storeu_ps(sj + i, _mm512_maskz_mov_ps(
                                   k, exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(sj + i), mx))));
    }
  }
  __m512 acc[G][V];
  __m128 sum[G];
  for (int j = 0; j < G; ++j) {
    sum[j] = _mm_setzero_ps();
    for (int v = 0; v < V; ++v) acc[j][v] = _mm512_setzero_ps();
  }
  for (int64_t t = first; t < ctx;) {
    const int64_t off0 = t % bs, stop = std::min(ctx, t - off0 + bs);
    prefetch_page(vc, table, t - off0 + bs, ctx, layer_off, bs, hkv, h, D);
    const T* vrow =
        vc + ((layer_off + static_cast<int64_t>(table[t / bs]) * bs + off0) * hkv + h) * D;
    for (; t < stop; ++t, vrow += hkv * D) {
      __m512 x[V];
      load_row<V>(vrow, x);
      for (int j = 0; j < G; ++j) {
        const float* pj = sc + j * n_pad + (t - first);
        const __m512 p = _mm512_set1_ps(*pj);
        sum[j] = _mm_add_ss(sum[j], _mm512_castps512_ps128(p));  // a builtin: not reassociated
        for (int v = 0; v < V; ++v) acc[j][v] = _mm512_fmadd_ps(p, x[v], acc[j][v]);
      }
    }
  }
  float* o = out + (row * sh.num_q_heads + h * G) * D;
  for (int j = 0; j < G; ++j) {
    const float inv = 1.0f / _mm_cvtss_f32(sum[j]);
    const __m512 f = _mm512_set1_ps(inv * v_scale[h]);
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(o + j * D + 16 * v, _mm512_mul_ps(acc[j][v], f));
  }
}
#endif  // __AVX512F__

template <typename T>
void attend_tile_dispatch(const Shapes& sh, int64_t layer, const float* q, const T* kc,
                          const T* vc, const int32_t* tables, int64_t s, int64_t h,
                          int64_t row0, int64_t p0, int64_t i0, int64_t i1, int64_t window,
                          float soft_cap, const float* v_scale, float* out,
                          std::vector<float>& buf) {
#if defined(__AVX512F__)
  switch (sh.head_dim) {
    case 64:
      return attend_tile_avx512<T, 64>(sh, layer, q, kc, vc, tables, s, h, row0, p0, i0, i1,
                                       window, soft_cap, v_scale, out, buf);
    case 128:
      return attend_tile_avx512<T, 128>(sh, layer, q, kc, vc, tables, s, h, row0, p0, i0, i1,
                                        window, soft_cap, v_scale, out, buf);
    case 256:
      return attend_tile_avx512<T, 256>(sh, layer, q, kc, vc, tables, s, h, row0, p0, i0, i1,
                                        window, soft_cap, v_scale, out, buf);
    default:
      break;
  }
#endif
  switch (sh.head_dim) {
    case 64:
      return attend_tile<T, 64>(sh, layer, q, kc, vc, tables, s, h, row0, p0, i0, i1, window,
                                soft_cap, v_scale, out, buf);
    case 128:
      return attend_tile<T, 128>(sh, layer, q, kc, vc, tables, s, h, row0, p0, i0, i1, window,
                                 soft_cap, v_scale, out, buf);
    case 256:
      return attend_tile<T, 256>(sh, layer, q, kc, vc, tables, s, h, row0, p0, i0, i1, window,
                                 soft_cap, v_scale, out, buf);
    default:
      return attend_tile<T, 0>(sh, layer, q, kc, vc, tables, s, h, row0, p0, i0, i1, window,
                               soft_cap, v_scale, out, buf);
  }
}

// A decode row in the prefill tiles' reduction order (`invariant`): attend_row_avx512 where it
// is built, else the row as a one-row tile.
template <typename T>
void attend_row_dispatch(const Shapes& sh, int64_t layer, const float* q, const T* kc,
                         const T* vc, const int32_t* tables, int64_t s, int64_t h, int64_t row,
                         int64_t ctx, int64_t window, float soft_cap, const float* v_scale,
                         float* out, std::vector<float>& buf) {
#if defined(__AVX512F__)
#define JAXSERVE_ROW(D, G)                                                                  \
  if (sh.head_dim == D && sh.group == G)                                                    \
    return attend_row_avx512<T, D, G>(sh, layer, q, kc, vc, tables, s, h, row, ctx, window, \
                                      soft_cap, v_scale, out, buf);
  JAXSERVE_ROW(64, 1) JAXSERVE_ROW(64, 2) JAXSERVE_ROW(64, 3) JAXSERVE_ROW(64, 4)
  JAXSERVE_ROW(64, 6) JAXSERVE_ROW(64, 8) JAXSERVE_ROW(128, 1) JAXSERVE_ROW(128, 2)
  JAXSERVE_ROW(128, 3) JAXSERVE_ROW(128, 4) JAXSERVE_ROW(256, 1) JAXSERVE_ROW(256, 2)
#undef JAXSERVE_ROW
#endif
  attend_tile_dispatch<T>(sh, layer, q, kc, vc, tables, s, h, row, ctx - 1, 0, 1, window,
                          soft_cap, v_scale, out, buf);
}

// A work item: sequence s's decode row (kDecode; kRow with `invariant`) or a prefill tile
// (kTile: its rows [i0, i1)).
enum class Kind : int8_t { kDecode, kRow, kTile };
struct Item {
  int64_t s, i0, i1;
  Kind kind;
};

struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
};

template <typename T>
void run(ffi::ThreadPool& pool, const Shapes& sh, int64_t layer, const float* q,
         const void* k_raw, const void* v_raw, const int32_t* tables, const int32_t* seq_lens,
         const int32_t* qsl, int64_t num_seqs, int64_t window, float soft_cap,
         const float* v_scale, bool prefill, bool invariant, float* out) {
  const T* kc = static_cast<const T*>(k_raw);
  const T* vc = static_cast<const T*>(v_raw);
  std::memset(out, 0, sizeof(float) * sh.num_tokens * sh.num_q_heads * sh.head_dim);
  // prefill tiles first, the longest contexts first (they cost most), then the decode rows
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = qsl[s + 1] - qsl[s];
    if (!prefill || q_len <= 1 || seq_lens[s] < q_len) continue;
    for (int64_t i0 = 0; i0 < q_len; i0 += kTileRows) {
      items.push_back({s, i0, std::min(q_len, i0 + kTileRows), Kind::kTile});
    }
  }
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return seq_lens[a.s] - (qsl[a.s + 1] - qsl[a.s]) + a.i1 >
           seq_lens[b.s] - (qsl[b.s + 1] - qsl[b.s]) + b.i1;
  });
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (qsl[s + 1] - qsl[s] == 1 && seq_lens[s] > 0) {
      items.push_back({s, 0, 1, invariant ? Kind::kRow : Kind::kDecode});
    }
  }
  auto job = std::make_shared<Job>();
  job->total = static_cast<int64_t>(items.size()) * sh.num_kv_heads;
  if (job->total == 0) return;
  auto items_p = std::make_shared<std::vector<Item>>(std::move(items));
  auto work = [=, &sh]() {
    thread_local std::vector<float> buf;
    for (;;) {
      const int64_t i = job->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= job->total) return;
      const Item& it = (*items_p)[i / sh.num_kv_heads];
      const int64_t s = it.s, h = i % sh.num_kv_heads;
      if (it.kind == Kind::kDecode) {
        attend_item_dispatch<T>(sh, layer, q, kc, vc, tables, s, h, qsl[s], seq_lens[s],
                                window, soft_cap, v_scale, out, buf);
      } else if (it.kind == Kind::kRow) {
        attend_row_dispatch<T>(sh, layer, q, kc, vc, tables, s, h, qsl[s], seq_lens[s],
                               window, soft_cap, v_scale, out, buf);
      } else {
        const int64_t p0 = seq_lens[s] - (qsl[s + 1] - qsl[s]);
        attend_tile_dispatch<T>(sh, layer, q, kc, vc, tables, s, h, qsl[s], p0, it.i0, it.i1,
                                window, soft_cap, v_scale, out, buf);
      }
      job->done.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    // a task that starts after the caller took every item returns at once; `job` and `items_p`
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
                               int32_t prefill, int32_t invariant,
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
           v_scale.typed_data(), prefill != 0, prefill != 0 && invariant != 0,
           out->typed_data());
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
                                  .Attr<int32_t>("prefill")
                                  .Attr<int32_t>("invariant")
                                  .Ret<ffi::Buffer<ffi::F32>>());
