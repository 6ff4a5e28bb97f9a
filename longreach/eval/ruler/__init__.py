"""RULER's 13 synthetic tasks, generated as NVIDIA/RULER's scripts generate them.

Reproduced revision: NVIDIA/RULER ``c3f5e3b`` (2026-07-22; ``scripts/data/prepare.py``,
``scripts/data/synthetic/*.py``, ``scripts/synthetic.yaml``, ``scripts/data/synthetic/constants.py``,
``scripts/eval/``), read, not copied. Per task: the template and answer prefix inside the model
template, the tokens to generate (niah 128, vt 30, cwe 120, fwe 50, qa 32) counted in the length,
vt's in-context example (one per run, renamed per sample), cwe's solved example, QA's distractors,
needle depths drawn from ``linspace(0, 100, 40)``, essay sentences split by nltk's Punkt as RULER splits
them (:func:`.haystack.sentences`), scoring with ``string_match_all`` /
``string_match_part`` after RULER's post-processing.

**Packing.** ``ruler:*`` sizes its haystacks as RULER does (:class:`.haystack.RulerSearch`): one search
per task and length, then each case backs off a task's step (500 essay words, 25 noise lines, 10
documents, ...) until it fits -- so many cases end a step short of the length, as upstream's do.
``ruler-tight:*`` packs every case to the largest haystack that fits (searched per case): about 20%
longer QA prompts at 4K, and harder; not comparable with published RULER tables.

Where this differs on purpose (docs/measuring.md lists it too): every case has its own random stream
(``random.Random("<task>/<length>/<seed>/<n>")``, so cases are independent and resumable) where
RULER draws samples one after another from one seeded stream, and the size search draws its own
stream; the length counts the BOS token (RULER counts ``tokenizer.tokenize()``, without it), so
no prompt passes the length; RULER's singular rewording of a one-value niah (``are`` -> ``is``) is
applied to the task text only, not to the whole template with its chat markup (where upstream turns
a system prompt's "You are" into "You is"); cwe cannot go past the 8,166 words of ``wonderwords``
(about 100K tokens): RULER's newer word list is not distributed on PyPI, so longer cwe cases are a
clear error; a QA case whose length needs more documents than the dataset has is an error (RULER
repeats the documents); where RULER would draw again at its smallest size until a draw fits, an error.

The package: :mod:`.common` (what every task shares), :mod:`.niah`, :mod:`.variables`, :mod:`.words`
(cwe, fwe), :mod:`.qa`; here, the 13 tasks by name.
"""

from __future__ import annotations

import dataclasses

from .common import DEPTHS, FIXED_SEED, PACKINGS, REVISION, postprocess
from .niah import Niah
from .qa import QA, qa_available, qa_data
from .variables import VariableTracking
from .words import CommonWords, FrequentWords

__all__ = [
    "DEPTHS",
    "FIXED_SEED",
    "PACKINGS",
    "REVISION",
    "TASKS",
    "TIGHT",
    "CommonWords",
    "FrequentWords",
    "Niah",
    "QA",
    "VariableTracking",
    "postprocess",
    "qa_available",
    "qa_data",
]

TASKS = {
    "niah_single_1": Niah("ruler:niah_single_1", haystack="noise"),
    "niah_single_2": Niah("ruler:niah_single_2"),
    "niah_single_3": Niah("ruler:niah_single_3", type_v="uuids"),
    "niah_multikey_1": Niah("ruler:niah_multikey_1", num_k=4),
    "niah_multikey_2": Niah("ruler:niah_multikey_2", haystack="needle"),
    "niah_multikey_3": Niah("ruler:niah_multikey_3", haystack="needle", type_k="uuids", type_v="uuids"),
    "niah_multivalue": Niah("ruler:niah_multivalue", num_v=4),
    "niah_multiquery": Niah("ruler:niah_multiquery", num_q=4),
    "vt": VariableTracking(),
    "cwe": CommonWords(),
    "fwe": FrequentWords(),
    "qa_1": QA("ruler:qa_1", "squad"),
    "qa_2": QA("ruler:qa_2", "hotpotqa"),
}
TIGHT = {
    name: dataclasses.replace(task, name=task.name.replace("ruler:", "ruler-tight:"), packing="tight")
    for name, task in TASKS.items()
}
"""The same tasks packed tight (``ruler-tight:*``): each case's haystack as large as fits."""
