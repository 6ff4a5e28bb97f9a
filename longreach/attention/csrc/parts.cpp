// Every part of a position method in one pass on the CPU: one online softmax per query row.
//
// A method's parts are disjoint regions of the causal pairs, lo <= i - j < hi (and, for DCA, keys in a span
// [first(t), stop(t)) per query row), each scored with its own view of q and k (longreach/methods/base.py). Here a part
// is a *cell* (query view, key view, lo, hi, span) and all cells of a row meet in one online softmax (Dao et al.
// 2022, FlashAttention, Algorithm 1): no log-sum-exp merge.
//
// Work is split like PyTorch's CPU flash attention -- a task per (sequence, head, tile of Q_TILE rows), the
// tile's scores against KV_TILE keys at a time by one BLAS product -- but the keys a cell's distance bounds
// cut are taken EDGE keys at a time, and only with the rows that reach them. PyTorch's kernel computes a
// causal square's edge in 256 x 512 tiles (about 256 wasted keys per row and edge); here an edge wastes
// about EDGE / 2 keys per row, so a method with three edges (STRING's band and far triangle) costs what
// causal attention does.
//
// float32 in and out; queries [B, Hq, Lq, D] per query view, keys [B, Hkv, Lkv, D] per key view, values
// [B, Hkv, Lkv, Dv]; grouped-query attention when Hq is a multiple of Hkv. Query row t is key index
// i = t + offset. first_key[b]: the first real key of sequence b (left padding). Returns the output and the
// log-sum-exp per row; a row that attends no key is 0 with log-sum-exp -inf. A cell's span is given as key indices,
// [B, Lq] each.

// ATen and torch's pybind11 casters, not <torch/extension.h>: the whole C++ frontend doubles the build (44 s -> 24 s)
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t Q_TILE = 256;   // query rows per task
constexpr int64_t KV_TILE = 512;  // keys per product where every row of the tile sees every key
constexpr int64_t EDGE = 32;      // keys per product where a distance bound cuts the tile
constexpr int64_t SMALL_QUERY = 16;  // decoding and short chunks (as the Python side's plan.SMALL_QUERY)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
using Vec = at::vec::Vectorized<float>;

// BLAS's single-precision product, column-major, as PyTorch links it (MKL on x86-64).
extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
                       const float*, const int*, const float*, float*, const int*);

void gemm(char trans_a, char trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b,
          int64_t ldb, float beta, float* c, int64_t ldc) {
  const int im = m, in = n, ik = k, ilda = lda, ildb = ldb, ildc = ldc;
  sgemm_(&trans_a, &trans_b, &im, &in, &ik, &alpha, a, &ilda, b, &ildb, &beta, c, &ildc);
}

struct Cell {
  int64_t query, key, lo, hi;  // hi < 0: no upper bound
  const int64_t* span_first;   // [B, Lq] key indices, or nullptr: no span
  const int64_t* span_stop;
};

