// Sparse attention read straight from the KV cache's storage bytes: the same math as attend.h
// (one softmax over [window keys || selected compressed keys || a per-head sink logit], K = V),
// but each key is taken from a row store by index and, when the store holds packed entries (the
// main KV's kv_fp4 or the window's window_fp8 bytes), decoded tile by tile inside the attention
// loop into a small scratch tile (KEY_TILE rows on the stack), the way index.h scores packed
// index keys: no decoded fp32 copy of the selected entries or of the window is written.
//
// Included by codecs.cpp AFTER its codec helpers (decode_row, check_tables: the same tables and
// the same per-entry decode as cedlm.kernels.decode, so a decoded key here is bit-identical to the
// codec's), unlike the other headers, which are included before them.
//
// The readable reference is `attend(..., dense=False)` in cedlm/model/attention.py over the
// decoded keys. One pass per query row with the running-max (online) softmax: each tile of keys is
// decoded once and used for the scores of every head and for the weighted sum; the scores are
// attend.h's (the same 4-lane dot products), the exponentials are taken against the running max
// and rescaled when it grows, and the sum is divided by the softmax's denominator at the end. So
// the output agrees with the reference (and with attend_sparse) to float32 rounding, not bit for
// bit; tests/test_attend_packed.py states the tolerance. Where the CPU has AVX2 + FMA (and
// CEDLM_KERNEL_ISA is not sse2) the dot products and the weighted sum run in 8-lane fused
// multiply-adds, chosen at run time like the indexer's scorer (another float32 rounding).
#pragma once

namespace cedlm_attend {

// One store of key rows: float32 [R, hd] (kind < 0, read in place) or packed entries uint8
// [R, width] of a codec kind (decoded per tile). idx gives the row of each key slot.
struct RowStore {
  const float* f32 = nullptr;
  const uint8_t* bytes = nullptr;
  int64_t stride = 0;             // elements (f32) or bytes (packed) per row
  int64_t kind = -1, block = 0;
};

// The two inner loops of a tile of c keys (key[j], j < c), for heads h0..h1 (h1 - h0 <= 4 when
// `wide`): scores s[h * TILE + j] = q_h . key[j] * scale, and acc[h] += e[h * TILE + j] * key[j].
// Portable version: attend.h's 4-lane dot products (dot4x4 for four heads: the key read once).
inline void tile_scores(const float* q, int64_t H, int64_t hd, const float* const* key, int64_t c,
                        float scale, float* s) {
  constexpr int64_t TILE = cedlm_index::KEY_TILE;
  int64_t h = 0;
  for (; h + 4 <= H; h += 4)
    for (int64_t j = 0; j < c; ++j) {
      float d[4];
      cedlm_index::dot4x4(q + h * hd, hd, key[j], d);
      for (int i = 0; i < 4; ++i) s[(h + i) * TILE + j] = d[i] * scale;
    }
  for (; h < H; ++h)
    for (int64_t j = 0; j < c; ++j) s[h * TILE + j] = cedlm_index::dot4(q + h * hd, key[j], hd) * scale;
}

inline void tile_accumulate(int64_t H, int64_t hd, const float* const* key, int64_t c,
                            const float* e, float* acc) {
  constexpr int64_t TILE = cedlm_index::KEY_TILE;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < c; ++j) {
      const float w = e[h * TILE + j];
      const float* v = key[j];
      float* o = acc + h * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = o[d] + w * v[d];
    }
}

#ifdef CEDLM_INDEX_AVX2
// The same with 8-lane fused multiply-adds (AVX2 + FMA, chosen at run time like the indexer's
// scorer; hd % 8 == 0): four heads against each key, and the output accumulated 8 dims at a time
// over the whole tile with four heads' sums held in registers (each key row loaded once).
__attribute__((target("avx2,fma")))
inline void tile_scores_avx2(const float* q, int64_t H, int64_t hd, const float* const* key,
                             int64_t c, float scale, float* s) {
  constexpr int64_t TILE = cedlm_index::KEY_TILE;
  int64_t h = 0;
  for (; h + 4 <= H; h += 4) {
    const float* qh = q + h * hd;
    for (int64_t j = 0; j < c; ++j) {
      __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
      __m256 c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8) {
        const __m256 kv = _mm256_loadu_ps(key[j] + d);
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), kv, c0);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + hd + d), kv, c1);
        c2 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 2 * hd + d), kv, c2);
        c3 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 3 * hd + d), kv, c3);
      }
      s[h * TILE + j] = cedlm_index::hsum8(c0) * scale;
      s[(h + 1) * TILE + j] = cedlm_index::hsum8(c1) * scale;
      s[(h + 2) * TILE + j] = cedlm_index::hsum8(c2) * scale;
      s[(h + 3) * TILE + j] = cedlm_index::hsum8(c3) * scale;
    }
  }
  for (; h < H; ++h)
    for (int64_t j = 0; j < c; ++j) {
      __m256 c0 = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; d += 8)
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * hd + d), _mm256_loadu_ps(key[j] + d), c0);
      s[h * TILE + j] = cedlm_index::hsum8(c0) * scale;
    }
}

