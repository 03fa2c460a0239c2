# Two commands on a fresh machine: `make serve` and `make test` (README.md).
# Everything lives in .venv inside the checkout; the default model goes to the cache
# folder that `ringserve download` prints ($RINGSERVE_CACHE, default ~/.cache/ringserve).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The `cuda` extra only where there is an NVIDIA driver to use it.
EXTRAS := test$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,cuda)
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: install model serve test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

model: install
	$(BIN)/ringserve download

serve: model
	$(BIN)/ringserve serve $(ARGS)

test: model
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
