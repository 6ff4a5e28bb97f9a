"""lm-evaluation-harness with a longreach method applied (tested with lm-eval 0.4.13).

:class:`LongreachLM` is lm-eval's Hugging Face model (``HFLM``) that applies a method right after
loading, so every request type -- ``generate_until``, ``loglikelihood``, ``loglikelihood_rolling`` --
runs batched and padded through longreach's attention::

    import lm_eval
    from longreach.lm_eval import LongreachLM

    lm = LongreachLM(pretrained="path/to/model", method="string", max_length=32768, batch_size=4)
    lm_eval.simple_evaluate(model=lm, tasks=["ruler"])

    python -m longreach.lm_eval --model_args pretrained=PATH,method=string,shift=1000 --tasks ruler ...

Every ``HFLM`` argument is accepted as it is. longreach adds ``method`` (default ``string``), the
method's own parameters by name (``shift``, ``local_window``, ``group_size``, ...), ``training_window``,
``scaling`` (a frequency method to compose, e.g. ``yarn``, with its parameters such as ``factor``),
``drop`` (``drop`` or ``dynamic_drop``, with theirs) and ``attention_backend`` (``longreach.apply``'s
``backend``; lm-eval's own ``backend`` keeps its meaning). Weights load from safetensors only unless
a ``gguf_file`` is given; ``trust_remote_code`` stays off unless asked for.
"""

from __future__ import annotations

import torch

from ..integrations.transformers import apply
from ..methods import available
from ..methods.spec import parse_value

INSTALL = 'pip install "lm_eval>=0.4.13,<0.5" (or, in a clone of longreach: pip install -e ".[lm-eval]")'

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as missing:
    raise ImportError(f"lm-evaluation-harness is not installed ({missing.name} is missing); run: {INSTALL}") from None

PARAMETERS = {row["name"]: set(row["parameters"]) for row in available()}
"""Every method's parameter names: what ``LongreachLM`` takes out of lm-eval's model arguments."""


def _claim(name: str | None, role: str, arguments: dict) -> dict:
    """The parameters of method ``name`` taken out of ``arguments`` (the rest stays for ``HFLM``)."""
    if name is None:
        return {}
    if name not in PARAMETERS:
        raise ValueError(f"{role}={name!r} is not a longreach method; choose from: {', '.join(PARAMETERS)}")
    # lm-eval hands strings on: read them as the command line does (lists with ';', none)
    return {
        key: parse_value(value) if isinstance(value := arguments.pop(key), str) else value
        for key in sorted(PARAMETERS[name] & set(arguments))
    }


@register_model("longreach")
class LongreachLM(HFLM):
    """lm-eval's ``HFLM`` with a longreach method applied after loading.

    Every request type (``generate_until``, ``loglikelihood``, ``loglikelihood_rolling``) runs batched
    and padded through longreach's attention. Weights load from safetensors only unless a ``gguf_file``
    is given; ``trust_remote_code`` stays off unless asked for.

    Args:
        pretrained: as ``HFLM``'s: a path or a hub id.
        method: the method to apply (``longreach.available()``).
        training_window: ``L``; default the config's ``max_position_embeddings``.
        scaling: a frequency method to compose (e.g. ``yarn``); its parameters (e.g. ``factor``) go in
            ``kwargs``.
        drop: ``drop`` or ``dynamic_drop``; their parameters go in ``kwargs``.
        attention_backend: ``longreach.apply``'s ``backend`` (lm-eval's own ``backend`` keeps its meaning).
        **kwargs: every ``HFLM`` argument, and the method's own parameters by name (``shift``, ...).

    Raises:
        ValueError: an unknown method or parameter; a batch size above 1 with dynamic NTK.

    Example:
        ```python
        lm = LongreachLM(pretrained="path/to/model", method="string", max_length=32768, batch_size=4)
        lm_eval.simple_evaluate(model=lm, tasks=["ruler"])
        ```
    """

    def __init__(
        self,
        pretrained,
        method: str = "string",
        training_window: int | None = None,
        scaling: str | None = None,
        drop: str | None = None,
        attention_backend: str = "auto",
        **kwargs,
    ) -> None:
        params = _claim(method, "method", kwargs)
        frequency = _claim(scaling, "scaling", kwargs)
        dropping = _claim(drop, "drop", kwargs)
        self.longreach = dict(
            method=method,
            training_window=training_window,
            backend=attention_backend,
            scaling=None if scaling is None else {"rope_type": scaling, **frequency},
            drop=None if drop is None else {"method": drop, **dropping},
            **params,
        )
        if "dynamic" in (method, scaling) and str(kwargs.get("batch_size", 1)) != "1":
            raise ValueError(
                f"batch_size={kwargs['batch_size']!r} with dynamic NTK: its frequencies follow the longest "
                "sequence of each forward, so a request's score would depend on its batch; use batch_size=1"
            )
        if isinstance(pretrained, str) and kwargs.get("gguf_file") is None:
            kwargs.setdefault("use_safetensors", True)
        super().__init__(pretrained, **kwargs)
        apply(self.model, **self.longreach)

    def _create_model(self, pretrained, *args, **kwargs) -> None:
        """Check the method on an empty (meta) copy of the model first: a typo fails in a second, not after loading."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            empty = AutoModelForCausalLM.from_config(self._config)
        apply(empty, **self.longreach)
        super()._create_model(pretrained, *args, **kwargs)


__all__ = ["LongreachLM"]
