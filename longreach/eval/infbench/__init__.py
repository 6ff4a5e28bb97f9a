"""InfiniteBench (Zhang et al., ACL 2024), the STRING paper's third benchmark, as STRING's script runs it.

Reproduced: HKUNLP/STRING ``216cc2f`` ``inifinite_bench/src/`` (``test_infbench_llama.py``: the prompt cut in the
middle of its tokens, greedy decoding with the task's tokens to generate, the output's whitespace joined;
``eval_utils.py``: ``create_prompt``, ``get_answer``, ``DATA_NAME_TO_MAX_NEW_TOKENS``; ``prompt.py``: the templates;
``compute_scores.py``: the scoring) and OpenBMB/InfiniteBench ``88b3daa`` ``data/construct_synthetic_dataset.py``
(the synthetic retrieval records), read, not copied.

``infbench:<task>`` uses the prompts STRING's script gives Llama 3.1 (``yarn_mistral_templates``: plain text);
``infbench-qwen2:<task>`` the ones it keeps for Qwen2 (the same, opened by ``<|im_start|>``). ``infbench`` names the
nine tasks of the paper's table.

Where this differs on purpose (docs/measuring.md lists it too): the prompt is cut to the length less the tokens to
generate, so that both fit the length (upstream cuts to 128K and generates past it); the synthetic tasks are built at
any length, as many noise lines or key-value pairs as fit (upstream writes 5,220 lines or 2,500 pairs for 128K and lets
the cut drop what passes), each case from its own random stream, its needle at upstream's positions taken coarse to
fine (:func:`.synthetic.needle_at`); kv_retrieval's UUIDs come from that stream (upstream's from the operating
system); the answer is scored without the special tokens upstream's decoding leaves in it (``<|eot_id|>`` glued to
the last word, which changes upstream's En.QA, En.Sum, Zh.QA, Code.Run and Retr.KV scores: docs/measuring.md says
how).

The package: :mod:`.prompts`, :mod:`.synthetic`, :mod:`.data` (the published records), :mod:`.scoring`,
:mod:`.tasks`; here, the tasks by name.
"""

from __future__ import annotations

from .tasks import MAX_NEW_TOKENS, InfiniteBenchTask

REVISION = "HKUNLP/STRING@216cc2f inifinite_bench/src; OpenBMB/InfiniteBench@88b3daa"
PAPER = {  # the STRING paper's InfiniteBench table, in its column order: task -> its name there
    "longbook_sum_eng": "En.Sum",
    "longbook_qa_eng": "En.QA",
    "longbook_choice_eng": "En.MC",
    "longdialogue_qa_eng": "En.Dia",
    "code_debug": "Code.Debug",
    "math_find": "Math.Find",
    "passkey": "Retr.PassKey",
    "number_string": "Retr.Num",
    "kv_retrieval": "Retr.KV",
}
OTHERS = {"longbook_qa_chn": "Zh.QA", "code_run": "Code.Run", "math_calc": "Math.Calc"}  # upstream's other three
FAMILIES = {"infbench": "llama3.1", "infbench-qwen2": "qwen2"}
TASKS = {
    f"{family}:{task}": InfiniteBenchTask(f"{family}:{task}", task, template)
    for family, template in FAMILIES.items()
    for task in MAX_NEW_TOKENS
}

__all__ = ["FAMILIES", "OTHERS", "PAPER", "REVISION", "TASKS", "InfiniteBenchTask"]
