// Compiled KV codecs of cedlm.kernels (kv_fp4, index_fp4, window_fp8): one pass over the data,
// bit-identical to the reference in cedlm/quant/formats.py + numerics.py.
//
// Built ahead of time by `python -m cedlm.kernels.build` (./setup.sh runs it) through
// torch.utils.cpp_extension into a per-user cache; loaded by cedlm/kernels/build.py. When the
// build is missing or stale, cedlm/kernels/gate.py logs one line and the callers run their
// torch paths (the vectorised torch codecs of cedlm/kernels/codecs.py) instead.
//
// How it stays identical to the reference:
// * every element mapping is a table computed FROM the reference in tables.py and passed in once
//   (set_tables): the E2M1 code and the E4M3 byte of each round-to-odd class of float32 bits
//   (see tables.py: every RNE decision boundary, the saturation point and the NaN/inf patterns
//   are exact class points, so the reference result is constant on each class), the value of
//   each E2M1 class, the two E2M1 values of each packed byte, the E4M3 and UE8M0 value of each
//   byte;
// * the scale rules are the reference's float32 operations in the same order (no -ffast-math,
//   no FP contraction); the UE8M0 ceil is the same bit arithmetic; E4M3 scales (kv_fp4) use
//   c10::Float8_e4m3fn, the conversion behind torch's float32 -> float8_e4m3fn cast;
// * t = x / s: a true division for E4M3 scales; for UE8M0 scales s = 2^k (|k| <= 126 here) so
//   x * (1/s) is the same correctly rounded number, and NaN scales always divide;
// * a tile's amax is the max of |x| as float32 bit patterns: the float order for non-NaN values,
//   and above 0x7F800000 exactly when the tile holds a NaN (the reference's amax is then NaN);
// * NaN * NaN returns the NaN the reference's mul_ returns (probed by tables.py, see mul_q_s).
//
// Speed: the amax and the class index of a tile use SSE2 (baseline on x86-64, so no -march and
// no dispatch; -DCEDLM_CODECS_SCALAR, which CEDLM_KERNEL_ISA=generic builds with, or another CPU
// gives the equivalent scalar loops), the table look-ups are scalar, rows are split over torch's
// intra-op threads. The only run-time dispatch is the indexer's AVX2 + FMA scorer (index.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__SSE2__) && !defined(CEDLM_CODECS_SCALAR)
#include <emmintrin.h>     // baseline on x86-64: no dispatch, no -march needed
#endif

#include "mhc.h"            // mHC mixes (not a codec; one module keeps the build to one unit)
#include "rope.h"           // RoPE rotation (likewise)
#include "index.h"          // indexer scores from packed keys, stable top-k (likewise)
#include "attend.h"         // sparse attention over [window || selected || sink] (likewise)

