// The two products of parts.cpp's online softmax for a few query rows at a time, with their accumulators held in
// registers (the register blocking of Goto and van de Geijn 2008, "Anatomy of high-performance matrix
// multiplication", Sec. 6): the scores of ROWS rows against a transposed key tile, and those rows' weights times a
// value tile added to their outputs. A register tile of M rows by V vectors of keys (or output columns) is M x V
// accumulators; each step broadcasts one element of every row and loads V vectors of the right operand. Its scores
// stay in the first level of cache, where a BLAS product of a whole query tile writes them out and reads them back.
// The tiles' shapes fill the vector registers: 32 with AVX-512, 16 with AVX2 (a tile and the vectors it loads).
#pragma once

#include "tiles.h"

namespace longreach {

constexpr int64_t LANES = Vec::size();
constexpr bool WIDE = LANES >= 16;          // AVX-512's 32 registers of 16 lanes
constexpr int ROWS = WIDE ? 8 : 6;          // rows of a score tile (x 2 vectors): 16 or 12 accumulators
constexpr int VALUE_ROWS = WIDE ? 4 : 6;    // rows of a value tile ...
constexpr int VALUE_VECTORS = WIDE ? 4 : 2; // ... by vectors of output columns: 16 or 12 accumulators

// c[i][j] <- alpha * sum_p a[i][p] b[p][j] (SCORES) or c[i][j] += sum_p a[i][p] b[p][j] (else), for M rows, `depth`
// steps and V vectors of columns, the last of them `last` lanes wide where PART (else whole).
template <int M, int V, bool SCORES, bool PART>
inline void register_tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth, float alpha, float* c,
                          int64_t ldc, int64_t last) {
  auto width = [&](int j) { return PART && j + 1 == V ? last : LANES; };
  Vec acc[M][V];
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) acc[i][j] = SCORES ? Vec(0.f) : Vec::loadu(c + i * ldc + j * LANES, width(j));
  }
  for (int64_t p = 0; p < depth; ++p) {
    Vec right[V];
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) right[j] = PART && j + 1 == V ? Vec::loadu(b + p * ldb + j * LANES, last) : Vec::loadu(b + p * ldb + j * LANES);
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      const Vec left(a[i * lda + p]);
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) acc[i][j] = at::vec::fmadd(left, right[j], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) (SCORES ? acc[i][j] * Vec(alpha) : acc[i][j]).store(c + i * ldc + j * LANES, width(j));
  }
}

// The columns past the whole register tiles, `rest` < V * LANES of them, in as few vectors as hold them.
template <int M, int V, bool SCORES>
inline void rest_tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth, float alpha, float* c, int64_t ldc,
                      int64_t rest) {
  if constexpr (V > 1) {
    if (rest <= (V - 1) * LANES) return rest_tile<M, V - 1, SCORES>(a, lda, b, ldb, depth, alpha, c, ldc, rest);
  }
  register_tile<M, V, SCORES, true>(a, lda, b, ldb, depth, alpha, c, ldc, rest - (V - 1) * LANES);
}

// `rows` rows (at most M) against every column, V vectors of columns at a time.
template <int M, int V, bool SCORES>
inline void product(int64_t rows, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth, float alpha, float* c,
                    int64_t ldc, int64_t columns) {
  if constexpr (M > 1) {
    if (rows < M) return product<M - 1, V, SCORES>(rows, a, lda, b, ldb, depth, alpha, c, ldc, columns);
  }
  int64_t j = 0;
  for (; j + V * LANES <= columns; j += V * LANES) register_tile<M, V, SCORES, false>(a, lda, b + j, ldb, depth, alpha, c + j, ldc, LANES);
  if (j < columns) rest_tile<M, V, SCORES>(a, lda, b + j, ldb, depth, alpha, c + j, ldc, columns - j);
}

// scores [rows, width] (row stride lds) <- scale * q [rows, d] (row stride d) times keys [d, width] (row stride ldk):
// rows <= ROWS, in tiles of ROWS x 2 vectors.
inline void scores_of(int64_t rows, const float* q, int64_t d, const float* keys, int64_t ldk, int64_t width, float scale, float* scores,
                      int64_t lds) {
  product<ROWS, 2, true>(rows, q, d, keys, ldk, d, scale, scores, lds, width);
}

// out [rows, dv] (row stride dv) += weights [rows, width] (row stride ldw) times values [width, dv] (row stride ldv):
// rows <= ROWS, in tiles of VALUE_ROWS x VALUE_VECTORS.
inline void add_values(int64_t rows, const float* weights, int64_t ldw, const float* values, int64_t ldv, int64_t width, int64_t dv,
                       float* out) {
  for (int64_t r = 0; r < rows; r += VALUE_ROWS) {
    product<VALUE_ROWS, VALUE_VECTORS, false>(std::min<int64_t>(VALUE_ROWS, rows - r), weights + r * ldw, ldw, values, ldv, width, 1.f,
                                              out + r * dv, dv, dv);
  }
}

}  // namespace longreach
