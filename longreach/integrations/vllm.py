"""longreach in vLLM: a general plugin, no fork. A model whose config carries a ``longreach`` record runs its method.

The entry point (``vllm.general_plugins``, pyproject.toml) is :func:`register`, which vLLM calls in its main, engine
and worker processes: on the vLLM releases the plugin is tested with (:data:`TESTED`) it puts :mod:`.vllm_cpu`'s
backend in place of vLLM's CPU attention backend (on the CPU the platform always takes ``CPU_ATTN``) and
:mod:`.vllm_cuda`'s in place of FlashAttention's, and builds the CPU kernel in the main process (:func:`prepare`);
on any other it warns once and leaves vLLM as it is. A model without a record gets vLLM's own implementation class.
A record comes from :func:`overrides` (``LLM(model, hf_overrides=longreach.integrations.vllm.overrides("string"))``,
or the same JSON for ``vllm serve --hf-overrides``)
or from a model folder saved after ``longreach.apply``, whose config holds it already
(:meth:`.applied.Applied.record`). A record given as JSON (``vllm serve``) is checked where the
engine starts; one from :func:`overrides` in the main process, against the model's config, before any engine.

A position method runs over the model's own RoPE, plain or scaled by Llama 3's, linear, YaRN or LongRoPE scaling
(:data:`OWN_SCALING`), one for the model or one per layer type (Gemma 3's full and sliding-window layers): its queries
and keys are moved by the frequencies vLLM's own rotary embedding turned them by
(:func:`.vllm_layer.inverse_frequencies`), as the transformers path moves them by the model's; on a sliding-window
layer, the parts within the window. A frequency method (PI, NTK, YaRN, llama3), alone or as ``scaling=``, is the
model's ``rope_parameters``, written as in the transformers path (:meth:`.methods.scaling.Scaling.rope_parameters`):
vLLM's own rotary embedding computes it. A drop method, alone or as ``drop=``, runs in the layers it names. Qwen2.5-1M's
``dual_chunk_attention_config`` becomes longreach's DCA (:func:`_over_own_dual_chunk`). Refused in one line: Dynamic
NTK (vLLM fixes its factor at the window; longreach grows it per forward), a frequency method over the model's own
scaling, a model whose RoPE scaling is of another type or set for other layer types, capped logits, MLA, M-RoPE, a
family :mod:`.families` does not verify (:func:`model_problem`), an untested vLLM release, and in the engine an fp8 KV
cache or context parallelism (:mod:`.vllm_layer`, which also reads each layer's rotary layout: layers without RoPE run
vLLM's own attention, interleaved pairs are permuted into the kernels' order).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

from .. import methods
from ..methods.base import PositionMethod, require_int
from ..methods.dca import qwen_dual_chunk
from ..methods.drop import Drop, DynamicDrop, in_model
from . import rotary_embedding
from .transformers import CONFIG_KEY
from .vllm_record import (
    check_without_model,
    command_line_problem,
    plain,
    record_of,
    resolve,
    runs_attention,
    stray_record,
)

# The vLLM releases (major.minor) the plugin is tested with: 0.32 by make test-vllm (vllm-cpu: engines on the CPU),
# 0.33 by make test-vllm-033 (vLLM's CUDA build imported without a GPU: the plugin and the CUDA backend through an
# emulation of FlashAttention). What differs between them, in what the plugin uses: 0.33's FlashAttention backend may
# skip the cache write (.vllm_cuda says no); its CPU backend moved an import and checks KV cache dtypes.
TESTED = ("0.32", "0.33")
# a model's own RoPE scaling the position methods run over (Gemma 4's proportional: frequencies over the whole head,
# zero past its rotary fraction)
OWN_SCALING = ("llama3", "linear", "yarn", "longrope", "proportional")
LAYER_TYPES = ("full_attention", "sliding_attention")  # layer types a RoPE may be given for: a sliding window or not
DUAL_CHUNK = "dual_chunk_attention_config"  # Qwen2.5-1M's DCA in its config, which vLLM no longer runs
LOADED = "LONGREACH_VLLM_PLUGIN"  # the process id of the first process of a tree that loaded the plugin


class Overrides:
    """vLLM's ``hf_overrides`` for a longreach method: a callable, which vLLM calls on the model's config in the main
    process before any engine starts -- the record is checked against the model's own window there (one-line
    ``ValueError``) and set on the config. :attr:`json` is the same for ``vllm serve --hf-overrides``."""

    def __init__(self, record: dict, context: int | None = None):
        self.record, self.context = record, context

    @property
    def json(self) -> str:
        """``{"longreach": record}`` as JSON (a frequency method needs the model's own ``rope_parameters``: none), with
        ``max_position_embeddings`` raised to the context where one is given."""
        if self.record.get("scaling"):
            raise ValueError(
                f"scaling={self.record['scaling']!r} is the model's rope_parameters, which vllm serve --hf-overrides "
                'replaces whole: give them whole, \'{"rope_parameters": {"rope_theta": ..., "rope_type": ...}}\''
            )
        if self.context is None:
            return json.dumps({CONFIG_KEY: self.record})
        if self.record.get("training_window") is None:
            raise ValueError(
                f"context={self.context} for vllm serve: give training_window= too (the record cannot know the "
                "model's own window once max_position_embeddings is raised)"
            )
        return json.dumps({CONFIG_KEY: self.record, "max_position_embeddings": self.context})

    def __call__(self, hf_config):
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        if not hasattr(text, "max_position_embeddings"):  # vLLM also calls this on configs that are not the model's
            return hf_config
        problem = model_problem(text)
        ropes = layer_ropes(text)
        own = sorted({rope.get("rope_type", "default") for rope in ropes.values()} - {"default"})
        if problem is None and self.record.get("scaling") and (own or None not in ropes):
            problem = (
                f"{self.record['scaling']['rope_type']} over the model's own {', '.join(own) or 'per-layer-type'} "
                "scaling: a frequency method composed over another does not run in vLLM yet"
            )
        if problem is None and runs_attention(self.record) and (release := version_problem()):
            problem = f"{release}: its attention methods do not run on it"
        if problem:
            raise ValueError(problem)
        record = _over_own_dual_chunk(self.record, hf_config, text)
        if record.get("drop"):  # the default layers cut to the model's, given ones checked against them
            record = {**record, "drop": in_model(record["drop"], text.num_hidden_layers)}
        window = int(text.max_position_embeddings)
        method, frequency, _ = resolve(record, window)
        if frequency is not None:
            text.rope_parameters = frequency.rope_parameters(dict(text.rope_parameters), _rotary_dims(text))
        if runs_attention(record):  # L is the record's, or the model's window as it was
            method.check_model(text.num_hidden_layers, text.num_attention_heads, _rotary_pairs(hf_config))
            setattr(hf_config, CONFIG_KEY, {**record, "training_window": record["training_window"] or window})
        if self.context is not None and self.context > window:
            text.max_position_embeddings = self.context  # vLLM's rotary table covers every position the engine holds
        return hf_config

    def __repr__(self) -> str:
        context = "" if self.context is None else f", context={self.context}"
        return f"longreach.integrations.vllm.Overrides({json.dumps({CONFIG_KEY: self.record})}{context})"


def _over_own_dual_chunk(record: dict, hf_config, text) -> dict:
    """The record for a model whose config holds Qwen2.5-1M's ``dual_chunk_attention_config``, which this removes
    (vLLM 0.32 still builds its ``DualChunkRotaryEmbedding`` from it, whose attention backend it no longer has): DCA
    takes its chunk and local sizes and Qwen's temperature where the record sets none (:func:`.dca.qwen_dual_chunk`),
    and ``L`` is its ``original_max_position_embeddings`` for every method where the record gives none."""
    own = getattr(text, DUAL_CHUNK, None)
    for config in (hf_config, text):
        if hasattr(config, DUAL_CHUNK):
            delattr(config, DUAL_CHUNK)
    if not own:
        return record
    params, original = qwen_dual_chunk(own)
    if record["method"] == "dca":
        record = {**record, "params": {**params, **(record.get("params") or {})}}
    return {**record, "training_window": record.get("training_window") or original}


def overrides(
    method: str = "string",
    *,
    training_window: int | None = None,
    context: int | None = None,
    scaling: dict | None = None,
    drop: dict | None = None,
    **params,
) -> Overrides:
    """vLLM's ``hf_overrides`` that run ``method`` with ``params``: ``LLM(model, hf_overrides=overrides("string"))``.

    Args:
        method: a position method vLLM runs with longreach (``rope``, ``string``, ``rerope``, ``self_extend``,
            ``dca``, ``dpe``), a frequency method vLLM's rotary embedding computes (``pi``, ``ntk``, ``yarn``,
            ``llama3``), or a drop method (``drop``, ``dynamic_drop``), as for ``longreach.apply``.
        training_window: ``L``; default: the model's ``max_position_embeddings``.
        context: the longest sequence the engine is to hold (its ``max_model_len``) where that is past the model's
            window (ReRoPE, Self-Extend, DCA and the frequency methods reach past it): the config's
            ``max_position_embeddings`` is raised to it, so that vLLM's rotary embedding, whose table of angles it
            sizes, covers every position (``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` alone leaves positions past the table
            reading outside it), while ``L`` stays the model's own window or ``training_window``.
        scaling: a frequency method composed with the position method, as for ``longreach.apply``
            (``{"rope_type": "yarn", "factor": 2.0}``): vLLM's rotary embedding computes it, on a model whose own RoPE
            is plain.
        drop: a drop method composed with it, as for ``longreach.apply`` (``{"method": "dynamic_drop"}``).
        **params: the method's parameters, as for ``longreach.apply``.

    Returns:
        :class:`Overrides`, which puts the record :func:`method_of` reads on the model's config; checked now as far
        as the model is not needed (all of it with ``training_window``), and against the model when vLLM loads
        its config.

    Raises:
        ValueError: one line naming what vLLM cannot run, or the parameter, its value and what is allowed.
    """
    params, training_window, context = plain(params), plain(training_window), plain(context)
    for value, argument, example in ((scaling, "scaling", "{'rope_type': 'yarn', 'factor': 2.0}"),
                                     (drop, "drop", "{'method': 'dynamic_drop'}")):  # fmt: skip
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{argument}={value!r} must be a dict such as {example}")
    if training_window is not None:
        require_int("training_window", training_window, 2, None, "the model's L, a whole number of tokens >= 2")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
        raise ValueError(f"context={context!r} is out of range: a whole number of tokens >= 1 (vLLM's max_model_len)")
    if method == "dpe" and params.get("dimensions") is not None and not isinstance(params["dimensions"], dict):
        # DPE's selected pairs in the record itself, as a saved model keeps them: no file for the workers to read
        selected = methods.create("dpe", training_window=2, **params).saved_params()["dimensions"]
        params = {**params, "dimensions": selected}
    record = record_of(method, params, training_window, plain(scaling), plain(drop))
    check_without_model(record)
    record = json.loads(json.dumps(record))
    if runs_attention(record):
        prepare()
    return Overrides(record, context)


def _family_problem(model_type: str) -> str | None:
    """Why the family does not run longreach's methods in vLLM (one line), or None: a family :mod:`.families` refuses
    or has not classified, or one whose last dimensions rotate (multi-head latent attention, which vLLM attends by
    backends of its own). Interleaved pairs, partial rotary and layers without RoPE run
    (:meth:`.vllm_layer.LayerMethod.layout_in`)."""
    from . import families

    try:
        family = families.classify(model_type)
    except ValueError as refused:
        return str(refused)
    if family.last:
        return (
            f"{model_type}: its last dimensions rotate (multi-head latent attention), which vLLM attends by backends "
            "longreach does not replace yet (in transformers, it runs)"
        )
    return None


def model_problem(text_config) -> str | None:
    """Why a model cannot run a longreach method in vLLM (one line), or ``None``: every RoPE layout the backends do not
    read correctly is refused here (:func:`inverse_frequencies` reads the rotary embedding of a layer, plain or with
    a scaling of :data:`OWN_SCALING`, one for the model or one per layer type of :data:`LAYER_TYPES`), and every
    family :func:`_family_problem` refuses."""
    if getattr(text_config, "kv_lora_rank", None):
        return "kv_lora_rank: models with multi-head latent attention (MLA) do not run longreach methods in vLLM yet"
    ropes = layer_ropes(text_config)
    others = sorted(name for name in ropes if name is not None and name not in LAYER_TYPES)
    if others:
        return (
            f"rope_parameters of layer type {', '.join(others)}: longreach's methods in vLLM know the RoPE of "
            f"{' and '.join(LAYER_TYPES)} layers only"
        )
    for layer_type, rope in ropes.items():
        where = "rope_parameters" if layer_type is None else f"rope_parameters[{layer_type!r}]"
        if "mrope_section" in rope or rope.get("rope_type") == "mrope":
            return f"{where}.mrope_section: multimodal RoPE (M-RoPE) does not run longreach methods in vLLM yet"
        if rope.get("rope_type") == "dynamic":
            return (
                f"{where}.rope_type='dynamic': vLLM fixes a model's own dynamic NTK at its window, transformers grows "
                "it with each forward pass; longreach's methods run over neither in vLLM"
            )
        if rope.get("rope_type", "default") not in ("default", *OWN_SCALING):
            return (
                f"{where}.rope_type={rope['rope_type']!r}: longreach's methods run in vLLM over a model's own RoPE "
                f"scaling of type {', '.join(OWN_SCALING)} only, for now"
            )
        if rope.get("rope_type") == "linear" and isinstance(rope.get("factor"), list):
            return f"{where}.factor={rope['factor']}: linear scaling with several factors does not run in vLLM"
        if "rope_theta" not in rope and getattr(text_config, "rope_theta", None) is None:
            return f"{where} has no rope_theta: longreach's methods in vLLM read the RoPE base from it"
    return _family_problem(str(getattr(text_config, "model_type", None) or "a config without a model_type"))


def layer_ropes(text_config) -> dict[str | None, dict]:
    """The model's ``rope_parameters`` by layer type (Gemma 3: a base and a scaling of its own for its full and its
    sliding-window layers), or ``{None: rope_parameters}`` where one RoPE serves every layer."""
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    return {name: dict(value) for name, value in rotary_embedding.layer_ropes(rope).items()}  # copies vLLM may change


def _rotary_dims(text_config) -> int:
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    head = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return int(head * rope.get("partial_rotary_factor", getattr(text_config, "partial_rotary_factor", 1.0)))


def _rotary_pairs(hf_config) -> int:
    """The most rotary pairs a layer of the model has, read from its layouts as ``longreach.apply`` reads them (Gemma
    4's heads differ in size by layer type)."""
    from .families import config_layouts

    layouts = config_layouts(hf_config).values()
    return max((layout.dims // 2 for layout in layouts if layout.rotated), default=0)


def _window(hf_config) -> int:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(text.max_position_embeddings)


def methods_of(hf_config) -> tuple[PositionMethod, Drop | DynamicDrop | None] | None:
    """The position and drop methods a model's config records for its attention (``None``: the model's attention
    runs as in stock vLLM: no record, or one of a frequency method alone, which is the config's rope_parameters); a
    record whose fields stand at the config's top level is refused (it would run nothing, silently)."""
    record = getattr(hf_config, CONFIG_KEY, None)
    if record is None and (problem := stray_record(vars(hf_config))):
        raise ValueError(problem)
    if not record or not runs_attention(record):
        return None
    method, frequency, drop = resolve(record, _window(hf_config))
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if frequency is not None and dict(text.rope_parameters) == (record.get("replaced_rope_parameters") or {}):
        raise ValueError(
            f"scaling={record['scaling']!r}: the model's rope_parameters do not hold it (composed over the model's "
            "own scaling, saved by longreach.apply), and vLLM's rotary embedding cannot compute it"
        )
    return method, drop


def records_a_method() -> bool:
    """Whether the engine being built (vLLM's current config) runs a longreach method in its attention: a backend then
    hands its layers longreach's implementation, else vLLM's own class."""
    from vllm.config import get_current_vllm_config_or_none

    model = getattr(get_current_vllm_config_or_none(), "model_config", None)
    return model is not None and methods_of(model.hf_config) is not None


def tested(version: str) -> bool:
    """Whether ``version`` is a vLLM release the plugin is tested with (:data:`TESTED`: major and minor)."""
    return version.split(".")[:2] in [release.split(".") for release in TESTED]


def version_problem() -> str | None:
    """Why this vLLM does not run longreach's methods (a release the plugin is not tested with), or ``None``."""
    import vllm

    if tested(vllm.__version__):
        return None
    return f"vLLM {vllm.__version__} is not a release longreach's plugin is tested with ({', '.join(TESTED)})"


def prepare() -> None:
    """The CPU kernel built, or found, in this process, before any engine starts: vLLM's workers never build it (a
    build there, on one core beside vLLM's busy threads, outlasted vLLM's step timeout and killed the engine); one that
    finds none runs the method by the tiled path, with one warning. Nothing where vLLM is absent, is a release the
    plugin leaves alone, or does not run on the CPU."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return
    if version_problem() is None and current_platform.is_cpu():
        from ..attention.backends import cpu_fused

        cpu_fused.ensure_built()  # where it cannot be built: one warning here, and one in each worker


def register() -> None:
    """The ``vllm.general_plugins`` entry point, which vLLM calls in each of its processes: on a vLLM release the plugin
    is tested with (:data:`TESTED`), longreach's backends in place of ``CPU_ATTN`` (:mod:`.vllm_cpu`) and
    ``FLASH_ATTN`` (:mod:`.vllm_cuda`, not run on a GPU yet), each of which gives a model without a record vLLM's own
    implementation class; in the first process of a tree to load the plugin (vLLM's main process, before its engine
    and workers start; they inherit :data:`LOADED`), the CPU kernel built or found (:func:`prepare`: about 25 s the
    first time on a machine and environment, then an import). On any other release, one warning and vLLM left as it
    is. A ``vllm serve`` command line whose record cannot run ends the process with one line
    (:func:`command_line_problem`). Idempotent."""
    if problem := command_line_problem(sys.argv):
        raise SystemExit(f"longreach: {problem}")  # not an Exception: vLLM's plugin loader would log it and go on
    problem = version_problem()
    if problem:
        warnings.warn(
            f"longreach: {problem}: vLLM is left as it is (its own attention; a model whose config holds a longreach "
            "record runs without its method)",
            stacklevel=2,
        )
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "longreach.integrations.vllm_cpu.LongreachCPUBackend")
    register_backend(AttentionBackendEnum.FLASH_ATTN, "longreach.integrations.vllm_cuda.LongreachFlashAttentionBackend")
    if LOADED not in os.environ:  # vLLM's engine and workers are this process's children: they inherit it
        os.environ[LOADED] = str(os.getpid())
        prepare()
