"""What one forward pass computes from positions alone, built once and shared by every layer.

Every attention layer of a forward pass meets the same keys at the same positions: the calls that
cover each part (:mod:`.plan`), FlexAttention's block masks, the angles of per-token shifts and the
padded key prefix depend on those positions, never on the layer's q, k and v. A :class:`Memo` kept
for one pass (the transformers integration keeps one per attention mask) builds each once; a layer
that finds an entry reuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

MAX_HELD_MASK_ELEMENTS = 1 << 26
"""A plan whose additive masks hold more elements than this (256 MiB in float32) is rebuilt per layer, not held."""


class Memo:
    """Entries keyed by a kind, the objects they were built from (parts, shifts, ``inv_freq``: held here,
    so an id is never reused while the memo lives) and plain values (lengths, dtypes)."""

    def __init__(self) -> None:
        self.entries: dict[tuple, object] = {}
        self.held: list[Sequence[object]] = []

    def get(
        self,
        kind: str,
        objects: Sequence[object],
        values: Hashable,
        build: Callable[[], object],
        keep: Callable[[object], bool] = lambda entry: True,
    ):
        """The entry for ``(kind, objects, values)``, built by ``build()`` the first time (and held if
        ``keep(entry)``)."""
        key = (kind, tuple(map(id, objects)), values)
        if key in self.entries:
            return self.entries[key]
        entry = build()
        if keep(entry):
            self.entries[key] = entry
            self.held.append(tuple(objects))
        return entry