__attribute__((target("avx2,fma")))
inline void tile_accumulate_avx2(int64_t H, int64_t hd, const float* const* key, int64_t c,
                                 const float* e, float* acc) {
  constexpr int64_t TILE = cedlm_index::KEY_TILE;
  int64_t h = 0;
  for (; h + 4 <= H; h += 4)
    for (int64_t d = 0; d < hd; d += 8) {
      float* o = acc + h * hd + d;
      __m256 a0 = _mm256_loadu_ps(o), a1 = _mm256_loadu_ps(o + hd);
      __m256 a2 = _mm256_loadu_ps(o + 2 * hd), a3 = _mm256_loadu_ps(o + 3 * hd);
      const float* eh = e + h * TILE;
      for (int64_t j = 0; j < c; ++j) {
        const __m256 v = _mm256_loadu_ps(key[j] + d);
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(eh[j]), v, a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(eh[TILE + j]), v, a1);
        a2 = _mm256_fmadd_ps(_mm256_set1_ps(eh[2 * TILE + j]), v, a2);
        a3 = _mm256_fmadd_ps(_mm256_set1_ps(eh[3 * TILE + j]), v, a3);
      }
      _mm256_storeu_ps(o, a0); _mm256_storeu_ps(o + hd, a1);
      _mm256_storeu_ps(o + 2 * hd, a2); _mm256_storeu_ps(o + 3 * hd, a3);
    }
  for (; h < H; ++h)
    for (int64_t d = 0; d < hd; d += 8) {
      __m256 a0 = _mm256_loadu_ps(acc + h * hd + d);
      for (int64_t j = 0; j < c; ++j)
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(e[h * TILE + j]), _mm256_loadu_ps(key[j] + d), a0);
      _mm256_storeu_ps(acc + h * hd + d, a0);
    }
}
#endif

// Whether the AVX2 + FMA loops run for head dim hd (CPU, build, CEDLM_KERNEL_ISA; set_avx2).
inline bool use_avx2(int64_t hd) {
#ifdef CEDLM_INDEX_AVX2
  static const bool cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return cpu && cedlm_index::allow_avx2() && hd % 8 == 0;
#else
  (void)hd;
  return false;
#endif
}

// Keys slot[0..n) of one query (rows idx[i] of the store, only where valid[i]): online softmax
// state per head (m running max, l denominator, acc [H, hd] unnormalised output) updated in
// tiles of KEY_TILE keys; decode(row, dst) writes a packed row's hd floats.
template <class Decode>
inline void attend_keys(const float* q, int64_t H, int64_t hd, const RowStore& st,
                        const int64_t* idx, const uint8_t* valid, int64_t n, float scale,
                        Decode decode, bool avx2, float* tile, const float** key, float* s,
                        float* m, float* l, float* acc) {
  constexpr int64_t TILE = cedlm_index::KEY_TILE;
  for (int64_t a = 0; a < n; a += TILE) {
    const int64_t b = std::min(a + TILE, n);
    int64_t c = 0;                                    // valid keys of this tile, packed together
    for (int64_t i = a; i < b; ++i) {
      if (!valid[i]) continue;
      if (st.f32 != nullptr) {
        key[c] = st.f32 + idx[i] * st.stride;
      } else {
        float* dst = tile + c * hd;
        decode(st.bytes + idx[i] * st.stride, st.kind, hd, st.block, dst);
        key[c] = dst;
      }
      ++c;
    }
    if (c == 0) continue;
#ifdef CEDLM_INDEX_AVX2
    if (avx2) tile_scores_avx2(q, H, hd, key, c, scale, s);
    else
#endif
      tile_scores(q, H, hd, key, c, scale, s);
    for (int64_t h = 0; h < H; ++h) {                 // running max, rescale, exponentials
      float* sh = s + h * TILE;
      float mx = m[h];
      for (int64_t j = 0; j < c; ++j) mx = std::max(mx, sh[j]);
      if (mx > m[h]) {                                // rescale what was summed so far
        const float r = std::exp(m[h] - mx);
        float* o = acc + h * hd;
        l[h] = l[h] * r;
        for (int64_t d = 0; d < hd; ++d) o[d] = o[d] * r;
        m[h] = mx;
      }
      for (int64_t j = 0; j < c; ++j) {
        sh[j] = std::exp(sh[j] - mx);
        l[h] = l[h] + sh[j];
      }
    }
#ifdef CEDLM_INDEX_AVX2
    if (avx2) tile_accumulate_avx2(H, hd, key, c, s, acc);
    else
#endif
      tile_accumulate(H, hd, key, c, s, acc);
  }
}

}  // namespace cedlm_attend

