"""Shared by both tiers: each test's tier as a marker, and a private workspace per run.

tests/unit     no Ray: config, checkpoints, leases, update rules, refusals  (pytest -m unit)
tests/system   end to end on a real local Ray, MLflow stores and servers    (pytest -m system)
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# No Hugging Face hub here: models and tokenizers come from the tests' own directories. Set before the
# session's Ray starts, so its workers inherit it.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The files that take longest, longest first (`time by file` of a clean clone's run, one test at a
# time: `pytest -n 0`). `make test` runs the suite on two xdist workers, each taking the next file as it frees
# up: the longest started first leaves short files for the end, so neither waits long for the other
# (largest first, the classic rule for two machines). Every other file keeps its place after these.
LONGEST_FIRST = [
    f"tests/system/test_{name}.py"
    for name in (
        "node_loss", "cli", "reliability", "streaming", "slurm", "cluster", "jobs", "chat_sft", "s3",
        "ray_up", "registration", "sweep", "bench", "tracking_server", "notebook", "ddp", "training",
    )
]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(item.path.parent.name)  # "unit" or "system": the tier is where the test lives
    rank = {path: place for place, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(config.rootpath).as_posix(), len(rank)))


@dataclass(frozen=True)
class Workspace:
    """Where a test's runs write: its own storage path and its own sqlite MLflow store. In the system
    tier the store starts as a copy of an empty one (`store`), so MLflow creates its schema once per
    session rather than once per test (1.6 s each on 2 cores)."""

    root: Path
    store: Path | None = None

    def __post_init__(self):
        if self.store is not None:
            shutil.copyfile(self.store, self.root / "mlflow.db")

    def untouched(self) -> bool:
        """Nothing written: no run directory, and the MLflow store as it was given (or none at all)."""
        db = self.root / "mlflow.db"
        if self.storage.exists():
            return False
        return db.read_bytes() == self.store.read_bytes() if self.store is not None else not db.exists()

    @property
    def storage(self) -> Path:
        return self.root / "runs"

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"

    def overrides(self, *extra: str) -> list[str]:
        # Half a CPU per worker leaves Ray Data a core on a 2-core machine. The controller polls the
        # workers every 0.2 s (0.5 by default): each run ends, and each failure is seen, sooner.
        return [
            f"run.storage_path={self.storage}",
            f"mlflow.tracking_uri={self.tracking_uri}",
            "scaling.num_workers=2",
            "scaling.resources_per_worker={CPU: 0.5}",
            "run.controller_poll_s=0.2",
            *extra,
        ]


SCENARIOS: list[dict] = []  # the reliability figures, printed as a table at the end of the session


@pytest.fixture
def record(request):
    """`record(scenario, attempts=..., resumed=..., wasted=..., checkpoints=..., versions=...)`. The row
    travels in the test's report, as text, so it reaches the session's table from an xdist worker too."""
    return lambda scenario, **figures: request.node.user_properties.append(
        ("scenario", {"scenario": scenario, **{name: str(value) for name, value in figures.items()}})
    )


FILE_SECONDS: dict[str, float] = {}  # each test file's setup, call and teardown time: where the suite's time goes
# Each test's wall time, the machine's CPU time over it and its cores' time waiting on the disk
# (/proc/stat, every process's, the test's own Ray and servers included): a test whose cores sit idle
# waits (a timeout, a poll, a server, or files read from a disk the page cache lost), and waiting is
# cut differently from work. Meaningful by test only where one test runs at a time (`-n 0`); with two
# xdist workers, the session's figure says how well the two kept the cores busy.
TEST_CPU: dict[str, tuple[float, float, float]] = {}
_STARTED = pytest.StashKey[tuple[float, tuple[float, float] | None]]()
_SESSION_STARTED = pytest.StashKey[tuple[float, tuple[float, float] | None]]()


def _cpu_seconds() -> tuple[float, float] | None:
    """The machine's busy CPU time so far and its time waiting on I/O, all cores (Linux; None elsewhere)."""
    try:
        with open("/proc/stat") as stat:
            user, nice, system, _idle, iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, iowait / tick


def pytest_sessionstart(session):
    session.config.stash[_SESSION_STARTED] = time.monotonic(), _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    item.stash[_STARTED] = time.monotonic(), _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The test's CPU figures, in its teardown report (from an xdist worker too)."""
    started, before = item.stash[_STARTED]
    if call.when == "teardown" and before is not None:
        busy, iowait = _cpu_seconds()
        item.user_properties.append(("cpu", (time.monotonic() - started, busy - before[0], iowait - before[1])))
    yield


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[path] = FILE_SECONDS.get(path, 0.0) + report.duration
    if report.when == "teardown":  # its user_properties: all the test added, fixtures' teardowns included
        for name, value in report.user_properties:
            if name == "scenario":
                SCENARIOS.append(value)
            elif name == "cpu":
                TEST_CPU[report.nodeid] = value


