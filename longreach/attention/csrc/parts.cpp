// Every part of a position method in one pass on the CPU: one online softmax per query row.
//
// A method's parts are disjoint regions of the causal pairs, lo <= i - j < hi (and, for DCA, keys in a span
// [first(t), stop(t)) per query row), each scored with its own view of q and k (longreach/methods/base.py). Here a part
// is a *cell* (query view, key view, lo, hi, span) and all cells of a row meet in one online softmax (Dao et al.
// 2022, FlashAttention, Algorithm 1): no log-sum-exp merge.
//
// Work is split like PyTorch's CPU flash attention -- a task per (sequence, head, tile of Q_TILE rows) -- but a tile's
// rows meet each tile of keys ROWS at a time, in register-blocked products (products.h) whose scores stay in the first
// level of cache, and each group of ROWS rows takes only the keys its rows reach: a distance bound that cuts the
// keys wastes about ROWS / 2 keys per row, so a method with three edges (STRING's band and far triangle) costs what
// causal attention does. (PyTorch's kernel computes a causal square's edge in 256 x 512 tiles.)
//
// Sequences of any lengths in one call, as vLLM batches them: queries [Hq, R, D] per query view (float32), sequence b
// holding rows [q_start[b], q_start[b + 1]), its row t being key index t + offset[b]; its kv_len[b] keys and values
// read from planes (tiles.h: a paged cache through block_table[b], or one block per sequence) in float32, bfloat16 or
// float16; grouped-query attention when Hq is a multiple of Hkv. first_key[b]: the first real key of sequence b (left
// padding). Returns the output [Hq, R, Dv] and the log-sum-exp [Hq, R]; a row that attends no key is 0 with
// log-sum-exp -inf. A cell's span is given as key indices per row, [R] each.

// ATen and torch's pybind11 casters, not <torch/extension.h>: the whole C++ frontend doubles the build (44 s -> 24 s)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "products.h"
#include "tiles.h"

namespace {

using namespace longreach;

constexpr int64_t Q_TILE = 256;      // query rows per task
constexpr int64_t KV_TILE = 512;     // keys read at a time (or a block's, if fewer)
constexpr int64_t SMALL_QUERY = 16;  // decoding and short chunks (as the Python side's plan.SMALL_QUERY)

struct Cell {
  int64_t query, key, lo, hi;  // hi < 0: no upper bound
  const int64_t* span_first;   // [R] key indices, or nullptr: no span
  const int64_t* span_stop;
};

// One sequence's keys: its block table, its block size, the key/value head, and which keys the task reads.
struct Keys {
  const int64_t* blocks;
  int64_t block_size, head, from, to;
};

// Rows [from, to) of a tile, with the keys some row reaches, [low, high), and those every row reaches, [whole_low,
// whole_high).
struct Group {
  int64_t from, to, low, high, whole_low, whole_high;
};

// One task's running softmax: the maximum, the sum and the weighted values of each row (FlashAttention's m, l, O),
// and, for the cell at hand, the keys [first, stop) each row reaches; buffers for keys and values read converted or
// rotated, and for the queries of a packed tile.
struct Rows {
  std::vector<float> scores, max, sum, out, keys, values, queries;
  std::vector<int64_t> first, stop;
  std::vector<Group> groups;
  Parts key_parts, value_parts;
  Rows(int64_t d, int64_t dv, int64_t views)
      : scores(ROWS * KV_TILE), max(Q_TILE), sum(Q_TILE), out(Q_TILE * dv), keys(KV_TILE * d), values(KV_TILE * dv),
        queries(views * Q_TILE * d), first(Q_TILE), stop(Q_TILE), groups(Q_TILE / ROWS + 1) {}
};

// Rows [r0, r1) of the tile (at most ROWS) against keys [s, e) of one cell, read as the parts k and v: scores by one
// product a part, each row's keys outside [first, stop) hidden where `cut`, the running softmax rescaled, the values
// added by a second product a part.
void attend(Rows& rows, const float* q, const Parts& k, const Parts& v, int64_t d, int64_t dv, float scale, int64_t r0, int64_t r1, int64_t s,
            int64_t e, bool cut) {
  const int64_t height = r1 - r0, width = e - s;
  float* scores = rows.scores.data();
  for (int64_t p = 0; p < k.count; ++p) {
    const int64_t from = std::max(s, k.start[p]), to = std::min(e, k.start[p + 1]), column = from - k.start[p];
    if (from >= to) continue;
    const Tile& keys = k.tile[p];
    if (keys.transposed) {
      scores_of(height, q + r0 * d, d, keys.data + column, keys.ld, to - from, scale, scores + (from - s), width);
    } else {  // a few rows against keys read in place, one key a row: BLAS
      gemm('T', 'N', to - from, height, d, scale, keys.data + column * keys.ld, keys.ld, q + r0 * d, d, 0.f, scores + (from - s), width);
    }
  }
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
    const float rescale = rows.max[t] == top ? 1.f : rows.max[t] == NEG_INF ? 0.f : std::exp(rows.max[t] - top);
    rows.sum[t] = rows.sum[t] * rescale + exponentiate(row, width, top);
    rows.max[t] = top;
    if (rescale != 1.f) {
      float* out = rows.out.data() + t * dv;
      for (int64_t c = 0; c < dv; ++c) out[c] *= rescale;
    }
  }
  for (int64_t p = 0; p < v.count; ++p) {
    const int64_t from = std::max(s, v.start[p]), to = std::min(e, v.start[p + 1]);
    if (from >= to) continue;
    const Tile& values = v.tile[p];
    add_values(height, scores + (from - s), width, values.data + (from - v.start[p]) * values.ld, values.ld, to - from, dv, rows.out.data() + r0 * dv);
  }
}

