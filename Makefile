# Both targets create and use a venv at the repo root; only a Python and make are needed.
# PYTHON selects the interpreter (e.g. `make test PYTHON=python3.12`); each one gets its
# own venv, .venv for the default python3 and .venv-<interpreter> for any other.
PYTHON ?= python3
VENV ?= $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[client,service,dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/optiremat serve

# pytest runs one worker per core; each test file stays in one worker (loadfile), so the
# models a module extracts and compiles once serve all its tests.
test: lint
	$(PY) -m pytest -q -n auto --dist loadfile

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) tools/typecheck.py

bench: $(STAMP)
	$(PY) bench/models.py

clean:
	rm -rf $(VENV)
