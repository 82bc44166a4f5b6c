# DARE environment and entry points. Everything runs through .venv/bin/... (no activation).
# See docs/environment.md for why the install happens in this order.

SHELL  := /bin/bash
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

# One GPU check decides the torch build and the DeepSpeed accelerator.
HAVE_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)

# torch goes in FIRST and pinned: a bare "torch" lets pip pull GBs of CUDA wheels.
ifeq ($(HAVE_GPU),1)
TORCH_SPEC ?= torch==2.13.0
else
TORCH_SPEC ?= torch==2.13.0+cpu
endif

# Constraints: hand-written pins (fast resolve) + the committed lock, if any (repeatable installs).
LOCK        := requirements/lock.txt
CONSTRAINTS := -c requirements/constraints.txt $(if $(wildcard $(LOCK)),-c $(LOCK))
# Re-stating the torch pin in later installs stops the resolver from swapping the build.
PIN_TORCH   := "$(TORCH_SPEC)"

PYTEST_ARGS ?=
# Test modules spread over this many processes (pytest-xdist; 0: all in this one). Each test
# computes on one thread (tests/conftest.py), so two keep CI's two cores busy: about half the time.
PYTEST_WORKERS ?= 2
RUN_ARGS    ?=

# lmdeploy's own environment (its lock is resolved with uv, which requirements/test.txt installs).
LMDEPLOY_VENV   := .venv-lmdeploy
LMDEPLOY_LOCK   := requirements/lmdeploy.txt
LMDEPLOY_PYTHON ?= $(PYTHON)
# The CPU overlay for tests; the variable the tests read (tests/lmdeploy_cpu.py) names it here too.
DARE_LMDEPLOY_CPU ?= $(CURDIR)/.cache/lmdeploy-cpu

