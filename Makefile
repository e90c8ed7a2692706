# chatserve developer commands. `make serve` and `make test` work from a fresh checkout.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
export HF_HUB_OFFLINE := 1

VENV   := .venv
PY     := $(VENV)/bin/python
PYTEST := HF_HUB_OFFLINE=1 $(PY) -m pytest
# Extra arguments, e.g. `make bench BENCH_ARGS="--only hf"` or `make serve SERVE_ARGS="--port 9000"`.
BENCH_ARGS ?=
SERVE_ARGS ?=
# Sessions persist in Redis when REDIS_URL is set (e.g. redis://127.0.0.1:6379/0); else they live in memory.
REDIS_URL  ?=
HOST       ?= 127.0.0.1
PORT       ?= 8000
PYTEST_ARGS ?=
# pytest-xdist workers for make test (whole test modules per worker, tests/conftest.py); 0 runs in one process.
TEST_WORKERS ?= 2

.PHONY: help setup setup-redis serve cluster test test-all lint docs bench

help:
	@echo "make setup     create .venv and install chatserve[dev], torch (if missing), the default model"
	@echo "make serve     OpenAI-compatible server + web client with the default model on http://$(HOST):$(PORT)"
	@echo "make cluster   2 replicas behind vllm-router sharing Redis (CLUSTER_ARGS=...; see docs/scaling-out.md)"
	@echo "make test      fast test suite (needs Redis; started if absent)"
	@echo "make test-all  full test suite, including tests marked slow"
	@echo "make lint      ruff over the code, mypy over the torch-free layers (part of make test)"
	@echo "make docs      the documentation site (MkDocs, warnings are errors) into build/site (part of make test)"
	@echo "make bench     offline benchmark: chatserve vs transformers (BENCH_ARGS=...)"

setup:
	scripts/setup_env.sh

setup-redis:
	scripts/setup_env.sh --with-redis

# The OpenAI-compatible server (SSE streaming, cancel endpoint, sessions, metrics) and the web client at /.
serve: setup
	$(PY) -m chatserve serve --host $(HOST) --port $(PORT) $(if $(REDIS_URL),--redis-url $(REDIS_URL)) $(SERVE_ARGS)

# Two replicas behind vLLM's router (cache_aware), sharing Redis at REDIS_URL (started if none answers).
cluster: setup-redis
	$(PY) -m chatserve cluster --host $(HOST) --port $(PORT) $(if $(REDIS_URL),--redis-url $(REDIS_URL)) $(CLUSTER_ARGS)

# Lint (ruff, configured in pyproject.toml) and types of the torch-free layers (mypy: cache, core, bench).
lint: setup
	$(VENV)/bin/ruff check chatserve tests benchmarks
	$(VENV)/bin/mypy

# The documentation site from docs/ (mkdocs.yml): --strict turns every warning (a broken link or anchor,
# a page missing from the nav) into a failure. NO_MKDOCS_2_WARNING: Material's end-of-life banner.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

# pytest exits 5 when it collects no tests; any non-zero status fails the target.
test: setup-redis lint docs
	@rc=0; $(PYTEST) -q -m "not slow" -n $(TEST_WORKERS) --durations=25 $(PYTEST_ARGS) tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests -- treating as failure" >&2; fi; \
	exit $$rc

test-all: setup-redis lint docs
	@rc=0; $(PYTEST) -q -n $(TEST_WORKERS) $(PYTEST_ARGS) tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-all: pytest collected no tests -- treating as failure" >&2; fi; \
	exit $$rc

bench: setup
	$(PY) benchmarks/peers/bench_offline.py $(BENCH_ARGS)
