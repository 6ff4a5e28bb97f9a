"""What :func:`longreach.apply` did to one model (:class:`Applied`), and each attention layer's share of it
(:class:`AppliedLayer`): held on the model and its attention modules, read by the attention function on every call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from ..attention.layout import Layout
from ..attention.rotary import inverse_frequencies
from ..attention.shifts import MovedKeys
from ..methods import drop as drops
from ..methods.base import PositionMethod
from ..methods.rope import Rope
from ..methods.scaling import Scaling
from .passes import Passes


@dataclass
class Applied:
    """What ``apply`` did to one model; everything ``remove`` needs to undo it (no closures: deep-copyable)."""

    method: PositionMethod
    previous: str
    window: int
    rotary: nn.Module
    layouts: dict[int, Layout]
    backend: str = "auto"
    scaling: Scaling | None = None
    drop: drops.Drop | drops.DynamicDrop | None = None
    replaced_rotary: nn.Module | None = None  # the model's own rotary module, when a frequency method replaced it
    replaced_rope_parameters: dict | None = None
    keep_moved_keys: bool = False
    passes: Passes = dataclasses.field(default_factory=lambda: Passes(), repr=False, compare=False)
    kept_keys: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)  # layer -> MovedKeys

    def kept_keys_of(self, layer: int | None) -> MovedKeys | None:
        """Layer ``layer``'s moved keys kept across decoding steps, with ``keep_moved_keys`` (else None)."""
        if not self.keep_moved_keys:
            return None
        return self.kept_keys.setdefault(layer, MovedKeys())

    def layer(self, index: int | None) -> AppliedLayer:
        """Attention layer ``index``'s share of what is applied: its layout, and what it runs."""
        layer = self.passes.layers.get(index)
        if layer is None:
            if index not in self.layouts:
                raise ValueError(
                    f"attention layer {index} had no rotary layout when the method was applied; apply it again"
                )
            layer = self.passes.layers.setdefault(index, AppliedLayer(self, index, self.layouts[index]))
        return layer

    def layer_parts(self, layer: int | None) -> tuple:
        """The method's parts of attention layer ``layer``, made once per ``apply`` and shared by every layer unless
        they differ by layer (their identity keys each pass's memo)."""
        held = layer if self.method.parts_differ_by_layer else None
        if held not in self.passes.parts:
            self.passes.parts[held] = self.method.layer_parts(layer)
        return self.passes.parts[held]

    def describe(self) -> str:
        extras = [x.describe() for x in (self.scaling, self.drop) if x is not None]
        return " + ".join([self.method.describe(), *extras]) + f" [L={self.window}]"

    def record(self) -> dict:
        """The JSON-able description saved in the model's config: enough for :func:`longreach.load` to re-apply.

        The method, not the device choice: the backend is chosen again where the model is loaded. Whatever
        the method reads from a file (DPE's selected pairs) is stored in the record itself."""
        scaling = None if self.scaling is None else {"rope_type": self.scaling.name, **self.scaling.params}
        drop = None if self.drop is None else {"method": self.drop.name, **_jsonable(dataclasses.asdict(self.drop))}
        return {
            "method": self.method.name,
            "params": _jsonable(self.method.saved_params()),
            "training_window": self.window,
            "scaling": scaling,
            "drop": drop,
            "replaced_rope_parameters": self.replaced_rope_parameters,
        }


@dataclass
class AppliedLayer:
    """One attention layer of an applied model: its :class:`~longreach.attention.layout.Layout`, and what it runs.
    A layer without RoPE runs causal attention as the model's own does, under every method: nothing positional to
    change, no logit factor, no drop."""

    applied: Applied
    index: int | None
    layout: Layout

    @property
    def method(self) -> PositionMethod:
        return self.applied.method if self.layout.rotated else Rope(self.applied.window)

    def parts(self) -> tuple:
        if self.layout.rotated:
            return self.applied.layer_parts(self.index)
        parts = self.applied.passes.parts
        if "no rope" not in parts:
            parts["no rope"] = Rope(self.applied.window).parts()
        return parts["no rope"]

    def frequencies(self):
        """The layer's ``inv_freq``, read at call time (dynamic NTK changes it during a forward pass)."""
        return inverse_frequencies(self.applied.rotary, self.layout.layer_type)

    def attention_scaling(self) -> float:
        """The factor on cos and sin of the layer's frequencies (YaRN's, LongRoPE's; 1.0 without one)."""
        rotary, layer_type = self.applied.rotary, self.layout.layer_type
        per_type = getattr(rotary, f"{layer_type}_attention_scaling", None) if layer_type else None
        return per_type if per_type else getattr(rotary, "attention_scaling", 1.0)


def _jsonable(values: dict) -> dict:
    """Tuples as lists, for the config's JSON."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
