# Two entry points for a fresh machine (see README): `make demo` and `make test`.
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: setup setup-tests demo test

setup:
	bash scripts/setup.sh

setup-tests:
	bash scripts/setup.sh --no-models

demo: setup
	$(BIN)/kvhandoff demo

test: setup-tests
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n auto
