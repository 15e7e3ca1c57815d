# Two entry points that set everything up on a new machine with Python 3.11:
#   make demo   - create .venv, install, run the demo on an embedded PostgreSQL
#   make test   - create .venv, install, lint, type-check and run the whole test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test check pytest test-storage bench screenshots clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/otel-agentcap demo

check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check otel_agentcap
	$(BIN)/mypy

# Two workers (pytest-xdist), each with an embedded PostgreSQL of its own; a test module's tests
# run on one worker, so module-scoped fixtures (a seeded log, a server that tests stop) are made once.
pytest: install
	$(BIN)/pytest -n 2 --dist loadfile

test: check pytest

# The storage tests alone, e.g. against another server:
#   AGENTCAP_TEST_DSN=postgresql://postgres:postgres@127.0.0.1:5432/postgres make test-storage
test-storage: install
	$(BIN)/pytest -m storage

# Screenshots of the web view for the README, taken by the browser tests on the demo run.
screenshots: install
	AGENTCAP_SCREENSHOT_DIR=docs/screenshots $(BIN)/pytest -m browser -k "runs_list or screenshot" -q

bench: install
	$(BIN)/python bench/bench_capture.py
	$(BIN)/python bench/bench_pg_ingest.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
