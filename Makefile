# ckptool: `make demo` runs the main job, `make test` the tests; both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO := demo-out
# pytest-xdist workers; --dist loadfile keeps each test file (and its module-scoped training runs) on one worker;
# tests/conftest.py hands the longest files out first
TEST_WORKERS ?= 2

.PHONY: venv demo test lint fuzz bench fixtures realworld frameworks clean

# the editable install also compiles the C twins of the opcode guard and the unpickler's run in place
# (optional extensions: without a compiler Python runs them), so a change to their sources installs again
$(VENV)/.installed: pyproject.toml training/pyproject.toml ckptool/native/_guard.c ckptool/native/_fastload.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[torch,test,remote]' -e ./training  # training/: the runs, a distribution of their own
	$(PY) -m compileall -q ckptool training  # as a wheel install does: no recompiling in every process
	touch $@

venv: $(VENV)/.installed

demo: venv
	bash scripts/demo.sh

test: venv
	$(PY) -m compileall -q ckptool training  # up-to-date .pyc: the tests start hundreds of processes
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# ruff (lint and format) and mypy over the package, as configured in pyproject.toml; the import contract is a
# test (tests/test_architecture.py)
lint: venv
	$(VENV)/bin/ruff check ckptool
	$(VENV)/bin/ruff format --check ckptool
	$(VENV)/bin/mypy

# the C extensions rebuilt with ASan and UBSan into build/fuzz/ (the in-place ones untouched), proven live on a
# planted fault, then held to their Python twins: the differential tests, and FUZZ_SECONDS (default 120) of
# structure-aware mutants of the fixtures, the hostile corpus and ../shared/corpus/ (scripts/fuzz/README.md)
fuzz: venv
	$(PY) scripts/fuzz/run.py

bench: venv
	$(PY) -m bench

fixtures: venv
	$(PY) fixtures/make_fixtures.py

# every command on real checkpoints shipped inside PyPI wheels, checked against torch; needs PyPI, so not in CI
# (cache: $$CKPTOOL_REALWORLD_CACHE or ~/.cache/ckptool-realworld)
realworld: venv
	$(PY) scripts/realworld.py

# every command on what Lightning, transformers, accelerate, timm, mmengine and ultralytics write with their own
# save paths, loaded back in each framework; a venv of its own for them (scripts/frameworks/README.md); not in CI
frameworks: venv
	$(PY) scripts/frameworks/run.py

clean:
	rm -rf $(DEMO) build *.egg-info training/*.egg-info
