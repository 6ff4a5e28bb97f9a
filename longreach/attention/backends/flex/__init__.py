"""``flex``: PyTorch's FlexAttention with each cell's block mask (Dong et al. 2024, "Flex Attention: A Programming
Model for Generating Optimized Attention Kernels", arXiv:2412.05496); the masks are :mod:`.masks`.

Prefill is one launch over queries and keys laid side by side (:meth:`Flex.prepare`); a decoding step and DPE's
per-head pairs take one call per cell on the tiled kernel's merge. Grouped-query attention is native
(``enable_gqa``), and the log-sum-exp comes back for the merge.

Compiled with ``torch.compile`` on CUDA. On CPU, PyTorch runs FlexAttention eagerly, computing the full scores
matrix, and has no backward there: this path exists on CPU so that the whole backend is checked against the dense
reference in CI at small sizes; ``auto`` never picks it on CPU.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

from .... import compat
from ...call import Call
from ...cells import Cell
from ...merge import merge
from ...parts import Shift
from ...plan import SMALL_QUERY, Block
from ...rotary import compute_dtype
from ...shifts import shifted, shifted_keys
from ...views import angles
from ..tiled import TiledBackend
from .masks import Region, _flex_module, segment_length, segmented_block_mask

_compile_failure: list[str] = []  # why compiling FlexAttention failed in this process, once it has


def compile_failed(error: BaseException) -> bool:
    """Whether ``error`` is PyTorch failing to compile FlexAttention (TorchDynamo, Inductor, a C++ or CUDA compiler)."""
    from torch._dynamo.exc import TorchDynamoException

    failures = (TorchDynamoException,)
    try:
        from torch._inductor import exc as inductor

        failures += tuple(
            getattr(inductor, name)
            for name in ("InductorError", "CppCompileError", "CUDACompileError")
            if hasattr(inductor, name)
        )
    except ImportError:  # pragma: no cover - depends on the installed PyTorch
        pass
    return isinstance(error, failures)


def give_up(error: BaseException) -> None:
    """Stop choosing FlexAttention for ``auto`` in this process, with one warning that says why."""
    if not _compile_failure:
        _compile_failure.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        warnings.warn(
            f"longreach: compiling FlexAttention failed ({_compile_failure[0]}); backend='auto' uses the tiled kernel "
            "from now on (slower on GPUs, the same results)",
            stacklevel=3,
        )


def available(device: torch.device | str, for_auto: bool = False) -> bool:
    """Whether FlexAttention can run on ``device``: on CUDA, Triton is installed to compile it (``for_auto``: and
    compiling it has not failed in this process)."""
    if for_auto and _compile_failure:
        return False
    if torch.device(device).type != "cuda":
        return True
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def part_attention(q, k, v, mask, causal, scaling):
    """One cell: ``flex_attention`` with the part's block mask (``mask``), returning ``(out, lse)`` in float32
    (float64 for float64 inputs). ``causal`` is never set: the block mask holds the whole region.

    Where Triton finds no configuration that fits the GPU's shared memory (an H200 with the segmented masks of
    ReRoPE, Self-Extend and DCA: 528 KB asked, 227 KB there), the call is compiled again with each of
    :data:`SMALLER_TILES` in turn; the kernel variant keeps the tiles that worked, other variants keep theirs."""
    kwargs = {"block_mask": mask, "scale": scaling, "enable_gqa": q.shape[1] != k.shape[1]}
    variant = _variant(q, mask)
    while True:
        taken = _tiles_taken.get(variant, 0)
        try:
            out, lse = compat.flex_attention_with_lse(
                _function(q.device.type),
                _flex_module,
                q,
                k,
                v,
                kernel_options=SMALLER_TILES[taken - 1] if taken else None,
                **kwargs,
            )
            break
        except Exception as error:
            if taken == len(SMALLER_TILES) or "out of resource" not in str(error):
                raise
            _tiles_taken[variant] = taken + 1
    return out.to(compute_dtype(q.dtype)), lse.to(compute_dtype(q.dtype))


SMALLER_TILES = (
    {"num_stages": 1},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1},
    {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1},
)
"""FlexAttention's ``kernel_options`` tried in turn when the default tiles need more shared memory than the GPU has
(fewer pipeline stages first: on an H200, 64 x 64 tiles made plain causal attention 1.6x slower than the default)."""
_tiles_taken: dict[tuple, int] = {}  # kernel variant (see _variant) -> how many of SMALLER_TILES it had to step through


def _variant(q: torch.Tensor, mask) -> tuple:
    """What decides a compiled kernel's shared memory: dtype, head size, the mask's code and what it reads (whether
    padding and key spans are there, the segments' table by its shape; per-token tensors not by their length)."""
    mod = mask.mask_mod

    def described(x):
        if isinstance(x, torch.Tensor):
            return tuple(x.shape) if x.numel() <= 64 else (x.dtype, x.dim())
        return None if x is None else type(x).__name__

    return (
        q.device.type,
        q.dtype,
        q.shape[-1],
        mod.__code__,
        tuple(described(cell.cell_contents) for cell in mod.__closure__ or ()),
    )


RECOMPILE_LIMIT = 64
"""Compiled variants of ``flex_attention`` allowed per process (PyTorch's default, 8, is spent by a few methods at
a few lengths; past it PyTorch falls back to the eager version, which holds the whole scores matrix)."""


@functools.cache
def _function(device_type: str):
    """Compiled ``flex_attention`` on CUDA; the eager one elsewhere (its warning about that, once, silenced)."""
    if device_type == "cuda":
        compiled = torch.compile(_flex_module.flex_attention)
        config = torch._dynamo.config

        def with_more_variants(*args, **kwargs):
            with config.patch(recompile_limit=max(RECOMPILE_LIMIT, config.recompile_limit)):
                return compiled(*args, **kwargs)

        return with_more_variants

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return _flex_module.flex_attention(*args, **kwargs)

    return eager


@dataclass(frozen=True, eq=False)
class OneLaunch:
    """Every cell in one FlexAttention launch: query segment ``a`` holds the query moved by ``queries[a]`` (``None``:
    the query as it is), key segment ``c`` the keys moved by ``keys[c] = (key shift, constant query shift)``, the
    query's constant shift moved onto the keys; ``mask`` gives each cell's pairs to its segments."""

    queries: list[Shift | None]
    keys: list[tuple[Shift, float]]
    mask: object  # a FlexAttention BlockMask


class Flex(TiledBackend):
    name = "flex"
    summary = "PyTorch's FlexAttention, each cell's pairs a block mask; prefill in one launch (compiled on CUDA)"
    differentiates_itself = True
    takes_wide_queries = True

    def unavailable(self, query) -> str | None:
        if not available(query.device):
            return (
                f"backend='flex' needs PyTorch's FlexAttention (torch >= 2.5, and Triton on CUDA); "
                f"not available on {query.device}"
            )
        return None

    def refuses(self, query, fusable, needs_grad) -> str | None:
        if needs_grad and query.device.type != "cuda":
            return (
                f"backend='flex' has no backward on {query.device.type} (PyTorch's FlexAttention has one on CUDA "
                "only): use backend='auto' or 'math' to compute gradients here"
            )
        return None

    def wants(self, query, fusable) -> bool:
        return query.device.type == "cuda" and query.shape[2] > SMALL_QUERY and available(query.device, for_auto=True)

    def compile_failed(self, error) -> bool:
        return compile_failed(error)

    def give_up(self, error) -> None:
        give_up(error)

    def block(self, q, k, v, mask, causal, scaling):
        return part_attention(q, k, v, mask, causal, scaling)

    def prepare(self, cells: tuple[Cell, ...], call: Call):
        """Prefill without per-head pairs: :class:`OneLaunch`. Otherwise one block per cell, its block mask over
        every key (FlexAttention masks the padding itself)."""
        if call.q_len > SMALL_QUERY and all(cell.part.pairs is None for cell in cells):
            return self.one_launch(cells, call)
        return [self.plan(cell, call, 0) for cell in cells]

    def plan(self, cell: Cell, call: Call, padded: int) -> list[Block]:
        span = cell.span(call.q_positions)
        region = Region(
            cell.lo, cell.hi, call.offset, call.key_padding, None if span is None else (*span, call.positions)
        )
        mask = region.block_mask(call.batch, call.q_len, call.kv_len, call.query.device)
        return [Block(slice(0, call.q_len), slice(0, call.kv_len), mask)]

    def one_launch(self, cells: tuple[Cell, ...], call: Call) -> OneLaunch:
        """A cell whose query shift is a constant moves its keys instead (RoPE's rotations add: ``(i + s_q) - (j + s_k)
        = i - (j + s_k - s_q)``), so cells that move by constants share the plain queries and meet in one softmax, no
        merge: STRING is the query against ``[K | K_far]``, ``K_far`` turned by ``S - W``, V used twice. A cell whose
        query shift depends on the position (ReRoPE, Self-Extend, DCA) has its own query segment against its keys'
        segment; a query segment's rows are a softmax of their own, merged with the others' by log-sum-exp."""
        queries, keys, regions = [], [], []
        for cell in cells:
            query: Shift | None = None
            if callable(cell.query_shift):  # a moving query: its own segment
                query, key = cell.query_shift, (cell.key_shift, 0.0)
            else:
                key = (cell.key_shift, float(cell.query_shift))
            queries += [] if query in queries else [query]
            keys += [] if key in keys else [key]
            span = cell.span(call.q_positions)
            region = Region(
                cell.lo, cell.hi, call.offset, call.key_padding, None if span is None else (*span, call.positions)
            )
            regions.append((queries.index(query), keys.index(key), region))
        mask = segmented_block_mask(regions, len(queries), len(keys), call.q_len, call.kv_len, call.query.device)
        return OneLaunch(queries, keys, mask)

    def keep(self, prepared) -> bool:
        return True if isinstance(prepared, OneLaunch) else super().keep(prepared)

    def run(self, prepared, cells: tuple[Cell, ...], call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(prepared, OneLaunch):
            return super().run(prepared, cells, call)
        q_positions, positions, inv_freq = call.q_positions, call.positions, call.inv_freq
        queries = [
            call.query
            if shift is None
            else shifted(call.query, shift, q_positions, inv_freq, None, angles(call, "query", shift, q_positions))
            for shift in prepared.queries
        ]
        keys = []  # [B, Hkv, Lkv, D] each
        for key_shift, query_constant in prepared.keys:
            moved = shifted_keys(
                call.key, key_shift, positions, inv_freq, None, angles(call, "key", key_shift, positions)
            )
            # a constant shift: the positions go unread
            keys.append(shifted(moved, -query_constant, positions, inv_freq) if query_constant else moved)
        q_segment, kv_segment = segment_length(call.q_len), segment_length(call.kv_len)
        side_queries = _side_by_side(queries, q_segment)  # [B, Hq, segments * s_q, D]
        side_keys = _side_by_side(keys, kv_segment)  # [B, Hkv, segments * s_k, D]
        side_values = _side_by_side([call.value] * len(keys), kv_segment)
        out, lse = part_attention(side_queries, side_keys, side_values, prepared.mask, False, call.scaling)
        merged, merged_lse = out[:, :, : call.q_len], lse[:, :, : call.q_len]  # [B, Hq, Lq, Dv], [B, Hq, Lq]
        for index in range(1, len(queries)):
            rows = slice(index * q_segment, index * q_segment + call.q_len)
            merged, merged_lse = merge(merged, merged_lse, out[:, :, rows], lse[:, :, rows])
        accumulate = compute_dtype(call.query.dtype)
        return merged.to(accumulate), merged_lse.to(accumulate)


def _side_by_side(tensors: list[torch.Tensor], segment: int) -> torch.Tensor:
    """``[B, H, L, D]`` tensors along dimension 2, each in a segment of ``segment`` positions (zeros after it)."""
    if len(tensors) == 1 and tensors[0].shape[2] == segment:
        return tensors[0]
    first = tensors[0]
    out = first.new_zeros(first.shape[0], first.shape[1], len(tensors) * segment, first.shape[-1])
    for index, tensor in enumerate(tensors):
        out[:, :, index * segment : index * segment + tensor.shape[2]] = tensor
    return out


BACKEND = Flex()
