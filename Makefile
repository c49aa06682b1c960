# Two commands do everything on a fresh clone:
#   make demo   - set up, then train the small GPT on an emulated heterogeneous cluster
#   make test   - set up, then run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench report clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/activate pyproject.toml .ci/constraints.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c .ci/constraints.txt torch
	$(BIN)/pip install -q -c .ci/constraints.txt -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python -m cephalo_lightning demo

test: setup
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python benchmarks/report.py

clean:
	rm -rf $(VENV) lightning_logs wandb runs benchmarks/out
