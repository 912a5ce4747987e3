# pin-nightly: make demo | make test | make test-all   (see README.md)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := requirements.txt requirements-dev.txt constraints.txt pyproject.toml
STAMP  := $(VENV)/.installed-$(shell cat $(DEPS) | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: setup demo test test-all test-stack test-exhaustive soak mutants lint airflow bench bench-growth constraints clean stop

# The development venv: runtime and development dependencies pinned by constraints.txt, and
# the job package (plugins/pin_nightly) installed editable. pip installs uv (pinned there too),
# uv the rest: it downloads in parallel, a fresh venv in about 30 s instead of two minutes.
# uv reads its own settings, not pip's: a package mirror is UV_INDEX_URL. It trusts the
# system's certificate store, as pip does (a proxy's own CA installed there works for both).
UV = $(BIN)/uv pip install --quiet --system-certs --python $(BIN)/python
$(STAMP): $(DEPS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check uv -c constraints.txt
	$(UV) --compile-bytecode -r requirements-dev.txt -c constraints.txt
	$(UV) --no-deps -e .
	@rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

demo: setup
	$(BIN)/python -m tools.demo

# make test: everything but the real-stack modules, the exhaustive fault matrix and the long
# system-level sequences, on TEST_WORKERS pytest-xdist workers (tests of one xdist_group share
# a worker; the tests wait on PostgreSQL and on their slowed batches about as much as they
# compute, so three keep two cores busy). make test-all adds them: make test's tests and the
# long sequences in one run on the workers (the long ones first), then at once the stack
# modules on STACK_WORKERS, a module a worker (each starts several Airflow processes of its
# own, which mostly wait), and the rest of the fault matrix in one process beside them; each
# of those two prints its report when it ends.
TEST_WORKERS ?= 3
STACK_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup
test: lint
	$(BIN)/python -m pytest $(XDIST) -m "not stack and not exhaustive and not long" $(PYTEST_ARGS)

test-all: lint
	$(BIN)/python -m pytest $(XDIST) -m "not stack and not exhaustive" $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-stack test-exhaustive

test-stack: setup
	$(BIN)/python -m pytest -n $(STACK_WORKERS) --dist loadfile -m stack $(PYTEST_ARGS)

test-exhaustive: setup
	PIN_TEST_ID=$(PIN_TEST_ID)exhaustive $(BIN)/python -m pytest -n 0 -m "exhaustive and not stack" $(PYTEST_ARGS)

# The model-based test of operation sequences, long: SOAK_EXAMPLES sequences of SOAK_STEPS
# operations each, random (a failure is shrunk to a short sequence and printed with a blob that
# reproduces it), per job; SOAK_MINUTES (per job) stops drawing new sequences after that long
# and ends green with a summary of what ran. Ctrl-C (SIGINT) stops it at once; SIGTERM does not
# (a range inside dag.test() takes it as the job's graceful stop). Hours if asked:
# make soak SOAK_EXAMPLES=2000 SOAK_MINUTES=240
SOAK_EXAMPLES ?= 100
SOAK_STEPS ?= 20
SOAK_MINUTES ?= 0
soak: setup
	PIN_MODEL_PROFILE=soak SOAK_EXAMPLES=$(SOAK_EXAMPLES) SOAK_STEPS=$(SOAK_STEPS) \
		SOAK_MINUTES=$(SOAK_MINUTES) $(BIN)/python -m pytest tests/test_model.py -s $(PYTEST_ARGS)

# Does the bounded profile of the model catch known defects? Each mutant of tools/mutants.toml
# (one small edit under plugins/ or include/sql/) in a scratch copy of the repository, one at a
# time; a table of the mutants caught; fails when one survives. Not part of make test.
# Only some: make mutants MUTANTS="correction_recorded_twice future_date_accepted"
MUTANTS ?=
mutants: setup
	$(BIN)/python -m tools.mutants $(MUTANTS)

# ruff: lint rules and formatting as configured in pyproject.toml
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The real Airflow (standalone) on 127.0.0.1:8080 with demo data; Ctrl-C or `make stop`.
airflow: setup
	$(BIN)/python -m tools.airflow_up

# Benchmarks (not part of the test suite): make bench [SCALE=0.1] [REPS=3]; bench-growth is
# scale 3 (3M posts / 30M comments, ~915k cards; ~12 GB of data) with one repetition, waiting
# up to 3 minutes before each measurement for the disk to write back the one before.
SCALE ?= 1
REPS ?= 3
bench: setup
	$(BIN)/python -m bench.run --scale $(SCALE) --reps $(REPS)
	$(BIN)/python -m bench.replica_lag

bench-growth: setup
	$(BIN)/python -m bench.run --scale 3 --reps 1 --quiet-wait 180

# Re-pin the full dependency set after changing requirements.txt or requirements-dev.txt.
constraints:
	rm -rf /tmp/pin-nightly-constraints && $(PYTHON) -m venv /tmp/pin-nightly-constraints
	/tmp/pin-nightly-constraints/bin/pip install --quiet -r requirements-dev.txt
	{ echo "# Full pinned set for Python 3.11 (pip freeze of a venv built from requirements-dev.txt)."; \
	  echo "# Regenerate: make constraints"; \
	  /tmp/pin-nightly-constraints/bin/pip freeze; } > constraints.txt

# Stop `make airflow` (and with it the embedded PostgreSQL it started).
stop:
	@if [ -x $(BIN)/python ]; then $(BIN)/python -m tools.airflow_up stop; \
	else echo "make airflow is not running"; fi

clean: stop
	rm -rf .pgdata .airflow .pytest_cache
