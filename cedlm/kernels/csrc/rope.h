// RoPE on the last r dims of many rows in one call (included by codecs.cpp, like mhc.h). The
// readable reference is Rope.apply in cedlm/model/rope.py; this does the same float32
// operations in the same order, with FP contraction off, so the result is bit-identical:
//   interleaved pairs (a, b) = (x[nope + 2i], x[nope + 2i + 1]), angle cos c, sin s (s negated
//   for the inverse rotation): (a*c - b*s, a*s + b*c); the first dim - r values are copied.
#pragma once
#include <cstdint>
#include <cstring>

namespace cedlm_rope {

// x, out: [P * heads, dim] rows; c, s: [P, r / 2] (one angle row per position, shared by the
// `heads` rows of that position).
inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t p0,
                   int64_t p1, int64_t heads, int64_t dim, int64_t r, bool inverse) {
  const int64_t half = r / 2, nope = dim - r;
  for (int64_t p = p0; p < p1; ++p) {
    const float* cp = c + p * half;
    const float* sp = s + p * half;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = (p * heads + h) * dim;
      const float* xr = x + row;
      float* o = out + row;
      if (nope > 0) std::memcpy(o, xr, sizeof(float) * nope);
      for (int64_t i = 0; i < half; ++i) {
        const float a = xr[nope + 2 * i], b = xr[nope + 2 * i + 1];
        const float cs = cp[i], sn = inverse ? -sp[i] : sp[i];
        o[nope + 2 * i] = a * cs - b * sn;
        o[nope + 2 * i + 1] = a * sn + b * cs;
      }
    }
  }
}

}  // namespace cedlm_rope
