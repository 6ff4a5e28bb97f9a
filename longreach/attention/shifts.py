"""The queries and keys each part sees: RoPE-rotated inputs moved by the part's shifts.

RoPE rotations add (Su et al. 2021, Eq. 34), so a query already rotated at ``i`` and moved by ``delta``
sits at ``i + delta``. A shift is a constant or a function of positions (Self-Extend, DCA); with
``pairs`` only some rotary pairs move (DPE). Per-token key angles are kept across layers and decoding
steps (:data:`KEY_ROTATIONS`).
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .parts import Part
from .rotary import apply_rotation, compute_dtype, rotate, rotation

MAX_FOLDED_BLOCKS = 64  # decoding: at most this many per-chunk parts replace a per-token key shift


def prepare(query, key, inv_freq, scaling, logit_scale, positions):
    """Default scale and positions, the logit scale on the query's rotary dims.

    Keys stay at their own head count: each part shifts them once per KV head, then expands.
    """
    scaling = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else scaling
    if isinstance(logit_scale, torch.Tensor) or logit_scale != 1.0:
        rotary_dims = 2 * inv_freq.shape[-1]
        factor = per_sequence(logit_scale, query.dtype, query.device)
        query = torch.cat((query[..., :rotary_dims] * factor, query[..., rotary_dims:]), dim=-1)
    if positions is None:
        positions = torch.arange(key.shape[2], device=query.device).expand(query.shape[0], -1)
    return query, key, scaling, positions


def per_sequence(value: float | torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """A number, or one value per sequence ``[B]`` shaped ``[B, 1, 1, 1]`` to broadcast over heads and positions."""
    value = torch.as_tensor(value, dtype=dtype, device=device)
    return value.view(-1, 1, 1, 1) if value.dim() else value


def shifted(
    x: torch.Tensor,
    shift,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    pairs: torch.Tensor | None = None,
    angles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x`` moved by a constant shift, or by ``shift(positions)`` per token (``[B, L]`` -> ``[B, 1, L]``;
    ``angles``: its ``(cos, sin)`` when already computed, see :func:`shift_angles` and :func:`.rotary.rotation`); with
    ``pairs`` (``[query heads, rotary pairs]``), only the marked pairs of each head move."""
    if angles is not None:
        moved = apply_rotation(x, *angles)
    elif callable(shift):
        moved = apply_rotation(x, *shift_angles(shift, positions, inv_freq, compute_dtype(x.dtype)))
    else:
        moved = rotate(x, shift, inv_freq) if shift else x
    return moved if pairs is None else torch.where(_pair_dims(pairs, x.shape[1], x.shape[-1], x.device), moved, x)