// One cell for one task's tile: each row's keys (distance bounds, span, padding, the task's split of the keys), then
// the keys some row reaches, a tile of at most KV_TILE keys in one block at a time, read once for every group of ROWS
// rows, each group taking the keys its rows reach and hiding, where its rows differ, each row's others. Row r of the
// tile is query row m + r % period, key index first_i + r % period, its span at span_row + r % period.
void attend_cell(Rows& rows, const Cell& cell, const float* q, const Plane& key, const Plane& value, const Keys& keys, float scale,
                 int64_t height, int64_t period, int64_t first_i, int64_t span_row) {
  int64_t used_from = height, used_to = 0;  // the rows that reach some key
  for (int64_t r = 0; r < height; ++r) {
    const int64_t t = r % period, i = first_i + t;
    int64_t first = std::max(keys.from, cell.hi < 0 ? keys.from : i - cell.hi + 1), stop = std::min(keys.to, i - cell.lo + 1);
    if (cell.span_first != nullptr) {
      first = std::max(first, cell.span_first[span_row + t]);
      stop = std::min(stop, cell.span_stop[span_row + t]);
    }
    rows.first[r] = first;
    rows.stop[r] = stop;
    if (stop > first) {
      used_from = std::min(used_from, r);
      used_to = r + 1;
    }
  }
  if (used_to <= used_from) return;
  // per group: the keys some row reaches [low, high), and those every row reaches [whole_low, whole_high)
  int64_t low = keys.to, high = keys.from, groups = 0;
  for (int64_t g = used_from; g < used_to; g += ROWS, ++groups) {
    Group& group = rows.groups[groups];
    group = {g, std::min(g + ROWS, used_to), keys.to, keys.from, keys.from, keys.to};
    for (int64_t r = group.from; r < group.to; ++r) {
      if (rows.stop[r] <= rows.first[r]) {  // a row with no key: no key every row reaches
        group.whole_high = group.whole_low;
        continue;
      }
      group.low = std::min(group.low, rows.first[r]);
      group.high = std::max(group.high, rows.stop[r]);
      group.whole_low = std::max(group.whole_low, rows.first[r]);
      group.whole_high = std::min(group.whole_high, rows.stop[r]);
    }
    low = std::min(low, group.low);
    high = std::max(high, group.high);
  }
  // keys read in place by BLAS where few rows share them and the plane holds them one a row (decoding), else as columns
  const bool transposed = key.transposed || used_to - used_from >= SMALL_QUERY * 4;
  for (int64_t s = low, e; s < high; s = e) {
    e = std::min({high, s + KV_TILE, (s / keys.block_size + Parts::MOST) * keys.block_size});
    bool read = false;
    for (int64_t at = 0; at < groups; ++at) {
      const Group& group = rows.groups[at];
      const int64_t a = std::max(s, group.low), b = std::min(e, group.high);
      if (a >= b) continue;
      if (!read) {
        read_parts(key, keys.blocks, keys.block_size, keys.head, s, e, rows.keys.data(), transposed, rows.key_parts);
        read_parts(value, keys.blocks, keys.block_size, keys.head, s, e, rows.values.data(), false, rows.value_parts);
        read = true;
      }
      attend(rows, q, rows.key_parts, rows.value_parts, key.width, value.width, scale, group.from, group.to, a, b,
             a < group.whole_low || b > group.whole_high);
    }
  }
}

// Where a tile's rows go: row r is head first_head + r / period's query row row0 + r % period of the [H, R, ...] output.
struct Destination {
  int64_t first_head, period, row0, total_rows;
  int64_t of(int64_t r) const { return (first_head + r / period) * total_rows + row0 + r % period; }
};