namespace {

enum Kind : int64_t { KV_FP4 = 0, INDEX_FP4 = 1, WINDOW_FP8 = 2 };
constexpr int64_t MAX_BLOCK = 256;

struct Tables {
  at::Tensor keep[6];               // the tensors behind the pointers, kept alive
  const uint8_t* e2m1_code = nullptr;   // [4096]  E2M1 class -> code (sign in bit 3)
  const float* e2m1_value = nullptr;    // [4096]  E2M1 class -> value (signed)
  const int64_t* e2m1_pair = nullptr;   // [256]   packed byte -> (low, high) values as 2 floats
  const uint8_t* e4m3_code = nullptr;   // [16384] E4M3 class -> byte (after the clamp to 448)
  const float* e4m3 = nullptr;          // [256]   byte -> value
  const float* ue8m0 = nullptr;         // [256]   byte -> value
  bool nan_s_wins = true;
  alignas(32) float e2m1_of_code[16] = {};   // E2M1 code (a nibble) -> value, from e2m1_pair
};
Tables T;

inline uint32_t bits_of(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
inline float float_of(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }

inline uint8_t ue8m0_ceil(float y) {       // numerics.ue8m0_ceil
  const uint32_t b = bits_of(y);
  const uint32_t v = ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u);
  return static_cast<uint8_t>(v > 255u ? 255u : v);
}

inline float clamp_nan(float v, float lo, float hi) {   // torch.clamp: NaN passes through
  if (std::isnan(v)) return v;
  return v < lo ? lo : (v > hi ? hi : v);
}

// formats._scale_bytes_from_amax
inline uint8_t scale_byte(int64_t kind, float amax) {
  if (kind == KV_FP4) {
    if (std::isnan(amax)) return 0x7F;
    const float y = clamp_nan(amax / 6.0f, 0.001953125f /* 2^-9 */, 448.0f);
    return c10::Float8_e4m3fn(clamp_nan(y, -448.0f, 448.0f)).x;     // numerics.e4m3_encode
  }
  const float a = amax;
  if (kind == INDEX_FP4) {
    const float fl = 6.0f * 1.1754943508222875e-38f;                 // 6 * 2^-126, exact
    return ue8m0_ceil((std::isnan(a) || a >= fl ? a : fl) / 6.0f);
  }
  const float fl = 1e-4f;                                            // WINDOW_FP8
  const float inv448 = static_cast<float>(1.0 / 448.0);
  return ue8m0_ceil((std::isnan(a) || a >= fl ? a : fl) * inv448);
}

inline float scale_value(int64_t kind, uint8_t sb) {
  return kind == KV_FP4 ? T.e4m3[sb] : T.ue8m0[sb];
}

// q * s where both may be NaN (E4M3 element 0x7F/0xFF under a NaN scale): which payload
// torch's mul_ keeps depends on how torch was compiled, so tables.py probes the reference once and
// passes the answer to set_tables. Written out so that no operand order chosen by this compiler
// can change the NaN bits. (With one NaN operand the result is that NaN, quieted, either way.)
inline float mul_q_s(float q, float s) {
  if (std::isnan(q) && std::isnan(s)) return T.nan_s_wins ? s : q;
  return q * s;
}

inline float tile_amax(const float* x, int64_t n) {
  uint32_t m = 0;
  int64_t j = 0;
#if defined(__SSE2__) && !defined(CEDLM_CODECS_SCALAR)
  // |x| bits are < 2^31, so the signed 32-bit compare orders them like the unsigned one
  const __m128i absmask = _mm_set1_epi32(0x7FFFFFFF);
  __m128i mx = _mm_setzero_si128();
  for (; j + 4 <= n; j += 4) {
    const __m128i v =
        _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j)), absmask);
    const __m128i gt = _mm_cmpgt_epi32(v, mx);
    mx = _mm_or_si128(_mm_and_si128(gt, v), _mm_andnot_si128(gt, mx));
  }
  alignas(16) uint32_t lanes[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), mx);
  for (uint32_t l : lanes) m = l > m ? l : m;
#endif
  for (; j < n; ++j) {
    const uint32_t b = bits_of(x[j]) & 0x7FFFFFFFu;
    m = b > m ? b : m;
  }
  return m > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : float_of(m);
}

// cls[j] = the round-to-odd class (SHIFT 20: E2M1, 3 mantissa bits kept; SHIFT 18: E4M3, 5 kept)
// of t = x[j] / s: a true division for E4M3 scales (kv_fp4) and for NaN scales, else
// x * (1/s) (s = 2^k: the same correctly rounded number, see the header).
template <int SHIFT>
inline void classes(const float* x, uint32_t* cls, int64_t n, int64_t kind, float s) {
  constexpr uint32_t low = (1u << SHIFT) - 1u, top = (1u << (32 - SHIFT)) - 1u;
  const bool recip = kind != KV_FP4 && !std::isnan(s);
  const float r = recip ? 1.0f / s : s;
  int64_t j = 0;
#if defined(__SSE2__) && !defined(CEDLM_CODECS_SCALAR)
  const __m128 vr = _mm_set1_ps(r);
  const __m128i vlow = _mm_set1_epi32(static_cast<int>(low));
  const __m128i vtop = _mm_set1_epi32(static_cast<int>(top));
  for (; j + 4 <= n; j += 4) {
    const __m128 xv = _mm_loadu_ps(x + j);
    const __m128i b = _mm_castps_si128(recip ? _mm_mul_ps(xv, vr) : _mm_div_ps(xv, vr));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(b, SHIFT), vtop);
    // sticky: (b & low) + low carries into bit SHIFT exactly when a low bit is set
    const __m128i sticky = _mm_srli_epi32(_mm_add_epi32(_mm_and_si128(b, vlow), vlow), SHIFT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(cls + j), _mm_or_si128(hi, sticky));
  }
