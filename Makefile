# The README's quick start: `make demo` trains the flagship job, `make test` runs the tests.
# Both install everything first (uv, then the locked dependencies into .venv).

UV_VERSION := 0.13.9
UV := $(or $(shell command -v uv 2>/dev/null),.tools/bin/uv)

.PHONY: install demo test test-quick

# uv itself, where the machine has none: a private copy in .tools, not on the user's PATH.
.tools/bin/uv:
	python3 -m venv .tools
	.tools/bin/pip install --quiet uv==$(UV_VERSION)

install: $(UV)
	$(UV) sync --locked

demo: install
	$(UV) run --locked raytrain-ddp train digits

test: install
	$(UV) run --locked pytest

test-quick: install
	$(UV) run --locked pytest -m "not slow"
