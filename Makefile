# Two commands on a fresh machine; each sets up what it needs (once) and says what it installs:
#
#   make simulate   the main job: `pagedkv simulate` on the bundled trace (ARGS="--json" etc.)
#   make test       the whole test suite, every extra installed, redis-server required
#
# Both share one virtual environment (VENV, default .venv), updated only when pyproject.toml or
# the set-up script changed since its extra was installed. PYTHON picks the interpreter (>= 3.11).

PYTHON ?= python3
VENV ?= .venv
ARGS ?=
PYTEST_ARGS ?= -q

.PHONY: simulate test

simulate: $(VENV)/.pagedkv-sim
	$(VENV)/bin/pagedkv simulate $(ARGS)

# PAGEDKV_REQUIRE_TEST_DEPS: a test that would skip because something this command provides is
# missing (an extra's package, redis-server, triton) fails instead (tests/strict_setup.py);
# PAGEDKV_REQUIRE_REDIS: the Redis tests' own check of the same (tests/redis_server.py).
test: $(VENV)/.pagedkv-dev
	@scripts/setup.sh redis
	PAGEDKV_REQUIRE_TEST_DEPS=1 PAGEDKV_REQUIRE_REDIS=1 $(VENV)/bin/python -m pytest $(PYTEST_ARGS)
	@# vLLM's own test suites against the drop-in (issue 10) are run from here, after ours.

$(VENV)/.pagedkv-%: pyproject.toml scripts/setup.sh
	@PYTHON="$(PYTHON)" scripts/setup.sh venv "$(VENV)" "$*"