#endif
  for (; j < n; ++j) {
    const uint32_t b = bits_of(recip ? x[j] * r : x[j] / r);
    cls[j] = ((b >> SHIFT) & top) | ((b & low) != 0u);
  }
}

// One entry's bytes -> dim float32 values (the reference decode of one row).
inline void decode_row(const uint8_t* br, int64_t kind, int64_t dim, int64_t block, float* orow) {
  const bool fp4 = kind != WINDOW_FP8;
  const int64_t tiles = dim / block, nd = fp4 ? dim / 2 : dim;
  for (int64_t k = 0; k < tiles; ++k) {
    const float s = scale_value(kind, br[nd + k]);
    float* o = orow + k * block;
    if (fp4) {
      const uint8_t* d = br + k * (block / 2);
      int64_t* o64 = reinterpret_cast<int64_t*>(o);
      for (int64_t j = 0; j < block / 2; ++j) o64[j] = T.e2m1_pair[d[j]];
      for (int64_t j = 0; j < block; ++j) o[j] = o[j] * s;   // E2M1 values are never NaN
    } else {
      const uint8_t* d = br + k * block;
      for (int64_t j = 0; j < block; ++j) o[j] = mul_q_s(T.e4m3[d[j]], s);
    }
  }
}

#ifdef CEDLM_INDEX_AVX2
// decode_row for the FP4 kinds, 8 values at a time (AVX2; block % 8 == 0): the same table values
// and the same one product by the tile's scale per value, so the same floats. Byte j of a tile
// holds values 2j (low nibble) and 2j + 1 (high nibble).
__attribute__((target("avx2,fma")))
inline void decode_row_fp4_avx2(const uint8_t* br, int64_t kind, int64_t dim, int64_t block,
                                float* orow) {
  const __m256 lo = _mm256_load_ps(T.e2m1_of_code), hi = _mm256_load_ps(T.e2m1_of_code + 8);
  const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
  const __m256i nib = _mm256_set1_epi32(0xF);
  const int64_t tiles = dim / block, nd = dim / 2;
  for (int64_t k = 0; k < tiles; ++k) {
    const __m256 s = _mm256_set1_ps(scale_value(kind, br[nd + k]));
    const uint8_t* d = br + k * (block / 2);
    float* o = orow + k * block;
    for (int64_t j = 0; j < block; j += 8) {
      int32_t four;
      std::memcpy(&four, d + j / 2, 4);
      const __m128i b = _mm_shuffle_epi8(_mm_cvtsi32_si128(four), dup);
      const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(b), shift), nib);
      const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, c), _mm256_permutevar8x32_ps(hi, c),
                                        _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
      _mm256_storeu_ps(o + j, _mm256_mul_ps(v, s));
    }
  }
}
#endif

// One key row for the index scorer: decode_row, or its 8-wide twin where `avx2` (the caller's
// choice: the AVX2 scorer, an FP4 kind, block % 8 == 0).
inline void decode_key_row(bool avx2, const uint8_t* br, int64_t kind, int64_t dim, int64_t block,
                           float* orow) {
#ifdef CEDLM_INDEX_AVX2
  if (avx2) return decode_row_fp4_avx2(br, kind, dim, block, orow);
#endif
  (void)avx2;
  decode_row(br, kind, dim, block, orow);
}

void check_tables() {
  TORCH_CHECK(T.e2m1_code != nullptr, "cedlm codec extension: set_tables() was not called");
}

void check_input(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "cedlm codec extension: expected a contiguous float32 CPU matrix");
  TORCH_CHECK(block > 0 && block <= MAX_BLOCK && block % 2 == 0 && x.size(1) % block == 0,
              "cedlm codec extension: bad block");
}

