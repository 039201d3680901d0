# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stamp-install

.PHONY: demo test lint venv bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls gigabytes of CUDA wheels.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,hf]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/remat compare --plot out/compare.png

# --dist loadscope: a module's tests run on one worker, so its module-scoped fixtures (the
# gloo ranks, warm fake copies) are built once, not once per worker. Bytecode is written
# even where PYTHONDONTWRITEBYTECODE is set: every worker and every subprocess would
# otherwise compile src/ (and pytest rewrite tests/) again, a few seconds a process.
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n 2 --dist loadscope -p no:cacheprovider tests --durations=25

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples scripts
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/strategies.py

clean:
	rm -rf $(VENV) out build src/*.egg-info
