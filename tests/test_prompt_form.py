"""``--template``, ``--chat-template-kwargs`` and ``--thinking`` (``longreach.eval.prompt_form``): the prompts each
form writes, the checks that refuse a form in one line, the thinking block taken off before scoring and kept, and a
folder that holds one form; on the transformers engine and a toy one (``tests/test_server.py``: on a server;
``tests/test_vllm_eval.py``: on vLLM)."""

import hashlib

import pytest
from helpers.tiny_models import TINY_VOCAB, byte_tokenizer, thinking_tokenizer, tiny_model
from test_engines import Toy

from longreach.cli import main
from longreach.eval import haystack, runner, tasks
from longreach.eval.grid import Grid
from longreach.eval.prompt_form import PromptForm, split_thinking
from longreach.methods.spec import MethodSpec

TASK = "ruler:niah_single_1"


def test_each_form_writes_its_prompt():
    tokenizer = thinking_tokenizer()
    turn = "<|im_start|>user\nfind it</s>\n<|im_start|>assistant\n"
    assert haystack.templated(tokenizer, "find it", " Answer:") == turn + " Answer:"
    base = PromptForm.parse("base").tokenizer(tokenizer)
    assert haystack.templated(base, "find it", " Answer:") == "find it Answer:"
    off = PromptForm.parse(chat_template_kwargs='{"enable_thinking": false}').tokenizer(tokenizer)
    assert haystack.templated(off, "find it", " Answer:") == turn + "<think>\n\n</think>\n\n Answer:"
    thinking = PromptForm.parse(thinking=64).tokenizer(tokenizer)
    assert haystack.templated(thinking, "find it", " Answer:") == turn  # RULER's advice: no answer prefix
    assert haystack.templated(thinking, "find it", " Answer:", demonstration=True) == turn + " Answer:"
    assert len(base) == len(tokenizer) and base("ab").input_ids == tokenizer("ab").input_ids


@pytest.mark.parametrize(
    "arguments, line",
    [
        ({"template": "raw"}, "--template='raw' is not one of auto, chat, base"),
        ({"chat_template_kwargs": "{enable"}, "--chat-template-kwargs='{enable' is not JSON"),
        ({"chat_template_kwargs": "[1]"}, "is not a JSON object, such as '{\"enable_thinking\": false}'"),
        ({"thinking": 0}, "--thinking=0 is out of range: a number of tokens, at least 1"),
        ({"template": "base", "thinking": 8}, "--thinking needs a chat template, and --template=base writes"),
    ],
)
def test_a_wrong_option_is_one_line(arguments, line):
    with pytest.raises(ValueError, match=line.replace("(", r"\(").replace("[", r"\[")) as refused:
        PromptForm.parse(**arguments)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "tokenizer, form, names, line",
    [
        (thinking_tokenizer, PromptForm(), [TASK], "the chat template thinks unless told not to"),
        (byte_tokenizer, PromptForm.parse("chat"), ["niah4"], "niah4 is not one (its prompt is the bare text"),
        (byte_tokenizer, PromptForm.parse(thinking=8), ["ppl"], "ppl is not one"),
        (lambda: None, PromptForm.parse("chat"), [TASK], "--template=chat needs a chat template"),
    ],
)
def test_a_form_the_model_or_a_task_cannot_take_is_refused_in_one_line(tokenizer, form, names, line):
    with pytest.raises(ValueError, match=line.replace("(", r"\(")) as refused:
        form.check(tokenizer(), names, tasks.get)
    assert "\n" not in str(refused.value)


def test_the_forms_that_run():
    tokenizer = thinking_tokenizer()
    for form in (PromptForm.parse(thinking=8), PromptForm.parse(chat_template_kwargs='{"enable_thinking": false}')):
        form.check(tokenizer, [TASK], tasks.get)
    PromptForm().check(tokenizer, ["niah4", "passkey", "ppl"], tasks.get)  # bare tasks: the template is not read
    PromptForm.parse("base").check(tokenizer, [TASK, "niah4"], tasks.get)
    PromptForm().check(byte_tokenizer(), [TASK], tasks.get)  # a template without a thinking switch