// packed entries: uint8 [..., data + scales] with contiguous bytes, of `dim` values each
void check_entries(const at::Tensor& b, int64_t kind, int64_t dim, int64_t block) {
  TORCH_CHECK(b.dtype() == at::kByte && b.dim() >= 1 && b.stride(-1) == 1 && b.device().is_cpu(),
              "cedlm codec extension: expected uint8 CPU rows with contiguous bytes");
  TORCH_CHECK(kind >= KV_FP4 && kind <= WINDOW_FP8, "cedlm codec extension: bad format kind");
  TORCH_CHECK(block > 0 && block <= MAX_BLOCK && block % 2 == 0 && dim % block == 0,
              "cedlm codec extension: bad block");
  const int64_t nd = kind != WINDOW_FP8 ? dim / 2 : dim;
  TORCH_CHECK(b.size(-1) == nd + dim / block, "cedlm codec extension: bad entry size");
}

int64_t grain(int64_t dim) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(dim, 1)); }

}  // namespace

#include "attend_packed.h"  // attention over packed rows: uses decode_row above (read its header)

void set_tables(at::Tensor e2m1_code, at::Tensor e2m1_value, at::Tensor e2m1_pair,
                at::Tensor e4m3_code, at::Tensor e4m3, at::Tensor ue8m0, bool nan_s_wins) {
  auto ok = [](const at::Tensor& t, at::ScalarType dt, int64_t n) {
    return t.scalar_type() == dt && t.numel() == n && t.is_contiguous() && t.device().is_cpu();
  };
  TORCH_CHECK(ok(e2m1_code, at::kByte, 4096) && ok(e2m1_value, at::kFloat, 4096) &&
              ok(e2m1_pair, at::kLong, 256) && ok(e4m3_code, at::kByte, 16384) &&
              ok(e4m3, at::kFloat, 256) && ok(ue8m0, at::kFloat, 256),
              "cedlm codec extension: bad tables");
  T.keep[0] = e2m1_code; T.keep[1] = e2m1_value; T.keep[2] = e2m1_pair;
  T.keep[3] = e4m3_code; T.keep[4] = e4m3; T.keep[5] = ue8m0;
  T.e2m1_code = e2m1_code.data_ptr<uint8_t>();
  T.e2m1_value = e2m1_value.data_ptr<float>();
  T.e2m1_pair = e2m1_pair.data_ptr<int64_t>();
  T.e4m3_code = e4m3_code.data_ptr<uint8_t>();
  T.e4m3 = e4m3.data_ptr<float>();
  T.ue8m0 = ue8m0.data_ptr<float>();
  T.nan_s_wins = nan_s_wins;
  for (int c = 0; c < 16; ++c) std::memcpy(&T.e2m1_of_code[c], &T.e2m1_pair[c], 4);   // low nibble
}

// x: float32 [rows, dim] contiguous -> uint8 [rows, data + dim/block]
at::Tensor encode(at::Tensor x, int64_t kind, int64_t block) {
  check_tables();
  check_input(x, block);
  const int64_t rows = x.size(0), dim = x.size(1), tiles = dim / block;
  const bool fp4 = kind != WINDOW_FP8;
  const int64_t nd = fp4 ? dim / 2 : dim, nbytes = nd + tiles;
  at::Tensor out = at::empty({rows, nbytes}, x.options().dtype(at::kByte));
  const float* X = x.data_ptr<float>();
  uint8_t* O = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t r0, int64_t r1) {
    alignas(16) uint32_t cls[MAX_BLOCK];
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = X + r * dim;
      uint8_t* orow = O + r * nbytes;
      for (int64_t k = 0; k < tiles; ++k) {
        const float* xt = xr + k * block;
        const uint8_t sb = scale_byte(kind, tile_amax(xt, block));
        const float s = scale_value(kind, sb);
        orow[nd + k] = sb;
        if (fp4) {
          uint8_t* o = orow + k * (block / 2);
          if (std::isnan(s)) {     // poisoned tile: code 0 with the sign of x (the reference)
            for (int64_t j = 0; j < block; j += 2)
              o[j / 2] = static_cast<uint8_t>((std::signbit(xt[j]) ? 0x08 : 0) |
                                              (std::signbit(xt[j + 1]) ? 0x80 : 0));
            continue;
          }
          classes<20>(xt, cls, block, kind, s);
          for (int64_t j = 0; j < block; j += 2)
            o[j / 2] = static_cast<uint8_t>(T.e2m1_code[cls[j]] | (T.e2m1_code[cls[j + 1]] << 4));
        } else {
          uint8_t* o = orow + k * block;
          classes<18>(xt, cls, block, kind, s);
          for (int64_t j = 0; j < block; ++j) o[j] = T.e4m3_code[cls[j]];
        }
      }
    }
  });
  return out;
}

