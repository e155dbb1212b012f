# Both targets create and use .venv at the repo root; only python3 and make are needed.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[client,service,dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/optiremat serve

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/models.py

clean:
	rm -rf $(VENV)
