# ivq-debug: set up a virtualenv and run the demo or the tests.
# The CPU build of torch is installed first: an unpinned torch would pull a multi-GB CUDA build. The venv gets
# every extra (`.[all,dev]`); a board needs only the core install (`pip install .`, docs/arm64.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ivq-installed
TORCH ?= torch==2.13.0
PIP := $(BIN)/python -m pip --disable-pip-version-check --quiet

.PHONY: setup chromium demo test test-slow test-all lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[all,dev]'
	touch $(STAMP)

# headless Chromium for the report's browser test (Debian package; skipped when it cannot be installed)
chromium:
	./scripts/install-chromium.sh || echo "chromium not installed: the browser test will be skipped"

demo: setup
	$(BIN)/ivq demo

# two workers (pytest-xdist); tests sharing an expensive fixture stay on one worker (tests/conftest.py XDIST_GROUPS)
test: setup chromium
	$(BIN)/python -m pytest -q -n 2

# the slow tests on two workers too (CI's 90-minute limit); exit code 5 = no slow test collected, not a failure
test-slow: setup
	$(BIN)/python -m pytest -q -n 2 -m slow || [ $$? -eq 5 ]

test-all: test test-slow

lint: setup
	$(BIN)/ruff check ivq_debug tests bench scripts

bench: setup
	$(BIN)/python bench/bench_spine.py

clean:
	rm -rf $(VENV) .pytest_cache test-artifacts reports/*.html
