# The README's two commands: `make demo` and `make test`. Each creates its own virtual environment
# (.venv) on first use and reinstalls when pyproject.toml changes. `make test` first installs the
# system packages the tests need when they are missing (tests/support/ensure_system_packages.sh).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The tests run in parallel worker processes (pytest-xdist), each with its own broker and servers:
# most of their time is spent waiting on brokers, servers and subprocesses, so more workers than cores
# pay off. TEST_WORKERS=0 runs them all in one process.
TEST_WORKERS ?= 4
PYTEST_ARGS ?=

.PHONY: demo test docs lint bench clean system-packages FORCE

# A .venv that cannot run pip on Python >= 3.11 (made by a Python that is gone or too old, or cut short
# before pip was in it) is made again from scratch, and everything is installed into it again.
VENV_OK := $(shell $(BIN)/python -c 'import sys, pip; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && echo yes)
ifneq ($(VENV_OK),yes)
$(BIN)/python $(VENV)/.installed-demo $(VENV)/.installed-test: FORCE
endif

CHECK_PYTHON = @$(PYTHON) -c 'import sys; sys.exit("tracejudge needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'

$(BIN)/python:
	$(CHECK_PYTHON)
	$(PYTHON) -m venv --clear $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $@ $(VENV)/.installed-demo

# Prometheus, Alertmanager and Chromium (Debian packages, with apt-get as root or through sudo), and
# Python's venv module when .venv has to be made; elsewhere it stops here with the command to run.
system-packages:
	$(if $(VENV_OK),,$(CHECK_PYTHON))
	@sh tests/support/ensure_system_packages.sh $(if $(VENV_OK),,$(PYTHON))

demo: $(VENV)/.installed-demo
	$(BIN)/tracejudge demo

test: system-packages $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest --numprocesses=$(TEST_WORKERS) $(PYTEST_ARGS)

# The documentation site (docs/mkdocs.yml, pages in docs/pages/) into docs/site/, warnings as errors
# (--strict: a broken link or anchor, a page missing from the nav, fails the build), as CI and
# tests/test_docs_site.py build it. NO_MKDOCS_2_WARNING=1 silences the end-of-life banner about
# MkDocs 2 that mkdocs-material >= 9.7 prints on every build. MkDocs and the theme come with the test
# extra (pyproject.toml). Open docs/site/index.html, or `.venv/bin/mkdocs serve -f docs/mkdocs.yml`.
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -f docs/mkdocs.yml -d $(CURDIR)/docs/site

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

bench: $(VENV)/.installed-test
	for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
