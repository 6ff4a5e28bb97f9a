"""bench/RESULTS.md: each benchmark run owns one ``## title`` section and replaces it when run again."""

from __future__ import annotations

import re
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(title: str, body: str) -> None:
    """Put ``body`` under ``## title`` in RESULTS.md (dated), replacing an older section of that title."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmarks\n"
    section = f"## {title}\n\nMeasured {date.today().isoformat()}.\n\n{body.strip()}\n\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text.rstrip("\n") + "\n")
