# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bootstrap clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: otherwise pip fetches a multi-GB CUDA build
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	# compile the simulator's kernels into numba's on-disk cache now (~16 s once), not in the first
	# `weightcast sim` a user times; its progress lines and any error stay on stderr
	$(BIN)/weightcast sim --hosts 100 --size 2GB --json > /dev/null
	touch $(STAMP)

bootstrap: $(STAMP)

demo: $(STAMP)
	$(BIN)/weightcast demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) *.egg-info
