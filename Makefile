# The course's two commands (see README.md):
#   make lab    set everything up, then open the course in JupyterLab
#   make test   set everything up, then run the whole test suite
# Both build .venv from the exact pins in requirements/lock.txt on first use.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8888
# What JupyterLab serves, and extra flags for it (the browser test passes --no-browser and a token).
LAB_ROOT ?= lessons
LAB_ARGS ?=
# The learners' Jupyter settings (jupyter-config/): nbgrader's Validate button stays, its
# instructor tools (formgrader, create assignment, course and assignment lists) are off.
LAB_CONFIG := JUPYTER_CONFIG_PATH="$(CURDIR)/jupyter-config$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}"
# JupyterLab refuses to run as root unless told to (containers often run as root).
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: setup lab test release lock doctor progress clean gpu-check torch-matrix

$(STAMP): requirements/lock.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=23.2"
	$(BIN)/python -m pip install --quiet -r requirements/lock.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	$(BIN)/python -m course doctor --short
	touch $@

setup: $(STAMP)

lab: setup
	$(LAB_CONFIG) $(BIN)/jupyter lab --port=$(PORT) --ServerApp.root_dir=$(LAB_ROOT) $(ROOT_FLAG) $(LAB_ARGS)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

release: setup
	$(BIN)/python -m autograder release

# The GPU acceptance (autograder/acceptance.py): every lesson graded at its CUDA sizes (the
# instructor's solution, the untouched version, a planted mistake), every benchmark at its GPU
# size, one summary in benchmarks/results/acceptance-cuda.md. Uses the torch this machine has
# (GPU machines come with their own) and installs only what is missing: no .venv, no download of
# torch. DEVICE=cpu runs the same acceptance with the CPU bars. WHEELS=DIR: a machine with no network
# installs from that folder (python -m autograder acceptance --download-wheels DIR, made elsewhere).
DEVICE ?= cuda
gpu-check:
	$(PYTHON) -m autograder acceptance --prepare $(if $(WHEELS),--wheels $(WHEELS))
	$(PYTHON) -m autograder acceptance --device $(DEVICE) --record

# The torch range as a tested matrix (benchmarks/torch_matrix.py): a throwaway environment per
# torch version (the lowest and newest the package accepts, the pinned one, the GPU acceptance's) under
# .torch-matrix/, every lesson run there as a learner would; writes docs/compatibility.md.
# Downloads each torch (the CUDA builds with their libraries: a few GB).
torch-matrix: setup
	$(BIN)/python benchmarks/torch_matrix.py

doctor: setup
	$(BIN)/python -m course doctor

progress: setup
	$(BIN)/python -m course progress

# Re-resolve the pins from the ranges in pyproject.toml (needs the package registry).
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet "torch==2.13.0" -e ".[lab,grading,test]"
	{ sed -n '1,2p' requirements/lock.txt; .lock-venv/bin/python -m pip freeze --exclude-editable \
	  | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > requirements/lock.new && mv requirements/lock.new requirements/lock.txt
	rm -rf .lock-venv

clean:
	rm -rf $(VENV) .autograder .torch-matrix
