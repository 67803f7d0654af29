# diffmm developer targets. `make test` is the one command that installs everything and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.14.1 torchvision==0.29.1

.PHONY: venv install test test-all demo demo-quick bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: venv

test: venv
	$(PY) -m pytest -q

test-all: venv
	$(PY) -m pytest -q -m ''

# The main job (issue 8): demo data, tiny CLIP vs DiffCLIP and Transformer vs DIFF LM over 3 seeds, report/.
demo: venv
	$(PY) -m diffmm.cli demo --out report $(DEMO_ARGS)

demo-quick: venv
	$(PY) -m diffmm.cli demo --quick --out report $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
