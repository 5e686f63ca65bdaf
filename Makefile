# The two commands a new user runs: `make demo` and `make test`.
# Both create .venv and install everything; torch is pinned to the local CPU
# build (a bare `torch` would pull several GB of CUDA wheels).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: venv demo test protos check-protos bench lint clean FORCE

# The strict editable install links each module into build/: a module added, moved or removed since needs
# a re-link, which MODULES (the list of the package's files, rewritten only when it changes) triggers.
MODULES := $(VENV)/.modules
INSTALLED := $(VENV)/.linked
PACKAGE_DIRS := client daemon dcp integrations protos

venv: $(INSTALLED)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev,lightning,hf,s3]' -c constraints.txt --config-settings editable_mode=strict
	touch $(STAMP)

$(MODULES): FORCE | $(STAMP)
	@find $(PACKAGE_DIRS) -type f \( -name '*.py' -o -name '*.toml' -o -name '*.proto' -o -name '*.pyi' \) | sort > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

$(INSTALLED): $(STAMP) $(MODULES)
	$(PY) -m pip install --quiet --no-deps -e . --config-settings editable_mode=strict
	touch $(INSTALLED)

FORCE:

demo: $(INSTALLED)
	$(VENV)/bin/ckptstage demo

test: $(INSTALLED)
	$(PY) tools/typecheck.py
	$(PY) -m pytest -q --durations=25

protos: $(INSTALLED)
	$(PY) tools/gen_protos.py

bench: $(INSTALLED)
	$(PY) bench/bench_save.py

lint: $(INSTALLED)
	$(PY) tools/typecheck.py

clean:
	rm -rf $(VENV) build *.egg-info
