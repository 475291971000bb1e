# Developer shortcuts. Everything goes through the scripts in scripts/, which
# create .venv (torch==2.13.0 installed FIRST, then `pip install -e .[test]`)
# and always rebuild toast._core in place before running anything.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export TOAST_VENV := $(abspath $(VENV))

.PHONY: help venv build test demo asan bench lint format clean

help:
	@echo "make venv   - create $(VENV): torch==2.13.0 first, then toast[test] editable"
	@echo "make build  - rebuild the C extension in place"
	@echo "make test   - full test suite (scripts/test.sh; ARGS='...' go to pytest)"
	@echo "make demo   - run the demo (scripts/demo.sh; ARGS='...' go to the demo)"
	@echo "make asan   - ASan+UBSan build (temp dir), pytest tests -m 'not slow' (ARGS to override)"
	@echo "make bench  - python benchmarks/bench_core.py"
	@echo "make lint   - ruff check (make format: ruff format)"
	@echo "make clean  - remove build artefacts (keeps the venvs)"

venv build:
	bash scripts/setup_env.sh

test:
	bash scripts/test.sh $(ARGS)

demo:
	bash scripts/demo.sh $(ARGS)

asan:
	bash scripts/asan.sh $(ARGS)

bench: venv
	$(PY) benchmarks/bench_core.py $(ARGS)

lint: venv
	@test -x $(VENV)/bin/ruff || $(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check .

format: venv
	@test -x $(VENV)/bin/ruff || $(PY) -m pip install -q ruff
	$(VENV)/bin/ruff format .

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache toast-demo toast/_core*.so
	find . -name __pycache__ -type d -not -path './.venv*' -prune -exec rm -rf {} +
