// The vector arithmetic of parts.cpp's online softmax, and the planes its keys and values are read from.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

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
    best = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, lanes);
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
  float total = at::vec::vec_reduce_all<float>(std::plus<Vec>(), lanes);
  for (; j < n; ++j) total += (x[j] = std::exp(x[j] - shift));
  return total;
}

// A plane of keys or values, [blocks, heads, slots, width] with the last two dense (a paged cache such as vLLM's, or
// one block per sequence), in float32, bfloat16 or float16, read through a sequence's block table. A *transposed*
// plane holds each block's keys as [width, slots] (vLLM's CPU cache for its "vec" kernels), so that a key block's
// scores are one product with no copy. A key plane may carry an angle table, cos and sin per key index and pair
// ([N, P]; [P, N] for a transposed plane): its keys are then rotated as they are read (a per-token key shift, Su et
// al. 2021, Eq. 34: the pairs (x_c, x_{c+P}) turned by the key's angles), instead of stored moved.
struct Plane {
  const void* data;
  at::ScalarType dtype;
  int64_t block_stride, head_stride, width;
  bool transposed = false;
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t pairs = 0, angle_stride = 0;  // angle_stride: between pairs of a transposed plane's table, else between keys
};

// Rows of a plane read as float32: key j's column c at data[j * ld + c], or at data[c * ld + j] where transposed.
struct Tile {
  const float* data;
  int64_t ld;
  bool transposed;
};

template <typename T>
void to_float(const T* x, float* y, int64_t n) {
  at::vec::convert(x, y, n);
}

inline void copy_float(const Plane& plane, int64_t from, float* to, int64_t n) {
  if (plane.dtype == at::kFloat) {
    std::copy_n(static_cast<const float*>(plane.data) + from, n, to);
  } else if (plane.dtype == at::kBFloat16) {
    to_float(static_cast<const at::BFloat16*>(plane.data) + from, to, n);
  } else {
    to_float(static_cast<const at::Half*>(plane.data) + from, to, n);
  }
}

// (a, b) turned by the angles, into (to_a, to_b), over n lanes: one rotation pair of several keys, or several pairs of
// one key (to_a may be a, to_b b).
inline void turn(const float* a_lanes, const float* b_lanes, float* to_a, float* to_b, const float* cos, const float* sin, int64_t n) {
  const int64_t lanes = n - n % Vec::size();
  for (int64_t c = 0; c < lanes; c += Vec::size()) {
    const Vec a = Vec::loadu(a_lanes + c), b = Vec::loadu(b_lanes + c), cs = Vec::loadu(cos + c), sn = Vec::loadu(sin + c);
    (a * cs - b * sn).store(to_a + c);
    (b * cs + a * sn).store(to_b + c);
  }
  for (int64_t c = lanes; c < n; ++c) {
    const float a = a_lanes[c], b = b_lanes[c];
    to_a[c] = a * cos[c] - b * sin[c];
    to_b[c] = b * cos[c] + a * sin[c];
  }
}

// Key j's columns [from, from + width) of a plain plane (not transposed) into `to`, as float32, its rotation pairs
// turned by its angles where the plane has them.
inline void key_row(const Plane& plane, int64_t at, int64_t j, float* to) {
  copy_float(plane, at, to, plane.width);
  if (plane.cos != nullptr) {
    const int64_t angle = j * plane.angle_stride;
    turn(to, to + plane.pairs, to, to + plane.pairs, plane.cos + angle, plane.sin + angle, plane.pairs);
  }
}

