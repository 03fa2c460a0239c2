# Two commands on a fresh machine: `make serve` and `make test` (README.md).
# Everything lives in .venv inside the checkout; the default model goes to the cache
# folder that `ringserve download` prints ($RINGSERVE_CACHE, default ~/.cache/ringserve).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
comma  := ,
# The `cuda` extra only where there is an NVIDIA driver to use it.
CUDA   := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,cuda)
TEST_EXTRAS  := test,plot,bench,kv-events$(CUDA)
ARGS   ?=
# Two pytest workers (CI's two cores): one worker's Numba compiles and server waits overlap the
# other's; a file's tests stay in one worker (--dist loadfile), so its module-scoped servers and
# models are made once. The suite on the 2-core CI machine: 17:31 -> 9:53 (2026-12-07). Tests
# marked `serial` (they leave or sweep stale shared memory, which every server start sweeps) run
# after them, alone. pytest's exit 5: PYTEST_ARGS selected none of a run's tests.
TEST_WORKERS ?= 2
PYTEST_ARGS ?=

# Python 3.12 (pyenv's, where there is one): a venv with what `.[cuda]` resolves to there
# (ringserve itself uninstalled: the tests put the checkout first), and beside it (not
# installed) numpy >= 2.5, the pair the start-up check must name; tests/test_cuda_stack.py
# compiles Numba CUDA kernels to PTX with them (no GPU needed). Outside the checkout and keyed
# by pyproject.toml and the ISO week, so that a fresh clone (CI) reuses it and what pip picks
# is at most a week old: ~35-50 s to build, 2 GB.
PYTHON312 ?= $(firstword $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.12*/bin/python))
VENV312   ?= $(HOME)/.cache/ringserve-venv312
PY312_KEY := $(shell sha256sum pyproject.toml | cut -c1-12)-$(shell date -u +%G%V)

.PHONY: install install-test browser model serve test venv312 wheels clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed$(subst $(comma),-,$(CUDA)): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".$(if $(CUDA),[cuda])"
	touch $@

$(VENV)/.installed-$(subst $(comma),-,$(TEST_EXTRAS)): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[$(TEST_EXTRAS)]"
	touch $@

install: $(VENV)/.installed$(subst $(comma),-,$(CUDA))

install-test: $(VENV)/.installed-$(subst $(comma),-,$(TEST_EXTRAS))

$(VENV312)/.installed-$(PY312_KEY):
	@if [ -z "$(PYTHON312)" ]; then echo "no Python 3.12 (pyenv): tests/test_cuda_stack.py skips"; else \
	  rm -rf $(VENV312) && $(PYTHON312) -m venv $(VENV312) && \
	  $(VENV312)/bin/python -m pip install --quiet ".[cuda]" && \
	  $(VENV312)/bin/python -m pip uninstall --quiet --yes ringserve && \
	  $(VENV312)/bin/python -m pip install --quiet --no-deps --target $(VENV312)/numpy25 "numpy>=2.5" && \
	  touch $@; fi

venv312: $(VENV312)/.installed-$(PY312_KEY)

# The wheels the device command carries (docs/deploy.md "The device command"): into .whl/.
wheels:
	PYTHON=$(PYTHON) bash tools/download_wheels.sh .whl

# Headless Chromium for the /dashboard test (Debian's package; needs root, else that test skips and says why).
browser:
	@command -v chromium >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

model: install
	$(BIN)/ringserve download

serve: model
	$(BIN)/ringserve serve $(ARGS)

test: install-test model browser venv312
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
