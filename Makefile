# Two commands do everything on a fresh clone:
#   make demo   - set up, then train the small GPT on an emulated heterogeneous cluster
#   make test   - set up, then run the test suite (its time at the end), one pytest worker per core
#   make test-fast - the in-process tests only (no gloo ranks, no subprocesses, no soak run): about 2 minutes
#   make lint      - pyflakes and import order (ruff)
#   make durations - run the suite and rewrite tests/durations.txt (the order the workers take the files in)
#   make bench     - run the results page's benchmarks, write docs/benchmarks/report.md (10-15 minutes)
#   make bench-smoke - every benchmark once in its --quick configuration, with its time
#   make docs      - build the user manual (MkDocs) into site/, warnings as errors; make docs-serve: live preview
#   make dist      - build the wheel and sdist into dist/ and check them with twine
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast durations lint bench bench-smoke docs docs-picture docs-serve dist clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/activate pyproject.toml .ci/constraints.txt
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c .ci/constraints.txt torch
	$(BIN)/pip install -q -c .ci/constraints.txt -e ".[dev,docs]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/python -m cephalo_lightning demo

# Workers: one per core up to 4 (xdist); a test file is never split between two (its module fixtures run once).
# Files start longest first (tests/conftest.py, from tests/durations.txt): xdist keeps the collection order.
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
XDIST := -n $(WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	@start=$$(date +%s); $(BIN)/python -m pytest -q $(XDIST) --durations=15 tests; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s"; exit $$rc

test-fast: setup
	@start=$$(date +%s); $(BIN)/python -m pytest -q $(XDIST) -m "not multiprocess and not soak" tests; rc=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s"; exit $$rc

durations: setup
	$(BIN)/python -m pytest -q $(XDIST) --junitxml=.durations.xml tests; rc=$$?; \
	$(BIN)/python -m tests.durations .durations.xml > tests/durations.txt && rm -f .durations.xml; exit $$rc

lint: setup
	$(BIN)/ruff check cephalo_lightning tests benchmarks examples scenarios

bench: setup
	$(BIN)/python -m benchmarks.report

# The API reference is generated from the docstrings (mkdocstrings reads the source, imports nothing);
# the plan picture of docs/plan-reading.md is drawn from the shipped cluster file (not committed).
docs-picture: setup
	$(BIN)/python -m cephalo_lightning plan configs/clusters/two-nodes.yaml -b 64 --plot docs/img/plan-two-nodes.png > /dev/null

docs: docs-picture
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: docs-picture
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# The release artefacts: wheel and sdist from a clean build, their metadata checked.
dist: setup
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*

clean:
	rm -rf $(VENV) lightning_logs wandb runs benchmarks/out site dist build