# ---- Runtime environment shared by every target (offline-friendly, caches inside the repo) ----
# dare.env holds the list; `dare stage` and the flow read the same file (dare_core/process/env_file.py).
# Its ${DARE_PROJECT} is this checkout (the checkout a workspace of an isolated run belongs to).
DARE_PROJECT := $(firstword $(subst /.cache/workspaces/, ,$(CURDIR)))
include dare.env
export $(shell sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p' dare.env)
ifneq ($(HAVE_GPU),1)
export DS_ACCELERATOR := cpu
endif

.PHONY: venv venv-test sandbox browser ds-ops lmdeploy lmdeploy-cpu lmdeploy-lock run test repro lock clean distclean

venv: $(VENV)/.stamp
venv-test: $(VENV)/.stamp-test

# requirements/lmdeploy.txt locks the engine's own environment (below), not this one.
$(VENV)/.stamp: pyproject.toml $(filter-out $(LMDEPLOY_LOCK),$(wildcard requirements/*.txt))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(CONSTRAINTS) $(PIN_TORCH)
	$(PIP) install $(CONSTRAINTS) $(PIN_TORCH) -r requirements/base.txt
# DeepSpeed's setup.py imports torch, so no build isolation; ops are JIT-built when first used.
	DS_BUILD_OPS=0 $(PIP) install --no-build-isolation $(CONSTRAINTS) $(PIN_TORCH) deepspeed
# Dependencies are already in place: install only our package (editable).
	$(PIP) install --no-deps -e .
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp requirements/test.txt
	$(PIP) install $(CONSTRAINTS) $(PIN_TORCH) -r requirements/test.txt
	touch $@

# The code reward's OS-level sandbox (dare_core/rewards/sandbox/__init__.py) runs candidate code under
# bubblewrap; without it the code reward refuses to run. Debian/Ubuntu package, installed as root or
# through sudo.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
	  sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y --no-install-recommends bubblewrap \
	    || { $$sudo apt-get update -q && $$sudo apt-get install -y --no-install-recommends bubblewrap; }; \
	} || { echo "error: could not install bubblewrap (the code sandbox needs it): install the bubblewrap package" >&2; exit 1; }

# Headless Chromium for the Prefect UI screenshot test (tests/flows/test_ui_screenshot.py, through
# Playwright with executable_path; Playwright's own browser download is not used). Debian package,
# installed as root or through sudo.
# after sandbox: the two apt-get installs would contend for dpkg's lock under `make -j`
browser: sandbox
	@test -x /usr/bin/chromium || { \
	  sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y --no-install-recommends chromium \
	    || { $$sudo apt-get update -q && $$sudo apt-get install -y --no-install-recommends chromium; }; \
	} || { echo "error: could not install chromium (the UI screenshot test needs it): install the chromium package" >&2; exit 1; }

# The pipeline's code reward needs the sandbox: installed here, so that a fresh machine's first code
# reward does not stop on SandboxUnavailable (nothing is installed where bwrap already is).
run: venv sandbox
	mkdir -p "$(PREFECT_HOME)"
	$(PY) -m flows.pipeline $(RUN_ARGS)

# DeepSpeed's CPU ops (CPU Adam for an offloaded optimizer, shared-memory collectives) are compiled
# on first use into .cache/torch_extensions, where the stages and tests look for them. Built here,
# once, with no time limit: a build inside a test's time limit that gets killed leaves its lock
# behind, and every later use then waits on it.
# The two ops build apart, so that `make -j` compiles them at the same time; each says what it
# builds and how long it took, as a stage does (dare_core/training/op_builds.py).
OPS_DIR := $(CURDIR)/.cache/torch_extensions
DS_OPS  := CPUAdamBuilder ShareMemCommBuilder
.PHONY: $(addprefix ds-op-,$(DS_OPS))
ds-ops: $(addprefix ds-op-,$(DS_OPS))
$(addprefix ds-op-,$(DS_OPS)): ds-op-%: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$(OPS_DIR)" \
	  $(PY) -m dare_core.training.op_builds $*

# Tests marked "gpu" are skipped automatically when no CUDA device is present (tests/conftest.py).
# The setup steps run side by side (pip, apt-get and the op builds wait on different things).
# DARE_LMDEPLOY_CPU makes the lmdeploy CPU tests fail, not skip, when the overlay is broken.
test:
	$(MAKE) -j4 venv-test sandbox browser ds-ops lmdeploy-cpu
	DARE_LMDEPLOY_CPU="$(DARE_LMDEPLOY_CPU)" $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# ---- lmdeploy: its own environment (docs/environment.md#lmdeploy) ----
# Every lmdeploy release wants peft<=0.14.0 and 0.18.0 wants torch<=2.12.1; DARE has peft 0.21.2 and
# torch 2.13.0. So the engine runs in a child process with the python of .venv-lmdeploy.
# One lock serves Python 3.11 and 3.12 on Linux x86_64 (lmdeploy has no other Linux wheel): resolved
# for the older one, whose pins (numpy, networkx) 3.12 also has; tests/test_lmdeploy_install.py
# resolves the lock again for both. --no-config: a user's uv.toml must not change the result.
LMDEPLOY_UV_ARGS := --no-config --index-url https://pypi.org/simple --python-platform x86_64-manylinux_2_28 --python-version 3.11

lmdeploy: $(LMDEPLOY_VENV)/.stamp

# The lock is complete, so --no-deps installs exactly it and `pip check` proves it consistent.
$(LMDEPLOY_VENV)/.stamp: $(LMDEPLOY_LOCK)
	@[ "$(HAVE_GPU)" = 1 ] || { echo "error: no nvidia-smi: lmdeploy's kernels need CUDA, and the lock holds GBs of CUDA wheels." \
	  "Building for a GPU machine (an image)? make lmdeploy HAVE_GPU=1. CPU tests: make lmdeploy-cpu" >&2; exit 1; }
	@$(LMDEPLOY_PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 11), (3, 12)))' \
	  || { echo "error: $(LMDEPLOY_LOCK) is resolved for Python 3.11 and 3.12; $(LMDEPLOY_PYTHON) is" \
	  "$$($(LMDEPLOY_PYTHON) -V 2>&1): make lmdeploy LMDEPLOY_PYTHON=python3.12" >&2; exit 1; }
	test -x $(LMDEPLOY_VENV)/bin/python || $(LMDEPLOY_PYTHON) -m venv $(LMDEPLOY_VENV)
	$(LMDEPLOY_VENV)/bin/python -m pip install --no-deps -r $(LMDEPLOY_LOCK)
	$(LMDEPLOY_VENV)/bin/python -m pip check
	touch $@

# A fresh resolve (the old lock is not consulted). The header holds the command that made it.
lmdeploy-lock: venv-test
	$(VENV)/bin/uv pip compile $(LMDEPLOY_UV_ARGS) --no-header requirements/lmdeploy.in -o $(LMDEPLOY_LOCK).tmp
	{ echo "# The lmdeploy engine's environment, fully pinned: make lmdeploy-lock, which runs"; \
	  echo "#   uv pip compile $(LMDEPLOY_UV_ARGS) --no-header requirements/lmdeploy.in -o $(LMDEPLOY_LOCK)"; \
	  echo "# (uv $$($(VENV)/bin/uv --version | cut -d' ' -f2)). Install: make lmdeploy (docs/environment.md)."; \
	  cat $(LMDEPLOY_LOCK).tmp; } > $(LMDEPLOY_LOCK)
	rm $(LMDEPLOY_LOCK).tmp

# CPU tests of the engine's code run lmdeploy's PyTorch engine modules on DARE's own torch and
# transformers: a `pip install --target` folder, put first on PYTHONPATH in a subprocess
# (tests/lmdeploy_cpu.py). Only the distributions that import needs beside DARE's environment, at
# the lock's versions (xgrammar and its apache-tvm-ffi: the model agent's module, whose names the
# engine's process calls). The TurboMind binary (~350 MB) goes: the PyTorch engine never loads it.
# Installed by .venv's pip so the wheels match its Python; built under a temporary name, then moved,
# so an interrupted build is never taken for a finished one.
LMDEPLOY_CPU_PKGS := lmdeploy triton pybase64 pyzmq xgrammar apache-tvm-ffi

lmdeploy-cpu: $(DARE_LMDEPLOY_CPU)/.stamp

$(DARE_LMDEPLOY_CPU)/.stamp: $(LMDEPLOY_LOCK) | venv
	rm -rf "$(DARE_LMDEPLOY_CPU)" "$(DARE_LMDEPLOY_CPU).tmp"
	mkdir -p "$(DARE_LMDEPLOY_CPU).tmp"
	for p in $(LMDEPLOY_CPU_PKGS); do grep -E "^$$p==" $(LMDEPLOY_LOCK) \
	  || { echo "error: $(LMDEPLOY_LOCK) pins no $$p" >&2; exit 1; }; done > "$(DARE_LMDEPLOY_CPU).tmp/pins.txt"
	$(PIP) install --no-deps --only-binary=:all: --target "$(DARE_LMDEPLOY_CPU).tmp" -r "$(DARE_LMDEPLOY_CPU).tmp/pins.txt"
	rm -f "$(DARE_LMDEPLOY_CPU).tmp"/lmdeploy/turbomind/_turbomind*.so
	mv "$(DARE_LMDEPLOY_CPU).tmp" "$(DARE_LMDEPLOY_CPU)"
	touch $@

# stage commands call `dare`, so the venv's bin goes first on PATH; the RL stage's code reward needs the sandbox
repro: venv sandbox
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/dvc repro

# torch/nvidia-*/triton/cuda-* are chosen per machine (CPU or CUDA build), so they stay out.
lock: venv
	$(PIP) freeze --exclude-editable \
	  | grep -viE '^(torch|triton)( |==|@)|^(nvidia|cuda)-' > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)
# The venv already matches the new lock: don't make the next target reinstall.
	touch $(VENV)/.stamp; test ! -e $(VENV)/.stamp-test || touch $(VENV)/.stamp-test

# Pipeline outputs and caches; DVC can rebuild them.
clean:
	rm -rf runs models metrics data/prepared .cache

distclean: clean
	rm -rf $(VENV) $(LMDEPLOY_VENV)
