# Two commands on a fresh machine with only Python: `make demo` and `make test`.
# Each creates .venv, installs torch 2.13.0 (CPU) first, then this project with its test, experiment, tensorboard, prometheus, storage, hf (transformers) and nat (cryptography) extras.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-slow setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,experiments,tensorboard,prometheus,storage,hf,nat]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gossiptrain demo

# pytest exits 5 when it collected no test: that must fail, not pass silently.
# Two workers (pytest-xdist): most tests wait on peer processes or poll, so two at a time use both cores.
test: $(STAMP)
	@$(BIN)/python -m pytest -n 2 --dist worksteal; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest ran no tests" >&2; exit 1; fi; exit $$rc

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