// b: uint8 [rows, nbytes] (rows may be strided, bytes contiguous) -> float32 [rows, dim]
at::Tensor decode(at::Tensor b, int64_t kind, int64_t dim, int64_t block) {
  check_tables();
  TORCH_CHECK(b.dim() == 2, "cedlm codec extension: expected uint8 rows");
  check_entries(b, kind, dim, block);
  const int64_t rows = b.size(0);
  at::Tensor out = at::empty({rows, dim}, b.options().dtype(at::kFloat));
  const uint8_t* B = b.data_ptr<uint8_t>();
  const int64_t rs = b.stride(0);
  float* O = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) decode_row(B + r * rs, kind, dim, block, O + r * dim);
  });
  return out;
}

// x: float32 [rows, dim] contiguous -> float32 [rows, dim] == decode(encode(x))
at::Tensor quant_dequant(at::Tensor x, int64_t kind, int64_t block) {
  check_tables();
  check_input(x, block);
  const int64_t rows = x.size(0), dim = x.size(1), tiles = dim / block;
  at::Tensor out = at::empty({rows, dim}, x.options());
  const float* X = x.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(dim), [&](int64_t r0, int64_t r1) {
    alignas(16) uint32_t cls[MAX_BLOCK];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t k = 0; k < tiles; ++k) {
        const float* xt = X + r * dim + k * block;
        float* o = O + r * dim + k * block;
        const float s = scale_value(kind, scale_byte(kind, tile_amax(xt, block)));
        if (kind != WINDOW_FP8) {
          // a poisoned tile: +-0 times the NaN s is s's NaN, as on the reference path
          classes<20>(xt, cls, block, kind, s);
          for (int64_t j = 0; j < block; ++j) o[j] = T.e2m1_value[cls[j]] * s;
        } else {
          classes<18>(xt, cls, block, kind, s);
          for (int64_t j = 0; j < block; ++j) o[j] = mul_q_s(T.e4m3[T.e4m3_code[cls[j]]], s);
        }
      }
    }
  });
  return out;
}

// mHC mixes of many rows: m [R, (2+n)n] float32 (after the projection and the RMS scale),
// base [(2+n)n], scale [3] -> (pre [R, n], post [R, n], comb [R, n, n]).
std::vector<torch::Tensor> mhc_mixes(torch::Tensor m, torch::Tensor base, torch::Tensor scale,
                                     double hc_eps, int64_t iters) {
  TORCH_CHECK(m.dim() == 2 && m.scalar_type() == torch::kFloat32 && m.is_contiguous(),
              "mhc_mixes: m must be a contiguous float32 [R, (2+n)n] tensor");
  const int64_t R = m.size(0), W = m.size(1);
  int64_t n = 1;
  while ((2 + n) * n < W) ++n;
  TORCH_CHECK((2 + n) * n == W, "mhc_mixes: width ", W, " is not (2+n)n");
  auto b = base.to(torch::kFloat32).contiguous();
  auto sc = scale.to(torch::kFloat32).contiguous();
  TORCH_CHECK(b.numel() == W && sc.numel() == 3, "mhc_mixes: base/scale sizes");
  auto pre = torch::empty({R, n}, m.options());
  auto post = torch::empty({R, n}, m.options());
  auto comb = torch::empty({R, n, n}, m.options());
  const float* mp = m.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const float* s = sc.data_ptr<float>();
  float* pp = pre.data_ptr<float>();
  float* qp = post.data_ptr<float>();
  float* cp = comb.data_ptr<float>();
  const float eps = static_cast<float>(hc_eps);
  for (int64_t r = 0; r < R; ++r)
    cedlm_mhc::mix_row(mp + r * W, bp, n, s[0], s[1], s[2], eps, iters, pp + r * n, qp + r * n,
                       cp + r * n * n);
  return {pre, post, comb};
}