// Rows [s, e) of one head of a plane as float32, laid out as `transposed` asks ([e - s, width], or [width, e - s]): in
// place where they lie in one block laid out so and nothing is converted or rotated, else in `buffer`, gathered block
// by block. A transposed plane is read transposed.
inline Tile rows_of(const Plane& plane, const int64_t* blocks, int64_t block_size, int64_t head, int64_t s, int64_t e, float* buffer,
                    bool transposed) {
  const int64_t n = e - s, width = plane.width;
  auto block_at = [&](int64_t j) { return blocks[j / block_size] * plane.block_stride + head * plane.head_stride; };
  if (plane.dtype == at::kFloat && plane.cos == nullptr && s / block_size == (e - 1) / block_size && plane.transposed == transposed) {
    const float* data = static_cast<const float*>(plane.data) + block_at(s);
    return transposed ? Tile{data + s % block_size, block_size, true} : Tile{data + (s % block_size) * width, width, false};
  }
  if (transposed && !plane.transposed) {  // a plain plane's keys turned into columns, one key at a time
    std::vector<float> row(width);  // any head dimension
    for (int64_t j = s; j < e; ++j) {
      key_row(plane, block_at(j) + (j % block_size) * width, j, row.data());
      for (int64_t c = 0; c < width; ++c) buffer[c * n + (j - s)] = row[c];
    }
    return Tile{buffer, n, true};
  }
  const int64_t pairs = plane.pairs;
  const bool turned = plane.cos != nullptr, fused = turned && plane.dtype == at::kFloat;  // float32: turned as copied
  const int64_t copied = fused ? 2 * pairs : 0;  // the first column copied as it is
  for (int64_t j = s, stop; j < e; j = stop) {
    stop = std::min(e, (j / block_size + 1) * block_size);
    const int64_t from = block_at(j), keys = stop - j;
    if (plane.transposed) {
      for (int64_t c = copied; c < width; ++c) copy_float(plane, from + c * block_size + j % block_size, buffer + c * n + (j - s), keys);
    } else if (copied == 0) {
      copy_float(plane, from + (j % block_size) * width, buffer + (j - s) * width, keys * width);
    } else {
      for (int64_t i = j; i < stop; ++i) copy_float(plane, from + (i % block_size) * width + copied, buffer + (i - s) * width + copied, width - copied);
    }
    if (!turned) continue;
    // the pairs (x_c, x_{c+P}) turned: from the plane where fused, else in the buffer
    const float* source = static_cast<const float*>(plane.data);
    if (plane.transposed) {  // pair c of these keys: rows c and c + P, their angles contiguous
      for (int64_t c = 0; c < pairs; ++c) {
        float* to = buffer + c * n + (j - s);
        const float* a = fused ? source + from + c * block_size + j % block_size : to;
        const int64_t angle = c * plane.angle_stride + j;
        turn(a, a + pairs * (fused ? block_size : n), to, to + pairs * n, plane.cos + angle, plane.sin + angle, keys);
      }
    } else {  // key i's pairs: the two halves of its row
      for (int64_t i = j; i < stop; ++i) {
        float* to = buffer + (i - s) * width;
        const float* a = fused ? source + from + (i % block_size) * width : to;
        turn(a, a + pairs, to, to + pairs, plane.cos + i * plane.angle_stride, plane.sin + i * plane.angle_stride, pairs);
      }
    }
  }
  return Tile{buffer, transposed ? n : width, transposed};
}

// Keys [s, e) of one head as parts, each a Tile of the keys from `start[p]` to the next part's start (or e): one part a
// block where the plane's keys can be read in place, else one part gathered into `buffer` (rows_of).
struct Parts {
  static constexpr int64_t MOST = 8;  // blocks a tile may span
  std::array<int64_t, MOST + 1> start;
  std::array<Tile, MOST> tile;
  int64_t count = 0;
};

inline void read_parts(const Plane& plane, const int64_t* blocks, int64_t block_size, int64_t head, int64_t s, int64_t e, float* buffer,
                       bool transposed, Parts& parts) {
  parts.count = 0;
  const bool in_place = plane.dtype == at::kFloat && plane.cos == nullptr && plane.transposed == transposed;
  for (int64_t j = s, stop; j < e; j = stop) {
    stop = in_place ? std::min(e, (j / block_size + 1) * block_size) : e;
    parts.start[parts.count] = j;
    parts.tile[parts.count++] = rows_of(plane, blocks, block_size, head, j, stop, buffer, transposed);
  }
  parts.start[parts.count] = e;
}

}  // namespace longreach
