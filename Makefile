# `make demo` and `make test` create the virtual environment when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch 2.13.0 is what tests run against; override for CUDA machines.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-long test-all env clean

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)" || $(PIP) install -q "torch>=2.6"
	$(PIP) install -q -e ".[dev]"
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install -q -e ".[triton-interpret]"
	touch $@

demo: env
	$(PY) -m megatrain.demo

# Two workers, each taking whole test files (module fixtures such as a spawned layout job stay in
# one worker): the launched training processes leave a core idle much of the time.
# `make test` leaves out the tests marked `long` (soak runs, further variants of a tested path);
# `make test-long` runs just those, `make test-all` everything.
test: env
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not long" tests

test-long: env
	$(PY) -m pytest -q -n 2 --dist loadfile -m long tests

test-all: env
	$(PY) -m pytest -q -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) demo_out
