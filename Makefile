# Two commands on a fresh machine; each sets up what it needs (once) and says what it installs:
#
#   make simulate   the main job: `pagedkv simulate` on the bundled trace (ARGS="--json" etc.)
#   make test       lint and types (make lint), then the whole test suite, every extra installed,
#                   redis-server required; then vLLM's own scheduler suites on pagedkv
#                   (.ci/vllm-suites, its own venv); between the two, .ci/wheel-smoke: the wheel
#                   installed into a fresh venv runs `pagedkv simulate` from another folder;
#                   last, .ci/router-e2e: the router in front of vLLM's own manager and publisher
#   make test-pagedkv   lint and types, then our suite alone
#   make lint       ruff check, ruff format --check, mypy (configured in pyproject.toml)
#
# Both share one virtual environment (VENV, default .venv), updated only when pyproject.toml or
# the set-up script changed since its extra was installed. PYTHON picks the interpreter (>= 3.11).

PYTHON ?= python3
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?= -q

.PHONY: simulate test test-pagedkv lint wheel-smoke

simulate: $(VENV)/.pagedkv-sim
	$(VENV)/bin/pagedkv simulate $(ARGS)

# PAGEDKV_REQUIRE_TEST_DEPS: a test that would skip because something this command provides is
# missing (an extra's package, redis-server, triton) fails instead (tests/support/strict_setup.py);
# PAGEDKV_REQUIRE_REDIS: the Redis tests' own check of the same (tests/support/redis_server.py).
test: test-pagedkv wheel-smoke
	PYTHON="$(PYTHON)" .ci/vllm-suites
	VENV="$(VENV)" .ci/router-e2e

# The package as a user gets it: build the wheel, install it with [sim,router] into a fresh
# venv, run the main job, `size` and the vLLM-mode router from a folder outside the clone.
wheel-smoke:
	PYTHON="$(PYTHON)" .ci/wheel-smoke

# lint first: the suite's recipe starts only once lint and types pass (fail fast).
test-pagedkv: lint $(VENV)/.pagedkv-dev
	@scripts/setup.sh redis
	PAGEDKV_REQUIRE_TEST_DEPS=1 PAGEDKV_REQUIRE_REDIS=1 $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.pagedkv-dev
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests examples
	$(VENV)/bin/mypy

$(VENV)/.pagedkv-%: pyproject.toml scripts/setup.sh
	@PYTHON="$(PYTHON)" scripts/setup.sh venv "$(VENV)" "$*"
