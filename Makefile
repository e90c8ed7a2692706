# chatserve developer commands. `make serve` and `make test` work from a fresh checkout.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
export HF_HUB_OFFLINE := 1

VENV   := .venv
PY     := $(VENV)/bin/python
PYTEST := HF_HUB_OFFLINE=1 $(PY) -m pytest
# Extra arguments, e.g. `make bench BENCH_ARGS="--only hf"` or `make serve PROMPT="Tell me a joke"`.
BENCH_ARGS ?=
PROMPT     ?= What is the capital of France?
PYTEST_ARGS ?=

.PHONY: help setup setup-redis serve test test-all bench

help:
	@echo "make setup     create .venv and install chatserve[dev], torch (if missing), the default model"
	@echo "make serve     offline demo generation with the default model (HTTP server: coming)"
	@echo "make test      fast test suite (needs Redis; started if absent)"
	@echo "make test-all  full test suite, including tests marked slow"
	@echo "make bench     offline benchmark: chatserve vs transformers (BENCH_ARGS=...)"

setup:
	scripts/setup_env.sh

setup-redis:
	scripts/setup_env.sh --with-redis

# NOTE: the HTTP server (`python -m chatserve serve --host 127.0.0.1 --port 8000`) does not exist yet;
# until it does, `serve` runs a short offline generation through the LLM API.
serve: setup
	$(PY) scripts/demo_generate.py "$(PROMPT)"

# pytest exits 5 when it collects no tests; any non-zero status fails the target.
test: setup-redis
	@rc=0; $(PYTEST) -q -m "not slow" $(PYTEST_ARGS) tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests -- treating as failure" >&2; fi; \
	exit $$rc

test-all: setup-redis
	@rc=0; $(PYTEST) -q $(PYTEST_ARGS) tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-all: pytest collected no tests -- treating as failure" >&2; fi; \
	exit $$rc

bench: setup
	$(PY) scripts/bench_offline.py $(BENCH_ARGS)