// mHC collapse / expand of R rows (mhc.h): x [R, n, D], pre [R, n] -> [R, D];
// x [R, n, D], f [R, D], post [R, n], comb [R, n, n] -> [R, n, D]. float32, contiguous.
torch::Tensor mhc_collapse(torch::Tensor x, torch::Tensor pre) {
  TORCH_CHECK(x.dim() == 3 && pre.dim() == 2 && x.scalar_type() == torch::kFloat32 &&
              pre.scalar_type() == torch::kFloat32 && x.is_contiguous() && pre.is_contiguous() &&
              pre.size(0) == x.size(0) && pre.size(1) == x.size(1) && x.size(1) > 0,
              "mhc_collapse: x [R, n, D] and pre [R, n] must be contiguous float32");
  const int64_t R = x.size(0), n = x.size(1), D = x.size(2);
  auto out = torch::empty({R, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = pre.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 8192 / std::max<int64_t>(n * D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) cedlm_mhc::collapse_row(xp + r * n * D, pp + r * n, n, D, op + r * D);
  });
  return out;
}

torch::Tensor mhc_expand(torch::Tensor x, torch::Tensor f, torch::Tensor post, torch::Tensor comb) {
  TORCH_CHECK(x.dim() == 3 && f.dim() == 2 && post.dim() == 2 && comb.dim() == 3 &&
              x.scalar_type() == torch::kFloat32 && f.scalar_type() == torch::kFloat32 &&
              post.scalar_type() == torch::kFloat32 && comb.scalar_type() == torch::kFloat32 &&
              x.is_contiguous() && f.is_contiguous() && post.is_contiguous() && comb.is_contiguous(),
              "mhc_expand: contiguous float32 x [R, n, D], f [R, D], post [R, n], comb [R, n, n]");
  const int64_t R = x.size(0), n = x.size(1), D = x.size(2);
  TORCH_CHECK(n > 0 && f.size(0) == R && f.size(1) == D && post.size(0) == R && post.size(1) == n &&
              comb.size(0) == R && comb.size(1) == n && comb.size(2) == n, "mhc_expand: shapes");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* fp = f.data_ptr<float>();
  const float* pp = post.data_ptr<float>();
  const float* cp = comb.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 8192 / std::max<int64_t>(n * D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      cedlm_mhc::expand_row(xp + r * n * D, fp + r * D, pp + r * n, cp + r * n * n, n, D, op + r * n * D);
  });
  return out;
}

// RoPE of x [..., dim] (float32, contiguous; P * heads rows) by angles cos/sin [P, r/2]
// (float32, contiguous): the `heads` consecutive rows of a position share its angle row.
torch::Tensor rope_rotate(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                          bool inverse) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
              x.device().is_cpu(), "rope_rotate: x must be a contiguous float32 CPU tensor");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
              cos.is_contiguous() && sin.is_contiguous() && cos.numel() == sin.numel() &&
              cos.dim() >= 1, "rope_rotate: cos/sin must be contiguous float32 of one shape");
  const int64_t dim = x.size(-1), half = cos.size(-1), r = 2 * half;
  TORCH_CHECK(heads > 0 && r <= dim && dim > 0, "rope_rotate: bad sizes");
  const int64_t rows = x.numel() / dim, P = rows / heads;
  TORCH_CHECK(P * heads == rows && cos.numel() == P * half, "rope_rotate: ", rows, " rows of x do "
              "not match ", cos.numel() / std::max<int64_t>(half, 1), " angle rows x ", heads, " heads");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, P, std::max<int64_t>(1, 16384 / std::max<int64_t>(heads * dim, 1)),
                   [&](int64_t p0, int64_t p1) {
    cedlm_rope::rotate(xp, cp, sp, op, p0, p1, heads, dim, r, inverse);
  });
  return out;
}

