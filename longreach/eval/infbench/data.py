"""InfiniteBench's published records (``xinrongzhang2022/InfiniteBench`` on the Hugging Face hub, one jsonl file per
task, as upstream's ``scripts/download_dataset.sh`` fetches them): from a folder or a file given with ``--data``
(``LONGREACH_INFBENCH_DATA``), else from the hub's cache, downloaded there once."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

HUB = "xinrongzhang2022/InfiniteBench"
DATA = "LONGREACH_INFBENCH_DATA"  # --data: a folder of <task>.jsonl files, or one task's file
FIELDS = ("context", "input", "answer")


def get_it(task: str) -> str:
    return (
        f"download it (hf download {HUB} {task}.jsonl --repo-type dataset --local-dir DIR, or "
        f"https://huggingface.co/datasets/{HUB}/resolve/main/{task}.jsonl) and give --data DIR"
    )


def locate(task: str) -> Path:
    """The jsonl file of ``task``; a one-line ``FileNotFoundError`` saying where to get it when it is not there."""
    given = os.environ.get(DATA)
    if given:
        path = Path(given).expanduser()
        if path.is_dir():
            path = path / f"{task}.jsonl"
        elif path.name != f"{task}.jsonl":
            raise FileNotFoundError(f"--data={given} is not a folder, nor {task}.jsonl: infbench:{task} needs it")
        if not path.is_file():
            raise FileNotFoundError(f"InfiniteBench's {task}.jsonl is not in {given}: {get_it(task)}")
        return path
    import logging

    from huggingface_hub import hf_hub_download

    hub_log = logging.getLogger("huggingface_hub")
    level, hub_log.level = hub_log.level, logging.ERROR  # its retries' warnings: the one line below says it
    try:
        return Path(hf_hub_download(HUB, f"{task}.jsonl", repo_type="dataset"))
    except Exception as error:  # offline, no such file, no access: one line, whichever
        raise FileNotFoundError(
            f"InfiniteBench's {task}.jsonl is not in the hub's cache and could not be downloaded "
            f"({error.__class__.__name__}): {get_it(task)}"
        ) from None
    finally:
        hub_log.setLevel(level)


def records(task: str) -> list[dict]:
    """The records of ``task``, checked: each a JSON object with ``context``, ``input`` and ``answer``."""
    return _read(locate(task))


@lru_cache(maxsize=2)
def _read(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not JSON ({error.msg})") from None
            missing = [f for f in FIELDS if not isinstance(row, dict) or f not in row]
            if missing:
                raise ValueError(f"{path}, line {number}: no {', '.join(missing)} (not an InfiniteBench record)")
            rows.append(row)
    return rows
