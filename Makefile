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
RUN_ARGS    ?=

# ---- Runtime environment shared by every target (offline-friendly, caches inside the repo) ----
# dare.env holds the list; `dare stage` and the flow read the same file (dare_core/env_file.py).
# Its ${DARE_PROJECT} is this checkout (the checkout a workspace of an isolated run belongs to).
DARE_PROJECT := $(firstword $(subst /.cache/workspaces/, ,$(CURDIR)))
include dare.env
export $(shell sed -n 's/^\([A-Za-z_][A-Za-z0-9_]*\)=.*/\1/p' dare.env)
ifneq ($(HAVE_GPU),1)
export DS_ACCELERATOR := cpu
endif

.PHONY: venv venv-test sandbox browser ds-ops run test repro lock clean distclean

venv: $(VENV)/.stamp
venv-test: $(VENV)/.stamp-test

$(VENV)/.stamp: pyproject.toml $(wildcard requirements/*.txt)
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

# The code reward's OS-level sandbox (dare_core/rewards/sandbox.py) runs candidate code under
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

run: venv
	mkdir -p "$(PREFECT_HOME)"
	$(PY) -m flows.pipeline $(RUN_ARGS)

# DeepSpeed's CPU ops (CPU Adam for an offloaded optimizer, shared-memory collectives) are compiled
# on first use into .cache/torch_extensions, where the stages and tests look for them. Built here,
# once, with no time limit: a build inside a test's time limit that gets killed leaves its lock
# behind, and every later use then waits on it.
# The two ops build apart, so that `make -j` compiles them at the same time.
OPS_DIR := $(CURDIR)/.cache/torch_extensions
DS_OPS  := CPUAdamBuilder ShareMemCommBuilder
.PHONY: $(addprefix ds-op-,$(DS_OPS))
ds-ops: $(addprefix ds-op-,$(DS_OPS))
$(addprefix ds-op-,$(DS_OPS)): ds-op-%: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$(OPS_DIR)" $(PY) -c \
	  'from deepspeed.accelerator import get_accelerator as a; a().create_op_builder("$*").load()'

# Tests marked "gpu" are skipped automatically when no CUDA device is present (tests/conftest.py).
# The setup steps run side by side (pip, apt-get and the op builds wait on different things).
test:
	$(MAKE) -j4 venv-test sandbox browser ds-ops
	$(PY) -m pytest -q $(PYTEST_ARGS)

# stage commands call `dare`, so the venv's bin goes first on PATH
repro: venv
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
	rm -rf $(VENV)