// Indexer scores from packed keys (index.h): q [B, T, H, D], w [B, T, H] float32 contiguous;
// keys uint8 [B, N, entry bytes] (bytes contiguous); visible bool [B, T, N] -> float32 [B, T, N].
torch::Tensor index_score(torch::Tensor q, torch::Tensor w, torch::Tensor keys,
                          torch::Tensor visible, int64_t kind, int64_t block) {
  check_tables();
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous() &&
              w.dim() == 3 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() &&
              q.device().is_cpu() && w.device().is_cpu(),
              "index_score: q [B,T,H,D] and w [B,T,H] must be contiguous float32 CPU tensors");
  const int64_t B = q.size(0), Tq = q.size(1), H = q.size(2), D = q.size(3);
  TORCH_CHECK(w.size(0) == B && w.size(1) == Tq && w.size(2) == H, "index_score: w shape");
  TORCH_CHECK(D % 4 == 0 && D <= cedlm_index::MAX_DIM, "index_score: head dim ", D);
  TORCH_CHECK(keys.dim() == 3 && keys.size(0) == B, "index_score: keys must be [B, N, bytes]");
  check_entries(keys, kind, D, block);
  const int64_t N = keys.size(1);
  TORCH_CHECK(visible.scalar_type() == torch::kBool && visible.is_contiguous() &&
              visible.dim() == 3 && visible.size(0) == B && visible.size(1) == Tq &&
              visible.size(2) == N, "index_score: visible must be a contiguous bool [B, T, N]");
  auto out = torch::empty({B, Tq, N}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const uint8_t* kp = keys.data_ptr<uint8_t>();
  const uint8_t* vp = reinterpret_cast<const uint8_t*>(visible.data_ptr<bool>());
  float* op = out.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1);
  const int64_t tiles = (N + cedlm_index::KEY_TILE - 1) / cedlm_index::KEY_TILE;
  const cedlm_index::TileFn tile = cedlm_index::pick_tile(D);
  // the FP4 keys decoded 8 at a time where the scorer is the AVX2 one (the same floats)
#ifdef CEDLM_INDEX_AVX2
  const bool fast4 = tile == cedlm_index::score_tile_avx2 && kind != WINDOW_FP8 && block % 8 == 0;
#else
  const bool fast4 = false;
#endif
  // work items: (sequence, tile of keys); each writes its own columns of out
  at::parallel_for(0, B * tiles, std::max<int64_t>(1, 64 / std::max<int64_t>(Tq, 1)),
                   [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / tiles, n0 = (i % tiles) * cedlm_index::KEY_TILE;
      const int64_t n1 = std::min(n0 + cedlm_index::KEY_TILE, N);
      const uint8_t* kb = kp + b * ks0;
      cedlm_index::score_rows(qp + b * Tq * H * D, wp + b * Tq * H, vp + b * Tq * N,
                              op + b * Tq * N, Tq, H, D, N, n0, n1, tile,
                              [&](int64_t n, float* dst) { decode_key_row(fast4, kb + n * ks1, kind, D, block, dst); });
    }
  });
  return out;
}

// The k best of each row of score [..., N] float32 under the indexer's tie rule (index.h)
// -> (indices int64 [..., k], values float32 [..., k]).
std::vector<torch::Tensor> stable_topk(torch::Tensor score, int64_t k) {
  TORCH_CHECK(score.dim() >= 1 && score.scalar_type() == torch::kFloat32 &&
              score.device().is_cpu(), "stable_topk: score must be a float32 CPU tensor");
  const int64_t N = score.size(-1);
  TORCH_CHECK(k >= 0 && k <= N, "stable_topk: k=", k, " outside [0, ", N, "]");
  TORCH_CHECK(N <= 0xFFFFFFFFLL, "stable_topk: a row of ", N, " scores (at most 2^32 - 1)");
  auto s = score.contiguous();
  const int64_t R = N ? s.numel() / N : 0;
  auto shape = s.sizes().vec();
  shape.back() = k;
  auto idx = torch::empty(shape, s.options().dtype(torch::kInt64));
  auto val = torch::empty(shape, s.options());
  const float* sp = s.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  float* vp = val.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / std::max<int64_t>(N, 1)),
                   [&](int64_t r0, int64_t r1) {
    std::vector<uint64_t> keys;
    for (int64_t r = r0; r < r1; ++r)
      cedlm_index::topk_row(sp + r * N, N, k, ip + r * k, vp + r * k, keys);
  });
  return {idx, val};
}

