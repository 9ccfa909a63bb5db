# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# torch 2.13.0 is the CPU wheel on our build machines. On a GPU machine: make demo CONSTRAINTS=
CONSTRAINTS ?= constraints.txt
BIN := $(VENV)/bin
# openpi's websocket client in a venv of its own (it pins numpy < 2): the tests drive `roboscale serve` with it
OPENPI_VENV ?= .venv-openpi
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export MUJOCO_GL ?= egl
export PYOPENGL_PLATFORM ?= egl

.PHONY: install demo test test-fast clean

$(BIN)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[sim,libero,test,lake,train,serve]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $@

$(OPENPI_VENV)/.installed:
	$(PYTHON) -m venv $(OPENPI_VENV)
	$(OPENPI_VENV)/bin/pip install --quiet --disable-pip-version-check openpi-client==0.1.2 typing_extensions
	touch $@

install: $(BIN)/.installed $(OPENPI_VENV)/.installed

demo: $(BIN)/.installed
	$(BIN)/roboscale demo

test: $(BIN)/.installed $(OPENPI_VENV)/.installed
	$(BIN)/pytest -q

test-fast: $(BIN)/.installed $(OPENPI_VENV)/.installed
	$(BIN)/pytest -q -m "not slow"

clean:
	rm -rf $(VENV) $(OPENPI_VENV) outputs
