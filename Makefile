# Both targets create and use a venv at the repo root; only a Python and make are needed.
# PYTHON selects the interpreter (e.g. `make test PYTHON=python3.12`); each one gets its
# own venv, .venv for the default python3 and .venv-<interpreter> for any other.
PYTHON ?= python3
VENV ?= $(if $(filter python3,$(PYTHON)),.venv,.venv-$(notdir $(PYTHON)))
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench bench-maxtext clean

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

# MaxText's own config path (bench/maxtext_plans.py, `optiremat plan-maxtext`): MaxText 0.2.5 needs
# Python 3.12 (MAXTEXT_PYTHON) and installs without its GPU extra's pins.
MAXTEXT_PYTHON ?= python3.12
MAXTEXT_VENV := .venv-maxtext

$(MAXTEXT_VENV)/.installed: pyproject.toml bench/maxtext-requirements.txt
	$(MAXTEXT_PYTHON) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet -e '.[client]' -r bench/maxtext-requirements.txt
	$(MAXTEXT_VENV)/bin/python -m pip install --quiet --no-deps maxtext==0.2.5
	touch $@

bench-maxtext: $(MAXTEXT_VENV)/.installed
	$(MAXTEXT_VENV)/bin/python bench/maxtext_plans.py

clean:
	rm -rf $(VENV)
