# Two entry points (see README): `make demo` and `make test`. Both set up first.
# For developers: `make check` (the quick loop), `make test-noise` (the kernel-sensitive tests
# under three noise seeds), `make screenshot` (docs/app*.png), `make bench`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tokenrouter-installed
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
# What `make test` runs once more under kernel noise (shared/kernel_noise.py); test-noise takes three.
NOISE_SEEDS ?= 1 2 3

.PHONY: demo test check lint test-noise screenshot setup bench clean

demo: setup
	$(PY) scripts/demo.py

# The full suite (what CI runs): lint, every test, the kernel-sensitive ones again under one
# noise seed, and a check that the tests left `git status` as they found it.
test: setup lint
	@mkdir -p build && (git status --porcelain 2>/dev/null || true) > build/git-status.before
	$(PYTEST)
	$(MAKE) --no-print-directory test-noise NOISE_SEEDS=1
	@(git status --porcelain 2>/dev/null || true) | diff build/git-status.before - \
	  || { echo "make test: the checkout changed during the tests (outputs belong under build/)"; exit 1; }

# The quick loop: lint and the tests that need no cloud server, browser or audio device (~2 min).
check: setup lint
	$(PYTEST) -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The tests that compare argmaxes or routing decisions, as another CPU's kernels would compute them.
test-noise: setup
	@for seed in $(NOISE_SEEDS); do \
	  echo "kernel-sensitive tests under TOKENROUTER_KERNEL_NOISE=$$seed"; \
	  TOKENROUTER_KERNEL_NOISE=$$seed $(PYTEST) -m kernel || exit 1; \
	done

# The page after one spoken turn, for docs/app.md (the browser test saves it under build/).
screenshot: setup
	$(PYTEST) tests/test_webapp_browser.py -k "test_spoken_question_answered_in_the_page or test_the_first_minute_explains_itself"
	cp build/screenshots/app.png build/screenshots/app-first-click.png build/screenshots/app-no-microphone.png \
	  build/screenshots/app-empty.png docs/

bench: setup
	$(PY) scripts/bench_routing.py

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
