"""The Python examples a newcomer runs first, run as written on the CPU with the default model.

The quick start (one block, the same in README.md and docs/get-started.md) and the API guide's block
(docs/usage.md) are executed; each ``print(...)  # text`` line must print that text. The runs are slow:
they load the real default model.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_block(page: str, heading: str) -> str:
    """The first ```python block after the heading ``heading`` of ``page``."""
    text = (ROOT / page).read_text(encoding="utf-8")
    match = re.search(rf"^#+ {re.escape(heading)}\n.*?^```python\n(.*?)^```", text, re.S | re.M)
    assert match, f"{page} has no python block under '{heading}'"
    return match.group(1)


def printed_and_promised(code: str, name: str) -> tuple[list[str], list[str]]:
    """What ``code`` printed, line by line, and what the comments of its ``print`` lines say it prints."""
    promised = [line.rsplit("  # ", 1)[1].strip() for line in code.splitlines() if line.startswith("print(")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), {})
    return out.getvalue().splitlines(), promised


def test_the_quick_start_is_one_text_in_the_readme_and_get_started():
    assert python_block("README.md", "Quick start, on a CPU") == python_block(
        "docs/get-started.md", "Quick start, on a CPU"
    )


@pytest.mark.slow
def test_the_quick_start_runs_on_the_cpu_and_prints_what_it_says():
    printed, promised = printed_and_promised(python_block("README.md", "Quick start, on a CPU"), "the quick start")
    assert printed == promised


@pytest.mark.slow
def test_the_api_guides_example_runs_on_the_cpu_save_and_load_included(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it saves the model to ./out
    printed, promised = printed_and_promised(
        python_block("docs/usage.md", "Python API guide"), "the API guide's example"
    )
    assert printed == promised and (tmp_path / "out" / "tokenizer.json").is_file()
