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
# where the environment sets it, every process (each test worker, Ray worker, job) would re-compile every module
# it imports from source: let the first import keep its .pyc (pip installs without them, see $(STAMP))
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv demo test test-slow test-all test-fast test-cluster stack-up stack-down bench clean gpu-prepare gpu-sim gpu-jobs-prepare gpu-jobs-sim

venv: $(STAMP)

# torch is installed first from the pinned CPU build; GPU machines: see README ("GPU install").
# --no-compile: pip would byte-compile all ~24,500 installed .py files one by one (~100 s on 2 cores, most never
# imported); Python compiles what is imported on first use instead and keeps it (hence the unexport above).
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile --upgrade pip
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)  ## the whole lifecycle on the embedded local stack (PROFILE=smoke|default|full)
	$(PY) -m jobs.demo --profile $(PROFILE)

# Unit tests live in tests/unit/<package>/ (mirroring the code), integration tests in tests/integration/:
# they start real servers and Ray in-process; Ray and MLflow keep process-wide state (auth token,
# tracking URI), so integration modules run in fresh interpreters (pytest exit 5 = nothing selected).
# The tiers run one after the other: measured 2026-12-07 on a quiet 2-core AVX2 EPYC, the unit tier alone
# (2 workers) took 352 s and the integration tier alone 244 s (178 + 28 + 38 s; busy ~90 % of its wall time), while
# side by side, the unit tier niced, they took 848 s and 468 s: each starves the other (Ray's and the servers'
# start-up and polling, two inductor builds and a flywheel loop on 2 cores), and a run ends when the slower ends.
# Tiers: `make test` (CI, <= 12 min on 2 cores incl. the install) skips tests marked `slow` (the long
# end-to-end runs: smoke demo, Ray Train kill/resume, ...); `make test-slow` runs exactly
# those; `make test-all` both. Unit tests run in one pytest on every core (pytest-xdist), the 31 marked `heavy`
# (each over ~4.5 s: inductor builds, thousands of χ² samples, SmolLM2, spawned gloo ranks) first and each
# worker taking the next test when free (`--dist load --maxschedchunk 1`): longest first, a tail of short tests.
# `make test-fast` (the developer's loop) skips the heavy ones.
PYTEST := $(PY) -m pytest -q --timeout=900 -p no:cacheprovider --durations=15  # durations: where CI time goes
# `make test`'s integration runs: storage, rollouts, learning curve and the flywheel loop share one local
# stack (the session fixture); serve
# and the stack CLI start their own.
FAST_INTEGRATION := "tests/integration/test_storage.py tests/integration/test_rollouts.py tests/integration/test_learning_curve.py tests/integration/test_flywheel.py" \
	tests/integration/test_serve.py tests/integration/test_stack.py

test: $(STAMP)  ## what CI runs: the unit tests (heavy ones first), then the integration tier, none marked slow (every tier runs; fails if any did)
	@echo "== tests/unit (not slow; the heavy ones first: lossless proofs through the compiled core, SmolLM2, ranks)"; \
	$(PYTEST) -n auto --dist load --maxschedchunk 1 -m "not slow" tests/unit; failed=$$?; \
	for modules in $(FAST_INTEGRATION); do \
	  echo "== $$modules (integration, not slow)"; \
	  $(PYTEST) -m "integration and not slow" $$modules || failed=1; \
	done; \
	[ $$failed -eq 0 ]

test-slow: $(STAMP)  ## the tests `make test` skips (~45 min on 2 cores): long end-to-end runs
	$(PYTEST) -m slow tests/unit || [ $$? -eq 5 ]
	set -e; for module in tests/integration/test_*.py; do \
	  echo "== $$module (integration, slow)"; \
	  $(PYTEST) -m "integration and slow" $$module || [ $$? -eq 5 ]; \
	done

test-all: test test-slow  ## everything but the multi-node cluster tests

# A head + 2 worker Ray nodes on 127.0.0.1 (tests/cluster/cluster_fixture.py); each test kills a node.
test-cluster: $(STAMP)  ## multi-node Ray: rollouts, ZeRO-3 training and serving survive losing a node
	$(PY) -m pytest -q --timeout=1800 -m cluster tests/cluster

test-fast: $(STAMP)  ## the developer's loop (~2 min): unit tests not marked slow or heavy, on every core
	$(PY) -m pytest -q -n auto --dist worksteal -p no:cacheprovider -m "not slow and not heavy" tests/unit

stack-up: $(STAMP)
	$(VENV)/bin/dspark stack up

stack-down: $(STAMP)
	$(VENV)/bin/dspark stack down

bench: $(STAMP)  ## every benchmark, JSON into benchmarks/report.json
	$(PY) -m benchmarks.run_all

gpu-prepare: $(STAMP)  ## .gpu-bundle/: wheels + compact target + launcher for a GPU machine (README "Running the GPU recipe")
	$(PY) -m recipes.gpu_prepare

gpu-sim: gpu-prepare  ## the GPU recipe on a simulated GPU machine (Python 3.12 + the image's torch/transformers), tiny and smollm2-135m
	$(PY) -m recipes.gpu_sim $(SIM)

gpu-jobs-prepare: $(STAMP)  ## .gpu-jobs-stage/ + .gpu-jobs/: Ray/DeepSpeed/MLflow wheels + launcher of the product's jobs on a GPU machine
	$(PY) -m recipes.gpu_jobs prepare

gpu-jobs-sim: gpu-jobs-prepare  ## the jobs bundle on the simulated GPU machine (the whole chain on its CPU; a cuda run stops at the CUDA check)
	$(PY) -m recipes.gpu_jobs sim

clean:
	-$(VENV)/bin/dspark stack down
	rm -rf .dspark
