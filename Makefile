# Two entry points (see README): `make demo` and `make test`. Both set up first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tokenrouter-installed

.PHONY: demo test setup bench clean

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -p no:cacheprovider

bench: setup
	$(PY) scripts/bench_routing.py

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
