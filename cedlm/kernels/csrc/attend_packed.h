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
// bit; tests/test_attend_packed.py states the tolerance.
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

// Keys slot[0..n) of one query (rows idx[i] of the store, only where valid[i]): online softmax
// state per head (m running max, l denominator, acc [H, hd] unnormalised output) updated in
// tiles of KEY_TILE keys; decode(row, dst) writes a packed row's hd floats.
template <class Decode>
inline void attend_keys(const float* q, int64_t H, int64_t hd, const RowStore& st,
                        const int64_t* idx, const uint8_t* valid, int64_t n, float scale,
                        Decode decode, float* tile, const float** key, float* s, float* m,
                        float* l, float* acc) {
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
    int64_t h = 0;
    for (; h + 4 <= H; h += 4)                        // four heads per key: the key read once
      for (int64_t j = 0; j < c; ++j) {
        float d[4];
        cedlm_index::dot4x4(q + h * hd, hd, key[j], d);
        for (int i = 0; i < 4; ++i) s[(h + i) * TILE + j] = d[i] * scale;
      }
    for (; h < H; ++h)
      for (int64_t j = 0; j < c; ++j) s[h * TILE + j] = cedlm_index::dot4(q + h * hd, key[j], hd) * scale;
    for (int64_t h = 0; h < H; ++h) {
      float* sh = s + h * TILE;
      float mx = m[h];
      for (int64_t j = 0; j < c; ++j) mx = std::max(mx, sh[j]);
      float* o = acc + h * hd;
      if (mx > m[h]) {                                // rescale what was summed so far
        const float r = std::exp(m[h] - mx);
        l[h] = l[h] * r;
        for (int64_t d = 0; d < hd; ++d) o[d] = o[d] * r;
        m[h] = mx;
      }
      for (int64_t j = 0; j < c; ++j) {
        const float e = std::exp(sh[j] - mx);
        l[h] = l[h] + e;
        const float* v = key[j];
        for (int64_t d = 0; d < hd; ++d) o[d] = o[d] + e * v[d];
      }
    }
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
  at::parallel_for(0, B * T, 1, [&](int64_t r0, int64_t r1) {
    alignas(32) float tile[TILE * cedlm_index::MAX_DIM];
    const float* key[TILE];
    std::vector<float> s(H * TILE), m(H), l(H), acc(H * hd);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T;
      for (int64_t h = 0; h < H; ++h) { m[h] = sp[h]; l[h] = 1.f; }   // the sink: exp(0)
      std::fill(acc.begin(), acc.end(), 0.f);
      const float* qr = qp + r * H * hd;
      cedlm_attend::attend_keys(qr, H, hd, ws, wi + b * W, wv + r * W, W, sc, decode_row, tile,
                                key, s.data(), m.data(), l.data(), acc.data());
      cedlm_attend::attend_keys(qr, H, hd, cs, ci + r * K, cv + r * K, K, sc, decode_row, tile,
                                key, s.data(), m.data(), l.data(), acc.data());
      float* o = op + r * H * hd;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < hd; ++d) o[h * hd + d] = acc[h * hd + d] / l[h];
    }
  });
  return out;
}
