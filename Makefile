# DMuon developer commands. `make demo` and `make test` work on a fresh clone with only
# Python 3.10+ and make installed.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
BENCH_STAMP := $(VENV)/.bench-installed
# Machines that keep wheels on local disk (torch among them) expose them in /opt/wheels.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels)
# Installs go through uv, put into the venv first by pip: it resolves as pip does and
# installs the same releases, faster (a fresh clone's setup: 151 s with
# pip, 21 s with uv, on 2 cores).
UV_INSTALL := $(BIN)/python -m pip install --quiet uv --constraint constraints.txt
INSTALL := $(BIN)/python -m uv pip install --quiet --python $(BIN)/python \
	--constraint constraints.txt $(FIND_LINKS)
# The start of both installs below: the venv, uv in it, and torch.
define venv_with_torch
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(UV_INSTALL)
	$(INSTALL) torch==2.13.0
endef

.PHONY: setup demo dist test test-fast test-core test-server test-docs fuzz lint format docs docs-serve bench bench-setup bench-quick bench-moe bench-optimizer clean

setup: $(STAMP)

# Reinstall only when a dependency list changed; otherwise `make setup` is a no-op.
$(STAMP): constraints.txt requirements-dev.txt packages/dmuon-core/pyproject.toml packages/dmuon-server/pyproject.toml
	$(venv_with_torch)
	$(INSTALL) -e packages/dmuon-core -e packages/dmuon-server -r requirements-dev.txt
	touch $(STAMP)

# What the demo runs and nothing of the developer tools: torch and the two packages.
$(DEMO_STAMP): constraints.txt packages/dmuon-core/pyproject.toml packages/dmuon-server/pyproject.toml
	$(venv_with_torch)
	$(INSTALL) -e packages/dmuon-core -e packages/dmuon-server
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m dmuon_server.demo

# Wheels of both packages in dist/: pip install 'dist/dmuon-<version>-py3-none-any.whl[hf]'.
dist: setup
	$(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir dist packages/dmuon-core packages/dmuon-server

# Two pytest workers, each taking whole test files (their module fixtures stay shared):
# many tests wait on processes they start, so two workers fill both cores. The files go
# out longest first, in the order tests/file_order.py collects them. The
# schemathesis module runs after them, alone: its tests (one per API operation) share one
# node id, which pytest-xdist would count as a single test.
SCHEMA_TESTS := tests/server/test_server_schemathesis.py
# Plugins only the schemathesis module needs stay unloaded elsewhere: 1.2 s of start-up
# for each pytest process (the two workers and their controller).
LEAN := -p no:schemathesis -p no:hypothesispytest -p no:anyio
# Python keeps its byte-code caches during the tests even where the environment turns
# them off (PYTHONDONTWRITEBYTECODE, as some container images set): the suite starts
# hundreds of processes (recipe ranks, servers, job runners) that import dmuon, and each
# would compile its sources again (0.6 s of a 4 s recipe process).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest
# Progress: one line per finished test file (its kind, counts and time), no dots and no
# percentages (the schemathesis tests, one node id for all, would leave theirs at 5%); the
# slowest tests are listed at the end, and each of the two runs prints its time.
PROGRESS := --file-progress -o console_output_style=classic
timed = start=$$(date +%s); status=0; $(2) || status=$$?; \
	echo "make test: $(1) took $$(( $$(date +%s) - start )) s"; exit $$status
test: setup
	@rm -f test-artifacts/file-seconds.json
	@$(call timed,pytest,$(PYTEST) -n 2 --dist loadfile --no-loadscope-reorder $(PROGRESS) --ignore=$(SCHEMA_TESTS) $(LEAN))
	@$(call timed,schemathesis,$(PYTEST) $(PROGRESS) $(SCHEMA_TESTS))

# The tests that start no process, server, site build or browser (kinds are marked by
# tests/conftest.py: pure, subprocess, multi_process, live_server, site_build, browser).
test-fast: setup
	$(PYTEST) -n 2 -m pure --ignore=$(SCHEMA_TESTS) $(LEAN)

test-core: setup
	$(PYTEST) tests/core

test-server: setup
	$(PYTEST) tests/server

test-docs: setup
	$(PYTEST) tests/docs

# The randomized differential suite for FUZZ_MINUTES minutes: generated models and
# distributed runs against one process; prints every case it runs and a shrunk
# counterexample per failure (FUZZ_SEED picks the first seed). `make test` runs a fixed,
# seeded set of the same cases.
FUZZ_MINUTES ?= 5
fuzz: setup
	cd tests/core && FUZZ_MINUTES=$(FUZZ_MINUTES) ../../$(BIN)/python -m fuzzing

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

docs: setup
	$(BIN)/mkdocs build --strict

docs-serve: setup
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# The peers (muon-fsdp2, dtensor-muon, pinned) and matplotlib: the optional `bench` extra.
bench-setup: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP)
	$(INSTALL) -e 'packages/dmuon-core[bench]'
	touch $(BENCH_STAMP)

# Full side-by-side benchmarks (about an hour on 2 cores; writes benchmarks/results/*.json
# and the plots in docs/assets/benchmarks/): optimizer step, distributed step time and
# counted traffic and memory of every contender (small at N=2 and 4; base at N=2 without
# muon-fsdp2, whose emulated-bfloat16 step takes minutes on a CPU), where the step time
# goes (profile_step), quality (learning-rate sweeps), scaling, DCP checkpoint save and
# load against FSDP2 + AdamW.
bench: bench-setup
	$(MAKE) bench-optimizer
	$(BIN)/python benchmarks/bench.py
	$(BIN)/python benchmarks/bench.py --nproc 4 --steps 3
	$(BIN)/python benchmarks/bench.py --model base --steps 3 \
		--contenders adamw-z2 adamw-z3 dmuon-z2 dmuon-z3 naive-z3
	$(BIN)/python benchmarks/profile_step.py --levers
	$(BIN)/python benchmarks/quality.py
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/plots.py
	$(BIN)/python benchmarks/checkpoint_io.py
	$(MAKE) bench-moe

# `dmuon.Muon.step()` against torch.optim.Muon + AdamW, one process, small and base (a few
# minutes).
bench-optimizer: bench-setup
	$(BIN)/python benchmarks/optimizer_step.py --model small,base --json benchmarks/results/optimizer_step.json

# Mixture of experts (about 20 minutes on 2 cores): the `moe` preset with its expert stacks
# on Muon, on AdamW, and AdamW alone; and whole against split `gate_up_proj` on a tiny
# Mixtral (needs the `transformers` test dependency).
bench-moe: bench-setup
	$(BIN)/python benchmarks/moe_quality.py
	$(BIN)/python benchmarks/moe_split.py

# CI: tiny model, every contender (the peers included); asserts only deterministic things
# (counted traffic against the formulas). A few minutes.
bench-quick: bench-setup
	$(BIN)/python benchmarks/bench.py --quick --check

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache
