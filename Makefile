# Two entry points (see README): `make demo` and `make test`. Both set up first.
# For developers: `make check` (the quick loop), `make test-noise` (the kernel-sensitive tests
# under three noise seeds), `make flakes` (the suite three times, once beside a busy core: what changed),
# `make screenshot` (docs/app*.png), `make bench`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tokenrouter-installed
PYTEST := $(PY) -m pytest -q -p no:cacheprovider
# The suite's parallel part runs on JOBS pytest-xdist workers, each pinned to a core of its own
# (tests/conftest.py), a module to a worker (its servers start once); the tests marked `serial`
# (real-time audio, the browser, timed windows) run after it, alone. One worker per CPU this make may use.
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
XDIST  := -n $(JOBS) --dist loadscope
JUNIT  ?= build/junit
# What `make test` runs once more under kernel noise (shared/kernel_noise.py); test-noise takes three.
NOISE_SEEDS ?= 1 2 3

.PHONY: demo test suite suite-parallel suite-serial suite-noise check lint test-noise flakes screenshot setup bench clean

demo: setup
	$(PY) scripts/demo.py

# The full suite (what CI runs): lint, every test, the kernel-sensitive ones again under one
# noise seed, and a check that the tests left `git status` as they found it.
test: setup lint
	@mkdir -p build && (git status --porcelain 2>/dev/null || true) > build/git-status.before
	$(MAKE) --no-print-directory suite
	@(git status --porcelain 2>/dev/null || true) | diff build/git-status.before - \
	  || { echo "make test: the checkout changed during the tests (outputs belong under build/)"; exit 1; }

# Every test once, then the kernel-sensitive ones under noise seed 1, in this order (make takes the
# parts left to right; `make -k suite` runs every part even if one fails). Each part writes its JUnit
# report under $(JUNIT): scripts/find_flakes.py compares them between runs.
suite: suite-parallel suite-serial suite-noise

suite-parallel: setup
	$(PYTEST) $(XDIST) -m "not serial" --junitxml=$(JUNIT)/parallel.xml

suite-serial: setup
	$(PYTEST) -m serial --junitxml=$(JUNIT)/serial.xml

suite-noise: setup
	TOKENROUTER_KERNEL_NOISE=1 $(PYTEST) $(XDIST) -m "kernel and not serial" --junitxml=$(JUNIT)/noise-parallel.xml
	TOKENROUTER_KERNEL_NOISE=1 $(PYTEST) -m "kernel and serial" --junitxml=$(JUNIT)/noise-serial.xml

# The quick loop: lint and the tests that need no cloud server, browser or audio device (~90 s on 2 cores).
check: setup lint
	$(PYTEST) $(XDIST) -m "not slow and not serial"
	$(PYTEST) -m "not slow and serial"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The tests that compare argmaxes or routing decisions, as another CPU's kernels would compute them.
test-noise: setup
	@for seed in $(NOISE_SEEDS); do \
	  echo "kernel-sensitive tests under TOKENROUTER_KERNEL_NOISE=$$seed"; \
	  TOKENROUTER_KERNEL_NOISE=$$seed $(PYTEST) $(XDIST) -m "kernel and not serial" || exit 1; \
	  TOKENROUTER_KERNEL_NOISE=$$seed $(PYTEST) -m "kernel and serial" || exit 1; \
	done

# The suite three times (twice on a quiet machine, once beside a core kept busy): every test whose
# result changed, under build/flakes/ (~75 minutes on 2 cores).
flakes: setup
	$(PY) scripts/find_flakes.py

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
