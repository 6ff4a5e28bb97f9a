"""InfiniteBench's prompts as STRING's script builds them (HKUNLP/STRING ``inifinite_bench/src/``): the template of
each task (``prompt.py``), the record filled in (``eval_utils.create_prompt``), and the middle of the tokens cut to
the length (``test_infbench_llama.truncate_by_tokens``)."""

from __future__ import annotations

import re

LLAMA = {  # prompt.py's yarn_mistral_templates, which STRING's script uses for llama3.1 and llama3.1-70b
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will "
    "quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is",
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you "
    "about the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is",
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n"
    "{input}",
    "longbook_sum_eng": "Summarize the book below.\n\n{context}\n\nSummary:",
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n"
    "A. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is",
    "longbook_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n"
    "Question: {question}\nAnswer:",
    "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
    "math_find": "{prefix}\n\n{context}\n\n{input}",
    "math_calc": "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: "
    "[1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:",
    "code_run": "There is a function called {func} in the following Python code.\n\n{context}\n\nPlease compute the "
    "exact value of {func_call}. The value of {func_call} is",
    "code_debug": "Following is a Python code where exactly one of the functions/methods has a deliberate error that "
    "makes it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe "
    "correct option is:",
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a character name is replaced "
    'with "$$MASK$$", and you should try to guess who that character is.\n\n{context}\n\nThe name that has been '
    "replaced with $$MASK$$ is likely",
}
TEMPLATES = {
    "llama3.1": LLAMA,
    "qwen2": {task: "<|im_start|>\n" + text for task, text in LLAMA.items()},  # prompt.py's qwen2_templates
}
FUNCTION_CALL = re.compile(r"func_[0-9]+\(\-?[0-9]+\)")
TARGET_NUMBER = re.compile(r"The .+ of")


def create_prompt(record: dict, task: str, template: str = "llama3.1") -> str:
    """The text of a record of ``task`` (InfiniteBench's jsonl format: ``context``, ``input``, ``options``), as
    ``eval_utils.create_prompt`` fills it in: Code.Run names the first ``func_N(x)`` of the input; Math.Find's first
    line asks for what the input's ``The ... of`` names (``The largest number of`` lower-cased, its last three
    characters cut: ``the largest number``, no space left); multiple choice puts the four options in."""
    text = TEMPLATES[template][task]
    context = record.get("context")
    # not strict: only the multiple-choice tasks have options (the others none)
    options = dict(zip(("OPTION_A", "OPTION_B", "OPTION_C", "OPTION_D"), record.get("options") or [], strict=False))
    if task == "code_run":
        call = FUNCTION_CALL.findall(record["input"])[0]
        return text.format(func=call.split("(")[0], func_call=call, context=context)
    if task in ("code_debug", "longbook_choice_eng"):
        return text.format(context=context, question=record.get("input"), **options)
    if task in ("longbook_qa_eng", "longbook_qa_chn"):
        return text.format(context=context, question=record["input"])
    if task in ("longdialogue_qa_eng", "longbook_sum_eng", "math_calc"):
        return text.format(context=context)
    if task == "math_find":
        found = TARGET_NUMBER.findall(record["input"])  # there is one: data.problem checked the record
        prefix = f"What is {found[0].lower()[:-3]} in the following list?"
        return text.format(prefix=prefix, context=context, input=record["input"])
    return text.format(context=record.get("content", context), input=record["input"])  # the retrieval tasks


def truncated(tokenizer, text: str, budget: int | None) -> tuple[str, int]:
    """``text`` as STRING's ``truncate_by_tokens`` hands it to the model, in at most ``budget`` tokens (``None``:
    uncut): ``(prompt, tokens)``.

    Upstream tokenizes the text (BOS included), keeps the first and the last ``budget // 2`` tokens when there are
    more than ``budget``, decodes them without special tokens (always: a text that fits goes through the round trip
    too, which drops special tokens written into it, e.g. Qwen2's ``<|im_start|>``) and tokenizes that again with
    BOS. The round trip can merge or split tokens at the cut; where the prompt then takes more than ``budget``, the
    cut is made that much deeper (upstream's can pass its budget by those tokens).
    """
    from ..haystack import count_tokens, with_bos

    ids = tokenizer(text)["input_ids"]
    keep = len(ids) if budget is None else budget
    while True:
        kept = ids if len(ids) <= keep else ids[: keep // 2] + ids[-(keep // 2) :]
        prompt = with_bos(tokenizer, tokenizer.decode(kept, skip_special_tokens=True))
        tokens = count_tokens(tokenizer, prompt)
        if budget is None or tokens <= budget:
            return prompt, tokens
        keep -= tokens - budget
        if keep < 2:
            raise ValueError(f"a budget of {budget} tokens holds no prompt of this task")
