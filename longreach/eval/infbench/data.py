"""InfiniteBench's published records (``xinrongzhang2022/InfiniteBench`` on the Hugging Face hub, one jsonl file per
task, as upstream's ``scripts/download_dataset.sh`` fetches them): from a folder or a file given with ``--data``
(``LONGREACH_INFBENCH_DATA``), else from the hub's cache, downloaded there once."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

from .prompts import FUNCTION_CALL, TARGET_NUMBER

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
    """The records of ``task``, each checked against upstream's format for the task (:func:`problem`); a one-line
    ``ValueError`` naming the file, the line and what is wrong at the first that is not."""
    return _read(locate(task), task)


@lru_cache(maxsize=2)
def _read(path: Path, task: str) -> list[dict]:
    rows = []
    with path.open("rb") as lines:  # an OSError here names the file
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}, line {number}: not UTF-8 (byte {raw[error.start]:#04x})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not JSON ({error.msg})") from None
            wrong = problem(row, task)
            if wrong:
                raise ValueError(f"{path}, line {number}: {wrong}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no records")
    return rows


OPTIONS = 4  # multiple choice: the templates' OPTION_A .. OPTION_D, answered by letter
CHOICE = ("code_debug", "longbook_choice_eng")


def problem(row, task: str) -> str | None:
    """What makes ``row`` other than a record of ``task`` as upstream's code reads it (``eval_utils.create_prompt``,
    ``get_answer`` and ``compute_scores``), in a few words; ``None`` when it is one.

    Every record: ``context`` and ``input`` texts. The answer: a non-empty list of texts for the QA and dialogue tasks
    (each is a reference); a text or a list of texts for En.Sum; a whole number (Code.Run), a number (Math.Find) or a
    non-empty list that starts with one; a non-empty list of whole numbers, or one inside a list, for Math.Calc; for
    multiple choice, four option texts and an answer among them (the text, ``[text]`` or ``[text, letter]``).
    Code.Run's input names a call ``func_N(x)``, Math.Find's a ``The ... of``. (The retrieval tasks are generated,
    not read.)"""
    if not isinstance(row, dict):
        return "not a JSON object (not an InfiniteBench record)"
    return _fields_problem(row) or _answer_problem(row["answer"], task) or _task_problem(row, task)


def _fields_problem(row: dict) -> str | None:
    """Every record's: its fields, ``context`` and ``input`` texts."""
    missing = [f for f in FIELDS if f not in row]
    if missing:
        return f"no {', '.join(missing)} (not an InfiniteBench record)"
    for field in ("context", "input"):
        if not isinstance(row[field], str):
            return f"{field}={_shown(row[field])} is not a text"
    return None


def _answer_problem(answer, task: str) -> str | None:
    """The answer's shape for ``task`` (multiple choice: :func:`_choice_problem`)."""
    first = answer[0] if isinstance(answer, list) and answer else answer
    if isinstance(answer, list) and not answer:
        return f"answer=[] holds no answer ({task})"
    if task in ("longbook_qa_eng", "longbook_qa_chn", "longdialogue_qa_eng") and not _texts(answer):
        return f"answer={_shown(answer)} is not a list of texts ({task}: each one a reference)"
    if task == "longbook_sum_eng" and not (isinstance(answer, str) or _texts(answer)):
        return f"answer={_shown(answer)} is not a text or a list of texts ({task})"
    if task == "code_run" and not _whole(first):
        return f"answer={_shown(answer)} is not a whole number, nor a list starting with one ({task})"
    if task == "math_find" and not (_whole(first) or isinstance(first, float)):
        return f"answer={_shown(answer)} is not a number, nor a list starting with one ({task})"
    if task == "math_calc":
        values = first if isinstance(first, list) else answer
        if not (isinstance(values, list) and values and all(_whole(v) for v in values)):
            return f"answer={_shown(answer)} is not a list of whole numbers, nor one inside a list ({task})"
    return None


def _task_problem(row: dict, task: str) -> str | None:
    """Multiple choice's options and answer; the call Code.Run's input names, the ``The ... of`` of Math.Find's."""
    if task in CHOICE:
        return _choice_problem(row, task)
    if task == "code_run" and not FUNCTION_CALL.search(row["input"]):
        return f"input={_shown(row['input'])} names no call func_N(x) ({task})"
    if task == "math_find" and not TARGET_NUMBER.search(row["input"]):
        return f"input={_shown(row['input'])} names no 'The ... of' ({task})"
    return None


def _choice_problem(row: dict, task: str) -> str | None:
    options, answer = row.get("options"), row["answer"]
    if not (_texts(options) and len(options) == OPTIONS):
        return f"options={_shown(options)} is not {OPTIONS} texts ({task}: options A to D)"
    if isinstance(answer, list) and len(answer) == 2:  # get_answer's [option, letter]
        if not (isinstance(answer[0], str) and answer[1] in ("A", "B", "C", "D")):
            return f"answer={_shown(answer)} is not [option, letter A-D] ({task})"
        return None
    given = answer[0] if isinstance(answer, list) and len(answer) == 1 else answer
    if not isinstance(given, str) or given not in options:
        return f"answer={_shown(answer)} is not among the options {_shown(options)} ({task})"
    return None


def _texts(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."
