// The vector arithmetic of parts.cpp's online softmax, and the planes its keys and values are read from.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace longreach {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
using Vec = at::vec::Vectorized<float>;

// BLAS's single-precision product, column-major, as PyTorch links it (MKL on x86-64).
extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
                       const float*, const int*, const float*, float*, const int*);

inline void gemm(char trans_a, char trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc) {
  const int im = m, in = n, ik = k, ilda = lda, ildb = ldb, ildc = ldc;
  sgemm_(&trans_a, &trans_b, &im, &in, &ik, &alpha, a, &ilda, b, &ildb, &beta, c, &ildc);
}


inline float maximum(const float* x, int64_t n) {
  float best = NEG_INF;
  int64_t j = 0;
  if (n >= Vec::size()) {
    Vec lanes = Vec::loadu(x);
    for (j = Vec::size(); j + Vec::size() <= n; j += Vec::size()) lanes = at::vec::maximum(lanes, Vec::loadu(x + j));
    float spilled[Vec::size()];
    lanes.store(spilled);
    for (int64_t l = 0; l < Vec::size(); ++l) best = std::max(best, spilled[l]);
  }
  for (; j < n; ++j) best = std::max(best, x[j]);
  return best;
}

// PyTorch's fast vector exp where the release has it (exp_u20, as its CPU flash attention), else the accurate one.
template <typename V>
auto fast_exp(const V& x, int) -> decltype(x.exp_u20()) {
  return x.exp_u20();
}
template <typename V>
V fast_exp(const V& x, long) {
  return x.exp();
}

// x <- exp(x - shift), returning the sum.
inline float exponentiate(float* x, int64_t n, float shift) {
  const Vec by(shift);
  Vec lanes(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec y = fast_exp(Vec::loadu(x + j) - by, 0);
    y.store(x + j);
    lanes = lanes + y;
  }
  float spilled[Vec::size()];
  lanes.store(spilled);
  float total = 0.f;
  for (int64_t l = 0; l < Vec::size(); ++l) total += spilled[l];
  for (; j < n; ++j) total += (x[j] = std::exp(x[j] - shift));
  return total;
}

// A plane of keys or values, [blocks, heads, slots, width] with the last two dense (a paged cache such as vLLM's, or
// one block per sequence), in float32, bfloat16 or float16, read through a sequence's block table. A key plane may
// carry an angle table, cos and sin [N, P] per key index: its keys are then rotated as they are read (a per-token key
// shift, Su et al. 2021, Eq. 34: the pairs (x_c, x_{c+P}) turned by the key's angles), instead of stored moved.
struct Plane {
  const void* data;
  at::ScalarType dtype;
  int64_t block_stride, head_stride, width;
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t pairs = 0;
};

template <typename T>
void to_float(const T* x, float* y, int64_t n) {
  at::vec::convert(x, y, n);
}

// Rows [s, e) of one head of a plane as float32 rows of the plane's width: a pointer into the plane where they lie in
// one block and nothing is converted or rotated, else into `buffer`, gathered block by block.
inline const float* rows_of(const Plane& plane, const int64_t* blocks, int64_t block_size, int64_t head, int64_t s, int64_t e,
                            float* buffer) {
  auto at = [&](int64_t j) { return blocks[j / block_size] * plane.block_stride + head * plane.head_stride + (j % block_size) * plane.width; };
  if (plane.dtype == at::kFloat && plane.cos == nullptr && s / block_size == (e - 1) / block_size) {
    return static_cast<const float*>(plane.data) + at(s);
  }
  for (int64_t j = s, stop; j < e; j = stop) {
    stop = std::min(e, (j / block_size + 1) * block_size);
    float* to = buffer + (j - s) * plane.width;
    const int64_t n = (stop - j) * plane.width;
    if (plane.dtype == at::kFloat) {
      std::copy_n(static_cast<const float*>(plane.data) + at(j), n, to);
    } else if (plane.dtype == at::kBFloat16) {
      to_float(static_cast<const at::BFloat16*>(plane.data) + at(j), to, n);
    } else {
      to_float(static_cast<const at::Half*>(plane.data) + at(j), to, n);
    }
  }
  if (plane.cos != nullptr) {
    const int64_t pairs = plane.pairs, lanes = pairs - pairs % Vec::size();
    for (int64_t j = s; j < e; ++j) {
      float* x1 = buffer + (j - s) * plane.width;
      float* x2 = x1 + pairs;
      const float* cos = plane.cos + j * pairs;
      const float* sin = plane.sin + j * pairs;
      for (int64_t c = 0; c < lanes; c += Vec::size()) {
        const Vec a = Vec::loadu(x1 + c), b = Vec::loadu(x2 + c), cs = Vec::loadu(cos + c), sn = Vec::loadu(sin + c);
        (a * cs - b * sn).store(x1 + c);
        (b * cs + a * sn).store(x2 + c);
      }
      for (int64_t c = lanes; c < pairs; ++c) {
        const float a = x1[c], b = x2[c];
        x1[c] = a * cos[c] - b * sin[c];
        x2[c] = b * cos[c] + a * sin[c];
      }
    }
  }
  return buffer;
}

}  // namespace longreach
