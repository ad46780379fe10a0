# The README's quick start: `make demo` trains the flagship job, `make test` runs the tests.
# Both install everything first (uv, then the locked dependencies into .venv).

UV_VERSION := 0.13.9
UV := $(or $(shell command -v uv 2>/dev/null),.tools/bin/uv)

.PHONY: install demo test test-quick test-ray-floor lint format bench bench-trl

# uv itself, where the machine has none: a private copy in .tools, not on the user's PATH.
.tools/bin/uv:
	python3 -m venv .tools
	.tools/bin/pip install --quiet uv==$(UV_VERSION)

# --compile-bytecode: Python caches nothing where PYTHONDONTWRITEBYTECODE is set (as on CI machines), and
# every process (each Ray worker) would compile torch, ray and transformers again: ~10 s per import.
install: $(UV)
	$(UV) sync --locked --compile-bytecode

# The venv's own executables, not `uv run`: under `uv run`, Ray starts every worker through
# `uv run` as well, which fails when uv is not on PATH (as with .tools/bin/uv).
demo: install
	.venv/bin/raytrain-ddp train digits

# Everything: lint, the smoke run on Ray's public API alone (every ray_compat capability off), the unit
# tier and the smoke run on the oldest Ray supported, then both tiers (tests/unit without Ray,
# tests/system end to end) on the lock's. System
# packages for the `ray up` test (sshd, rsync) and the compile test (g++) are installed where the
# machine allows, else named. Two test files at a time (pytest-xdist: two workers, each taking the
# next file, the longest first: tests/conftest.py): one test's waits on a server, a node or Slurm
# are the other's working time (the session's line in `time by file` says how busy the cores were).
test: lint
	bash tests/system-deps.sh
	RAYTRAIN_DDP_RAY_INTERNALS=off .venv/bin/pytest -m smoke -p no:cacheprovider -q
	$(MAKE) --no-print-directory test-ray-floor
	.venv/bin/pytest -n 2 --dist loadfile --no-loadscope-reorder

# The oldest Ray the service runs on (pyproject.toml's floor: docs/ray-versions.md): the unit tier and
# the smoke run there too, in a second environment that differs from .venv in Ray alone: .venv's files
# hard-linked (seconds, no disk; copied where links cannot be made), its scripts pointed at it, then Ray
# replaced by the floor's release. Three unit files test what no Ray touches (MLflow's new stores, model
# logging ahead, torch.compile): half the tier's time, the same on either Ray, run on the lock's alone.
RAY_FLOOR := 2.55.1
RAY_FLOOR_VENV := .venv-ray-$(RAY_FLOOR)
RAY_FREE := $(addprefix --ignore=tests/unit/,test_new_store.py test_preparing_thread.py test_compile.py)

test-ray-floor: install
	rm -rf $(RAY_FLOOR_VENV)
	cp -al .venv $(RAY_FLOOR_VENV) 2>/dev/null || cp -a .venv $(RAY_FLOOR_VENV)
	grep -l '^#!.*/\.venv/bin/python' $(RAY_FLOOR_VENV)/bin/* | xargs -r sed -i '1s|/\.venv/bin/python|/$(RAY_FLOOR_VENV)/bin/python|'
	$(UV) pip install --quiet --python $(RAY_FLOOR_VENV)/bin/python --compile-bytecode "ray[default,train,data]==$(RAY_FLOOR)"
	$(RAY_FLOOR_VENV)/bin/pytest tests/unit $(RAY_FREE) -n 2 -p no:cacheprovider -q
	$(RAY_FLOOR_VENV)/bin/pytest -m smoke -p no:cacheprovider -q

# While developing: the unit tier and one 2-worker run, a few minutes on 2 cores.
test-quick: install
	.venv/bin/pytest -m "unit or smoke"

# ruff: lint, formatting, short functions, Ray's internals only in ray_compat/ (pyproject.toml's
# [tool.ruff]); import-linter: the layers by process and no import cycle ([tool.importlinter]).
# `make format` fixes what it can.
lint: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/lint-imports

format: install
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

# torchrun DDP against raytrain_ddp, alternating (bench/harness.py; ~30 min on 2 cores):
# the table is printed and written to bench/results/<machine>.{json,md}.
bench: install
	.venv/bin/python bench/harness.py $(ARGS)

# chat_sft against TRL's SFTTrainer (bench/sft_vs_trl.py; a warm-up and 3 rounds, ~55 min on 2 cores).
# TRL is the benchmark's alone: installed into a second environment, .venv's files hard-linked as for
# the Ray floor, never into .venv or the lock.
TRL := 1.16.0
TRL_VENV := .venv-trl-$(TRL)

bench-trl: install
	test -x $(TRL_VENV)/bin/trl || { rm -rf $(TRL_VENV) \
	  && (cp -al .venv $(TRL_VENV) 2>/dev/null || cp -a .venv $(TRL_VENV)) \
	  && grep -l '^#!.*/\.venv/bin/python' $(TRL_VENV)/bin/* | xargs -r sed -i '1s|/\.venv/bin/python|/$(TRL_VENV)/bin/python|' \
	  && $(UV) pip install --quiet --python $(TRL_VENV)/bin/python --compile-bytecode "trl==$(TRL)"; }
	.venv/bin/python bench/sft_vs_trl.py --trl-python $(TRL_VENV)/bin/python $(ARGS)
