# Every target sets itself up on a fresh machine: its own virtualenv, and for tests/bench the
# llama.cpp b11434 reference (sdist, converter venv, compiled binaries) cached in ~/.cache/dflash-gguf.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
OUT := out

.PHONY: venv demo pair verify tune test test-fast reference bench bench-full lint clean
QUANT ?= q4_0
# pytest-xdist workers for the test targets (one per CPU by default; TEST_WORKERS=0 runs in one process).
TEST_WORKERS ?= auto
REFERENCE_MARK := reference
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadscope

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

# The whole pipeline on the offline fixtures, from local folders: no network, no llama.cpp build (the built-in
# converters and quantizer), then dflash-verify on the pair.json it wrote.
demo: venv
	@rm -rf $(OUT)/demo && mkdir -p $(OUT)/demo
	$(PY) scripts/make_fixtures.py $(OUT)/demo --no-qwen-weights
	$(VENV)/bin/dflash-convert --target $(OUT)/demo/targets/gemma-4-tiny-it \
	    --drafter $(OUT)/demo/drafters/gemma4-tiny-it-DFlash --quant $(QUANT) --outdir $(OUT)/demo/pair
	$(VENV)/bin/dflash-verify $(OUT)/demo/pair/pair.json

# make pair TARGET=google/gemma-4-12B-it DRAFTER=z-lab/gemma4-12B-it-DFlash [QUANT=q4_0] [OUT=dir]
pair: venv
	@test -n "$(TARGET)" -a -n "$(DRAFTER)" || { echo "usage: make pair TARGET=org/name DRAFTER=org/name [QUANT=q4_0] [OUT=dir]"; exit 2; }
	$(VENV)/bin/dflash-convert --target $(TARGET) --drafter $(DRAFTER) --quant $(QUANT) \
	    $(if $(filter command line,$(origin OUT)),--outdir $(OUT))

# make verify DRAFTER=pair/pair.json | DRAFTER=d.gguf [TARGET=t.gguf]
verify: venv
	@test -n "$(DRAFTER)" || { echo "usage: make verify DRAFTER=pair.json|DRAFTER.gguf [TARGET=TARGET.gguf]"; exit 2; }
	$(VENV)/bin/dflash-verify $(DRAFTER) $(TARGET)

# make tune PAIR=dir/pair.json|dir [FLAGS='-ngl 99 -fa on'] : measure the pair with llama-server on this machine
tune: venv
	@test -n "$(PAIR)" || { echo "usage: make tune PAIR=pair.json|DIR [FLAGS='llama-server flags']"; exit 2; }
	$(VENV)/bin/dflash-gguf tune $(PAIR) $(if $(FLAGS),-- $(FLAGS))

reference: venv
	$(PY) scripts/reference_env.py setup

test: venv reference
	$(PY) -m ruff check dflash_gguf tests scripts
	$(PY) -m mypy
	$(PYTEST) --durations=40 tests

# The inner loop: every test that needs no llama.cpp reference, with the reference hidden (an empty cache folder),
# so what needs it skips; not for CI, which runs everything (make test).
test-fast: venv
	$(PY) -m ruff check dflash_gguf tests scripts
	$(PY) -m mypy
	ref=$$(mktemp -d) && trap 'rm -rf "$$ref"' EXIT && \
	    CI= DFLASH_GGUF_CACHE="$$ref" $(PYTEST) -m "not $(REFERENCE_MARK)" tests

bench: venv reference
	$(PY) scripts/bench.py

# The whole pipeline on a Gemma-4-12B-it-shaped stand-in (23.8 GB BF16, real 262k vocabulary) against the manual
# b11434 workflow and cat: about 60 GB of free disk. BENCH_DIR=/big/disk picks where.
bench-full: venv reference
	$(PY) scripts/bench.py --full $(if $(BENCH_DIR),--workdir $(BENCH_DIR))

lint: venv
	$(PY) -m ruff check dflash_gguf tests scripts
	$(PY) -m mypy

clean:
	rm -rf $(OUT) $(VENV)