def shift_angles(
    shift, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[B, 1, L, D_rot / 2]`` of a per-token shift at ``positions [B, L]``; the shift is
    evaluated in float64, so that fractional shifts (Leaky ReRoPE) of large positions keep their precision.
    A shift per group of rotary pairs (``[B, L, G]``) gives each pair its group's angle."""
    values = shift(positions.to(torch.float64))
    if values.dim() == 2:
        return rotation(values[:, None, :], inv_freq, dtype, positions.device)
    pairs = inv_freq.shape[-1]
    if pairs % values.shape[-1]:
        raise ValueError(f"a shift with {values.shape[-1]} frequency groups cannot split {pairs} rotary pairs evenly")
    values = values.repeat_interleave(pairs // values.shape[-1], dim=-1)[:, None]  # [B, 1, L, P]
    angle = values * inv_freq.to(device=positions.device, dtype=torch.float64)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _pair_dims(pairs: torch.Tensor, heads: int, dim: int, device) -> torch.Tensor:
    """The dimensions ``[1, heads, 1, dim]`` of the rotary pairs marked in ``pairs [query heads, P]``
    (both halves of each pair; never the dimensions without rotation). With fewer ``heads`` than query
    heads (a key/value head serves a group whose marks agree), each group's first row is used."""
    marks = pairs[:: pairs.shape[0] // heads].to(device)
    rest = torch.zeros(heads, dim - 2 * marks.shape[-1], dtype=torch.bool, device=device)
    return torch.cat((marks, marks, rest), dim=-1)[None, :, None, :]


def pairs_split_groups(parts: Sequence[Part], kv_heads: int, q_heads: int) -> bool:
    """Whether some part moves different pairs in query heads that share a key/value head (DPE's per-head pairs)."""
    for part in parts:
        if part.pairs is not None:
            if part.pairs.shape[0] != q_heads:
                raise ValueError(
                    f"a part's pairs mark {part.pairs.shape[0]} heads; the model has {q_heads} query heads"
                )
            groups = part.pairs.view(kv_heads, q_heads // kv_heads, -1)
            if not bool((groups == groups[:, :1]).all()):
                return True
    return False


def augmented(query, key, part: Part, q_positions, positions, inv_freq) -> tuple[torch.Tensor, torch.Tensor]:
    """Query heads with their own pairs against shared key/value heads, without repeating the keys.

    Each query head's score is ``q_sel . k_moved + q_rest . k``: its marked pairs against the moved keys,
    the rest against the keys as they are. Side by side, that is one dot product of ``[q_sel, q_rest]``
    (``[B, Hq, Lq, 2D]``) with ``[k_moved, k]`` (``[B, Hkv, L, 2D]``, still one per key/value head): exact,
    and for a decoding step far less traffic than keys and values repeated per query head. The value
    keeps its dimension, so these blocks run on the math backend (see :func:`block_for`).
    """
    moved_q = shifted(query, part.query_shift, q_positions, inv_freq)
    moved_k = shifted_keys(key, part.key_shift, positions, inv_freq)
    assert part.pairs is not None  # augmented: for a part with per-head pairs only
    dims = _pair_dims(part.pairs, query.shape[1], query.shape[-1], query.device)
    q = torch.cat((moved_q.masked_fill(~dims, 0.0), query.masked_fill(dims, 0.0)), dim=-1)
    return q, torch.cat((moved_k, key), dim=-1)


def shifted_keys(
    key: torch.Tensor,
    shift,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    pairs: torch.Tensor | None = None,
    angles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`shifted` for keys, with the angles of a per-token shift taken from :data:`KEY_ROTATIONS`."""
    if callable(shift) and angles is None:
        angles = KEY_ROTATIONS.get(shift, positions, inv_freq, compute_dtype(key.dtype))
    return shifted(key, shift, positions, inv_freq, pairs, angles)


class KeyRotations:
    """The ``(cos, sin)`` of per-token key shifts (ReRoPE, Self-Extend, DCA), kept across layers and decoding steps.

    Every layer of a forward pass moves the same key positions by the same shift, and a decoding step
    adds one position: the angles are computed once per pass, and a step computes only the new ones.
    An entry is used only for the same shift object, equal ``inv_freq`` and equal leading positions
    (checked on every call, O(n)); shifts act on each position on its own, as every method's do.
    """

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: OrderedDict[int, tuple] = OrderedDict()

    def get(
        self, shift, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, 1, Lkv, D_rot / 2]`` for keys at ``positions [B, Lkv]``."""
        entry = self.entries.get(id(shift))
        if entry is not None and self._extends(entry, shift, positions, inv_freq, dtype):
            _, known, _, cos, sin = entry
            if known.shape[1] == positions.shape[1]:
                self.entries.move_to_end(id(shift))
                return cos, sin
            new_cos, new_sin = shift_angles(shift, positions[:, known.shape[1] :], inv_freq, dtype)
            cos, sin = torch.cat((cos, new_cos), dim=-2), torch.cat((sin, new_sin), dim=-2)
        else:
            cos, sin = shift_angles(shift, positions, inv_freq, dtype)
        self.entries[id(shift)] = (shift, positions.clone(), inv_freq.detach().clone(), cos, sin)
        self.entries.move_to_end(id(shift))
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return cos, sin

    @staticmethod
    def _extends(entry, shift, positions, inv_freq, dtype) -> bool:
        held_shift, known, held_inv_freq, cos, _ = entry
        return (
            held_shift is shift
            and cos.dtype == dtype
            and known.device == positions.device
            and known.shape[0] == positions.shape[0]
            and known.shape[1] <= positions.shape[1]
            and held_inv_freq.shape == inv_freq.shape
            and torch.equal(held_inv_freq, inv_freq.to(held_inv_freq.device))
            and torch.equal(known, positions[:, : known.shape[1]])
        )


KEY_ROTATIONS = KeyRotations()


class MovedKeys:
    """One attention layer's keys moved by each per-token key shift (ReRoPE, Self-Extend, DCA's prefill), kept across
    decoding steps: a step moves its new keys only, instead of every cached key (opt-in:
    ``apply(..., keep_moved_keys=True)``).

    Costs one more copy of the keys per shift (ReRoPE, Self-Extend: +50% of the key/value cache), with room
    for 1,024 more keys before it grows. Kept keys are used only where the cache provably still holds what they
    were moved from: before the layer's forward, :meth:`vouch` is shown the key tensor the cache holds for the
    layer (by a forward pre-hook, :mod:`longreach.integrations.kept_keys`), and trusts it only when it is the very
    tensor the layer received at its last call, unchanged since by its in-place version counter; the call must then
    add exactly its own queries' keys after the kept ones. An appended cache passes. Another conversation's cache, a
    cropped, reordered, reset or rewritten one makes a new tensor or bumps its version, and every key is moved again.
    So do the same shift, ``inv_freq``, batch, dtype, device and leading positions checked on every call.
    """

    ROOM = 1024

    def __init__(self) -> None:
        self.entries: dict[int, tuple] = {}
        self.received: tuple | None = (
            None  # (weak reference to the key tensor of the layer's last call, its version then)
        )
        self.vouched = False  # before a call: the cache holds ``received``, unchanged
        self.extending = 0  # during a call: the keys it adds after the kept ones (0: none are trusted)

    def __deepcopy__(self, memo_of_copy) -> MovedKeys:
        return MovedKeys()  # a copied model keeps nothing: its cache is another one

    def vouch(self, cached_key: torch.Tensor | None) -> None:
        """Before the layer's forward: ``cached_key`` is what the cache holds for the layer (``None``: unknown)."""
        held = self.received
        self.vouched = (
            held is not None and cached_key is not None and held[0]() is cached_key and cached_key._version == held[1]
        )

    def begin(self, key: torch.Tensor, new_keys: int) -> None:
        """A call of the layer: ``key`` as the cache handed it over, whose last ``new_keys`` are the call's own."""
        self.extending = new_keys if self.vouched else 0
        self.vouched = False
        self.received = (weakref.ref(key), key._version)

    def get(self, shift, key: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """``key [B, H, Lkv, D]`` moved by ``shift`` at ``positions [B, Lkv]``."""
        length = key.shape[2]
        entry = self.entries.get(id(shift))
        if entry is not None and self._extends(entry, shift, key, positions, inv_freq, length - self.extending):
            _, known, _, moved = entry
            kept = known.shape[1]
            if length > moved.shape[2]:
                moved = torch.cat(
                    (moved[:, :, :kept], moved.new_empty(*moved.shape[:2], length - kept + self.ROOM, moved.shape[-1])),
                    dim=2,
                )
            moved[:, :, kept:length] = shifted_keys(key[:, :, kept:], shift, positions[:, kept:], inv_freq)
        else:
            moved = key.new_empty(*key.shape[:2], length + self.ROOM, key.shape[-1])
            moved[:, :, :length] = shifted_keys(key, shift, positions, inv_freq)
        self.entries[id(shift)] = (shift, positions.clone(), inv_freq.detach().clone(), moved)
        return moved[:, :, :length]

    def _extends(self, entry, shift, key, positions, inv_freq, trusted: int) -> bool:
        """Whether ``entry`` holds the first ``trusted`` keys of this call, moved by ``shift``."""
        held_shift, known, held_inv_freq, moved = entry
        kept = known.shape[1]
        return (
            self.extending > 0
            and kept == trusted
            and held_shift is shift
            and moved.dtype == key.dtype
            and moved.device == key.device
            and moved.shape[:2] == key.shape[:2]
            and moved.shape[-1] == key.shape[-1]
            and held_inv_freq.shape == inv_freq.shape
            and torch.equal(held_inv_freq, inv_freq.to(held_inv_freq.device))
            and torch.equal(known, positions[:, :kept])
        )


def fold_block_key_shifts(parts: Sequence[Part], positions: torch.Tensor) -> list[Part]:
    """Decoding: a part whose key shift is constant on aligned blocks of key positions (DCA's chunks)
    becomes one part per block, the block's shift moved to the query side.

    Keys of a block all sit at ``j + sigma``, so ``(i + s_q(i)) - (j + sigma) = (i + s_q(i) - sigma) - j``:
    the query turns by ``-sigma`` and the cached keys are used as they are. A decoding step then
    rotates one query per block instead of all ``n`` cached keys.
    """
    if all(part.key_shift_block is None for part in parts):
        return list(parts)
    lowest, highest = int(positions.min()), int(positions.max())
    folded = []
    for part in parts:
        size = part.key_shift_block
        starts = range(lowest // size * size, highest + 1, size) if size is not None else range(0)
        if size is None or not starts or len(starts) > MAX_FOLDED_BLOCKS:  # tiny chunks: rotating the keys is cheaper
            folded.append(part)
            continue
        key_shift = part.key_shift
        assert callable(key_shift)  # constant on blocks: a function of the positions (DCA's)
        for start in starts:
            sigma = float(key_shift(torch.tensor([start], dtype=torch.float64))[0])
            folded.append(
                Part(
                    part.min_distance,
                    part.max_distance,
                    query_shift=_minus(part.query_shift, sigma),
                    key_span=_within(part.key_span, start, start + size),
                    pairs=part.pairs,
                )
            )
    return folded


def _minus(shift, sigma: float):
    """The shift ``shift - sigma`` (a constant, or a function of positions)."""
    return (lambda p: shift(p) - sigma) if callable(shift) else shift - sigma


def _within(key_span, first: int, stop: int):
    """``key_span`` cut to the key positions ``[first, stop)`` (``None``: every key position)."""

    def span(p):
        if key_span is None:
            return torch.full_like(p, first), torch.full_like(p, stop)
        lo, hi = key_span(p)
        return lo.clamp(min=first), hi.clamp(max=stop)

    return span