def pytest_terminal_summary(terminalreporter, config):
    cores = os.cpu_count() or 1
    one_at_a_time = (config.getoption("numprocesses", None) or 0) <= 1  # xdist's -n
    if FILE_SECONDS:
        terminalreporter.section("time by file")
        total = sum(FILE_SECONDS.values())
        busy = {}
        for nodeid, (_, cpu, _) in TEST_CPU.items():
            path = nodeid.split("::", 1)[0]
            busy[path] = busy.get(path, 0.0) + cpu
        for path, seconds in sorted(FILE_SECONDS.items(), key=lambda item: -item[1]):
            shown = one_at_a_time and path in busy and seconds > 1
            used = f"  cores {busy[path] / (seconds * cores):4.0%} busy" if shown else ""
            terminalreporter.write_line(f"{seconds:8.1f} s {seconds / total:6.1%}{used}  {path}")
        terminalreporter.write_line(f"{total:8.1f} s in all")
    started, before = config.stash[_SESSION_STARTED]
    if before is not None:
        wall, (busy_s, iowait) = time.monotonic() - started, _cpu_seconds()
        idle = wall - (busy_s - before[0]) / cores
        lanes = "one test at a time" if one_at_a_time else f"{config.getoption('numprocesses')} xdist workers"
        terminalreporter.write_line(
            f"the session: {wall:.1f} s, {lanes}; its {cores} cores {1 - idle / wall:.0%} busy, "
            f"{idle:.1f} s idle ({(iowait - before[1]) / cores:.1f} s of it waiting on the disk)"
        )
    if TEST_CPU and one_at_a_time:
        terminalreporter.section("time the cores sat idle, by test")
        idle = {nodeid: wall - cpu / cores for nodeid, (wall, cpu, _) in TEST_CPU.items()}
        disk = {nodeid: iowait / cores for nodeid, (_, _, iowait) in TEST_CPU.items()}
        for nodeid, seconds in sorted(idle.items(), key=lambda item: -item[1])[:15]:
            wall = TEST_CPU[nodeid][0]
            terminalreporter.write_line(
                f"{seconds:8.1f} s idle of {wall:6.1f} s ({disk[nodeid]:5.1f} s of it on the disk)  {nodeid}"
            )
        terminalreporter.write_line(
            f"{sum(idle.values()):8.1f} s idle in all ({sum(disk.values()):.1f} s of it waiting on the disk), "
            f"{cores} cores"
        )
    if not SCENARIOS:
        return
    columns = ["scenario", "attempts", "resumed", "wasted", "checkpoints", "versions", "note"]
    terminalreporter.section("reliability scenarios")
    terminalreporter.write_line("| " + " | ".join(columns) + " |")
    terminalreporter.write_line("|" + "---|" * len(columns))
    for row in SCENARIOS:
        terminalreporter.write_line("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")


@pytest.fixture
def workspace(tmp_path: Path, request) -> Workspace:
    return Workspace(tmp_path, _store(request))


@pytest.fixture(scope="module")
def module_workspace(tmp_path_factory, request) -> Workspace:
    return Workspace(tmp_path_factory.mktemp("workspace"), _store(request))


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An empty MLflow sqlite store, its schema created by MLflow, once for the session."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("empty-store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def _store(request) -> Path | None:
    """The system tier's workspaces start with a copy of the empty store; the unit tier's with none."""
    return request.getfixturevalue("empty_store") if request.path.parent.name == "system" else None


@pytest.fixture
def readme_job(tmp_path: Path) -> Path:
    """The README's own job ("Writing your own job"), written out as a user would, away from the
    project: wine.py, wine.yaml, and the wine table as the CSV it reads (wine.csv). Returns wine.py."""
    from sklearn.datasets import load_wine

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Writing your own job", 1)[1].split("\n## ", 1)[0]
    [python] = re.findall(r"```python\n(.*?)```", section, re.S)
    [yaml] = re.findall(r"```yaml\n(.*?)```", section, re.S)
    (tmp_path / "wine.py").write_text(python)
    (tmp_path / "wine.yaml").write_text(yaml)
    load_wine(as_frame=True).frame.to_csv(tmp_path / "wine.csv", index=False)
    return tmp_path / "wine.py"


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory) -> Path:
    """examples/tiny_chat.py's output: model/ (a tiny random Llama and its tokenizer), train.jsonl, val.jsonl."""
    spec = importlib.util.spec_from_file_location("tiny_chat", Path(__file__).parents[1] / "examples" / "tiny_chat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write(tmp_path_factory.mktemp("tiny-chat"))
