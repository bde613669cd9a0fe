# Two commands on a fresh machine with only Python: `make demo` and `make test`.
# Each creates .venv, installs torch 2.13.0 (CPU) first, then this project with its test, experiment, tensorboard, prometheus, storage, hf (transformers), nat (cryptography), docs (mkdocs) and deploy (kubernetes-validate) extras.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-slow setup clean docs docs-build docs-reference

setup: $(STAMP)

# One setup at a time: a second `make` started meanwhile (two `make demo` in a fresh clone) waits for the first,
# then finds the stamp newer than pyproject.toml and installs nothing (two pip runs in one .venv break it).
# The lock is held on the Makefile itself (no file to create or ignore); without flock(1) (macOS), no lock.
SETUP_LOCK := $(if $(shell command -v flock),flock Makefile,)

$(STAMP): pyproject.toml
	@$(SETUP_LOCK) sh -c 'if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then exit 0; fi; set -ex; \
	$(PYTHON) -m venv $(VENV); \
	$(BIN)/python -m pip install --quiet torch==2.13.0; \
	$(BIN)/python -m pip install --quiet -e ".[dev,experiments,tensorboard,prometheus,storage,hf,nat,docs,deploy]"; \
	touch $(STAMP)'

demo: $(STAMP)
	$(BIN)/gossiptrain demo

# pytest exits 5 when it collected no test: that must fail, not pass silently.
# Two workers (pytest-xdist): most tests wait on peer processes or poll, so two at a time use both cores.
test: $(STAMP)
	@$(BIN)/python -m pytest -n 2 --dist worksteal; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest ran no tests" >&2; exit 1; fi; exit $$rc

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# The docs site (mkdocs.yml; docs/). Strict: a broken link, a missing anchor or snippet, or a page left out of the nav
# fails the build. `docs` builds, then serves it locally (the address is printed); `docs-build` writes site/.
# NO_MKDOCS_2_WARNING: Material's banner about its end of life, printed on every build.
DOCS_ADDR ?= 127.0.0.1:8000
MKDOCS    := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs

docs: docs-build
	@echo "docs: serving at http://$(DOCS_ADDR)/ (Ctrl+C stops)"
	$(MKDOCS) serve --dev-addr $(DOCS_ADDR)

docs-build: $(STAMP)
	$(MKDOCS) build --strict --site-dir site

# Regenerate the generated reference pages (docs/reference/cli.md, config.md) from the code.
docs-reference: $(STAMP)
	$(BIN)/python -m gossiptrain.cli.reference

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis site
