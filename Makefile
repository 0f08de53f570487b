# Set-up is part of every target: the venv is (re)built whenever the dependency files change.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS_HASH := $(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
STAMP := $(VENV)/.deps-$(DEPS_HASH)
# Sources come from this checkout even when the venv is a cached one made from another clone.
RUN := PYTHONPATH=$(CURDIR) $(PY)
TASK ?= asr

.PHONY: venv train test test-slow lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,speech,voices,whisper,wandb,mlflow,export,optuna,timm,detection,hf,parquet,eval]'
	@rm -f $(VENV)/.deps-*
	@touch $@

# `make train` trains TASK's recipe, +task=TASK. For speech that is Whisper tiny.en fine-tuned on the multi-engine
# voices corpus, the configuration that meets issue #28's goals within 6 minutes on 2 cores
# (docs/benchmarks/asr.md § Whisper tiny.en fine-tuned); TRAIN=experiment=asr_conformer trains the Conformer-XS on
# the 115-word preset instead.
TRAIN ?= +task=$(TASK)

train: venv
	$(RUN) -m recipes.train $(TRAIN) $(ARGS)

# The default suite on TEST_WORKERS processes (pytest-xdist), its 25 slowest tests listed at the end (what to
# cut first when the CI budget tightens, docs/testing.md): most of its time is CLI subprocesses and
# process starts, which two workers overlap on two cores. TEST_WORKERS=0 runs it in this one process.
# --dist loadscope: a module's tests go to one worker, so its module-scoped trained runs are trained once, not
# once a worker.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) $(if $(filter 0,$(TEST_WORKERS)),,--dist loadscope)

test: venv
	$(RUN) -m pytest -q $(XDIST) --durations=25 $(ARGS)

# The slow tests on TEST_WORKERS processes too: they are whole CLI runs, compiles and launches, which two
# workers overlap as they do the default suite's (docs/benchmarks/training-loop.md § The default test suite).
test-slow: venv
	$(RUN) -m pytest -q -m slow $(XDIST) --durations=25 $(ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache

# Legacy profile: torch 2.3 + torchtext 0.18 (torchtext's last release loads only against torch 2.3).
# The venv lives outside the clone, keyed by the dependency files, so clones and CI runs share it.
LEGACY_HASH := $(shell cat pyproject.toml constraints-legacy.txt | sha256sum | cut -c1-16)
LEGACY_VENV ?= $(or $(TORCHKILN_VENV_CACHE),$(HOME)/.cache/torchkiln/venvs)/legacy-$(LEGACY_HASH)
LEGACY_PY := $(LEGACY_VENV)/bin/python

.PHONY: venv-legacy test-legacy

venv-legacy: $(LEGACY_VENV)/.ready

$(LEGACY_VENV)/.ready: pyproject.toml constraints-legacy.txt
	@test -x $(LEGACY_PY) || $(PYTHON) -m venv $(LEGACY_VENV)
	$(LEGACY_PY) -m pip install -q --upgrade pip
	$(LEGACY_PY) -m pip install -q -c constraints-legacy.txt -e '.[dev]' torchtext
	@touch $@

# pytest exits 5 when nothing is marked legacy; that is a failure here, not a pass.
test-legacy: venv-legacy
	PYTHONPATH=$(CURDIR) $(LEGACY_PY) -m pytest -q -m legacy $(XDIST) $(ARGS)

# The arm64-marked tests on an emulated aarch64 userland (QEMU user mode), for a Graviton2-like and a
# Graviton3-like CPU: needs root; the rootfs and its venv are built once, cached outside the clone
# (scripts/arm64.sh, docs/graviton.md). Not part of `test`: it needs root, and emulation is slow.
.PHONY: test-arm64

test-arm64:
	PYTHON=$(PYTHON) scripts/arm64.sh $(ARGS)