namespace {

// A key store argument: float32 [R, hd] (kind -1) or packed entries uint8 [R, width] of a codec
// kind; rows contiguous in their elements.
cedlm_attend::RowStore row_store(const torch::Tensor& rows, int64_t kind, int64_t block,
                                 int64_t hd, const char* name) {
  cedlm_attend::RowStore st;
  TORCH_CHECK(rows.dim() == 2 && rows.device().is_cpu() && rows.stride(1) == 1,
              "attend_packed: ", name, " must be a CPU matrix [rows, ...] with contiguous rows");
  st.kind = kind;
  st.block = block;
  st.stride = rows.stride(0);
  if (kind < 0) {
    TORCH_CHECK(rows.scalar_type() == torch::kFloat32 && rows.size(1) == hd, "attend_packed: ",
                name, " with kind -1 must be float32 [rows, ", hd, "]");
    st.f32 = rows.data_ptr<float>();
  } else {
    check_entries(rows, kind, hd, block);
    st.bytes = rows.data_ptr<uint8_t>();
  }
  return st;
}

// One packed key row -> hd floats: decode_row (the codec's decode), with the FP8 window's
// element loop written without the NaN-times-NaN rule where the block's scale is not NaN (then
// q * s is that rule's result too: the same values, bit for bit).
void decode_key(const uint8_t* br, int64_t kind, int64_t dim, int64_t block, float* orow) {
  if (kind != WINDOW_FP8) return decode_row(br, kind, dim, block, orow);
  const int64_t tiles = dim / block;
  for (int64_t k = 0; k < tiles; ++k) {
    const float s = scale_value(kind, br[dim + k]);
    if (std::isnan(s)) return decode_row(br, kind, dim, block, orow);
    const uint8_t* d = br + k * block;
    float* o = orow + k * block;
    for (int64_t j = 0; j < block; ++j) o[j] = T.e4m3[d[j]] * s;
  }
}

// Every index of a valid slot names a row of the store (invalid slots are never read).
void check_rows(const torch::Tensor& idx, const torch::Tensor& valid, int64_t R, const char* name) {
  const int64_t* ip = idx.data_ptr<int64_t>();
  const bool* vp = valid.data_ptr<bool>();
  const int64_t n = idx.numel();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(!vp[i] || (ip[i] >= 0 && ip[i] < R), "attend_packed: ", name, " index ", ip[i],
                " outside the store's ", R, " rows");
}

}  // namespace

