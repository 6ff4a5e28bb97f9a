"""The site's home page is README.md: one text for both, so that they cannot disagree (a hook of mkdocs.yml).

docs/index.md holds only a note. When the site is built, its Markdown is replaced by README.md's, with the paths
README.md gives from the repository's root made relative to docs/: ``docs/PAGE`` becomes ``PAGE``, and
``bench/RESULTS.md`` becomes ``benchmarks.md`` (the page that includes it). Any other path README.md links to is
left as it is, so ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import re
from pathlib import Path

TO_SITE = [(re.compile(r'(\]\(|src=")docs/'), r"\1"), (re.compile(r"\]\(bench/RESULTS\.md"), "](benchmarks.md")]


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    text = (Path(config.config_file_path).parent / "README.md").read_text(encoding="utf-8")
    for pattern, replacement in TO_SITE:
        text = pattern.sub(replacement, text)
    return text
