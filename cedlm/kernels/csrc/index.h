// Lightning-indexer scoring read straight from the packed index keys, and the indexer's top-k
// with its deterministic tie rule (included by codecs.cpp, like mhc.h and rope.h).
//
// score: the readable reference is Indexer.score in cedlm/model/indexer.py over keys decoded by
// the codec (KVCache.index_keys):
//   I(t, n) = sum_h w(t, h) * ReLU(q(t, h) . k(n))   where entry n is visible to query t, else -inf.
// Here each key row is decoded from its bytes into a small scratch tile (a block of KEY_TILE rows,
// on the stack) just before it is scored against every query of the call, so no decoded copy of
// the cache is kept and a prefill chunk decodes each key once, not once per query. Same math,
// another summation order (the dot product in 4 float32 lanes, or 8 lanes of fused multiply-adds
// where the CPU has AVX2 + FMA; heads summed in order), so it agrees with the reference to float32
// rounding (tests/test_index_fast.py states the tolerance), not bit for bit. A score does not
// depend on the batch, the chunk or the other entries, so incremental decode and a full forward
// score an entry identically on one machine.
//
// topk: the reference is stable_topk in cedlm/model/indexer.py: a stable descending sort of the
// flipped scores, i.e. the total order "larger score first, NaN largest, equal scores newest
// (highest index) first". A selection does no arithmetic, so this partial sort under the same
// total order returns the same indices and values, bit for bit.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>
#if defined(__SSE2__) && !defined(CEDLM_CODECS_SCALAR)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(CEDLM_CODECS_SCALAR)
#include <immintrin.h>     // AVX2 + FMA for one function, chosen at run time (no -march)
#endif

