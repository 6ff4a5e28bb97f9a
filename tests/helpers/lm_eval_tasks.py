"""lm-evaluation-harness's local tasks, offline: YAML with local ``data_files`` over passages within a tiny model's
window and well past it (tests/test_lm_eval.py, tests/test_vllm_lm_eval.py). Needs no lm-eval to write."""

import json

STRING = dict(method="string", shift=16, local_window=4)
WORDS = [
    "river",
    "stone",
    "amber",
    "falcon",
    "quiet",
    "meadow",
    "copper",
    "lantern",
    "harbor",
    "violet",
    "thunder",
    "maple",
    "echo",
    "silver",
    "canyon",
]


def passage(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + 3 * i + i * i) % len(WORDS)] for i in range(words))


def write_task(folder, name: str, output_type: str, rows: list[dict], fields: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        f"output_type: {output_type}\n{fields}metadata:\n  version: 1.0\n"
    )


def write_tasks(tasks):
    """The generation and multiple-choice tasks, each over passages within L and well past it, in folder ``tasks``."""
    tasks.mkdir()
    lengths = [6, 30, 70, 110]  # words: within L, and well past it
    write_task(
        tasks,
        "lr_tiny_gen",
        "generate_until",
        [{"context": passage(s, n) + "\nNext:", "answer": WORDS[s]} for s, n in enumerate(lengths)],
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
    )
    write_task(
        tasks,
        "lr_tiny_choice",
        "multiple_choice",
        [
            {"context": passage(s, n), "choices": [" " + w for w in WORDS[s : s + 3]], "label": s % 3}
            for s, n in enumerate(lengths)
        ],
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n",
    )
    return tasks


def loglikelihoods(responses) -> list[float]:
    return [float(r[0][0] if isinstance(r[0], (list, tuple)) else r[0]) for doc in responses for r in doc]
