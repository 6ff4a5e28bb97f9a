"""The C++ kernel (``csrc/parts.cpp``): the cells laid out as it reads them, its one call, and its build.

Two callers make the same call: the ``cpu_fused`` backend (:mod:`.backends.cpu_fused`: a batch of sequences, each its
keys as one block) and vLLM's paged cache (:mod:`.paged`: requests of any lengths, their keys in cache blocks). Both lay
out their cells by :func:`cell_table` and call :func:`parts_attention`.

Built by ``torch.utils.cpp_extension`` with the machine's C++ compiler (about 25 seconds on 2 cores, once per
machine, environment, PyTorch release and source; ``TORCH_EXTENSIONS_DIR`` says where), under a lock that names its
builder (:mod:`.build_lock`: a build killed midway does not block the next), then imported as built. A build that
fails raises :class:`BuildError`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import build_lock
from .cells import Cell

SOURCE = Path(__file__).parent / "csrc" / "parts.cpp"
SOURCES = (SOURCE, SOURCE.with_name("tiles.h"), SOURCE.with_name("products.h"))  # the kernel and its headers


class BuildError(RuntimeError):
    """The kernel could not be compiled or loaded on this machine."""


def cell_table(
    cells: Sequence[Cell],
    view_of: Sequence[int],
    key_of: Sequence[int],
    q_positions: torch.Tensor,
    key_indices: Callable[[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The cells as the kernel reads them: ``(table, span_first, span_stop)``. ``table [cells, 5]`` int64 holds per
    cell its query view ``view_of[c]`` (:func:`.cells.query_views`' index), its key view ``key_of[c]``
    (:func:`.cells.key_views`' index), ``lo``, ``hi`` (-1: none) and its span (-1: none, else an index of
    ``span_first`` and ``span_stop``). A cell with a key span (DCA) adds its span at the queries' positions
    ``q_positions``, as key indices: ``key_indices`` turns the span's key positions ``(first, stop)`` into the key
    indices ``(first, stop)`` the caller hands the kernel."""
    rows, span_first, span_stop = [], [], []
    for cell, query_view, key_view in zip(cells, view_of, key_of, strict=True):
        span = -1
        key_span = cell.span(q_positions)
        if key_span is not None:
            first, stop = key_indices(key_span)
            span_first.append(first)
            span_stop.append(stop)
            span = len(span_first) - 1
        rows.append((query_view, key_view, cell.lo, -1 if cell.hi is None else cell.hi, span))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 5), span_first, span_stop


