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

.PHONY: install demo test test-fast test-cluster clean

$(BIN)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[sim,libero,test,lake,train,serve,onnx]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $@

$(OPENPI_VENV)/.installed:
	$(PYTHON) -m venv $(OPENPI_VENV)
	$(OPENPI_VENV)/bin/pip install --quiet --disable-pip-version-check openpi-client==0.1.2 typing_extensions
	touch $@

install: $(BIN)/.installed $(OPENPI_VENV)/.installed

demo: $(BIN)/.installed
	$(BIN)/roboscale demo

test: $(BIN)/.installed $(OPENPI_VENV)/.installed
	$(BIN)/pytest -q -m "not cluster"

test-fast: $(BIN)/.installed $(OPENPI_VENV)/.installed
	$(BIN)/pytest -q -m "not slow and not cluster"

# the multi-host tests (tests/cluster, marked `cluster`): torchrun, Ray and SLURM (examples/) across hosts of a
# cluster in a box; needs root and iproute2 (SLURM also slurm-wlm and munge), each skips with its reason otherwise
test-cluster: $(BIN)/.installed
	$(BIN)/pytest -q -m cluster

clean:
	rm -rf $(VENV) $(OPENPI_VENV) outputs
