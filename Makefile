# The two commands: `make demo` and `make test`. Each does all set-up first (idempotent).
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test clean

setup:
	@scripts/setup.sh

demo: setup
	@$(VENV)/bin/prism demo

test: setup
	@$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