// q [B, T, H, hd] float32; window keys: store win_rows, win_idx int64 [B, W] (one row per window
// slot of each sequence), win_valid bool [B, T, W]; selected entries: store comp_rows, comp_idx
// int64 [B, T, K] (K may be 0), comp_valid bool [B, T, K]; sink [H] -> [B, T, H, hd] float32.
// A store is float32 [R, hd] (its kind -1) or packed uint8 entries of kind (0 kv_fp4, 1 index_fp4,
// 2 window_fp8) and block.
torch::Tensor attend_packed(torch::Tensor q, torch::Tensor win_rows, torch::Tensor win_idx,
                            torch::Tensor win_valid, int64_t win_kind, int64_t win_block,
                            torch::Tensor comp_rows, torch::Tensor comp_idx,
                            torch::Tensor comp_valid, int64_t comp_kind, int64_t comp_block,
                            torch::Tensor sink, double scale) {
  check_tables();
  auto cpu = [](const torch::Tensor& t, int64_t dim, torch::ScalarType dt) {
    return t.dim() == dim && t.scalar_type() == dt && t.is_contiguous() && t.device().is_cpu();
  };
  TORCH_CHECK(cpu(q, 4, torch::kFloat32) && cpu(sink, 1, torch::kFloat32),
              "attend_packed: q [B,T,H,hd] and sink [H] must be contiguous float32 CPU tensors");
  TORCH_CHECK(cpu(win_idx, 2, torch::kInt64) && cpu(comp_idx, 3, torch::kInt64) &&
              cpu(win_valid, 3, torch::kBool) && cpu(comp_valid, 3, torch::kBool),
              "attend_packed: contiguous int64 win_idx [B,W], comp_idx [B,T,K] and bool masks");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3);
  const int64_t W = win_idx.size(1), K = comp_idx.size(2);
  TORCH_CHECK(hd % 4 == 0 && hd <= cedlm_index::MAX_DIM, "attend_packed: head dim ", hd);
  TORCH_CHECK(sink.size(0) == H && win_idx.size(0) == B && win_valid.size(0) == B &&
              win_valid.size(1) == T && win_valid.size(2) == W && comp_idx.size(0) == B &&
              comp_idx.size(1) == T && comp_valid.size(0) == B && comp_valid.size(1) == T &&
              comp_valid.size(2) == K, "attend_packed: shapes");
  const cedlm_attend::RowStore ws = row_store(win_rows, win_kind, win_block, hd, "win_rows");
  const cedlm_attend::RowStore cs = row_store(comp_rows, comp_kind, comp_block, hd, "comp_rows");
  check_rows(win_idx.unsqueeze(1).expand({B, T, W}).contiguous(), win_valid, win_rows.size(0),
             "win_idx");
  check_rows(comp_idx, comp_valid, comp_rows.size(0), "comp_idx");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* sp = sink.data_ptr<float>();
  const int64_t* wi = win_idx.data_ptr<int64_t>();
  const int64_t* ci = comp_idx.data_ptr<int64_t>();
  const uint8_t* wv = reinterpret_cast<const uint8_t*>(win_valid.data_ptr<bool>());
  const uint8_t* cv = reinterpret_cast<const uint8_t*>(comp_valid.data_ptr<bool>());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  constexpr int64_t TILE = cedlm_index::KEY_TILE;
  const bool avx2 = cedlm_attend::use_avx2(hd);
  // Several query rows of a sequence (a verification's block in the static step) share its window:
  // its packed rows are decoded once, where any row sees them, into float32 rows that every
  // query row then reads (the same floats the per-row decode gives).
  cedlm_attend::RowStore wst = ws;
  std::vector<float> wdec;
  std::vector<int64_t> wslot;
  if (T > 1 && ws.f32 == nullptr && W > 0) {
    wdec.assign(B * W * hd, 0.f);
    wslot.resize(B * W);
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t w = 0; w < W; ++w) {
          wslot[b * W + w] = b * W + w;
          bool seen = false;
          for (int64_t t = 0; t < T && !seen; ++t) seen = wv[(b * T + t) * W + w] != 0;
          if (seen)
            decode_key(ws.bytes + wi[b * W + w] * ws.stride, ws.kind, hd, ws.block,
                       wdec.data() + (b * W + w) * hd);
        }
    });
    wst.f32 = wdec.data();
    wst.bytes = nullptr;
    wst.kind = -1;
    wst.stride = hd;
    wi = wslot.data();
  }
  at::parallel_for(0, B * T, 1, [&](int64_t r0, int64_t r1) {
    alignas(32) float tile[TILE * cedlm_index::MAX_DIM];
    const float* key[TILE];
    std::vector<float> s(H * TILE), m(H), l(H), acc(H * hd);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T;
      for (int64_t h = 0; h < H; ++h) { m[h] = sp[h]; l[h] = 1.f; }   // the sink: exp(0)
      std::fill(acc.begin(), acc.end(), 0.f);
      const float* qr = qp + r * H * hd;
      cedlm_attend::attend_keys(qr, H, hd, wst, wi + b * W, wv + r * W, W, sc, decode_key, avx2,
                                tile, key, s.data(), m.data(), l.data(), acc.data());
      cedlm_attend::attend_keys(qr, H, hd, cs, ci + r * K, cv + r * K, K, sc, decode_key, avx2,
                                tile, key, s.data(), m.data(), l.data(), acc.data());
      float* o = op + r * H * hd;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < hd; ++d) o[h * hd + d] = acc[h * hd + d] / l[h];
    }
  });
  return out;
}