namespace cedlm_index {

constexpr int64_t KEY_TILE = 16;          // key rows decoded per tile (16 x 128 floats: 8 KiB)
constexpr int64_t MAX_DIM = 512;

// sum_j a[j] * b[j], 4 lanes (lane = j % 4), lanes added 0+1+2+3 in order; d % 4 == 0.
inline float dot4(const float* a, const float* b, int64_t d) {
#if defined(__SSE2__) && !defined(CEDLM_CODECS_SCALAR)
  __m128 acc = _mm_setzero_ps();
  for (int64_t j = 0; j < d; j += 4)
    acc = _mm_add_ps(acc, _mm_mul_ps(_mm_loadu_ps(a + j), _mm_loadu_ps(b + j)));
  alignas(16) float l[4];
  _mm_store_ps(l, acc);
  return ((l[0] + l[1]) + l[2]) + l[3];
#else
  float l[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t j = 0; j < d; j += 4)
    for (int64_t i = 0; i < 4; ++i) l[i] = l[i] + a[j + i] * b[j + i];
  return ((l[0] + l[1]) + l[2]) + l[3];
#endif
}

// dot4 of four query rows (a + i * D, i < 4) against one key b -> d[0..4): the same lanes and the
// same order per row as dot4, computed together so the four accumulations overlap.
inline void dot4x4(const float* a, int64_t D, const float* b, float* d) {
#if defined(__SSE2__) && !defined(CEDLM_CODECS_SCALAR)
  __m128 c0 = _mm_setzero_ps(), c1 = _mm_setzero_ps(), c2 = _mm_setzero_ps(), c3 = _mm_setzero_ps();
  for (int64_t j = 0; j < D; j += 4) {
    const __m128 kv = _mm_loadu_ps(b + j);
    c0 = _mm_add_ps(c0, _mm_mul_ps(_mm_loadu_ps(a + j), kv));
    c1 = _mm_add_ps(c1, _mm_mul_ps(_mm_loadu_ps(a + D + j), kv));
    c2 = _mm_add_ps(c2, _mm_mul_ps(_mm_loadu_ps(a + 2 * D + j), kv));
    c3 = _mm_add_ps(c3, _mm_mul_ps(_mm_loadu_ps(a + 3 * D + j), kv));
  }
  alignas(16) float l[16];
  _mm_store_ps(l, c0); _mm_store_ps(l + 4, c1); _mm_store_ps(l + 8, c2); _mm_store_ps(l + 12, c3);
  for (int i = 0; i < 4; ++i) d[i] = ((l[4 * i] + l[4 * i + 1]) + l[4 * i + 2]) + l[4 * i + 3];
#else
  for (int i = 0; i < 4; ++i) d[i] = dot4(a + i * D, b, D);
#endif
}

inline float relu(float v) { return std::isnan(v) ? v : (v > 0.f ? v : 0.f); }   // torch.relu

// Scores of queries [T, H, D] (q, weights w [T, H]) against keys a..b of one sequence, already
// decoded into `keys` ([b - a, D]); vis [T, N] (bool bytes); out [T, N]. Heads are summed in
// order; the dot products are the only thing the two versions do differently.
using TileFn = void (*)(const float* q, const float* w, const uint8_t* vis, float* out, int64_t T,
                        int64_t H, int64_t D, int64_t N, int64_t a, int64_t b, const float* keys);

inline void score_tile(const float* q, const float* w, const uint8_t* vis, float* out, int64_t T,
                       int64_t H, int64_t D, int64_t N, int64_t a, int64_t b, const float* keys) {
  const float neg = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < T; ++t) {
    const float* qt = q + t * H * D;
    const float* wt = w + t * H;
    for (int64_t n = a; n < b; ++n) {
      if (!vis[t * N + n]) { out[t * N + n] = neg; continue; }
      const float* k = keys + (n - a) * D;
      float s = 0.f, d[4];
      int64_t h = 0;
      for (; h + 4 <= H; h += 4) {                   // four dots at a time
        dot4x4(qt + h * D, D, k, d);
        for (int i = 0; i < 4; ++i) s = s + relu(d[i]) * wt[h + i];
      }
      for (; h < H; ++h) s = s + relu(dot4(qt + h * D, k, D)) * wt[h];
      out[t * N + n] = s;
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(CEDLM_CODECS_SCALAR)
#define CEDLM_INDEX_AVX2 1
// The same with 8-lane fused multiply-adds (AVX2 + FMA, chosen at run time; D % 8 == 0): lanes
// j % 8, added ((0+1)+(2+3))+((4+5)+(6+7)).
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  alignas(32) float l[8];
  _mm256_store_ps(l, v);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// hsum8 of four accumulators at once, in the same order: two rounds of pairwise adds within each
// 128-bit half give ((0+1)+(2+3)) and ((4+5)+(6+7)) of each, then the halves are added.
__attribute__((target("avx2,fma"))) inline void hsum8x4(__m256 a, __m256 b, __m256 c, __m256 e,
                                                        float* d) {
  const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, e));
  _mm_store_ps(d, _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

__attribute__((target("avx2,fma")))
inline void score_tile_avx2(const float* q, const float* w, const uint8_t* vis, float* out,
                            int64_t T, int64_t H, int64_t D, int64_t N, int64_t a, int64_t b,
                            const float* keys) {
  const float neg = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < T; ++t) {
    const float* qt = q + t * H * D;
    const float* wt = w + t * H;
    for (int64_t n = a; n < b; ++n) {
      if (!vis[t * N + n]) { out[t * N + n] = neg; continue; }
      const float* k = keys + (n - a) * D;
      float s = 0.f;
      int64_t h = 0;
      for (; h + 4 <= H; h += 4) {
        const float* qh = qt + h * D;
        __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
        __m256 c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
        for (int64_t j = 0; j < D; j += 8) {
          const __m256 kv = _mm256_loadu_ps(k + j);
          c0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + j), kv, c0);
          c1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + D + j), kv, c1);
          c2 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 2 * D + j), kv, c2);
          c3 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 3 * D + j), kv, c3);
        }
        alignas(16) float d[4];
        hsum8x4(c0, c1, c2, c3, d);
        s = s + relu(d[0]) * wt[h];
        s = s + relu(d[1]) * wt[h + 1];
        s = s + relu(d[2]) * wt[h + 2];
        s = s + relu(d[3]) * wt[h + 3];
      }
      for (; h < H; ++h) {
        __m256 c = _mm256_setzero_ps();
        for (int64_t j = 0; j < D; j += 8)
          c = _mm256_fmadd_ps(_mm256_loadu_ps(qt + h * D + j), _mm256_loadu_ps(k + j), c);
        s = s + relu(hsum8(c)) * wt[h];
      }
      out[t * N + n] = s;
    }
  }
}
#endif

