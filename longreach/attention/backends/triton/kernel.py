"""The fused kernel's Triton source (:mod:`.launch` launches it): per query tile and key/value head, one
pass over the keys, each cell's dot products where its distance bounds reach, one online softmax (Dao et al.
2022, FlashAttention, Algorithm 1). Defined only where Triton is installed."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installed packages
    triton = None


if triton is not None:
    NO_DISTANCE = tl.constexpr(1 << 62)  # beyond every distance: the empty side of a min or max

    @triton.jit
    def _load_rows(base, rows_ok, PAIRS: tl.constexpr, PAIRS_P: tl.constexpr, REST: tl.constexpr, REST_P: tl.constexpr):
        """A tile of vectors in three slices: the first and second halves of the rotary pairs, and the rest."""
        pair = tl.arange(0, PAIRS_P)
        ok = rows_ok[:, None] & (pair < PAIRS)[None, :]
        first = tl.load(base[:, None] + pair[None, :], mask=ok, other=0.0)
        second = tl.load(base[:, None] + PAIRS + pair[None, :], mask=ok, other=0.0)
        if REST > 0:
            extra = tl.arange(0, REST_P)
            rest = tl.load(
                base[:, None] + 2 * PAIRS + extra[None, :], mask=rows_ok[:, None] & (extra < REST)[None, :], other=0.0
            )
        else:
            rest = first
        return first, second, rest

    @triton.jit
    def _cell(
        scores,
        lo,
        hi,
        q1,
        q2,
        q3,
        k1,
        k2,
        k3,
        distance,
        d_min,
        d_max,
        SCALE: tl.constexpr,
        COS,
        SIN,
        table_base,
        cols,
        cols_ok,
        FIRST,
        STOP,
        span_base,
        t,
        rows_ok,
        key_at,
        TABLE: tl.constexpr,
        SPAN: tl.constexpr,
        PAIRS: tl.constexpr,
        PAIRS_P: tl.constexpr,
        REST: tl.constexpr,
        ACC: tl.constexpr,
    ):
        """A cell's scores written into ``scores`` at its pairs ``lo <= d < hi``; skipped when the tile's distances
        miss that range."""
        if (d_max >= lo) & (d_min < hi):
            if (
                TABLE >= 0
            ):  # keys turned by per-key angles: (k1 cos - k2 sin, k2 cos + k1 sin), as rotary.apply_rotation
                pair = tl.arange(0, PAIRS_P)
                ok = cols_ok[:, None] & (pair < PAIRS)[None, :]
                cos = tl.load(COS + table_base + pair[None, :], mask=ok, other=1.0).to(ACC)
                sin = tl.load(SIN + table_base + pair[None, :], mask=ok, other=0.0).to(ACC)
                a, b = k1.to(ACC), k2.to(ACC)
                k1 = (a * cos - b * sin).to(q1.dtype)
                k2 = (b * cos + a * sin).to(q1.dtype)
            qk = tl.dot(q1, tl.trans(k1), input_precision="ieee", out_dtype=ACC)
            qk += tl.dot(q2, tl.trans(k2), input_precision="ieee", out_dtype=ACC)
            if REST > 0:
                qk += tl.dot(q3, tl.trans(k3), input_precision="ieee", out_dtype=ACC)
            inside = (distance >= lo) & (distance < hi)
            if SPAN:
                first = tl.load(FIRST + span_base + t, mask=rows_ok, other=0)
                stop = tl.load(STOP + span_base + t, mask=rows_ok, other=0)
                inside = inside & (key_at[None, :] >= first[:, None]) & (key_at[None, :] < stop[:, None])
            scores = tl.where(inside, qk * SCALE, scores)
        return scores

    @triton.jit
    def longreach_fused(  # noqa: C901 -- one Triton program: its steps are jit helpers, the rest constexpr branches
        Q,
        K,
        V,
        COS,
        SIN,
        VALID,
        FIRST,
        STOP,
        KEYPOS,
        QPOS,
        OUT,
        LSE,
        stride_qc,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_kb,
        stride_kh,
        stride_kj,
        stride_vb,
        stride_vh,
        stride_vj,
        stride_tt,
        stride_tb,
        stride_tj,
        stride_fc,
        stride_fb,
        stride_pb,
        stride_kpb,
        stride_qpb,
        stride_os,
        stride_ob,
        stride_oh,
        stride_ot,
        stride_ls,
        stride_lb,
        stride_lh,
        kv_heads,
        group,
        q_len,
        kv_len,
        offset,
        keys_per_split,
        lo0,
        hi0,
        lo1,
        hi1,
        lo2,
        hi2,
        lo_min,
        hi_max,
        PAIRS: tl.constexpr,
        PAIRS_P: tl.constexpr,
        REST: tl.constexpr,
        REST_P: tl.constexpr,
        VALUE: tl.constexpr,
        VALUE_P: tl.constexpr,
        CELLS: tl.constexpr,
        TABLE0: tl.constexpr,
        TABLE1: tl.constexpr,
        TABLE2: tl.constexpr,
        SPAN0: tl.constexpr,
        SPAN1: tl.constexpr,
        SPAN2: tl.constexpr,
        PADDED: tl.constexpr,
        BY_POSITION: tl.constexpr,
        BOUNDED: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SCALE: tl.constexpr,
        F64: tl.constexpr,
    ):
        """One program: a tile of query rows (a group's heads packed) against one split of the keys. ``SCALE``, the
        softmax scale, is a compile-time constant (one per model: a float argument would be float32 here and float64
        under Inductor); ``F64``: accumulate in float64 (float64 inputs), else float32."""
        ACC: tl.constexpr = tl.float64 if F64 else tl.float32
        # indices in int64: offsets past 2**31 elements (128K rows, batch 2, three cells' queries) must not wrap
        tile, head_of_batch = tl.program_id(0), tl.program_id(1).to(tl.int64)
        split = tl.program_id(2).to(tl.int64)
        b, kv_head = head_of_batch // kv_heads, head_of_batch % kv_heads
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_ok = rows < group * q_len
        t = (rows % q_len).to(tl.int64)
        head = kv_head * group + rows // q_len
        t_lo = tl.min(tl.where(rows_ok, t, q_len), axis=0)
        t_hi = tl.max(tl.where(rows_ok, t, -1), axis=0)

        q_rows = Q + b * stride_qb + head * stride_qh + t * stride_qt
        q1a, q2a, q3a = _load_rows(q_rows, rows_ok, PAIRS, PAIRS_P, REST, REST_P)
        q1b, q2b, q3b = q1a, q2a, q3a
        q1c, q2c, q3c = q1a, q2a, q3a
        if CELLS > 1:
            q1b, q2b, q3b = _load_rows(q_rows + stride_qc, rows_ok, PAIRS, PAIRS_P, REST, REST_P)
        if CELLS > 2:
            q1c, q2c, q3c = _load_rows(q_rows + stride_qc + stride_qc, rows_ok, PAIRS, PAIRS_P, REST, REST_P)

        begin = split * keys_per_split
        if BY_POSITION:  # distances from the positions (a static cache's slots, in any order): every slot is read
            q_at = tl.load(QPOS + b * stride_qpb + t, mask=rows_ok, other=0)
            end = tl.minimum(kv_len, begin + keys_per_split)
        else:  # distances from the indices: keys past the last row's reach, or below every cell's, are skipped
            end = tl.minimum(tl.minimum(kv_len, begin + keys_per_split), t_hi + offset - lo_min + 1)
            if BOUNDED:  # (tile aligned)
                begin = tl.maximum(begin, (t_lo + offset - hi_max + 1) // BLOCK_N * BLOCK_N)

        m_i = tl.full([BLOCK_M], float("-inf"), ACC)
        l_i = tl.zeros([BLOCK_M], ACC)
        acc = tl.zeros([BLOCK_M, VALUE_P], ACC)
        value_dims = tl.arange(0, VALUE_P)
        for start in range(begin, end, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
            cols_ok = cols < end
            k1, k2, k3 = _load_rows(
                K + b * stride_kb + kv_head * stride_kh + cols * stride_kj, cols_ok, PAIRS, PAIRS_P, REST, REST_P
            )
            if BY_POSITION:
                key_at = tl.load(KEYPOS + b * stride_kpb + cols, mask=cols_ok, other=0)
                distance = q_at[:, None] - key_at[None, :]
                pair_ok = rows_ok[:, None] & cols_ok[None, :]
                d_min = tl.min(tl.min(tl.where(pair_ok, distance, NO_DISTANCE), axis=1), axis=0)
                d_max = tl.max(tl.max(tl.where(pair_ok, distance, -NO_DISTANCE), axis=1), axis=0)
            else:
                distance = t[:, None] + offset - cols[None, :]
                d_min = t_lo + offset - (start + BLOCK_N - 1)
                d_max = t_hi + offset - start
                key_at = cols
                if SPAN0 | SPAN1 | SPAN2:
                    key_at = tl.load(KEYPOS + b * stride_kpb + cols, mask=cols_ok, other=0)
            table_base = b * stride_tb + cols[:, None] * stride_tj
            scores = tl.full([BLOCK_M, BLOCK_N], float("-inf"), ACC)
            scores = _cell(
                scores,
                lo0,
                hi0,
                q1a,
                q2a,
                q3a,
                k1,
                k2,
                k3,
                distance,
                d_min,
                d_max,
                SCALE,
                COS + TABLE0 * stride_tt,
                SIN + TABLE0 * stride_tt,
                table_base,
                cols,
                cols_ok,
                FIRST,
                STOP,
                b * stride_fb,
                t,
                rows_ok,
                key_at,
                TABLE0,
                SPAN0,
                PAIRS,
                PAIRS_P,
                REST,
                ACC,
            )
            if CELLS > 1:
                scores = _cell(
                    scores,
                    lo1,
                    hi1,
                    q1b,
                    q2b,
                    q3b,
                    k1,
                    k2,
                    k3,
                    distance,
                    d_min,
                    d_max,
                    SCALE,
                    COS + TABLE1 * stride_tt,
                    SIN + TABLE1 * stride_tt,
                    table_base,
                    cols,
                    cols_ok,
                    FIRST,
                    STOP,
                    b * stride_fb + stride_fc,
                    t,
                    rows_ok,
                    key_at,
                    TABLE1,
                    SPAN1,
                    PAIRS,
                    PAIRS_P,
                    REST,
                    ACC,
                )
            if CELLS > 2:
                scores = _cell(
                    scores,
                    lo2,
                    hi2,
                    q1c,
                    q2c,
                    q3c,
                    k1,
                    k2,
                    k3,
                    distance,
                    d_min,
                    d_max,
                    SCALE,
                    COS + TABLE2 * stride_tt,
                    SIN + TABLE2 * stride_tt,
                    table_base,
                    cols,
                    cols_ok,
                    FIRST,
                    STOP,
                    b * stride_fb + stride_fc + stride_fc,
                    t,
                    rows_ok,
                    key_at,
                    TABLE2,
                    SPAN2,
                    PAIRS,
                    PAIRS_P,
                    REST,
                    ACC,
                )
            allowed = rows_ok[:, None] & cols_ok[None, :]
            if PADDED:
                real = tl.load(VALID + b * stride_pb + cols, mask=cols_ok, other=0)
                allowed = allowed & (real != 0)[None, :]
            scores = tl.where(allowed, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                V + b * stride_vb + kv_head * stride_vh + cols[:, None] * stride_vj + value_dims[None, :],
                mask=cols_ok[:, None] & (value_dims < VALUE)[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee", out_dtype=ACC)
            m_i = m_new

        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        out_rows = OUT + split * stride_os + b * stride_ob + head * stride_oh + t * stride_ot
        tl.store(out_rows[:, None] + value_dims[None, :], out, mask=rows_ok[:, None] & (value_dims < VALUE)[None, :])
        tl.store(LSE + split * stride_ls + b * stride_lb + head * stride_lh + t, lse, mask=rows_ok)
