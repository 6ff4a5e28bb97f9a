"""Method specs (:class:`~longreach.methods.spec.MethodSpec`) on a model: apply one, or check every one before the
weights load."""

from __future__ import annotations

from ..methods.spec import MethodSpec


def apply(model, spec: MethodSpec, training_window: int, **options) -> None:
    """Apply ``spec`` to ``model`` with ``L = training_window``, unless the spec names its own; ``options`` are
    :func:`longreach.apply`'s own (``backend``, ``keep_moved_keys``)."""
    from ..integrations.transformers import apply as apply_method

    method, kwargs = spec.arguments(training_window)
    apply_method(model, method, **{"training_window": training_window, **kwargs}, **options)


def check(methods: list[MethodSpec], config, training_window: int | None = None) -> dict[str, str]:
    """Apply each method to an empty (meta) model built from ``config``: every ``--method`` is checked, parameters and
    ranges included, before any weights load. Returns each label's method as resolved (every parameter and ``L``)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from ..integrations.transformers import describe
    from ..integrations.transformers import training_window as window_of

    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    window = training_window or window_of(config)
    resolved = {}
    for spec in methods:
        apply(empty, spec, window)
        resolved[spec.label] = describe(empty)
    return resolved
