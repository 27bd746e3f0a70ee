# make demo: create .venv if needed, install, run the default sweep (tiny Llama, generated data).
# make test: create .venv if needed, install with the test extras, run the test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test install clean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Without a CUDA GPU, install the CPU build of torch first (PyPI's torch for Linux is a CUDA build of several GB):
# a local wheel where pip's find-links hold one (no index asked; its dependencies come with the package's), else
# PyTorch's CPU index (Linux; elsewhere PyPI's torch has no CUDA build).
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
$(STAMP): pyproject.toml | $(BIN)/python
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA GPU found: torch comes from the package's dependencies"; \
	else \
		echo "No CUDA GPU: installing the CPU torch wheel"; \
		if [ "$$(uname -s)" = Linux ]; then \
			$(BIN)/python -m pip install --quiet --no-index --no-deps torch==$(TORCH_VERSION)+cpu 2>/dev/null || \
			$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION)+cpu --index-url $(TORCH_CPU_INDEX); \
		else \
			$(BIN)/python -m pip install --quiet torch==$(TORCH_VERSION); \
		fi; \
	fi
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

demo: install
	$(BIN)/multilora demo

# The tests in TEST_WORKERS processes, a file's tests in one (its module fixtures made once), one torch thread each
# (tests/conftest.py): on 2 cores 10 minutes, not 14 in one process of 2 threads.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf runs lightning_logs .pytest_cache
