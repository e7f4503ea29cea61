# The README's two commands: `make demo` and `make test`. Both install everything they need first.
SHELL := /bin/bash
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test install lint cluster-build cluster-down bench

$(STAMP): pyproject.toml engine/pyproject.toml operator/pyproject.toml gateway/pyproject.toml bench/pyproject.toml scripts/bootstrap.sh
	bash scripts/bootstrap.sh

install: $(STAMP)

demo: install
	bash scripts/demo.sh

test: install
	bash scripts/test.sh

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

cluster-build: install
	$(VENV)/bin/flotilla cluster build

cluster-down: install
	$(VENV)/bin/flotilla cluster down
