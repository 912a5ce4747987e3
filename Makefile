# pin-nightly: make demo | make test   (see README.md)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt constraints.txt | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: setup demo test constraints clean stop

$(STAMP): requirements.txt constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check \
		-r requirements.txt -c constraints.txt
	@rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

demo: setup
	$(BIN)/python -m tools.demo

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Re-pin the full dependency set after changing requirements.txt.
constraints:
	rm -rf /tmp/pin-nightly-constraints && $(PYTHON) -m venv /tmp/pin-nightly-constraints
	/tmp/pin-nightly-constraints/bin/pip install --quiet -r requirements.txt
	{ echo "# Full pinned set for Python 3.11 (pip freeze of a venv built from requirements.txt)."; \
	  echo "# Regenerate: make constraints"; \
	  /tmp/pin-nightly-constraints/bin/pip freeze; } > constraints.txt

# Stop the embedded PostgreSQL if a process left it running.
stop:
	@if [ -f .pgdata/postmaster.pid ]; then \
		$(BIN)/python -c "import pgserver,sys; pgserver.get_server('.pgdata', cleanup_mode='stop')" ; \
		$$(ls -d $(VENV)/lib/python*/site-packages/pgserver/pginstall/bin)/pg_ctl -D .pgdata stop -m fast || true; fi

clean: stop
	rm -rf .pgdata .airflow .pytest_cache
