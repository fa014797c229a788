# Two entry points: `make run` and `make test`. Both install into .venv first.
# `make bench` reproduces the bench table (minutes; an hour with TUNE_TRIALS=400).
VENV := .venv
PY := $(VENV)/bin/python
PIP_CACHE_DIR ?= $(CURDIR)/.cache/pip
export PIP_CACHE_DIR

.PHONY: install run test lint bench

TUNE_TRIALS ?= 0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest

run: install
	$(PY) -m server

bench: install
	$(PY) loadtest/bench_table.py --tune-trials $(TUNE_TRIALS)
