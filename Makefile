# A new user's two commands: `make run` (the farm end to end, embedded) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WORK ?= .work

.PHONY: install run run-cli test clean

install: $(VENV)/.installed

# torch first, pinned: pip then takes the local CPU build and never pulls a multi-GB CUDA one.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# The farm end to end on embedded defaults: serve, an export over the REST API, its artifacts and
# catalog entry, then the farm stopped (services/demo.py).
run: install
	$(BIN)/python -m services.demo --work $(WORK)

# The bare exporter, no farm: one export written to a directory.
run-cli: install
	$(BIN)/python -m exporter.tiny_checkpoint $(WORK)/demo-checkpoint --arch qwen2
	$(BIN)/exportfarm export --model $(WORK)/demo-checkpoint --out $(WORK)/demo-export --overwrite
	@echo "files:" && ls -l $(WORK)/demo-export

test: install
	$(BIN)/python -m pytest -q -ra --durations=30 $(PYTEST_ARGS)

clean:
	rm -rf $(WORK) $(VENV)
