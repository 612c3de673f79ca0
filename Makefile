# The two commands: `make demo` and `make test`. Both build .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-text test soak lint bench bench-transports clean install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch is pinned and installed first: that exact build is the CPU wheel, and installing it
# before the project keeps the resolver from pulling a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check pipeline transports stages tests benchmarks examples
	$(BIN)/ruff format --check pipeline transports stages tests benchmarks examples
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -m "not soak" $(PYTEST_ARGS)

# Long load tests, bounded in time: STAGEWIRE_SOAK_SECONDS per test (90 by default).
soak: $(STAMP)
	$(BIN)/python -m pytest -m soak -s $(PYTEST_ARGS)

# The reference pipeline (a tiny vision-language model in four stages): one response
# streamed as it is decoded, then a batch with a progress bar, then the figures.
demo: $(STAMP)
	$(BIN)/stagewire run configs/tiny-vlm.yaml --input-file stages/assets/requests.jsonl \
		--requests 200 --concurrency 16 --show-stream text_delta

# The text example: split -> upper -> join.
demo-text: $(STAMP)
	$(BIN)/stagewire run configs/demo.yaml --input-file configs/demo-inputs.jsonl --requests 200 --concurrency 16

bench: $(STAMP)
	$(BIN)/python benchmarks/hops.py

# Every transport by payload size; the plot and the Ray baseline need the bench extra.
bench-transports: $(STAMP)
	$(BIN)/python benchmarks/transport_bench.py --plot benchmarks/transports.png

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
