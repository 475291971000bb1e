# Developer shortcuts. Everything goes through the scripts in scripts/, which
# create .venv (torch==2.13.0 installed FIRST, then `pip install -e .[test]`)
# and always rebuild toast._core in place before running anything.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export TOAST_VENV := $(abspath $(VENV))

.PHONY: help venv build test demo asan bench lint format clean \
	ctest ctest-asan ctest-valgrind fuzz-ci fuzz-long

help:
	@echo "make venv   - create $(VENV): torch==2.13.0 first, then toast-compress[test] editable"
	@echo "make build  - rebuild the C extension in place"
	@echo "make test   - full test suite (scripts/test.sh; ARGS='...' go to pytest)"
	@echo "make demo   - run the demo (scripts/demo.sh; ARGS='...' go to the demo)"
	@echo "make asan   - ASan+UBSan build (temp dir), pytest tests -m 'not slow and not hf' (ARGS to override)"
	@echo "make ctest  - C-level tests of the core (csrc/tests, no Python)"
	@echo "make ctest-asan     - the same under ASan+UBSan"
	@echo "make ctest-valgrind - the same under valgrind (memcheck)"
	@echo "make fuzz-ci   - atheris fuzzing of toast._core (90 s) + ASan replay"
	@echo "make fuzz-long - the same for 30 minutes (FUZZ_TIME=seconds)"
	@echo "make bench  - python benchmarks/bench_core.py"
	@echo "make lint   - ruff, import-linter contracts, mypy, size rules (make format: ruff format)"
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

lint:
	bash scripts/lint.sh

format: venv
	@test -x $(VENV)/bin/ruff || $(PY) -m pip install -q ruff
	$(VENV)/bin/ruff format .

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache toast-demo toast/_core*.so
	find . -name __pycache__ -type d -not -path './.venv*' -prune -exec rm -rf {} +

# ---------------------------------------------------------------- C tests
# csrc/tests/test_core.c against the core sources and the scipy-openblas32
# wheel's OpenBLAS (as setup.py does); binaries go to build/ctest/.
CC ?= gcc
CTEST_DIR := build/ctest
CTEST_SRC := $(wildcard csrc/*.c) csrc/tests/test_core.c
CTEST_CFLAGS := -std=c11 -fopenmp-simd -Wall -Wextra -Icsrc -DTOAST_BLAS_PREFIX=scipy_
# Evaluated only when a ctest target runs (needs the venv).
BLAS_INC = $(shell $(PY) -c "import scipy_openblas32 as s; print(s.get_include_dir())")
BLAS_LIB = $(shell $(PY) -c "import scipy_openblas32 as s; print(s.get_lib_dir())")
CTEST_LDFLAGS = -L$(BLAS_LIB) -Wl,-rpath,$(BLAS_LIB) -lscipy_openblas -lm
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer

$(CTEST_DIR)/test_core: $(CTEST_SRC) $(wildcard csrc/*.h)
	@mkdir -p $(CTEST_DIR)
	$(CC) $(CTEST_CFLAGS) -O2 -g -I$(BLAS_INC) $(CTEST_SRC) $(CTEST_LDFLAGS) -o $@

$(CTEST_DIR)/test_core_asan: $(CTEST_SRC) $(wildcard csrc/*.h)
	@mkdir -p $(CTEST_DIR)
	$(CC) $(CTEST_CFLAGS) -O1 -g -UNDEBUG -fno-wrapv $(SAN_FLAGS) -I$(BLAS_INC) \
		$(CTEST_SRC) $(CTEST_LDFLAGS) -o $@

ctest: $(CTEST_DIR)/test_core
	$(CTEST_DIR)/test_core

# allocator_may_return_null: absurd sizes must come back as TOAST_ENOMEM.
ctest-asan: $(CTEST_DIR)/test_core_asan
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 $(CTEST_DIR)/test_core_asan

# The normal build under memcheck. One OpenBLAS thread: its thread pool keeps
# "possibly lost" blocks by design; only definite leaks and errors count.
ctest-valgrind: $(CTEST_DIR)/test_core
	@command -v valgrind >/dev/null || { echo "valgrind is not installed"; exit 1; }
	OPENBLAS_NUM_THREADS=1 valgrind -q --error-exitcode=1 --leak-check=full \
		--errors-for-leak-kinds=definite --show-leak-kinds=definite \
		$(CTEST_DIR)/test_core

# ---------------------------------------------------------------- fuzzing
# scripts/fuzz.sh: atheris over toast._core (coverage-guided), then every input
# replayed against an ASan+UBSan build (see there). fuzz-long keeps its working
# corpus in fuzz/work/ (not committed) and prints libFuzzer's final statistics.
FUZZ_TIME ?= 1800
fuzz-ci:
	bash scripts/fuzz.sh -max_total_time=90 $(ARGS)

fuzz-long:
	FUZZ_WORK=fuzz/work bash scripts/fuzz.sh -max_total_time=$(FUZZ_TIME) -print_final_stats=1 $(ARGS)
