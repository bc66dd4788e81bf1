# Every target sets itself up on a fresh machine: its own virtualenv, and for tests/bench the
# llama.cpp b11434 reference (sdist, converter venv, compiled binaries) cached in ~/.cache/dflash-gguf.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
OUT := out

.PHONY: venv demo test reference bench lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	@rm -rf $(OUT)/demo && mkdir -p $(OUT)/demo
	$(PY) scripts/make_fixtures.py $(OUT)/demo --no-qwen-weights
	$(VENV)/bin/dflash-convert --drafter $(OUT)/demo/drafters/gemma4-tiny-it-DFlash \
	    --target $(OUT)/demo/targets/gemma-4-tiny-it --outfile $(OUT)/demo/gemma4-tiny-it-DFlash-BF16.gguf
	$(PY) scripts/gguf_summary.py $(OUT)/demo/gemma4-tiny-it-DFlash-BF16.gguf
	$(VENV)/bin/dflash-verify $(OUT)/demo/gemma4-tiny-it-DFlash-BF16.gguf

reference: venv
	$(PY) scripts/reference_env.py setup

test: venv reference
	$(PY) -m ruff check dflash_gguf tests scripts
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: venv reference
	$(PY) scripts/bench.py

lint: venv
	$(PY) -m ruff check dflash_gguf tests scripts

clean:
	rm -rf $(OUT) $(VENV)