// Whether pick_tile may choose the AVX2 + FMA scorer (set_avx2; CEDLM_KERNEL_ISA=sse2 clears it).
inline bool& allow_avx2() {
  static bool allow = true;
  return allow;
}

// The tile scorer for this CPU and head dim.
inline TileFn pick_tile(int64_t D) {
#ifdef CEDLM_INDEX_AVX2
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && allow_avx2() && D % 8 == 0) return score_tile_avx2;
#endif
  (void)D;
  return score_tile;
}

// Keys n0..n1 of one sequence, KEY_TILE at a time: decode(n, buf) writes key n's D floats (only
// for tiles some query sees), then `tile` scores them.
template <class Decode>
void score_rows(const float* q, const float* w, const uint8_t* vis, float* out, int64_t T,
                int64_t H, int64_t D, int64_t N, int64_t n0, int64_t n1, TileFn tile,
                Decode decode) {
  alignas(32) float keys[KEY_TILE * MAX_DIM];
  for (int64_t a = n0; a < n1; a += KEY_TILE) {
    const int64_t b = std::min(a + KEY_TILE, n1);
    bool any = false;
    for (int64_t t = 0; t < T && !any; ++t)
      for (int64_t n = a; n < b && !any; ++n) any = vis[t * N + n] != 0;
    if (any)
      for (int64_t n = a; n < b; ++n) decode(n, keys + (n - a) * D);
    tile(q, w, vis, out, T, H, D, N, a, b, keys);
  }
}

// The k best of row[0..N) under the reference's order -> idx[0..k), val[0..k).
// The reference's order as one unsigned integer compared with >: the score's bits made
// monotone in the upper half (NaN largest, -0.0 equal to +0.0), the index in the lower half (equal
// scores: the newest first). The k largest keys are kept in a heap and then sorted: a strict total
// order, so the result is the reference's, bit for bit; the values are read back from the row,
// so a NaN's payload and a zero's sign are kept.
inline uint64_t order_key(float v, int64_t i) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  uint32_t m;
  if (std::isnan(v)) m = 0xFFFFFFFFu;
  else if (v == 0.f) m = 0x80000000u;                    // -0.0 and +0.0 tie
  else m = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (static_cast<uint64_t>(m) << 32) | static_cast<uint64_t>(i);
}

inline void topk_row(const float* row, int64_t N, int64_t k, int64_t* idx, float* val,
                     std::vector<uint64_t>& keys) {
  keys.clear();
  if (k == 0) return;
  // the k largest keys in a heap whose top is the smallest of them
  const auto worse = std::greater<uint64_t>();
  for (int64_t i = 0; i < k; ++i) keys.push_back(order_key(row[i], i));
  std::make_heap(keys.begin(), keys.end(), worse);
  // a score below the worst kept one (as floats: neither is NaN then) cannot enter: most of a
  // long row is passed over with one comparison
  float worst = row[keys.front() & 0xFFFFFFFFu];
  for (int64_t i = k; i < N; ++i) {
    if (row[i] < worst) continue;
    const uint64_t key = order_key(row[i], i);
    if (key > keys.front()) {
      std::pop_heap(keys.begin(), keys.end(), worse);
      keys.back() = key;
      std::push_heap(keys.begin(), keys.end(), worse);
      worst = row[keys.front() & 0xFFFFFFFFu];
    }
  }
  std::sort(keys.begin(), keys.end(), std::greater<uint64_t>());
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = static_cast<int64_t>(keys[j] & 0xFFFFFFFFu);
    idx[j] = i;
    val[j] = row[i];
  }
}

}  // namespace cedlm_index
