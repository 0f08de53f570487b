# Set-up is part of every target: the venv is (re)built whenever the dependency files change.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS_HASH := $(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
STAMP := $(VENV)/.deps-$(DEPS_HASH)
# Sources come from this checkout even when the venv is a cached one made from another clone.
RUN := PYTHONPATH=$(CURDIR) $(PY)
TASK ?= image_classification

.PHONY: venv train test test-slow lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@rm -f $(VENV)/.deps-*
	@touch $@

train: venv
	$(RUN) -m recipes.train +task=$(TASK) $(ARGS)

test: venv
	$(RUN) -m pytest -q $(ARGS)

test-slow: venv
	$(RUN) -m pytest -q -m slow $(ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
