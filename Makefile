# The two commands a new user runs: `make demo` and `make test`.
# Both create .venv and install everything; torch is pinned to the local CPU
# build (a bare `torch` would pull several GB of CUDA wheels).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: venv demo test protos check-protos bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev,lightning,hf,s3]' -c constraints.txt --config-settings editable_mode=strict
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ckptstage demo

test: $(STAMP)
	$(PY) tools/typecheck.py
	$(PY) -m pytest -q

protos: $(STAMP)
	$(PY) tools/gen_protos.py

bench: $(STAMP)
	$(PY) bench/bench_save.py

lint: $(STAMP)
	$(PY) tools/typecheck.py

clean:
	rm -rf $(VENV) build *.egg-info
