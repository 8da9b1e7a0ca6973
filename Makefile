# Everything installs itself: a fresh machine needs only python3 (3.11+) and make.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest audit clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,dev]'
	touch $(STAMP)

## The worked example on loopback with the embedded SQLite store.
demo: $(STAMP)
	$(BIN)/fenceproxy demo

## Lint, types and the whole test suite.
test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check fenceproxy tests
	$(BIN)/ruff format --check fenceproxy tests

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

## Known vulnerabilities in the installed dependencies fail the build. Needs PyPI's
## JSON API; --strict fails rather than passing when a dependency cannot be audited.
audit: $(STAMP)
	$(BIN)/pip-audit --strict --skip-editable --progress-spinner off

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
