"""InfiniteBench's scoring, task by task, as ``compute_scores.get_score_one`` in STRING's copy
(HKUNLP/STRING ``inifinite_bench/src/compute_scores.py``, which its numbers come from): each function takes the
prediction (the output with its whitespace joined, as ``test_infbench_llama.get_pred`` leaves it) and the label
(``eval_utils.get_answer``: the record's answer; for multiple choice ``[option text, letter]``) and returns upstream's
value (a bool or a fraction), which the task reports x 100."""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache


def _first(label):
    return label[0] if isinstance(label, list) else label


def _replaced(text: str, characters) -> str:
    for c in characters:
        text = text.replace(c, " ")
    return text


def first_int(prediction: str) -> str:
    """The first run of digits (``first_int_match``), or ``""``."""
    return next((item for item in re.split("[^0-9]", prediction) if item), "")


def passkey(prediction: str, label) -> bool:
    """Retrieve.PassKey and Retrieve.Number: the first run of digits is the key."""
    return _first(label) == first_int(prediction)


def kv_retrieval(prediction: str, label) -> bool:
    """Retrieve.KV: the value is one of the words once punctuation and braces are spaces."""
    return _first(label) in _replaced(prediction, ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]).split()


def code_run(prediction: str, label) -> bool:
    """Code.Run: the last word, punctuation spaced out, is the integer returned."""
    words = _replaced(prediction.strip(), ["\n", ".", "`", "'", '"', ":"]).split()
    try:
        return bool(words) and int(words[-1]) == _first(label)
    except ValueError:
        return False


def _after_prefix(prediction: str, prefixes, accepted) -> bool | None:
    """Upstream's answer prefixes: the first of ``prefixes`` found decides whether what follows it (past one
    character) starts with one of ``accepted``; ``None`` when none is found."""
    for prefix in prefixes:
        at = prediction.find(prefix)
        if at == -1:
            continue
        if len(prediction) < at + len(prefix) + 1:
            return False
        return any(prediction[at + len(prefix) + 1 :].startswith(a) for a in accepted)
    return None


def code_debug(prediction: str, label) -> bool:
    """Code.Debug: the last standalone letter A-J of the first line that has one, or the option's letter or the
    function's name at the start of the prediction or after an answer prefix."""
    prediction = prediction.strip()
    letter, function = label[1], label[0]
    match = re.search(r"\b[A-J]\b(?!.*\b[A-J]\b)", prediction)
    if match and match.group(0) == letter:
        return True
    prediction = _replaced(prediction.strip(), ["\n", "`", "'", '"', "-", "*", "Option", "option"])
    while "  " in prediction:
        prediction = prediction.replace("  ", " ")
    if prediction.startswith(letter) or prediction.startswith(function):
        return True
    return bool(_after_prefix(prediction, ("answer is:", "is:", "answer:", "correct option is:"), (letter, function)))


def math_find(prediction: str, label) -> bool:
    """Math.Find: the first number (``12.5`` or ``12``) equals the label, as an integer when the label is one."""
    label = _first(label)
    number = re.search(r"\d+\.\d+|\d+", prediction)
    if not isinstance(label, (int, float)):
        raise TypeError(f"Math.Find's label must be an int or a float, not {type(label).__name__}")
    if number is None:
        return False
    if isinstance(label, int):
        return int(float(number.group(0))) == label
    return float(number.group(0)) == label


def longdialogue_qa_eng(prediction: str, label) -> bool:
    """En.Dia: one of the names, upper-cased, is in the upper-cased prediction."""
    prediction = prediction.strip().upper()
    return any(name.upper() in prediction for name in label)


