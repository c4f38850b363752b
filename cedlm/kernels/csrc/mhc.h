// mHC mixes after the projection, one row at a time (included by codecs.cpp into the same
// extension, so setup.sh builds one module). The readable reference is cedlm/model/mhc.py
// (hc_mixes + sinkhorn); this computes the same float32 operations in the same order:
//   pre  = sigmoid(a0 * m[:n] + b[:n]) + hc_eps
//   post = 2 * sigmoid(a1 * m[n:2n] + b[n:2n])
//   comb = Sinkhorn(softmax_row(a2 * m[2n:] + b[2n:]) + hc_eps): a column normalisation, then
//          iters - 1 rounds of row then column normalisation, each denominator + hc_eps.
// Sums run in index order; exp is the C library's, so sigmoid and softmax may differ from
// torch's vectorised exp in the last bit (tests/test_mhc_fast.py bounds the difference).
// Below them, `collapse_row` and `expand_row`: the residual copies' read and write around each
// sub-layer (mhc.py `collapse`, `expand`), sums in index order (the reference's einsum may sum in
// another order: float32 rounding apart, same test).
#pragma once
#include <cmath>
#include <cstdint>

namespace cedlm_mhc {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// m: [(2+n)n] of one row; base: [(2+n)n]; outputs pre [n], post [n], comb [n*n] (row-major i, j).
inline void mix_row(const float* m, const float* base, int64_t n, float a0, float a1, float a2,
                    float hc_eps, int64_t iters, float* pre, float* post, float* comb) {
  for (int64_t i = 0; i < n; ++i) {
    pre[i] = sigmoid(a0 * m[i] + base[i]) + hc_eps;
    post[i] = 2.0f * sigmoid(a1 * m[n + i] + base[n + i]);
  }
  const float* mc = m + 2 * n;
  const float* bc = base + 2 * n;
  for (int64_t i = 0; i < n; ++i) {                 // softmax over each row j of comb[i, :]
    float* row = comb + i * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = a2 * mc[i * n + j] + bc[i * n + j];
      mx = row[j] > mx ? row[j] : mx;
    }
    float s = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - mx);
      s += row[j];
    }
    for (int64_t j = 0; j < n; ++j) row[j] = row[j] / s + hc_eps;
  }
  auto col_norm = [&]() {
    for (int64_t j = 0; j < n; ++j) {
      float s = 0.0f;
      for (int64_t i = 0; i < n; ++i) s += comb[i * n + j];
      s += hc_eps;
      for (int64_t i = 0; i < n; ++i) comb[i * n + j] /= s;
    }
  };
  auto row_norm = [&]() {
    for (int64_t i = 0; i < n; ++i) {
      float s = 0.0f;
      for (int64_t j = 0; j < n; ++j) s += comb[i * n + j];
      s += hc_eps;
      for (int64_t j = 0; j < n; ++j) comb[i * n + j] /= s;
    }
  };
  col_norm();
  for (int64_t k = 0; k + 1 < iters; ++k) {
    row_norm();
    col_norm();
  }
}

// collapse (mhc.py `collapse`) of one row: x [n, D], pre [n] -> out[d] = sum_i pre[i] x[i, d],
// summed in i order.
inline void collapse_row(const float* x, const float* pre, int64_t n, int64_t D, float* out) {
  for (int64_t d = 0; d < D; ++d) out[d] = x[d] * pre[0];
  for (int64_t i = 1; i < n; ++i) {
    const float* xi = x + i * D;
    const float p = pre[i];
    for (int64_t d = 0; d < D; ++d) out[d] = out[d] + xi[d] * p;
  }
}

// expand (mhc.py `expand`) of one row: x [n, D], f [D], post [n], comb [n, n] ->
// out[j, d] = (sum_i comb[i, j] x[i, d]) + post[j] f[d], the sum in i order.
inline void expand_row(const float* x, const float* f, const float* post, const float* comb,
                       int64_t n, int64_t D, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    float* o = out + j * D;
    for (int64_t d = 0; d < D; ++d) o[d] = x[d] * comb[j];
    for (int64_t i = 1; i < n; ++i) {
      const float* xi = x + i * D;
      const float c = comb[i * n + j];
      for (int64_t d = 0; d < D; ++d) o[d] = o[d] + xi[d] * c;
    }
    const float pj = post[j];
    for (int64_t d = 0; d < D; ++d) o[d] = o[d] + pj * f[d];
  }
}

}  // namespace cedlm_mhc
