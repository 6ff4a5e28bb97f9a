"""The upstream procedures, checked with the default model's real tokenizer: RULER (NVIDIA/RULER@c3f5e3b),
STRING's 4-needle test (HKUNLP/STRING) and passkey (landmark attention); intervals and RULER's averages."""

import json
import math
import random
import re

import pytest
from helpers.tiny_models import TINY_VOCAB, byte_tokenizer, tiny_model
from transformers import AutoTokenizer

from longreach import models
from longreach.eval import generate, report, ruler, runner, stats, tasks
from longreach.eval.engines.transformers import Transformers
from longreach.eval.grid import Grid
from longreach.methods.spec import MethodSpec

ALL = [name for name in tasks.TASKS if getattr(tasks.get(name), "synthetic", True)]  # InfiniteBench's files: not here


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(models.default_path())


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("length", [2048, pytest.param(4096, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ALL)
def test_prompt_plus_generation_fits_the_length_and_fills_it(tokenizer, name, length):
    case = tasks.get(name).build(tokenizer, length, 0.5 if tasks.get(name).uses_depth else None, seed=3)
    assert case.n_tokens == count(tokenizer, case.prompt)
    assert case.n_tokens + case.max_new_tokens <= length
    if not name.startswith("ruler:"):  # packed tight: within a unit (a sentence, a line, a document) of the budget
        unit = 600 if ":qa_" in name else 160
        assert length - unit <= case.n_tokens + case.max_new_tokens


STEPS = {"niah_single_1": 25, "niah_single_2": 500, "niah_multikey_2": 25, "vt": 10, "cwe": 10, "qa_1": 10, "qa_2": 10}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_ruler_sizes_its_haystacks_as_rulers_scripts_do(tokenizer, name):
    """One search per task and length; every case starts from its size and backs off RULER's step until it fits
    (niah.py, variable_tracking.py, common_words_extraction.py, qa.py): sizes size - k step, never above."""
    length = 4096
    cases = [tasks.get(f"ruler:{name}").build(tokenizer, length, None, seed) for seed in range(8)]
    tight = [tasks.get(f"ruler-tight:{name}").build(tokenizer, length, None, seed) for seed in range(8)]
    size = max(c.haystack_units for c in cases)
    assert all((size - c.haystack_units) % STEPS[name] == 0 for c in cases)
    assert sum(c.n_tokens for c in cases) <= sum(c.n_tokens for c in tight)  # tight: each case as large as fits


def test_rulers_fwe_scans_up_by_a_32nd_of_the_budget(tokenizer):
    cases = [tasks.get("ruler:fwe").build(tokenizer, 4096, None, seed) for seed in range(4)]
    step = (4096 - 50) // 32
    assert len({c.haystack_units % step for c in cases}) == 1 and all(c.n_tokens + 50 <= 4096 for c in cases)


@pytest.mark.parametrize("family", ["ruler", "ruler-tight"])
@pytest.mark.parametrize("length", range(600, 950, 50))
def test_vt_never_drops_links_of_its_chain(tokenizer, family, length):
    """Too short for the example and 5 chain lines: a one-line error (RULER's script cannot build it either),
    never a case with fewer links than its references (the review: 1 of 5 at 700 tokens)."""
    try:
        case = tasks.get(f"{family}:vt").build(tokenizer, length, None, seed=0)
    except ValueError as error:
        assert "over the budget" in str(error)
        return
    main = case.prompt.split("Memorize and track the chain(s)")[2]
    assert sorted(re.findall(r"VAR ([A-Z]{5}) = ", main)) == sorted(case.references) and len(case.references) == 5


@pytest.mark.parametrize("family", ["ruler", "ruler-tight"])
@pytest.mark.parametrize("length", range(550, 950, 50))
def test_cwe_lists_all_ten_common_words(tokenizer, family, length):
    """The review: at about 640 tokens the list held 3 distinct words against 10 references."""
    try:
        case = tasks.get(f"{family}:cwe").build(tokenizer, length, None, seed=0)
    except ValueError as error:
        assert "over the budget" in str(error)
        return
    listed = case.prompt.split("Memorize the ones that appear most often.\n")[2].split("\nQuestion:")[0]
    assert set(case.references) <= set(re.findall(r"\d+\. (.+?)(?= \d+\.|$)", listed)) and len(case.references) == 10


def test_a_vt_chain_whose_names_repeat_is_drawn_again_one_step_smaller(tokenizer):
    """RULER's generate_chains raises on a repeated name (its extra names make a short second chain), and its sample
    loop draws again one step smaller, with fresh draws (here, the smaller size's own stream)."""
    from longreach.eval import haystack
    from longreach.eval.ruler import variables

    class Repeating(random.Random):
        def choices(self, population, weights=None, *, cum_weights=None, k=1):
            return ["A"] * k

    with pytest.raises(haystack.Redraw, match="repeat"):
        variables._chain(Repeating(0), 4, icl=False)
    built = []

    def build(n: int) -> str:
        built.append(n)
        if len(built) == 1:
            raise haystack.Redraw("the chain's names repeat")
        return "word " * n

    scan = haystack.RulerSearch(5, binary=False, start=10)
    n, prompt, used, size = haystack.fit_as_ruler(tokenizer, 100, 100, build, lambda n: "word " * n, scan, ("redraw",))
    assert built == [size, size - 5] and n == size - 5 and used <= 100

    def rejected(n: int) -> str:
        raise haystack.Redraw("the chain's names repeat")

    with pytest.raises(ValueError, match=r"with \d+ units is a draw RULER's generator rejects, over the budget"):
        haystack.fit_as_ruler(tokenizer, 100, 100, rejected, str, scan, ("redraw",))


def test_the_vt_example_is_one_per_run_renamed_per_case(tokenizer):
    examples = [
        tasks.get("ruler:vt").build(tokenizer, length, None, seed).prompt.split("Memorize and track the chain(s)")[1]
        for length, seed in ((2048, 0), (4096, 5))
    ]

    def layout(example):
        return re.sub(r"VAR [A-Z]+ = (VAR [A-Z]+|\d+)", "VAR", example.split("Question:")[0])

    assert layout(examples[0]) == layout(examples[1]) and examples[0] != examples[1]


def test_the_sentence_splitter_keeps_every_character():
    """Punkt (RULER's splitter) may add a space where it cuts, never drops a character."""
    from longreach.eval import haystack

    assert haystack.sentences('He said "Hi." Then (ok.) End.') == ['He said "Hi."', "Then (ok.) End."]
    text = re.sub(r"\s+", " ", haystack.essays()).strip()
    assert "".join(" ".join(haystack.sentences(text)).split()) == "".join(
        text.split()
    )  # the review: 11 of 38 quotes lost


def test_niah4_reads_the_essays_in_the_order_of_strings_own_file(tokenizer):
    """HKUNLP/STRING's PaulGrahamEssays.json holds RULER's essays in another order; its test reads its own."""
    from longreach.eval import haystack

    text = haystack.string_essays()
    assert len(text) == 3048886 and text.startswith("July 2006I've discovered a handy test for figuring out")
    case = tasks.get("niah4").build(tokenizer, 2048, None, seed=0)
    assert case.prompt.split("the important information there.\n")[1].startswith("July 2006I've discovered")


@pytest.mark.parametrize("length", [8192, 16384])
def test_cwe_builds_past_8k_with_the_answer_inside_the_length(tokenizer, length):
    case = tasks.get("ruler:cwe").build(tokenizer, length, None, seed=0)
    assert case.n_tokens + 120 <= length and len(case.references) == 10


def test_tokens_to_generate_are_upstreams():
    expected = {
        "niah4": 128,
        "niah4-chat": 128,
        "passkey": 10,
        "passkey-chat": 10,
        "niah": 128,
        "ruler:vt": 30,
        "ruler:cwe": 120,
        "ruler:fwe": 50,
        "ruler:qa_1": 32,
        "ruler:qa_2": 32,
    }
    expected |= {f"ruler:{n}": 128 for n in ruler.TASKS if n.startswith("niah")}
    expected |= {
        name.replace("ruler:", "ruler-tight:"): tokens for name, tokens in expected.items() if name.startswith("ruler:")
    }
    for family in ("infbench", "infbench-qwen2"):  # STRING's DATA_NAME_TO_MAX_NEW_TOKENS
        expected |= {f"{family}:passkey": 6, f"{family}:number_string": 12, f"{family}:kv_retrieval": 50}
    assert {name: tasks.get(name).max_new_tokens for name in ALL} == expected
    assert tasks.expand("ruler-tight") == [f"ruler-tight:{n}" for n in ruler.TASKS]


def test_vt_has_its_in_context_example_with_fresh_names_and_value(tokenizer):
    case = tasks.get("ruler:vt").build(tokenizer, 4096, None, seed=1)
    assert case.prompt.count("Memorize and track the chain(s)") == 2
    example, main = case.prompt.split("Memorize and track the chain(s)")[1:]
    chain = re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", example)
    assert len(chain) == 5 and all(len(name) == 3 for name, _ in chain)
    value = chain[0][1]
    assert value != "12345" and f"5 variables are assigned the value {value}, they are: " in example
    assert example.rstrip().endswith(" ".join(name for name, _ in chain))  # the example's answer, renamed as upstream
    assert count(tokenizer, "Memorize and track the chain(s)" + example) <= 520
    assert re.findall(r"VAR ([A-Z]{5}) = ", main) and set(case.references) == set(
        re.findall(r"VAR ([A-Z]{5}) = ", main)
    )
    assert case.prompt.endswith(", they are: ")


@pytest.mark.parametrize("length, example, repeats", [(2048, (20, 3, 1), (6, 1)), (4096, (40, 10, 3), (30, 3))])
def test_cwe_has_one_solved_example_and_upstreams_repeats(tokenizer, length, example, repeats):
    case = tasks.get("ruler:cwe").build(tokenizer, length, None, seed=2)
    first, second = case.prompt.split(ruler.words.CWE_ANSWER)[:2]
    words = re.findall(
        r"\d+\. ([^\d\n]+?)(?= \d+\.|\n|$)", first.split("Memorize the ones that appear most often.\n")[1]
    )
    assert len(words) == 10 * example[1] + (example[0] - 10) * example[2]
    solved = re.findall(r"\d+\. (.+?)(?= \d+\.|\n)", second.split("\n")[0] + "\n")
    assert len(solved) == 10 and all(words.count(w) == example[1] for w in solved)  # the example is solved correctly
    listed = case.prompt.split("Memorize the ones that appear most often.\n")[2].split("\nQuestion:")[0]
    items = re.findall(r"\d+\. (.+?)(?= \d+\.|$)", listed)
    assert all(items.count(w) == repeats[0] for w in case.references)
    assert {items.count(w) for w in set(items) - set(case.references)} == {repeats[1]}


def test_squad_fills_with_its_own_article_first_and_hotpotqa_keeps_all_ten(tokenizer):
    questions, documents = ruler.qa_data("squad")
    case = tasks.get("ruler:qa_1").build(tokenizer, 4096, None, seed=0)
    shown = re.findall(r"Document \d+:\n(.*?)(?=\n\nDocument \d+:|\n\nAnswer the question)", case.prompt, re.S)
    item = questions[0]
    assert documents[item["documents"][0]] in shown
    own = {documents[i] for i in item["article"]}
    assert len(shown) == case.haystack_units and (
        set(shown) - {documents[item["documents"][0]]} <= own or own <= set(shown)
    )
    questions, documents = ruler.qa_data("hotpotqa")
    for seed in (0, 5):
        case = tasks.get("ruler:qa_2").build(tokenizer, 2048, None, seed=seed)
        assert (
            all(documents[i] in case.prompt for i in questions[seed]["documents"])
            and len(questions[seed]["documents"]) == 10
        )


def test_ruler_needles_sit_at_depths_drawn_from_its_forty(tokenizer):
    allowed = {d / 100 for d in ruler.DEPTHS}
    seen = set()
    for seed in range(6):
        case = tasks.get("ruler:niah_multikey_1").build(tokenizer, 2048, None, seed=seed)
        assert case.depth is None and len(case.needle_depths) == 1 and case.needle_depths[0] in allowed
        context = case.prompt.split("afterwards.\n")[1].rsplit("\nWhat is", 1)[0]
        assert abs(context.index(case.references[0]) / len(context) - case.needle_depths[0]) < 0.1  # recorded = placed
        seen.add(case.needle_depths[0])
        multi = tasks.get("ruler:niah_multivalue").build(tokenizer, 2048, None, seed=seed)
        assert len(set(multi.needle_depths)) == 4 and set(multi.needle_depths) <= allowed
    assert len(seen) >= 4
    noise = tasks.get("ruler:niah_single_1").build(tokenizer, 2048, None, seed=0)
    lines = noise.prompt.split("afterwards.\n")[1].split("\n")
    assert sum(line == ruler.niah.NOISE for line in lines) == noise.haystack_units
    at = next(i for i, line in enumerate(lines) if noise.references[0] in line)
    assert at == round(noise.needle_depths[0] * noise.haystack_units)


def test_ruler_scores_after_upstreams_postprocessing():
    case = tasks.get("ruler-tight:niah_multivalue").build(byte_tokenizer(), 3000, None, seed=0)
    answer = "\x01 " + " ".join(case.references[:3]) + "\n"
    assert tasks.get("ruler:niah_multivalue").score(answer, case)["score"] == 75.0
    assert ruler.postprocess(" \x00\t ") == "" and ruler.postprocess("a\x07b ") == "a\nb"


def test_string_four_needles_as_the_string_repository(tokenizer):
    task = tasks.get("niah4")
    case = task.build(tokenizer, 8192, None, seed=4)
    assert case.prompt.startswith(
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them."
    )
    assert case.prompt.endswith(". \n\n\nWhat are the magic numbers mentioned in the provided text?\nThe numbers are")
    assert all(
        f" One of the magic number is: {v}. " in case.prompt and 100000 <= int(v) <= 1000000 for v in case.references
    )
    positions = [case.prompt.index(f"is: {v}.") / len(case.prompt) for v in case.references]
    assert [int(d / (0.99 / 4)) for d in case.needle_depths] == [0, 1, 2, 3] and positions == sorted(positions)
    assert all(abs(p - d) < 0.03 for p, d in zip(positions, case.needle_depths, strict=True))
    assert case.n_tokens <= 8192 - 128
    two = task.score(f"{case.references[3]}, {case.references[0]}</s>", case)
    assert two["score"] == 100.0 and two["fraction"] == 0.5 and task.score(case.references[1], case)["score"] == 0.0
    chat = tasks.get("niah4-chat").build(tokenizer, 8192, None, seed=4)
    assert chat.prompt.startswith("<|im_start|>system") and chat.prompt.endswith(
        "<|im_start|>assistant\nThe numbers are"
    )


def test_niah4_asks_llama_3_1_as_strings_script_does(tokenizer):
    """STRING's get_needles: a model path holding llama3.1 gets the question ending "\\n " and no answer prefix."""
    standard = tasks.get("niah4").build(tokenizer, 2048, None, seed=4)
    llama = tasks.get("niah4:question=llama3.1").build(tokenizer, 2048, None, seed=4)
    assert llama.task == "niah4:question=llama3.1" and llama.references == standard.references  # the same draws
    assert llama.prompt.endswith(". \n\n\nWhat are the magic numbers mentioned in the provided text?\n ")
    chat = tasks.get("niah4-chat:question=llama3.1").build(tokenizer, 2048, None, seed=4)
    assert chat.prompt.endswith("<|im_start|>assistant\n")
    assert tasks.for_model(["niah4", "niah4-chat", "passkey"], "meta-llama/Llama-3.1-8B-Instruct") == [
        "niah4:question=llama3.1",
        "niah4-chat:question=llama3.1",
        "passkey",
    ]
    assert tasks.is_llama_3_1("/models/llama3.1-8b-instruct") and not tasks.is_llama_3_1("Llama-3.2-3B")
    assert tasks.for_model(["niah4"], "default") == ["niah4"]
    with pytest.raises(ValueError, match="niah4 takes question=standard or question=llama3.1"):
        tasks.get("niah4:question=llama3")


def test_passkey_as_landmark_attentions_script(tokenizer):
    task = tasks.get("passkey")
    case = task.build(tokenizer, 4096, None, seed=7)
    lines = case.prompt.split("\n")
    key = case.references[0]
    assert len(lines) == 5 and lines[2] == f"The pass key is {key}. Remember it. {key} is the pass key."
    assert lines[4] == "What is the pass key? The pass key is" and 1 <= int(key) <= 50000
    assert abs(len(lines[1]) / case.haystack_units - case.needle_depths[0]) < 1e-9
    assert task.score(f" {key}. The", case)["score"] == 100.0
    assert task.score(f" 0{key}", case)["score"] == 100.0  # the first integer, as int()
    assert task.score(f" 7 then {key}", case)["score"] == 0.0 and task.score("none", case)["score"] == 0.0
    chat = tasks.get("passkey-chat").build(tokenizer, 4096, None, seed=7)
    assert chat.prompt.endswith("What is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is")


def test_running_out_of_words_or_documents_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(ruler.words, "_cwe_words", lambda: [f"w{i}" for i in range(40)])
    for family in ("ruler", "ruler-tight"):
        with pytest.raises(
            ValueError, match=rf"{family}:cwe at 16384 tokens: all 40 distinct words of wonderwords take only \d+ of"
        ):
            tasks.get(f"{family}:cwe").build(byte_tokenizer(), 16384, None, seed=0)


def test_wilson_and_bootstrap_intervals_on_hand_worked_counts():
    low, high = stats.wilson(8, 10)
    assert (round(low, 1), round(high, 1)) == (49.0, 94.3)
    assert stats.wilson(0, 20)[0] == 0.0 and round(stats.wilson(0, 10)[1], 1) == 27.8 and stats.wilson(0, 10)[0] == 0.0
    assert round(stats.wilson(10, 10)[0], 1) == 72.2 and stats.wilson(10, 10)[1] == 100.0
    assert stats.bootstrap([[50.0] * 7]) == (50.0, 50.0)
    assert math.isnan(
        stats.bootstrap([[50.0, 60.0], [70.0]])[0]
    )  # one case of a task: no interval, not a zero-width one
    assert stats.effective_length({2048: math.nan}) == 0
    low, high = stats.interval([0.0, 25.0, 50.0, 75.0, 100.0] * 4)
    assert 30 < low < 50 < high < 70
    assert stats.interval([100.0, 0.0, 100.0, 100.0, 0.0, 100.0, 100.0, 100.0, 100.0, 100.0]) == stats.wilson(8, 10)
    averages = stats.weighted_averages({4096: 90.0, 8192: 80.0, 16384: 70.0})
    assert (
        averages["avg"] == 80.0
        and averages["wavg_inc"] == pytest.approx(460 / 6)
        and averages["wavg_dec"] == pytest.approx(500 / 6)
    )


def _record(task: str, length: int, seed: int, score: float, empty: bool = False) -> dict:
    return {
        "model": "m",
        "method": "rope",
        "resolved": "rope [L=8192]",
        "window": 8192,
        "task": task,
        "length": length,
        "depth": None,
        "seed": seed,
        "score": score,
        "metric": "string_match_all",
        "empty": empty,
        "seconds": 1.0,
    }


@pytest.mark.slow
def test_the_ruler_score_is_the_mean_of_task_means_with_averages_and_effective_length(tmp_path):
    means = {4096: 90.0, 8192: 86.0}  # every task scores these at 4K and 8K: RULER mean = the same
    records = [
        _record(task, n, seed, means[n] + (5 if seed else -5), empty=(seed == 0 and task == "ruler:vt"))
        for task in report.RULER_TASKS
        for n in means
        for seed in range(2)
    ]
    (tmp_path / runner.RESULTS).write_text("".join(json.dumps(r) + "\n" for r in records))
    markdown = report.build(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {row["length"]: row for row in summary["ruler"]}
    assert rows[4096]["score"] == pytest.approx(90.0) and rows[8192]["score"] == pytest.approx(86.0)
    assert all(
        row["complete"] and row["cases"] == 26 and row["low"] < row["score"] < row["high"] for row in rows.values()
    )
    ruler_length = next(e for e in summary["effective_length"] if e["task"] == "ruler")
    assert (
        ruler_length["point"] == 8192 and ruler_length["sure"] == 4096
    )  # at 8K the lower bound (about 84) misses 85.6
    assert ruler_length["avg"] == pytest.approx(88.0) and ruler_length["wavg_inc"] == pytest.approx((90 + 2 * 86) / 3)
    assert "vt 2" in markdown and "## RULER" in markdown and (tmp_path / "compare_ruler.png").stat().st_size > 0
    assert "Minus rope" not in markdown  # one method: nothing to pair
    without_qa = [r for r in records if not r["task"].startswith("ruler:qa")]
    (tmp_path / runner.RESULTS).write_text("".join(json.dumps(r) + "\n" for r in without_qa))
    assert "(11 tasks, n=22)" in report.build(tmp_path)
    qa_1 = [r for r in records if r["task"] == "ruler:qa_1"]  # qa_2 could not be built at this length, qa_1 could
    (tmp_path / runner.RESULTS).write_text("".join(json.dumps(r) + "\n" for r in without_qa + qa_1))
    markdown = report.build(tmp_path)
    assert (
        "(12 tasks, incomplete, n=24)" in markdown and "11 tasks" not in markdown.split("## RULER")[1].split("\n\n")[2]
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not any(row["complete"] for row in summary["ruler"])
    assert next(e for e in summary["effective_length"] if e["task"] == "ruler")["point"] is None  # out of the averages


@pytest.mark.slow
def test_the_ruler_difference_against_rope_pairs_cases_within_each_task(tmp_path):
    # string gains 20 on the first task only (its two cases 0 -> 20 and 10 -> 30): the mean over 13 tasks is 20 / 13;
    # each task's pairs are resampled on their own, so the interval is exact; the third case of string has no pair
    rope = [_record(task, 4096, seed, 10.0 * seed) for task in report.RULER_TASKS for seed in range(2)]
    first = report.RULER_TASKS[0]
    string = [
        {**r, "method": "string", "resolved": "string [L=8192]", "score": r["score"] + 20 * (r["task"] == first)}
        for r in rope
    ]
    unpaired = {**string[0], "seed": 2}
    (tmp_path / runner.RESULTS).write_text("".join(json.dumps(r) + "\n" for r in rope + string + [unpaired]))
    markdown = report.build(tmp_path)
    (paired,) = json.loads((tmp_path / "summary.json").read_text())["ruler_paired"]
    assert paired["method"] == "string" and paired["n"] == 26
    assert paired["difference"] == pytest.approx(20 / 13) and paired["low"] == paired["high"] == pytest.approx(20 / 13)
    assert "| string | +1.5 [+2, +2] (n=26) |" in markdown
    (tmp_path / runner.RESULTS).write_text(
        "".join(json.dumps(r) + "\n" for r in rope[:-2] + string[:-2])
    )  # 12 tasks both
    assert "| string | +1.7 [+2, +2] (n=24) (12 tasks) |" in report.build(
        tmp_path
    )  # 20 / 12: a partial average, marked
    (tmp_path / runner.RESULTS).write_text(
        "".join(json.dumps(r) + "\n" for r in rope + string[2:])
    )  # string lacks a task
    report.build(tmp_path)
    (paired,) = json.loads((tmp_path / "summary.json").read_text())["ruler_paired"]
    assert paired["n"] == 0 and paired["difference"] is None


def test_effective_length_is_reported_by_point_and_by_lower_bound(tmp_path):
    records = [
        _record("niah4", n, seed, 100.0 if seed < passed else 0.0)
        for n, passed in ((2048, 10), (4096, 9))
        for seed in range(10)
    ]
    (tmp_path / runner.RESULTS).write_text("".join(json.dumps(r) + "\n" for r in records))
    report.build(tmp_path)
    (effective,) = json.loads((tmp_path / "summary.json").read_text())["effective_length"]
    assert effective["point"] == 4096 and effective["sure"] == 0  # 9/10: 90 >= 85.6, its lower bound 59.6 is not


def test_nolimas_relative_effective_length_keeps_85_percent_of_the_shortest_lengths_score(tmp_path):
    """NoLiMa's rule beside RULER's: a model scoring 60 at 2K never reaches 85.6, but keeps 85% of its own 60 (51)
    up to 4K."""
    assert stats.relative_effective_length({2048: 60, 4096: 52, 8192: 50}, base=60) == 4096
    assert stats.relative_effective_length({2048: 0, 4096: 0}, base=0) is None  # nothing to keep
    records = [
        _record("niah4", n, seed, 100.0 if seed < passed else 0.0)
        for n, passed in ((2048, 6), (4096, 6), (8192, 2))
        for seed in range(10)
    ]
    (tmp_path / runner.RESULTS).write_text("".join(json.dumps(r) + "\n" for r in records))
    report.build(tmp_path)
    (effective,) = json.loads((tmp_path / "summary.json").read_text())["effective_length"]
    assert (effective["point"], effective["relative"], effective["relative_sure"]) == (0, 4096, 0)
    assert (tmp_path / "summary.csv").read_text().splitlines()[1].endswith(",0,0,4096,0")


@pytest.mark.slow
def test_a_batch_gives_the_answers_of_one_case_at_a_time_also_read_in_chunks(tmp_path):
    model = tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=1024)

    def grid():
        return Grid(
            "tiny",
            ["passkey", "ruler-tight:niah_single_1"],
            [MethodSpec.parse("rope"), MethodSpec.parse("string:shift=200,local_window=8")],
            [700, 900],
            [0.5],
            3,
        )

    one = runner.read_results(runner.run(grid(), tmp_path / "one", Transformers((model, byte_tokenizer()))))
    three = runner.read_results(
        runner.run(grid(), tmp_path / "three", Transformers((model, byte_tokenizer())), batch_size=3)
    )
    chunked = runner.read_results(
        runner.run(
            grid(), tmp_path / "chunked", Transformers((model, byte_tokenizer()), prefill_tokens=256), batch_size=3
        )
    )  # three prompts of 700-900 tokens in chunks of 85
    assert len(one) == len(three) == len(chunked) == 24

    def answers(records):
        return {runner.case_key(r): (r["answer"], r["prompt_hash"], r["n_tokens"]) for r in records}

    assert answers(one) == answers(three) == answers(chunked)
    assert {r["prefill_tokens"] for r in one} == {0} and {r["prefill_tokens"] for r in three} == {
        generate.BATCH_PREFILL_TOKENS
    }
    assert {r["prefill_tokens"] for r in chunked} == {256}


def test_length_dependent_methods_answer_the_same_in_any_batch_and_chunking(tmp_path):
    """Beyond L: DCA's temperature and DDA's rates take the whole prompt however it is read; dynamic NTK, whose
    frequencies follow a forward's longest sequence, decodes each case alone in one forward."""
    model = tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=512)
    methods = ["dynamic:factor=2", "dca:mscale=true,chunk_size=300,local_window=40", "dynamic_drop:chunk=64,layers=0;1"]

    def grid():
        return Grid("tiny", ["passkey"], [MethodSpec.parse(m) for m in methods], [600, 700], [0.5], 3)

    runs = {
        name: runner.read_results(
            runner.run(grid(), tmp_path / name, Transformers((model, byte_tokenizer()), prefill), batch_size=batch)
        )
        for name, batch, prefill in (("one", 1, None), ("three", 3, None), ("chunked", 3, 301))
    }

    def answers(records):
        return {runner.case_key(r): (r["answer"], r["prompt_hash"]) for r in records}

    assert len(runs["one"]) == 18 and answers(runs["one"]) == answers(runs["three"]) == answers(runs["chunked"])
    dynamic = [r for r in runs["chunked"] if r["method"].startswith("dynamic:")]
    assert {(r["batch"], r["prefill_tokens"]) for r in dynamic} == {(1, 0)}
    assert {(r["batch"], r["prefill_tokens"]) for r in runs["chunked"] if r not in dynamic} == {(3, 301)}


def test_a_prefill_forward_stays_within_its_token_budget_over_the_batch():
    assert (
        generate.prefill_budget(1, None) == 0
        and generate.prefill_budget(4, None) == generate.BATCH_PREFILL_TOKENS == 4096
    )
    assert generate.prefill_budget(1, 8192) == 8192 and generate.prefill_budget(8, 0) == 0  # as given
    assert generate.prefill_chunk(4096, 4, 8192) == 2048
    assert generate.prefill_chunk(8000, 1, 8192) is None  # fits: one forward, as transformers does by default
    assert generate.prefill_chunk(16384, 1, 8192) == 8192
    assert generate.prefill_chunk(16384, 8, 0) is None  # 0: no budget
    assert generate.prefill_chunk(100, 3, 2) == 1