def longbook_choice_eng(prediction: str, label) -> bool:
    """En.MC: the last standalone A-D of the first line that has one; else the first character; else the prediction
    is the option; else what follows an answer prefix; else the first word that is part of ``"ABCD"`` (a substring
    test, as upstream's)."""
    prediction = prediction.strip()
    match = re.search(r"\b[A-D]\b(?!.*\b[A-D]\b)", prediction)
    if match and match.group(0) in label:
        return True
    if prediction == "":
        return False
    if prediction[0] in "ABCD":
        return prediction[0] in label
    if prediction in label:
        return True
    prediction = _replaced(prediction, ["\n", '"', "'", ".", ",", "?", "!", "{", "}"])
    while "  " in prediction:
        prediction = prediction.replace("  ", " ")
    found = _after_prefix(prediction, ("answer is:", "answer:", "answer is", "option is"), label)
    if found is not None:
        return found
    for word in prediction.split():
        if word in "ABCD":
            return word in label
    return False


def normalized(text: str) -> str:
    """SQuAD's normalisation (``normalize_answer``): lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _f1(prediction: list, truth: list) -> float:
    common = sum((Counter(prediction) & Counter(truth)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def longbook_qa_eng(prediction: str, label) -> float:
    """En.QA: the best token F1 over the answers, both normalised (``qa_f1_score``)."""
    return max([0.0] + [_f1(normalized(prediction).split(), normalized(truth).split()) for truth in label])


CHINESE_PUNCTUATION = (  # normalize_zh_answer's cn_punctuation
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣"
    "､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)


def _normalized_chinese(text: str) -> str:
    punctuation = set(string.punctuation + CHINESE_PUNCTUATION)
    return "".join("".join(c for c in text.lower() if c not in punctuation).split())


def longbook_qa_chn(prediction: str, label) -> float:
    """Zh.QA: the best character F1 over the answers, lower case, no punctuation or spaces (``qa_f1_score_zh``)."""
    return max([0.0] + [_f1(list(_normalized_chinese(prediction)), list(_normalized_chinese(t))) for t in label])


@lru_cache(maxsize=1)
def _rouge():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)


def longbook_sum_eng(prediction: str, label) -> float:
    """En.Sum: ROUGE-Lsum's F-measure (Lin 2004), Google's ``rouge-score`` as Hugging Face ``evaluate``'s ``rouge``
    runs it (no stemming; several references: the best)."""
    if isinstance(label, list):
        return _rouge().score_multi(label, prediction)["rougeLsum"].fmeasure
    return _rouge().score(label, prediction)["rougeLsum"].fmeasure


def math_calc(prediction: str, label) -> float:
    """Math.Calc: the share of the intermediate values given in order before the first wrong one (the prediction's
    runs of digits: a minus sign is not read)."""
    values = label[0] if isinstance(label[0], list) else label
    given = [int(item) for item in re.split("[^0-9]", prediction) if item]
    right = 0
    for value, guess in zip(values, given, strict=False):  # a prediction may give fewer or more values
        if value != guess:
            break
        right += 1
    return right / len(values)


SCORERS = {
    "passkey": passkey,
    "number_string": passkey,
    "kv_retrieval": kv_retrieval,
    "longbook_sum_eng": longbook_sum_eng,
    "longbook_choice_eng": longbook_choice_eng,
    "longbook_qa_eng": longbook_qa_eng,
    "longbook_qa_chn": longbook_qa_chn,
    "longdialogue_qa_eng": longdialogue_qa_eng,
    "math_find": math_find,
    "math_calc": math_calc,
    "code_run": code_run,
    "code_debug": code_debug,
}
METRICS = {
    "passkey": "first_int_match",
    "number_string": "first_int_match",
    "kv_retrieval": "word_match",
    "longbook_sum_eng": "rouge_lsum_f",
    "longbook_choice_eng": "choice_match",
    "longbook_qa_eng": "qa_f1",
    "longbook_qa_chn": "qa_f1_zh",
    "longdialogue_qa_eng": "name_in_answer",
    "math_find": "first_number_match",
    "math_calc": "values_in_order",
    "code_run": "last_integer_match",
    "code_debug": "choice_match",
}
