# dspark — the two set-up commands are `make demo` and `make test`; both create .venv themselves.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROFILE ?= default
export RAY_USAGE_STATS_ENABLED := 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export DS_ACCELERATOR := cpu
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo test test-fast test-cluster stack-up stack-down bench clean

venv: $(STAMP)

# torch is installed first from the pinned CPU build; GPU machines: see README ("GPU install").
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)  ## the whole lifecycle on the embedded local stack (PROFILE=smoke|default|full)
	$(PY) -m jobs.demo --profile $(PROFILE)

# Unit tests live in tests/unit/<package>/ (mirroring the code), integration tests in tests/integration/:
# they start real servers and Ray in-process; Ray and MLflow keep process-wide state (auth token,
# tracking URI), so each integration module runs in a fresh interpreter.
test: $(STAMP)  ## the full test suite, as CI runs it
	$(PY) -m pytest -q --timeout=900 tests/unit
	set -e; for module in tests/integration/test_*.py; do \
	  echo "== $$module (integration)"; \
	  $(PY) -m pytest -q --timeout=900 -m integration $$module; \
	done

# A head + 2 worker Ray nodes on 127.0.0.1 (tests/cluster/cluster_fixture.py); each test kills a node.
test-cluster: $(STAMP)  ## multi-node Ray: rollouts, ZeRO-3 training and serving survive losing a node
	$(PY) -m pytest -q --timeout=1800 -m cluster tests/cluster

test-fast: $(STAMP)  ## unit tests only (no servers, no slow tests)
	$(PY) -m pytest -q -m "not slow" tests/unit

stack-up: $(STAMP)
	$(VENV)/bin/dspark stack up

stack-down: $(STAMP)
	$(VENV)/bin/dspark stack down

bench: $(STAMP)  ## every benchmark, JSON into benchmarks/report.json
	$(PY) -m benchmarks.run_all

clean:
	-$(VENV)/bin/dspark stack down
	rm -rf .dspark