// Sparse attention (attend.h): q [B, T, H, hd]; win [B, W, hd], win_valid bool [B, T, W];
// comp [B, T, k, hd], comp_valid bool [B, T, k] (k may be 0); sink [H] -> [B, T, H, hd].
torch::Tensor attend_sparse(torch::Tensor q, torch::Tensor win, torch::Tensor win_valid,
                            torch::Tensor comp, torch::Tensor comp_valid, torch::Tensor sink,
                            double scale) {
  auto f32 = [](const torch::Tensor& t, int64_t dim) {
    return t.dim() == dim && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu();
  };
  auto b8 = [](const torch::Tensor& t) {
    return t.dim() == 3 && t.scalar_type() == torch::kBool && t.is_contiguous() && t.device().is_cpu();
  };
  TORCH_CHECK(f32(q, 4) && f32(win, 3) && f32(comp, 4) && f32(sink, 1) && b8(win_valid) &&
              b8(comp_valid), "attend_sparse: contiguous float32 q, win, comp, sink and bool masks");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3);
  const int64_t W = win.size(1), K = comp.size(2);
  TORCH_CHECK(hd % 4 == 0 && win.size(0) == B && win.size(2) == hd && sink.size(0) == H &&
              win_valid.size(0) == B && win_valid.size(1) == T && win_valid.size(2) == W &&
              comp.size(0) == B && comp.size(1) == T && comp.size(3) == hd &&
              comp_valid.size(0) == B && comp_valid.size(1) == T && comp_valid.size(2) == K,
              "attend_sparse: shapes");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* wp = win.data_ptr<float>();
  const float* cp = comp.data_ptr<float>();
  const float* sp = sink.data_ptr<float>();
  const uint8_t* wv = reinterpret_cast<const uint8_t*>(win_valid.data_ptr<bool>());
  const uint8_t* cv = reinterpret_cast<const uint8_t*>(comp_valid.data_ptr<bool>());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * T, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch(W + K + 1);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T;
      cedlm_attend::attend_row(qp + r * H * hd, H, hd, wp + b * W * hd, wv + r * W, W,
                               cp + r * K * hd, cv + r * K, K, sp, sc, scratch.data(),
                               op + r * H * hd);
    }
  });
  return out;
}

// Allow (true, the default) or forbid the run-time choice of AVX2 + FMA code (the indexer's
// scorer); returns whether this CPU and build have that code at all.
bool set_avx2(bool on) {
  cedlm_index::allow_avx2() = on;
#ifdef CEDLM_INDEX_AVX2
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

int64_t abi_version() { return 9; }

#include <torch/library.h>
#include "dispatch.h"        // the ops of ops.py as CPU kernels of the dispatcher (read its header)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_tables", &set_tables);
  m.def("encode", &encode);
  m.def("decode", &decode);
  m.def("quant_dequant", &quant_dequant);
  m.def("mhc_mixes", &mhc_mixes);
  m.def("mhc_collapse", &mhc_collapse);
  m.def("mhc_expand", &mhc_expand);
  m.def("rope_rotate", &rope_rotate);
  m.def("index_score", &index_score);
  m.def("stable_topk", &stable_topk);
  m.def("attend_sparse", &attend_sparse);
  m.def("attend_packed", &attend_packed);
  m.def("set_avx2", &set_avx2);
  m.def("register_ops", &register_ops);
  m.def("set_ops_enabled", &set_ops_enabled);
  m.def("abi_version", &abi_version);
}
