// Sparse attention of a few query rows (decode, short chunks) over [window || selected entries ||
// sink] in one pass (included by codecs.cpp, like the other kernels). The readable reference is
// `attend(..., dense=False)` in cedlm/model/attention.py: scores q . k * scale of the valid window
// keys and the valid selected entries, a per-head sink logit that takes probability mass and adds
// no value, one softmax over all of them, the output sum_i p_i v_i (K = V: one latent per key).
// Same math; the dot products run in 4 float32 lanes (cedlm_index::dot4), exp is the C library's
// and the sums run in key order, so it agrees with the reference to float32 rounding
// (tests/test_attend_fast.py states the tolerance), not bit for bit.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "index.h"

namespace cedlm_attend {

// One query row: q [H, hd]; keys: nw window rows (win + w * hd) then nc entries (comp + j * hd),
// their validity bytes; scratch holds nw + nc floats; out [H, hd].
inline void attend_row(const float* q, int64_t H, int64_t hd, const float* win,
                       const uint8_t* wvalid, int64_t nw, const float* comp,
                       const uint8_t* cvalid, int64_t nc, const float* sink, float scale,
                       float* scratch, float* out) {
  const float neg = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < H; ++h) {
    const float* qh = q + h * hd;
    float mx = sink[h];
    for (int64_t i = 0; i < nw + nc; ++i) {
      const bool ok = i < nw ? wvalid[i] != 0 : cvalid[i - nw] != 0;
      const float* k = i < nw ? win + i * hd : comp + (i - nw) * hd;
      const float s = ok ? cedlm_index::dot4(qh, k, hd) * scale : neg;
      scratch[i] = s;
      mx = std::max(mx, s);
    }
    float sum = std::exp(sink[h] - mx);
    for (int64_t i = 0; i < nw + nc; ++i) {
      const float e = scratch[i] == neg ? 0.f : std::exp(scratch[i] - mx);
      scratch[i] = e;
      sum = sum + e;
    }
    float* o = out + h * hd;
    for (int64_t d = 0; d < hd; ++d) o[d] = 0.f;
    for (int64_t i = 0; i < nw + nc; ++i) {
      if (scratch[i] == 0.f) continue;
      const float p = scratch[i] / sum;
      const float* v = i < nw ? win + i * hd : comp + (i - nw) * hd;
      for (int64_t d = 0; d < hd; ++d) o[d] = o[d] + p * v[d];
    }
  }
}

}  // namespace cedlm_attend
