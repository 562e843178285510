# The two commands: `make demo` runs the main job, `make test` runs the whole suite.
# Both create the virtualenv and install everything they need on a fresh machine.

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3

.PHONY: demo test lint typecheck bench bench-rescale clean

# `python -m` puts the working directory first on sys.path, where our operator/ folder would
# shadow the standard library's `operator`; so venv and pip run from / and by their scripts.
$(STAMP): pyproject.toml
	cd / && $(PYTHON) -m venv $(CURDIR)/$(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/keyshift run examples/clicks.yaml --duration 30

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	tools/typecheck.sh

test: lint typecheck
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(PY) bench/throughput.py

bench-rescale: $(STAMP)
	$(PY) bench/rescale.py

clean:
	rm -rf $(VENV) .typecheck .mypy_cache .ruff_cache .pytest_cache out