// Each row's running softmax written out: weights normalised (out) and log(sum) + max (lse); a row with no key: 0, -inf.
void finish(const float* max, const float* sum, const float* acc, int64_t height, int64_t dv, const Destination& to, float* out, float* lse) {
  for (int64_t r = 0; r < height; ++r) {
    const int64_t row = to.of(r);
    float* o = out + row * dv;
    if (sum[r] == 0.f) {
      std::fill(o, o + dv, 0.f);
      lse[row] = NEG_INF;
      continue;
    }
    const float inverse = 1.f / sum[r];
    for (int64_t c = 0; c < dv; ++c) o[c] = acc[r * dv + c] * inverse;
    lse[row] = max[r] + std::log(sum[r]);
  }
}

// One task: the rows of a tile of one sequence against one split of its keys. Decoding and short chunks are *packed*:
// a tile holds the rows of every query head sharing a key/value head, so each key is read once per group, and the
// keys are split between tasks (Dao et al. 2023, "Flash-Decoding") so that every thread has work; the splits'
// softmaxes are combined at the end. Else a tile is Q_TILE rows of one query head.
struct Task {
  int64_t sequence, head, m, height, split, splits, kept;  // head: a key/value head if packed; kept: the splits' slot
  bool packed;
};

// A plane [blocks, heads, slots, width] dense per head, or [blocks, heads, width, slots] where transposed; its angle
// table (none: empty) is [N, P], or [P, N] where transposed.
Plane plane_of(const at::Tensor& x, bool transposed, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.stride(2) == x.size(3), "a plane is [blocks, heads, slots, width], dense per head");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "planes are float32, bfloat16 or float16");
  Plane plane{x.data_ptr(), x.scalar_type(), x.stride(0), x.stride(1), x.size(transposed ? 2 : 3), transposed};
  if (cos.defined() && cos.numel() > 0) {
    plane.cos = cos.data_ptr<float>();
    plane.sin = sin.data_ptr<float>();
    plane.pairs = cos.size(transposed ? 0 : 1);
    plane.angle_stride = cos.size(1);
  }
  return plane;
}