def parts_attention(
    queries: list[torch.Tensor],
    keys: list[torch.Tensor],
    keys_transposed: list[bool],
    key_cos: list[torch.Tensor],
    key_sin: list[torch.Tensor],
    value: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    sequences: torch.Tensor,
    table: torch.Tensor,
    span_first: list[torch.Tensor],
    span_stop: list[torch.Tensor],
    scaling: float,
    kernel=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every cell of every sequence in one online softmax per query row (Dao et al. 2022, FlashAttention, Algorithm 1).

    Args:
        queries: per query view, ``[Hq, R, D]`` float32, contiguous: the rows ``R`` of every sequence one after
            another; view 0 the queries as they are, view ``v`` moved as :func:`.cells.query_views`'s ``v``-th.
        keys: per key plane, the keys ``[blocks, Hkv, block size, D]`` (``[blocks, Hkv, D, block size]`` where
            transposed), dense per head, float32, bfloat16 or float16; plane 0 the keys as they are, plane ``v`` the
            keys of :func:`.cells.key_views`'s ``v``-th shift (moved already, or turned as read by its angle table).
        keys_transposed: per key plane, whether it is transposed.
        key_cos, key_sin: per key plane, the float32 angle table its keys are turned by as they are read, ``[N, P]``
            by key index (``[P, N]`` where transposed), or an empty tensor: the keys as they are.
        value: the values ``[blocks, Hkv, block size, Dv]`` (never transposed).
        block_table: ``[B, blocks per sequence]`` int64: sequence ``b``'s blocks in order of its keys.
        block_size: the keys per block.
        sequences: ``[B, 5]`` int64, per sequence: its first query row in ``R``, its query rows, its offset (its
            query row ``t`` is key index ``t + offset``), its keys, and its first real key (left padding: 0 else).
        table: the cells ``[cells, 5]`` as :func:`cell_table` lays them out.
        span_first, span_stop: per key span of the table, ``[R]`` int64: each query row's first and stop key index.
        scaling: the logits' scale.
        kernel: the extension (default: :func:`extension`, built here if need be).

    Returns ``(out [Hq, R, Dv], lse [Hq, R])`` in float32; a row that attends no key is 0 with ``lse = -inf``.
    """
    return (kernel or extension()).parts_attention(
        queries,
        keys,
        keys_transposed,
        key_cos,
        key_sin,
        value,
        block_table,
        block_size,
        sequences,
        table,
        span_first,
        span_stop,
        float(scaling),
    )


_loaded: list = []  # the extension, once this process has it


def extension():
    """The compiled extension, built first where this environment has not built it: once per machine, environment,
    Python and PyTorch release and source (the folder's name holds their hash), in ``TORCH_EXTENSIONS_DIR`` (default
    ``~/.cache/torch_extensions``), under a lock that names its builder. A kernel built already is imported without
    a build step. Raises :class:`BuildError` where it cannot be built or loaded."""
    return prebuilt() or _build()


def prebuilt():
    """The kernel where this environment has built it, imported as it is -- no build step, no lock, no compiler -- or
    ``None`` where it is not built. A vLLM worker takes it so (building there, on one core beside vLLM's busy threads,
    can outlast vLLM's step timeout): the main process builds it first (:func:`longreach.integrations.vllm.prepare`)."""
    if not _loaded:
        folder = _build_folder()
        building = (folder / build_lock.LOCK).exists()  # its library may be half-written: not built yet
        module = None if building else _imported(_library(folder))
        if module is not None:
            _loaded.append(module)
    return _loaded[0] if _loaded else None


def _build():
    from torch.utils import cpp_extension

    flags = _flags()
    folder = _build_folder()
    path = os.environ.get("PATH", "")
    try:
        # torch runs ninja by name: the one pip installed beside this Python counts too
        os.environ["PATH"] = os.pathsep.join([path, os.path.dirname(sys.executable)])
        with build_lock.holding(folder):
            module = _imported(_library(folder))  # built by another process meanwhile
            if module is None:
                _library(folder).unlink(missing_ok=True)  # half-written by a build that died
                print(
                    f"longreach: building the CPU attention kernel once (about 25 s on 2 cores) in {folder}",
                    file=sys.stderr,
                    flush=True,
                )
                module = cpp_extension.load(
                    name=folder.name,
                    sources=[str(SOURCE)],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(folder),
                    verbose=False,
                )
    except (
        OSError,
        RuntimeError,
        ImportError,
        SystemExit,
        subprocess.SubprocessError,
    ) as error:  # a compiler that fails its version check
        raise BuildError(
            f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        ) from error
    finally:
        os.environ["PATH"] = path
    _loaded.append(module)
    return module


def _library(folder: Path) -> Path:
    return folder / f"{folder.name}.so"


def _imported(library: Path):
    """The extension module in ``library``, or ``None`` where there is none, or one that does not load (half-written
    by a build that died: the loader opens it in ``module_from_spec``)."""
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(library.stem, library)
    assert spec is not None and spec.loader is not None  # a .so file: the extension module loader's
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None
    return module


def _flags() -> list[str]:
    """The compiler flags: -O3, OpenMP, and PyTorch's vector types in the widest form the CPU has, AVX-512 or AVX2."""
    flags = ["-O3", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
        flags += ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
    elif capability == "AVX2":
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return flags


def _build_folder() -> Path:
    """Where the kernel is built: ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), then a name that
    holds a hash of the source, the PyTorch and Python releases, the flags and the environment (its prefix and
    torch's folder: torch writes the environment's include and library paths into the folder's build file, so two
    environments that shared a folder rebuilt the kernel in turn, each time the other had used it)."""
    from torch.utils import cpp_extension

    environment = [sys.prefix, str(Path(torch.__file__).parent)]
    digest = hashlib.sha256(
        "\n".join(
            [
                *(path.read_text() for path in SOURCES),
                torch.__version__,
                sys.implementation.cache_tag,
                *_flags(),
                *environment,
            ]
        ).encode()
    )
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / f"longreach_parts_{digest.hexdigest()[:12]}"
