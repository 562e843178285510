# The two commands: `make demo` runs the main job, `make test` runs the whole suite.
# Both create the virtualenv and install everything they need on a fresh machine.

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3
PROMETHEUS := /usr/bin/prometheus
JAVA := /usr/bin/java
# apt-get needs root: use sudo when we are not root and it exists (else apt-get says why it fails).
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || command -v sudo)
APT_INSTALL := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends

.PHONY: demo demo-autoscale test test-fast lint typecheck prometheus java bench bench-chain bench-rescale bench-autoscaling bench-ds2-graph bench-spark bench-checkpoints bench-nexmark clean

# `python -m` puts the working directory first on sys.path, where our operator/ folder would
# shadow the standard library's `operator`; so venv and pip run from / and by their scripts.
# pip does not byte-compile every installed file (Spark's thousands): imports compile what
# they use, once.
$(STAMP): pyproject.toml
	cd / && $(PYTHON) -m venv $(CURDIR)/$(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet --no-compile -e '.[dev]'
	touch $(STAMP)

# The tests use a real Prometheus server, Debian's `prometheus` package; install it
# when missing. Refresh the package lists only when apt does not know the package yet.
prometheus: $(PROMETHEUS)

$(PROMETHEUS):
	@out=$$($(APT_INSTALL) prometheus 2>&1); status=$$?; echo "$$out"; \
	if [ $$status -ne 0 ]; then \
	  echo "$$out" | grep -qE 'Unable to locate package|has no installation candidate' || exit $$status; \
	  $(SUDO) apt-get update && $(APT_INSTALL) prometheus; \
	fi

# Spark (local mode) needs a Java runtime; install Debian's when there is none.
java: $(JAVA)

$(JAVA):
	@out=$$($(APT_INSTALL) openjdk-17-jre-headless 2>&1); status=$$?; echo "$$out"; \
	if [ $$status -ne 0 ]; then \
	  echo "$$out" | grep -qE 'Unable to locate package|has no installation candidate' || exit $$status; \
	  $(SUDO) apt-get update && $(APT_INSTALL) openjdk-17-jre-headless; \
	fi

# The main job: a PySpark source whose load rises and falls -> a keyed job that DS2 scales out
# and in with live hot-first migration -> a PySpark sink writing Parquet; the live view, a
# report (out/spark-demo/report.png) and a closing line checking the sink against Spark.
demo: $(STAMP) java
	$(PY) examples/spark/demo.py

# The autoscaling demo without Spark: the built-in generator feeds the job.
demo-autoscale: $(STAMP)
	$(VENV)/bin/keyshift run examples/autoscale.yaml --duration 100 --report out/autoscale-report.png

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	tools/typecheck.sh

# Two workers sharing the tests one at a time: the live tests also wait (process starts,
# rescale steps, checkpoints), so two keep the two cores busier than one. The modules marked `alone` (the
# operator in process, Spark's JVM) slow down too much beside another, and run after, alone.
test: lint typecheck prometheus java
	$(VENV)/bin/pytest -n 2 --dist worksteal -m "not alone" --durations=25
	$(VENV)/bin/pytest -m alone --durations=10

# The tests that start no process and no server (`-m "not live"`; a test that does and is not
# marked `live` fails at once, see tests/conftest.py): minutes, for the edit-test loop.
test-fast: lint typecheck
	$(VENV)/bin/pytest -n 2 --dist worksteal -m "not live and not alone" --durations=10

bench: $(STAMP)
	$(PY) bench/throughput.py

bench-chain: $(STAMP)
	$(PY) bench/chain_throughput.py

bench-rescale: $(STAMP)
	$(PY) bench/rescale.py

bench-autoscaling: $(STAMP)
	$(PY) bench/autoscaling_sim.py

bench-ds2-graph: $(STAMP)
	$(PY) bench/ds2_graph.py

bench-spark: $(STAMP) java
	$(PY) bench/spark_io.py

bench-checkpoints: $(STAMP)
	$(PY) bench/checkpoints.py

bench-nexmark: $(STAMP)
	$(PY) bench/nexmark.py --full

clean:
	rm -rf $(VENV) .typecheck .mypy_cache .ruff_cache .pytest_cache out