// cell_table [cells, 5]: query view, key view, lo, hi (-1: none), span (-1: none; else an index of span_first, span_stop).
// keys_transposed: per key plane, whether it is transposed (plane_of); key_cos, key_sin: per key plane, its angle table
// or an empty tensor. The value plane is never transposed. sequences [B, 5]: q_start, q_len, offset, kv_len, first_key.
std::vector<at::Tensor> parts_attention(const std::vector<at::Tensor>& queries, const std::vector<at::Tensor>& keys,
                                        const std::vector<bool>& keys_transposed, const std::vector<at::Tensor>& key_cos, const std::vector<at::Tensor>& key_sin, const at::Tensor& value,
                                        const at::Tensor& block_table, int64_t block_size, const at::Tensor& sequences,
                                        const at::Tensor& cell_table, const std::vector<at::Tensor>& span_first,
                                        const std::vector<at::Tensor>& span_stop, double scaling) {
  const at::Tensor& q0 = queries.at(0);
  const int64_t q_heads = q0.size(0), total_rows = q0.size(1), d = q0.size(2);
  const int64_t kv_heads = value.size(1), dv = value.size(3), group = q_heads / kv_heads, views = queries.size();
  std::vector<Cell> cells;
  auto table = cell_table.accessor<int64_t, 2>();
  for (int64_t c = 0; c < cell_table.size(0); ++c) {
    const int64_t span = table[c][4];
    cells.push_back({table[c][0], table[c][1], table[c][2], table[c][3], span < 0 ? nullptr : span_first.at(span).data_ptr<int64_t>(),
                     span < 0 ? nullptr : span_stop.at(span).data_ptr<int64_t>()});
  }
  std::vector<const float*> q_data;
  for (const auto& q : queries) q_data.push_back(q.data_ptr<float>());
  std::vector<Plane> key_planes;
  for (size_t p = 0; p < keys.size(); ++p) {
    TORCH_CHECK(!keys_transposed.at(p) || keys[p].size(3) == block_size, "a transposed key plane is [blocks, heads, width, block_size]");
    key_planes.push_back(plane_of(keys[p], keys_transposed.at(p), key_cos.at(p), key_sin.at(p)));
  }
  const Plane value_plane = plane_of(value, false, at::Tensor(), at::Tensor());
  const int64_t* blocks = block_table.data_ptr<int64_t>();
  const int64_t blocks_per_sequence = block_table.size(1), batch = sequences.size(0);
  auto sequence = sequences.accessor<int64_t, 2>();
  at::Tensor out = at::empty({q_heads, total_rows, dv}, q0.options());
  at::Tensor lse = at::empty({q_heads, total_rows}, q0.options());
  float* out_data = out.data_ptr<float>();
  float* lse_data = lse.data_ptr<float>();

  std::vector<Task> tasks;
  int64_t kept_rows = 0;  // rows kept for the combination of split keys
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = sequence[b][1], kv_len = sequence[b][3];
    const bool packed = q_len <= SMALL_QUERY && q_len * group <= Q_TILE;
    const int64_t heads = packed ? kv_heads : q_heads, height = packed ? group * q_len : Q_TILE;
    const int64_t wanted = (4 * at::get_num_threads() + batch * heads - 1) / (batch * heads);
    const int64_t splits = packed ? std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, kv_len / (2 * KV_TILE))) : 1;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t m = 0; m < (packed ? 1 : q_len); m += Q_TILE) {
        for (int64_t split = 0; split < splits; ++split) {
          tasks.push_back({b, h, m, packed ? height : std::min(Q_TILE, q_len - m), split, splits, splits > 1 ? kept_rows : -1, packed});
          if (splits > 1) kept_rows += height;
        }
      }
    }
  }
  std::vector<float> kept_max(kept_rows), kept_sum(kept_rows), kept_out(kept_rows * dv);
  const float scale = static_cast<float>(scaling);

  at::parallel_for(0, tasks.size(), 1, [&](int64_t begin, int64_t end) {
    Rows rows(d, dv, views);
    for (int64_t index = begin; index < end; ++index) {
      const Task& task = tasks[index];
      const int64_t b = task.sequence, q_start = sequence[b][0], q_len = sequence[b][1], offset = sequence[b][2], kv_len = sequence[b][3];
      const int64_t split_keys = (kv_len + task.splits - 1) / task.splits, height = task.height;
      const Keys reach{blocks + b * blocks_per_sequence, block_size, task.packed ? task.head : task.head / group,
                       std::max(sequence[b][4], task.split * split_keys), std::min(kv_len, (task.split + 1) * split_keys)};
      const int64_t period = task.packed ? q_len : Q_TILE;
      const Destination to{task.packed ? task.head * group : task.head, period, q_start + task.m, total_rows};
      std::fill(rows.max.begin(), rows.max.begin() + height, NEG_INF);
      std::fill(rows.sum.begin(), rows.sum.begin() + height, 0.f);
      std::fill(rows.out.begin(), rows.out.begin() + height * dv, 0.f);
      if (task.packed) {  // the group's rows side by side
        for (int64_t v = 0; v < views; ++v) {
          for (int64_t r = 0; r < height; ++r) std::copy_n(q_data[v] + to.of(r) * d, d, rows.queries.data() + (v * Q_TILE + r) * d);
        }
      }
      for (const Cell& cell : cells) {
        const float* q = task.packed ? rows.queries.data() + cell.query * Q_TILE * d : q_data[cell.query] + to.of(0) * d;
        attend_cell(rows, cell, q, key_planes[cell.key], value_plane, reach, scale, height, period, task.m + offset, q_start + task.m);
      }
      if (task.kept < 0) {
        finish(rows.max.data(), rows.sum.data(), rows.out.data(), height, dv, to, out_data, lse_data);
      } else {  // kept for the combination
        std::copy_n(rows.max.begin(), height, kept_max.begin() + task.kept);
        std::copy_n(rows.sum.begin(), height, kept_sum.begin() + task.kept);
        std::copy_n(rows.out.begin(), height * dv, kept_out.begin() + task.kept * dv);
      }
    }
  });
  // each split row's splits rescaled to their common maximum and added (FlashAttention's merge of blocks)
  at::parallel_for(0, tasks.size(), 1, [&](int64_t begin, int64_t end) {
    Rows rows(d, dv, 0);
    for (int64_t index = begin; index < end; ++index) {
      const Task& task = tasks[index];
      if (task.kept < 0 || task.split != 0) continue;
      for (int64_t r = 0; r < task.height; ++r) {
        float top = NEG_INF;
        for (int64_t sp = 0; sp < task.splits; ++sp) top = std::max(top, kept_max[task.kept + sp * task.height + r]);
        float total = 0.f;
        float* acc = rows.out.data() + r * dv;
        std::fill(acc, acc + dv, 0.f);
        for (int64_t sp = 0; sp < task.splits && top != NEG_INF; ++sp) {
          const int64_t at = task.kept + sp * task.height + r;
          if (kept_sum[at] == 0.f) continue;
          const float weight = std::exp(kept_max[at] - top);
          total += kept_sum[at] * weight;
          for (int64_t c = 0; c < dv; ++c) acc[c] += kept_out[at * dv + c] * weight;
        }
        rows.max[r] = top;
        rows.sum[r] = total;
      }
      const Destination to{task.head * group, sequence[task.sequence][1], sequence[task.sequence][0], total_rows};
      finish(rows.max.data(), rows.sum.data(), rows.out.data(), task.height, dv, to, out_data, lse_data);
    }
  });
  return {out, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("parts_attention", &parts_attention, "Every cell of a method in one online softmax (see the file's head)");
}
