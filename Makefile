# make demo | make test | make bench  -- each creates .venv if missing and installs what it needs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# One stamp per extra, remade when pyproject.toml changes.
$(VENV)/.stamp-%: pyproject.toml | $(BIN)/python
	$(PIP) install -e '.[$*]'
	@touch $@

demo: $(VENV)/.stamp-demo
	$(BIN)/paramshard demo

test: $(VENV)/.stamp-test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.stamp-bench
	$(BIN)/python -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis bench/results