@pytest.mark.parametrize(
    "answer, thinking, rest",
    [
        ("<think>\nthe key is 4</think>\n\n 12345", "<think>\nthe key is 4</think>", "12345"),
        ("the key is 4</think> 12345", "the key is 4</think>", "12345"),  # the template opened the block
        ("<think> still thinking", "<think> still thinking", ""),  # the budget ran out
        ("12345", "", "12345"),
    ],
)
def test_the_thinking_block_is_split_off(answer, thinking, rest):
    assert split_thinking(answer) == (thinking, rest)


class Thinker(Toy):
    """The toy engine with a thinking tokenizer, which thinks (naming a wrong number) before it answers right."""

    def start(self, grid, world):
        resolved = super().start(grid, world)
        self.tokenizer, self.asked = thinking_tokenizer(), []
        return resolved

    def decode(self, task, label, cases):
        self.asked.append((task.max_new_tokens, [case.prompt for case in cases]))
        for index, case in enumerate(cases):
            yield index, {"answer": f"<think>is it 99?</think> {' '.join(case.references)}"}


def grid(names=(TASK,)) -> Grid:
    return Grid("tiny", list(names), [MethodSpec.parse("rope")], [1500], [0.5], 2)


def test_a_thinking_run_scores_the_answer_after_the_block_and_keeps_the_block(tmp_path):
    engine, form = Thinker(), PromptForm.parse(thinking=32)
    runner.run(grid(), tmp_path, engine, form=form)
    records = runner.read_results(tmp_path / runner.RESULTS)
    task = tasks.get(TASK)
    assert [budget for budget, _ in engine.asked] == [task.max_new_tokens + 32] * 2
    assert all(r["score"] == 100.0 and r["thinking"] == "<think>is it 99?</think>" for r in records)
    assert all(r["answer"] == " ".join(r["references"]) for r in records)
    assert all(r["max_new_tokens"] == task.max_new_tokens + 32 for r in records)
    assert all(r["prompt_form"] == {"template": "auto", "chat_template_kwargs": "{}", "thinking": 32} for r in records)
    dressed = form.tokenizer(thinking_tokenizer())
    for (_, [prompt]), record in zip(engine.asked, records, strict=True):
        assert prompt.endswith("<|im_start|>assistant\n")  # no answer prefix after the open turn
        assert record["prompt_hash"] == hashlib.sha256(prompt.encode()).hexdigest()[:16]
        built = task.build(dressed, 1500, None, record["seed"])
        assert built.prompt == prompt
        assert built.n_tokens + task.max_new_tokens <= 1500  # the haystack as without thinking


def test_a_folder_holds_one_prompt_form(tmp_path):
    runner.run(grid(), tmp_path, Thinker(), form=PromptForm.parse(thinking=32))
    other = PromptForm.parse(chat_template_kwargs='{"enable_thinking": false}')
    with pytest.raises(ValueError, match=r"holds results in \{.*\"thinking\": 32\}: resume it with those --template"):
        runner.run(grid(), tmp_path, Thinker(), form=other)
    runner.run(grid(), tmp_path, Thinker(), form=PromptForm.parse(thinking=32))  # the same form resumes


def test_the_default_form_keeps_records_as_they_were(tmp_path):
    runner.run(grid(["passkey"]), tmp_path, Toy())
    assert not any("prompt_form" in r for r in runner.read_results(tmp_path / runner.RESULTS))


def test_the_command_line_runs_each_form_on_the_transformers_engine(tmp_path):
    folder = tmp_path / "model"
    tiny_model("llama", vocab_size=TINY_VOCAB, max_position_embeddings=2048).save_pretrained(folder)
    thinking_tokenizer().save_pretrained(folder)
    common = [TASK, "--model", str(folder), "--lengths", "1500", "--samples", "1", "--method", "rope"]
    with pytest.raises(SystemExit, match="the chat template thinks unless told not to"):
        main(["eval", *common, "--out", str(tmp_path / "auto")])
    prompts = {}
    for name, extra in {
        "thinking": ["--thinking", "6"],
        "off": ["--chat-template-kwargs", '{"enable_thinking": false}'],
        "base": ["--template", "base"],
    }.items():
        main(["eval", *common, *extra, "--out", str(tmp_path / name)])
        [record] = runner.read_results(tmp_path / name / runner.RESULTS)
        assert not record.get("error") and ("thinking" in record) == (name == "thinking")
        prompts[name] = record
    assert prompts["thinking"]["max_new_tokens"] == tasks.get(TASK).max_new_tokens + 6
    assert len({r["prompt_hash"] for r in prompts.values()}) == 3