float maximum(const float* x, int64_t n) {
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
float exponentiate(float* x, int64_t n, float shift) {
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

// One task's running softmax: the maximum, the sum and the weighted values of each row (FlashAttention's m, l, O),
// and, for the cell at hand, the keys [first, stop) each row reaches.
struct Rows {
  std::vector<float> scores, max, sum, out;
  std::vector<int64_t> first, stop;
  explicit Rows(int64_t dv)
      : scores(Q_TILE * std::max(KV_TILE, EDGE)), max(Q_TILE), sum(Q_TILE), out(Q_TILE * dv), first(Q_TILE), stop(Q_TILE) {}
};

// Rows [r0, r1) of the tile against keys [s, e) of one cell: scores by one product, each row's keys outside
// [first, stop) hidden where `cut`, the running softmax rescaled, the values added by a second product.
void attend(Rows& rows, const float* q, const float* k, const float* v, int64_t d, int64_t dv, float scale, int64_t r0, int64_t r1,
            int64_t s, int64_t e, bool cut) {
  const int64_t height = r1 - r0, width = e - s;
  float* scores = rows.scores.data();
  gemm('T', 'N', width, height, d, scale, k + s * d, d, q + r0 * d, d, 0.f, scores, width);  // row-major [height, width]
  for (int64_t r = 0; r < height; ++r) {
    float* row = scores + r * width;
    const int64_t t = r0 + r;
    if (cut) {
      std::fill(row, row + std::clamp<int64_t>(rows.first[t] - s, 0, width), NEG_INF);
      std::fill(row + std::clamp<int64_t>(rows.stop[t] - s, 0, width), row + width, NEG_INF);
    }
    const float top = std::max(rows.max[t], maximum(row, width));
    if (top == NEG_INF) {  // no key of this row here, nor before
      std::fill(row, row + width, 0.f);
      continue;
    }
    const float rescale = rows.max[t] == NEG_INF ? 0.f : std::exp(rows.max[t] - top);
    rows.sum[t] = rows.sum[t] * rescale + exponentiate(row, width, top);
    rows.max[t] = top;
    if (rescale != 1.f) {
      float* out = rows.out.data() + t * dv;
      for (int64_t c = 0; c < dv; ++c) out[c] *= rescale;
    }
  }
  gemm('N', 'N', dv, height, width, 1.f, v + s * dv, dv, scores, width, 1.f, rows.out.data() + r0 * dv, dv);
}

// One cell for one task's tile: each row's keys (distance bounds, span, padding, the task's split of the keys), then
// the keys every row reaches KV_TILE at a time with no mask, and the others EDGE at a time with the rows that reach
// them. Row r of the tile is query row m + r % period, key index first_i + r % period.
void attend_cell(Rows& rows, const Cell& cell, const float* q, const float* k, const float* v, int64_t d, int64_t dv, float scale,
                 int64_t height, int64_t m, int64_t period, int64_t first_i, int64_t row_offset, int64_t keys_from, int64_t keys_to) {
  int64_t used_from = height, used_to = 0;  // the rows that reach some key
  for (int64_t r = 0; r < height; ++r) {
    const int64_t t = r % period, i = first_i + t;
    int64_t first = std::max(keys_from, cell.hi < 0 ? keys_from : i - cell.hi + 1), stop = std::min(keys_to, i - cell.lo + 1);
    if (cell.span_first != nullptr) {
      first = std::max(first, cell.span_first[row_offset + m + t]);
      stop = std::min(stop, cell.span_stop[row_offset + m + t]);
    }
    rows.first[r] = first;
    rows.stop[r] = stop;
    if (stop > first) {
      used_from = std::min(used_from, r);
      used_to = r + 1;
    }
  }
  if (used_to <= used_from) return;
  int64_t low = keys_to, high = keys_from, whole_low = keys_from, whole_high = keys_to;
  bool contiguous = true;
  for (int64_t r = used_from; r < used_to; ++r) {
    contiguous = contiguous && rows.stop[r] > rows.first[r];
    low = std::min(low, rows.first[r]);
    high = std::max(high, rows.stop[r]);
    whole_low = std::max(whole_low, rows.first[r]);
    whole_high = std::min(whole_high, rows.stop[r]);
  }
  if (!contiguous || whole_high <= whole_low) whole_low = whole_high = high;  // no key every row reaches
  auto edge = [&](int64_t from, int64_t to) {
    for (int64_t s = from; s < to; s += EDGE) {
      const int64_t e = std::min(to, s + EDGE);
      int64_t r0 = used_to, r1 = used_from;  // the rows that reach a key of [s, e)
      for (int64_t r = used_from; r < used_to; ++r) {
        if (rows.first[r] < e && rows.stop[r] > s && rows.stop[r] > rows.first[r]) {
          r0 = std::min(r0, r);
          r1 = r + 1;
        }
      }
      if (r1 > r0) attend(rows, q, k, v, d, dv, scale, r0, r1, s, e, true);
    }
  };
  edge(low, whole_low);
  for (int64_t s = whole_low; s < whole_high; s += KV_TILE) attend(rows, q, k, v, d, dv, scale, used_from, used_to, s, std::min(whole_high, s + KV_TILE), false);
  edge(whole_high, high);
}

// Each row's running softmax written out: weights normalised (out) and log(sum) + max (lse); a row with no key: 0, -inf.
void finish(const float* max, const float* sum, const float* acc, int64_t height, int64_t dv, float* out, float* lse) {
  for (int64_t r = 0; r < height; ++r) {
    float* o = out + r * dv;
    if (sum[r] == 0.f) {
      std::fill(o, o + dv, 0.f);
      lse[r] = NEG_INF;
      continue;
    }
    const float inverse = 1.f / sum[r];
    for (int64_t c = 0; c < dv; ++c) o[c] = acc[r * dv + c] * inverse;
    lse[r] = max[r] + std::log(sum[r]);
  }
}

// cell_table [cells, 5]: query view, key view, lo, hi (-1: none), span (-1: none; else an index of span_first, span_stop).
std::vector<at::Tensor> parts_attention(const std::vector<at::Tensor>& queries, const std::vector<at::Tensor>& keys, const at::Tensor& value,
                                        const at::Tensor& cell_table, const std::vector<at::Tensor>& span_first,
                                        const std::vector<at::Tensor>& span_stop, const at::Tensor& first_key, int64_t offset, double scaling) {
  const at::Tensor& q0 = queries.at(0);
  const int64_t batch = q0.size(0), q_heads = q0.size(1), q_len = q0.size(2), d = q0.size(3);
  const int64_t kv_heads = value.size(1), kv_len = value.size(2), dv = value.size(3), group = q_heads / kv_heads;
  std::vector<Cell> cells;
  auto table = cell_table.accessor<int64_t, 2>();
  for (int64_t c = 0; c < cell_table.size(0); ++c) {
    const int64_t span = table[c][4];
    cells.push_back({table[c][0], table[c][1], table[c][2], table[c][3], span < 0 ? nullptr : span_first.at(span).data_ptr<int64_t>(),
                     span < 0 ? nullptr : span_stop.at(span).data_ptr<int64_t>()});
  }
  std::vector<const float*> q_data, k_data;
  for (const auto& q : queries) q_data.push_back(q.data_ptr<float>());
  for (const auto& k : keys) k_data.push_back(k.data_ptr<float>());
  const int64_t* first_keys = first_key.data_ptr<int64_t>();
  const float* v_data = value.data_ptr<float>();
  at::Tensor out = at::empty({batch, q_heads, q_len, dv}, value.options());
  at::Tensor lse = at::empty({batch, q_heads, q_len}, value.options());
  float* out_data = out.data_ptr<float>();
  float* lse_data = lse.data_ptr<float>();
  // Decoding and short chunks: a tile holds the rows of every query head sharing a key/value head (their rows are
  // adjacent in memory), so each key is read once per group, and the keys are split between tasks (Dao et al. 2023,
  // "Flash-Decoding") so that every thread has work; the splits' softmaxes are combined at the end. Else a tile is
  // Q_TILE rows of one head.
  const bool packed = q_len <= SMALL_QUERY && q_len * group <= Q_TILE;
  const int64_t tiles = packed ? 1 : (q_len + Q_TILE - 1) / Q_TILE, heads = packed ? kv_heads : q_heads;
  const int64_t height_max = packed ? group * q_len : Q_TILE;
  const int64_t wanted = (4 * at::get_num_threads() + batch * heads - 1) / (batch * heads);
  const int64_t splits = packed ? std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, kv_len / (2 * KV_TILE))) : 1;
  const int64_t split_keys = (kv_len + splits - 1) / splits;
  std::vector<float> split_max, split_sum, split_out;  // [task, row] and [task, row, dv] when the keys are split
  if (splits > 1) {
    split_max.resize(batch * heads * splits * height_max);
    split_sum.resize(split_max.size());
    split_out.resize(split_max.size() * dv);
  }
  const int64_t period = packed ? q_len : std::numeric_limits<int64_t>::max();
  const float scale = static_cast<float>(scaling);

  at::parallel_for(0, batch * heads * tiles * splits, 1, [&](int64_t begin, int64_t end) {
    Rows rows(dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t split = task % splits, tile = (task / splits) % tiles, h = (task / (splits * tiles)) % heads;
      const int64_t b = task / (splits * tiles * heads);
      const int64_t hk = packed ? h : h / group, first_head = packed ? h * group : h;
      const int64_t m = tile * Q_TILE, height = packed ? height_max : std::min(Q_TILE, q_len - m);
      std::fill(rows.max.begin(), rows.max.begin() + height, NEG_INF);
      std::fill(rows.sum.begin(), rows.sum.begin() + height, 0.f);
      std::fill(rows.out.begin(), rows.out.begin() + height * dv, 0.f);
      const int64_t first_i = m + offset;  // the tile's first row as a key index
      const int64_t start = (b * q_heads + first_head) * q_len + m;  // the tile's first row in the queries and the output
      const float* v = v_data + (b * kv_heads + hk) * kv_len * dv;
      const int64_t keys_from = std::max(first_keys[b], split * split_keys), keys_to = std::min(kv_len, (split + 1) * split_keys);
      for (const Cell& cell : cells) {
        const float* q = q_data[cell.query] + start * d;
        const float* k = k_data[cell.key] + (b * kv_heads + hk) * kv_len * d;
        attend_cell(rows, cell, q, k, v, d, dv, scale, height, m, period, first_i, b * q_len, keys_from, keys_to);
      }
      if (splits == 1) {
        finish(rows.max.data(), rows.sum.data(), rows.out.data(), height, dv, out_data + start * dv, lse_data + start);
      } else {  // kept for the combination
        std::copy(rows.max.begin(), rows.max.begin() + height, split_max.begin() + task * height_max);
        std::copy(rows.sum.begin(), rows.sum.begin() + height, split_sum.begin() + task * height_max);
        std::copy(rows.out.begin(), rows.out.begin() + height * dv, split_out.begin() + task * height_max * dv);
      }
    }
  });
  if (splits > 1) {  // each row's splits rescaled to their common maximum and added (FlashAttention's merge of blocks)
    at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
      Rows rows(dv);
      for (int64_t pair = begin; pair < end; ++pair) {
        for (int64_t r = 0; r < height_max; ++r) {
          float top = NEG_INF;
          for (int64_t sp = 0; sp < splits; ++sp) top = std::max(top, split_max[(pair * splits + sp) * height_max + r]);
          float total = 0.f;
          float* acc = rows.out.data() + r * dv;
          std::fill(acc, acc + dv, 0.f);
          for (int64_t sp = 0; sp < splits && top != NEG_INF; ++sp) {
            const int64_t at = (pair * splits + sp) * height_max + r;
            if (split_sum[at] == 0.f) continue;
            const float weight = std::exp(split_max[at] - top);
            total += split_sum[at] * weight;
            for (int64_t c = 0; c < dv; ++c) acc[c] += split_out[at * dv + c] * weight;
          }
          rows.max[r] = top;
          rows.sum[r] = total;
        }
        const int64_t b = pair / heads, h = pair % heads;
        const int64_t start = (b * q_heads + h * group) * q_len;
        finish(rows.max.data(), rows.sum.data(), rows.out.data(), height_max, dv, out_data + start * dv, lse_data + start);
      }
    });
  }
  return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("parts_attention", &parts_attention, "Every cell of a method in one online softmax (see the file's head)");
}
