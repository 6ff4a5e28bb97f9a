"""Load a model: ``default`` (the bundled SmolLM2-135M-Instruct), ``gemma3-270m`` (the bundled Gemma 3 270M), a
``.gguf`` file, a local folder, or a Hugging Face id.

The bundled models and a GGUF file are converted to safetensors once and cached (:mod:`.gguf_models`), so later
loads take seconds. Weights are only ever read from safetensors or GGUF, and ``trust_remote_code`` stays off unless
the caller turns it on.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from .gguf_models import (  # noqa: F401 (cache_dir, default_gguf and publish: re-exported)
    BUNDLED,
    DEFAULT,
    cache_dir,
    converts,
    default_gguf,
    path_of,
    publish,
)


def load(
    name: str = DEFAULT,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    trust_remote_code: bool = False,
    tp: bool = False,
):
    """Load a model and its tokenizer, in eval mode with SDPA attention (the stock baseline).

    Weights are read from safetensors (or the default model's GGUF) only; a folder holding only
    ``pytorch_model.bin`` is refused. A model saved with ``save_pretrained`` after
    [`apply`][longreach.apply] comes back with the same method applied (its config records it; plain
    ``from_pretrained`` keeps only a frequency method, which lives in ``rope_parameters``).

    Args:
        name: ``"default"`` (the bundled SmolLM2-135M-Instruct, converted from GGUF once and cached),
            a local folder, or a Hugging Face id (when the hub can be reached).
        dtype: the weights' and activations' precision.
        device: where to put the model.
        trust_remote_code: transformers' option, off unless asked for.
        tp: shard the model over the processes of ``torchrun`` with transformers' tensor parallelism
            (``tp_plan="auto"``: each process holds some heads of every layer; the device is then chosen
            by transformers). Every process must run the same forward passes.

    Returns:
        ``(model, tokenizer)``; the tokenizer is ``None`` for a checkpoint of ``longreach probe train`` (token ids
        only).

    Raises:
        RuntimeError: a missing default model or folder, a folder without ``config.json``, without
            safetensors weights or without a tokenizer, a hub id while offline, key/value heads that do not split
            over the processes.
        ValueError: a malformed ``longreach`` record in ``config.json`` (one line naming the file and the field).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .integrations.transformers import reapply

    source = source_of(name)
    config, recorded = _config(source, name, trust_remote_code)
    try:
        sharding = _tp_plan(config) if tp else {}
        tokenizer = (
            None
            if _probe_checkpoint(source)
            else AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        )
        model = AutoModelForCausalLM.from_pretrained(
            source,
            config=config,
            dtype=dtype,
            attn_implementation="sdpa",
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            **sharding,
        )
    except OSError as error:
        raise _unfetchable(name, error) from None
    model = (model if tp else model.to(device)).eval()
    if recorded is not None:
        reapply(model, recorded)
    return model, tokenizer


def load_config(name: str = DEFAULT, trust_remote_code: bool = False):
    """A model's config, without its weights, checked as :func:`load` checks it: enough to check a method on an
    empty (meta) model first, so that ``longreach eval --method strng`` fails in a second, not after loading."""
    return _config(source_of(name), name, trust_remote_code)[0]


def source_of(name: str) -> str:
    """What ``from_pretrained`` reads for ``name``: a folder holding a config, safetensors weights and a tokenizer (a
    checkpoint of ``longreach probe train`` has none), or a hub id."""
    source = str(path_of(name)) if converts(name) else name
    if not Path(source).exists() and not _hub_reachable():
        raise RuntimeError(
            f"cannot load model {name!r}: no such local folder, and the Hugging Face hub cannot be reached "
            f"(offline). Pass a local path or a .gguf file, or one of the bundled models: {', '.join(BUNDLED)}."
        )
    if Path(source).is_dir() and not (Path(source) / "config.json").exists():
        raise RuntimeError(f"cannot load model {name!r}: the folder {source} holds no config.json (not a saved model)")
    if Path(source).is_dir() and not any(Path(source).glob("*.safetensors")):
        pickles = sorted(p.name for p in Path(source).glob("*.bin")) or ["no weights file"]
        raise RuntimeError(
            f"cannot load model {name!r}: the folder {source} has no safetensors weights ({', '.join(pickles[:3])}); "
            "longreach refuses .bin on purpose (pickles can run code): save the model with safe_serialization=True"
        )
    if Path(source).is_dir() and not any(Path(source).glob("tokenizer*")) and not _probe_checkpoint(source):
        raise RuntimeError(
            f"cannot load model {name!r}: the folder {source} has no tokenizer (no tokenizer.json or "
            f"tokenizer_config.json); save it beside the model: tokenizer.save_pretrained({source!r})"
        )
    return source


def _config(source: str, name: str, trust_remote_code: bool):
    """``(config, the longreach record it holds or None)``; the record checked, and the model's own RoPE put back where
    a frequency method had replaced it (``apply`` rescales it again)."""
    from transformers import AutoConfig

    from .integrations import saved
    from .integrations.transformers import CONFIG_KEY

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as error:
        raise _unfetchable(name, error) from None
    recorded = getattr(config, CONFIG_KEY, None)
    if recorded is not None:
        recorded = saved.checked(
            recorded, f"{Path(source) / 'config.json' if Path(source).is_dir() else name + ' (its config.json)'}"
        )
        if recorded.get("replaced_rope_parameters"):
            config.get_text_config().rope_parameters = recorded["replaced_rope_parameters"]
    return config, recorded


def _unfetchable(name: str, error: OSError) -> RuntimeError:
    return RuntimeError(
        f"cannot load model {name!r}: not a local folder and not fetchable from the Hugging Face hub "
        f"(offline?). Pass a local path, or 'default' for the bundled SmolLM2-135M. ({error.__class__.__name__})"
    )


def _probe_checkpoint(source) -> bool:
    """A checkpoint of ``longreach probe train``: token ids only, no tokenizer (its tasks: ``probe``,
    ``probe-tail``)."""
    return Path(source).is_dir() and (Path(source) / "state.json").exists() and not any(Path(source).glob("tokenizer*"))


SAMPLE_BYTES = 1 << 16  # of each weights file, at five places: enough to tell overwritten weights apart


def identity(name: str) -> str:
    """The model a results record keys its cases on: ``FOLDER@DIGEST``, the resolved folder and a
    SHA-256 of its ``config.json`` and of each weights file's name, size and 64 KiB at five places (the
    first holds the safetensors header). So ``tiny`` and ``tiny/`` are one model, and a folder whose weights were
    overwritten is another. A hub id keys on its cached snapshot; one not in the cache on the id as given."""
    folder = path_of(name) if converts(name) else Path(name)
    if not folder.is_dir():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # not a valid hub id either: the run itself reports that
            cached = None
        if not isinstance(cached, str):
            return name
        folder = Path(cached).parent
    digest = hashlib.sha256()
    for path in [folder / "config.json", *sorted(folder.glob("*.safetensors")), *sorted(folder.glob("*.gguf"))]:
        if not path.is_file():
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as stream:
            if path.name == "config.json":
                digest.update(stream.read())
                continue
            for place in (0, size // 4, size // 2, 3 * size // 4, max(0, size - SAMPLE_BYTES)):
                stream.seek(place)
                digest.update(stream.read(SAMPLE_BYTES))
    return f"{folder.resolve()}@{digest.hexdigest()[:16]}"


def tensor_parallel_processes() -> int:
    """The processes ``torchrun`` started, to shard a model over (``--tp``); a one-line error when it did not start
    us."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ or size < 2:
        raise ValueError(
            "--tp shards the model over processes: start under torchrun, e.g. "
            "torchrun --nproc-per-node 2 -m longreach eval ... --tp"
        )
    return size


def _tp_plan(config) -> dict:
    """``from_pretrained``'s tensor-parallel arguments, after checking that ``torchrun`` started us and
    that the heads split evenly over its processes."""
    processes = tensor_parallel_processes()
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if heads % processes:
        raise RuntimeError(
            f"tensor parallelism over {processes} processes needs the key/value heads ({heads}) to split "
            f"evenly: use --nproc-per-node with a divisor of {heads}"
        )
    if not getattr(text, "base_model_tp_plan", None):
        raise RuntimeError(
            f"{text.model_type} has no tensor-parallel plan in transformers (base_model_tp_plan); run it without --tp"
        )
    return {"tp_plan": "auto"}


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub answers at all: offline, transformers would retry for most of a minute first."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def default_path() -> Path:
    """The default model as safetensors in the cache, converted from its GGUF once."""
    return path_of(DEFAULT)
