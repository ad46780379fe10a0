"""`make bench`: what Ray and raytrain_ddp cost over a plain torchrun DDP script, side by side.

    python bench/harness.py                       # 1 warm-up round + 5 measured rounds, the default sides
    python bench/harness.py --rounds 1 --no-warmup --sides A,B key=value ...   # a quick look

Sides, run in alternation in every round (the same workload, bench/workload.py, and settings,
bench/workload.yaml plus the overrides given here):

    A        torchrun --nproc-per-node N bench/torchrun_ddp.py: plain PyTorch DDP
    B-cold   raytrain-ddp train (Ray Data ingest, a checkpoint every epoch, MLflow), no Ray running
    B        the same, with Ray already up (as under `ray job submit`)
    B-async  B with checkpoint.upload=async
    B-quiet  B with run.progress_s=0: no live progress (B/B-quiet, same round, is what the display costs)
    B-fresh, B-cold-fresh   B and B-cold with run.prestart_workers=false: the workers' processes started
             when Ray Train asks for them, not ahead (against B, same round: what starting them ahead gains)
    B-usage  B with Ray Data's usage collection on in the driver (RAY_DATA_USAGE_DISABLED=0), as before
             the driver turned it off (against B, same round: what that gains)
    B'       B with dataset.source=torch: a torch DataLoader through prepare_data_loader

Every side's model carries the same probe (workload.StepTrace: each forward's start time, per rank),
read here into: steady step time (the gaps between consecutive training forwards, without the first
steps of each epoch), time to first step (launch -> the second forward, i.e. the first optimizer step
done), teardown (the last step's end -> process exit). Data wait per worker and checkpoint blocking
come from each side's own clocks (A's rank<R>.json; B's metrics, saved in each checkpoint). Final
weights of A and B are compared (they train on the same batches). Results: a JSON file and a
Markdown table under bench/results/, named for the machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

from raytrain_ddp.worker.flops import count, peak_flops

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
BIN = Path(sys.executable).parent  # the venv's executables: torchrun, raytrain-ddp, ray (else found on PATH)
sys.path.insert(0, str(BENCH))
import torchrun_ddp  # noqa: E402  (the same config reader as side A)
import workload  # noqa: E402

# What each of Ray's internals buys (raytrain_ddp/ray_compat): B and B-cold on Ray's public API alone
# (-public), and without one capability at a time (-no-<capability>).
INTERNALS = ("prestart", "torch_free_controller", "lean_trainer", "system_config")
WARM_INTERNALS = ("B-public", *(f"B-no-{name}" for name in INTERNALS if name != "system_config"))
COLD_INTERNALS = ("B-cold-public", *(f"B-cold-no-{name}" for name in INTERNALS))
SIDES = (
    "A",
    "B-cold",
    "B-cold-fresh",
    *COLD_INTERNALS,
    "B",
    "B-fresh",
    "B-usage",
    "B-unregistered",
    "B-async",
    "B'",
    "B-quiet",
    *WARM_INTERNALS,
)
DEFAULT_SIDES = ("A", "B-cold", "B", "B-async", "B'", "B-quiet")  # the others when asked for
# while the harness's Ray is up
WARM = ("B", "B-fresh", "B-usage", "B-unregistered", "B-async", "B'", "B-quiet", *WARM_INTERNALS)
SIDE_OVERRIDES = {
    "B-cold-fresh": ["run.prestart_workers=false"],
    "B-fresh": ["run.prestart_workers=false"],
    "B-async": ["checkpoint.upload=async"],
    "B'": ["dataset.source=torch"],
    "B-quiet": ["run.progress_s=0"],
    "B-unregistered": ["mlflow.register=never"],
}
SIDE_ENV = {  # the driver's environment, beyond the harness's
    "B-usage": {"RAY_DATA_USAGE_DISABLED": "0"},
    "B-public": {"RAYTRAIN_DDP_RAY_INTERNALS": "off"},
    "B-cold-public": {"RAYTRAIN_DDP_RAY_INTERNALS": "off"},
    **{f"B-no-{name}": {"RAYTRAIN_DDP_RAY_INTERNALS": f"-{name}"} for name in INTERNALS},
    **{f"B-cold-no-{name}": {"RAYTRAIN_DDP_RAY_INTERNALS": f"-{name}"} for name in INTERNALS},
}
SETTLE_S = 30.0  # before each run, the longest wait for idle cores (`_settle`)
DROP_FIRST_STEPS = 5  # of each epoch: iterator start-up, not the steady state
# The goals (issue 16), each judged on the worst measured round, so a lucky round cannot make a miss look met.
GOALS = {
    "ratio": 1.05,
    "ttfs_gap_s": 6.0,
    "cold_ttfs_gap_s": 10.0,
    "teardown_s": 3.0,
    "data_wait": 0.05,
    "checkpoint_share": 0.02,
}


@dataclass
class Run:
    side: str
    round: int  # 0 = warm-up
    exit_code: int
    wall_s: float  # launch -> process exit
    ttfs_s: float | None = None
    step_ms: float | None = None  # median steady step, all ranks
    step_p90_ms: float | None = None
    epoch_step_ms: list[float] = field(default_factory=list)  # median steady step of each epoch, all ranks
    data_wait: list[float] = field(default_factory=list)  # per worker, over all epochs
    checkpoint_s: list[float] = field(default_factory=list)  # training blocked, per checkpoint
    epoch_s: list[float] = field(default_factory=list)
    teardown_s: float | None = None
    threads: list[int] = field(default_factory=list)  # torch intra-op threads per rank
    weights_vs_a: float | None = None  # max |w_B - w_A| over all parameters (B-side runs of a round with A)
    phases: dict[str, float] = field(default_factory=dict)  # B: the run's timeline, phase -> seconds
    cpu_s: float | None = None  # the machine's busy CPU-seconds from launch to exit (every process's)
    reported_rate: float | None = None  # B: rows (or tokens) per second, as its last report says (samples_per_s)
    reported_mfu: float | None = None  # B: MFU as its last report says (GPU of known peak only)
    log: str = ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every side (e.g. train.epochs=2)")
    parser.add_argument("--config", metavar="FILE", help="a YAML layered over bench/workload.yaml (a GPU workload)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up round")
    parser.add_argument("--sides", default=",".join(DEFAULT_SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker: NCCL, bf16")
    parser.add_argument("--workers", type=int, help="DDP workers (default: 2 on CPU, every GPU with --gpu)")
    parser.add_argument("--out", default=str(BENCH / "results"), help="where the JSON and Markdown go")
    parser.add_argument("--name", help="results file name (default: the machine's)")
    parser.add_argument(
        "--no-dashboard", action="store_true", help="the warm sides' Ray (`ray start --head`) without its dashboard"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=SETTLE_S,
        help=f"before each run, wait for idle cores at most this long (default {SETTLE_S:g}; 0: not at all)",
    )
    parser.add_argument("--table", metavar="JSON", help="only print (and rewrite) the Markdown table of a results file")
    args = parser.parse_args(argv)
    if args.table:
        results = json.loads(Path(args.table).read_text())
        print(write(results, Path(args.table).parent, Path(args.table).stem))
        return 0
    sides = [s for s in SIDES if s in args.sides.split(",")]
    if unknown := set(args.sides.split(",")) - set(SIDES):
        parser.error(f"unknown sides {sorted(unknown)}; choose from {', '.join(SIDES)}")

    workers = args.workers or (torch.cuda.device_count() if args.gpu else 2)
    overrides = [f"scaling.num_workers={workers}", *_device_overrides(args.gpu, workers), *args.overrides]
    config = _config(args.config, overrides)
    work = Path(tempfile.mkdtemp(prefix="rtb-"))  # short: Ray's socket paths live under it
    bench = Bench(work, config, overrides, args.config, workers, not args.no_dashboard, args.settle_s)
    print(f"benchmark: {bench.describe()}; work directory {work}", flush=True)

    runs: list[Run] = []
    for round_ in range(0 if args.no_warmup else -1, args.rounds):
        number = round_ + 1  # 0 = warm-up
        cold = [s for s in sides if s not in WARM]
        for side in cold if round_ % 2 == 0 else cold[::-1]:  # alternate which goes first
            runs.append(bench.run(side, number))
        if warm := [s for s in sides if s in WARM]:
            with bench.ray_cluster():
                for side in warm[round_ % len(warm) :] + warm[: round_ % len(warm)]:
                    runs.append(bench.run(side, number))
        bench.compare_weights([r for r in runs if r.round == number])
        table = write(summarize(runs, bench, sides), Path(args.out), args.name or _machine_name(args.gpu))
        print(f"round {number or 'warm-up'} done", flush=True)
    print(table)
    print(f"written under {args.out}")
    failed = [r for r in runs if r.exit_code != 0]
    for r in failed:
        print(f"FAILED: {r.side} round {r.round} exit {r.exit_code}; log {r.log}", file=sys.stderr)
    return 1 if failed else 0


def write(results: dict, out: Path, name: str) -> str:
    """The JSON and the Markdown table (after every round, so an interrupted benchmark keeps its rounds)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (out / f"{name}.md").write_text(table)
    return table


def _busy_cpu_s() -> float:
    """The machine's busy CPU time so far, all processes (psutil: user + system + irq...)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def _device_overrides(gpu: bool, workers: int) -> list[str]:
    if not gpu:
        return []
    cpus = max(1, (os.cpu_count() or 2) // (2 * workers))  # half the cores for the workers, half for Ray Data
    return ["scaling.use_gpu=true", f"scaling.resources_per_worker={{CPU: {cpus}, GPU: 1}}", "train.precision=bf16"]


def _config(layer: str | None, overrides: list[str]) -> dict:
    return torchrun_ddp.load(str(BENCH / "workload.yaml"), overrides, layer)


class Bench:
    def __init__(
        self,
        work: Path,
        config: dict,
        overrides: list[str],
        layer: str | None,
        workers: int,
        dashboard: bool = True,
        settle_s: float = SETTLE_S,
    ):
        self.work, self.config, self.overrides, self.layer, self.workers = work, config, overrides, layer, workers
        self.dashboard = dashboard  # the warm sides' Ray has one, as `ray start --head` does by default
        self.settle_s = settle_s  # the longest wait for idle cores before a run
        self.address: str | None = None
        d, t = config["dataset"], config["train"]
        rows = len(workload.rank_rows(d["rows"], 0, workers))
        self.batches_per_epoch = math.ceil(rows / t["batch_size"])

    @property
    def unit(self) -> str:
        return "tokens/s" if self.config["dataset"].get("sequence") else "images/s"

    def throughput(self, step_ms: float) -> float:
        """Rows (or tokens) per second, all workers together, at a steady step of `step_ms`."""
        rows = self.config["train"]["batch_size"] * self.workers
        return rows * (self.config["dataset"].get("sequence") or 1) / (step_ms / 1e3)

    def mfu(self, step_ms: float) -> float | None:
        """Model FLOPs utilization at a steady step of `step_ms`, both sides alike: the FLOPs of a
        training step per row as raytrain_ddp counts them (flops.py) against the GPUs' dense peak at
        the run's precision (flops.PEAKS). None on CPU, or a GPU not in the table."""
        if not self.config["scaling"].get("use_gpu"):
            return None
        peak = peak_flops(torch.cuda.get_device_name(0), self.config["train"].get("precision", "fp32"))
        if peak is None:
            return None
        rows_per_s = self.config["train"]["batch_size"] * self.workers / (step_ms / 1e3)
        return rows_per_s * self.flops_per_row / (peak * self.workers)

    @functools.cached_property
    def flops_per_row(self) -> float:
        """A training step's FLOPs per row of the workload, counted on the meta device: no compute."""
        with torch.device("meta"):
            model = workload.build_model(**{k: v for k, v in self.config["model"].items() if k != "trace"})
        d = self.config["dataset"]
        shape, classes = tuple(d.get("shape", (1, 28, 28))), d.get("classes", 10)
        rows = workload.make_data(0, 2, shape=shape, classes=classes, sequence=d.get("sequence"))
        batch = {name: torch.from_numpy(values).to("meta") for name, values in rows.items()}
        counted = count(workload.compute_loss, model, batch, tokens=None)
        if not counted.known:
            raise RuntimeError(f"the workload's FLOPs: {counted.missing}")
        return counted.per_sample

    def describe(self) -> str:
        warm = "" if self.dashboard else ", warm Ray without its dashboard"
        return describe(self.config, self.workers, self.batches_per_epoch) + warm

    def run(self, side: str, round_: int) -> Run:
        directory = self.work / f"{round_}-{side.replace(chr(39), 'p')}"
        directory.mkdir()
        common = [f"model.trace={directory / 'trace'}", *self.overrides, *SIDE_OVERRIDES.get(side, [])]
        layer = ["--config", self.layer] if self.layer else []
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
        if side == "A":
            command = [
                _exe("torchrun"),
                f"--nproc-per-node={self.workers}",
                "--master-port",
                str(_free_port()),
                str(BENCH / "torchrun_ddp.py"),
                str(BENCH / "workload.yaml"),
                *layer,
                "--out",
                str(directory),
                *common,
            ]
        else:
            command = [
                _exe("raytrain-ddp"),
                "train",
                *layer,
                str(BENCH / "workload.py"),
                *common,
                f"run.storage_path={directory / 'runs'}",
                "run.name=bench",
                f"mlflow.tracking_uri=sqlite:///{self.work / 'mlflow.db'}",
            ]
            if side in WARM:
                env |= self.cluster_env
            env |= SIDE_ENV.get(side, {})
        log = directory / "log.txt"
        _settle(self.settle_s)
        with open(log, "w") as out:
            busy, launched = _busy_cpu_s(), time.time()
            exit_code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
            exited = time.time()
        run = Run(side, round_, exit_code, exited - launched, log=str(log), cpu_s=_busy_cpu_s() - busy)
        if exit_code == 0:
            self._read(run, directory, launched, exited)
        print(
            f"  {side:8} {_fmt(run.step_ms, '.2f')} ms/step, first step {_fmt(run.ttfs_s, '.1f')} s, "
            f"wall {run.wall_s:.1f} s{'' if exit_code == 0 else f', FAILED (exit {exit_code}, {log})'}",
            flush=True,
        )
        return run

    def _read(self, run: Run, directory: Path, launched: float, exited: float) -> None:
        traces = _read_traces(directory / "trace")
        n = self.batches_per_epoch
        epochs = [
            [g for train in traces.values() for g in _diffs(train[e * n : (e + 1) * n])[DROP_FIRST_STEPS:]]
            for e in range(min(len(train) for train in traces.values()) // n)
        ]
        gaps = [g for epoch in epochs for g in epoch]
        run.step_ms = statistics.median(gaps) * 1e3
        run.epoch_step_ms = [statistics.median(epoch) * 1e3 for epoch in epochs]
        run.step_p90_ms = statistics.quantiles(gaps, n=10)[-1] * 1e3
        first = traces[0]
        run.ttfs_s = first[1] - launched
        run.teardown_s = exited - (first[-1] + run.step_ms / 1e3)
        run.threads = [t for _, t in sorted(_read_threads(directory / "trace").items())]
        if run.side == "A":
            ranks = [json.loads(p.read_text()) for p in sorted(directory.glob("rank*.json"))]
            run.data_wait = [
                sum(e["data_wait_s"] for e in r["epochs"]) / sum(e["data_wait_s"] + e["compute_s"] for e in r["epochs"])
                for r in ranks
            ]
            run.checkpoint_s = [e["checkpoint_s"] for e in ranks[0]["epochs"]]
            run.epoch_s = [e["epoch_time_s"] for e in ranks[0]["epochs"]]
            return
        reports = [
            json.loads(p.read_text()) for p in sorted((directory / "runs" / "bench").glob("epoch_*/metrics.json"))
        ]
        busy = [r["data_wait_s"] + r["compute_s"] for r in reports]  # per rank, averaged: weights each epoch's fraction
        run.data_wait = [
            sum(r["data_wait_fraction_per_worker"][w] * b for r, b in zip(reports, busy)) / sum(busy)
            for w in range(self.workers)
        ]
        run.checkpoint_s = [r["checkpoint_s"] for r in reports[1:]]  # each report carries the previous checkpoint's
        run.epoch_s = [r["epoch_time_s"] for r in reports]
        kept = json.loads((directory / "runs" / "bench" / "timeline.json").read_text())
        run.phases = {phase: length for phase, _, length in kept["phases"]}
        run.phases["exit"] = exited - max(at for _, at in kept["marks"])  # the last mark -> the process's exit
        run.reported_rate = reports[-1]["samples_per_s"] * (self.config["dataset"].get("sequence") or 1)
        run.reported_mfu = reports[-1].get("mfu")

    def compare_weights(self, runs: list[Run]) -> None:
        a = next((r for r in runs if r.side == "A" and r.exit_code == 0), None)
        if a is None:
            return
        final = torch.load(Path(a.log).parent / "final.pt", weights_only=True)
        for run in runs:
            if run.side != "A" and run.exit_code == 0:
                checkpoints = sorted((Path(run.log).parent / "runs" / "bench").glob("epoch_*/model.pt"))
                theirs = torch.load(checkpoints[-1], weights_only=True)
                run.weights_vs_a = max(float((final[k].float() - theirs[k].float()).abs().max()) for k in final)

    @property
    def cluster_env(self) -> dict[str, str]:
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.work / "token")}

    def ray_cluster(self) -> RayCluster:
        return RayCluster(self)


class RayCluster:
    """`ray start --head --block` with this benchmark's own temp dir and ports, stopped by its process
    tree (never `ray stop`, which would stop every Ray on the machine)."""

    def __init__(self, bench: Bench):
        self.bench = bench

    def __enter__(self) -> RayCluster:
        b = self.bench
        (b.work / "token").write_text(secrets.token_hex(32))
        port = _free_port()
        b.address = f"127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {
            k: v for k, v in b.cluster_env.items() if k != "RAY_ADDRESS"
        }
        command = [
            _exe("ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--temp-dir={b.work / 'ray'}",
            "--disable-usage-stats",
        ]
        if not b.dashboard:
            command.append("--include-dashboard=false")
        if b.config["scaling"].get("use_gpu"):
            command.append(f"--num-gpus={b.workers}")
        self.log = open(b.work / "ray-head.txt", "a")
        self.process = subprocess.Popen(
            command, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.time() + 120
        while not _cluster_up(b.address, env | b.cluster_env):
            if self.process.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the benchmark's Ray head did not start; see {b.work / 'ray-head.txt'}")
            time.sleep(1)
        return self

    def __exit__(self, *exc) -> None:
        processes = [self.process_info(), *self.process_info().children(recursive=True)]
        for p in processes:
            _signal(p, signal.SIGTERM)
        _, alive = psutil.wait_procs(processes, timeout=10)
        for p in alive:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=10)
        self.log.close()
        self.bench.address = None

    def process_info(self) -> psutil.Process:
        return psutil.Process(self.process.pid)


def _cluster_up(address: str, env: dict[str, str]) -> bool:
    """`ray status` names an active node: the head's raylet has registered. Its exit status alone
    is 0 as soon as the GCS answers ("No cluster status" while the node still starts): a warm round
    checked that way would begin seconds before its node registered."""
    done = subprocess.run([_exe("ray"), "status", f"--address={address}"], env=env, capture_output=True, text=True)
    return done.returncode == 0 and re.search(r"Active:\s*\n\s*\d+ node_", done.stdout) is not None


def _settle(limit_s: float, busy_percent: float = 10.0) -> None:
    """Wait until the cores are idle (under `busy_percent` busy over half a second), at most `limit_s`:
    each run starts on quiet cores, not beside the last one's processes still exiting or a new
    cluster's still starting."""
    deadline = time.time() + limit_s
    while time.time() < deadline and psutil.cpu_percent(interval=0.5) >= busy_percent:
        pass


def _signal(process: psutil.Process, sig: int) -> None:
    try:
        process.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def _read_traces(directory: Path) -> dict[int, list[float]]:
    """rank -> the start times of its training forwards, in order."""
    traces: dict[int, list[float]] = {}
    for path in directory.glob("rank*.txt"):
        rank = int(path.name[4:].split("-")[0])
        traces.setdefault(rank, []).extend(
            float(line.split()[1]) for line in path.read_text().splitlines() if line.startswith("t ")
        )
    return {rank: sorted(times) for rank, times in traces.items()}


def _read_threads(directory: Path) -> dict[int, int]:
    return {
        int(p.name[4:].split("-")[0]): int(p.read_text().split("\n", 1)[0].split()[1])
        for p in directory.glob("rank*.txt")
    }


def _diffs(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def _exe(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else shutil.which(name) or name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# ---- results -------------------------------------------------------------------------------------


def summarize(runs: list[Run], bench: Bench, sides: list[str]) -> dict:
    """Medians over the measured rounds, with their spread (min, max); ratios and gaps against A are
    taken within each round (A and the other side ran back to back), then summarized."""
    measured = [r for r in runs if r.round > 0 and r.exit_code == 0]
    by_side = {side: [r for r in measured if r.side == side] for side in sides}
    figures = {}
    for side, side_runs in by_side.items():
        if not side_runs:
            continue
        shares = [c / e for r in side_runs for c, e in zip(r.checkpoint_s, r.epoch_s)]
        figures[side] = {
            "runs": len(side_runs),
            "step_ms": _spread([r.step_ms for r in side_runs]),
            "step_p90_ms": _spread([r.step_p90_ms for r in side_runs]),
            "ttfs_s": _spread([r.ttfs_s for r in side_runs]),
            "data_wait_per_worker": [statistics.median(ws) for ws in zip(*(r.data_wait for r in side_runs))],
            "checkpoint_s": _spread([c for r in side_runs for c in r.checkpoint_s]),
            "checkpoint_share": _spread(shares),
            "epoch_s": _spread([e for r in side_runs for e in r.epoch_s]),
            "teardown_s": _spread([r.teardown_s for r in side_runs]),
            "wall_s": _spread([r.wall_s for r in side_runs]),
            "cpu_s": _spread([r.cpu_s for r in side_runs]),
            "throughput": _spread([bench.throughput(r.step_ms) for r in side_runs]),
            "mfu": _spread([bench.mfu(r.step_ms) for r in side_runs]),
            "reported_throughput": _spread([r.reported_rate for r in side_runs]),
            "reported_mfu": _spread([r.reported_mfu for r in side_runs]),
            "threads": side_runs[0].threads,
            "phases": {
                phase: _spread([r.phases.get(phase) for r in side_runs])
                for phase in dict.fromkeys(p for r in side_runs for p in r.phases)
            },
            "weights_vs_a": max((r.weights_vs_a for r in side_runs if r.weights_vs_a is not None), default=None),
        }
    a = {r.round: r for r in by_side.get("A", [])}
    paired = {side: [(r, a[r.round]) for r in rs if r.round in a] for side, rs in by_side.items() if side != "A"}
    for side, pairs in paired.items():
        if side in figures and pairs:
            figures[side]["ratio_vs_a"] = _spread([r.step_ms / ra.step_ms for r, ra in pairs])
            figures[side]["ttfs_gap_vs_a_s"] = _spread([r.ttfs_s - ra.ttfs_s for r, ra in pairs])
            by_epoch = [[b / a for b, a in zip(r.epoch_step_ms, ra.epoch_step_ms)] for r, ra in pairs]
            figures[side]["epoch_ratio_vs_a"] = [_spread(list(epoch)) for epoch in zip(*by_epoch)]
    quiet = {r.round: r for r in by_side.get("B-quiet", [])}
    if "B" in figures and (pairs := [(r, quiet[r.round]) for r in by_side["B"] if r.round in quiet]):
        figures["B"]["ratio_vs_quiet"] = _spread([r.step_ms / rq.step_ms for r, rq in pairs])
    _against_the_internals(figures, by_side)
    return {
        "machine": _machine(bench.config["scaling"].get("use_gpu", False)),
        "workload": bench.describe(),
        "unit": bench.unit,
        "config": bench.config,
        "overrides": bench.overrides,
        "rounds": max((r.round for r in runs), default=0),
        "figures": figures,
        "goals": _goals(figures),
        "runs": [asdict(r) | {"log": str(Path(r.log).relative_to(bench.work))} for r in runs],  # no machine paths
    }


def _against_the_internals(figures: dict, by_side: dict[str, list[Run]]) -> None:
    """What each of Ray's internals buys: a side without it (B-no-*, B-cold-no-*, *-public) against B or
    B cold of the same round; positive: it costs that much more without."""
    for side in (*WARM_INTERNALS, *COLD_INTERNALS):
        base = {r.round: r for r in by_side.get("B-cold" if side.startswith("B-cold") else "B", [])}
        pairs = [(r, base[r.round]) for r in by_side.get(side, []) if r.round in base]
        if side in figures and pairs:
            figures[side]["ttfs_gap_vs_base_s"] = _spread([r.ttfs_s - b.ttfs_s for r, b in pairs])
            figures[side]["wall_gap_vs_base_s"] = _spread([r.wall_s - b.wall_s for r, b in pairs])
            figures[side]["cpu_gap_vs_base_s"] = _spread(
                [r.cpu_s - b.cpu_s for r, b in pairs if r.cpu_s is not None and b.cpu_s is not None]
            )


def describe(config: dict, workers: int, batches_per_epoch: int) -> str:
    t, d = config["train"], config["dataset"]
    return (
        f"{config['model'].get('arch', 'mlp')}, {workers} worker{'s' if workers > 1 else ''} "
        f"x batch {t['batch_size']}, "
        f"{d['rows']} rows, {batches_per_epoch} steps/epoch, {t['epochs']} epoch{'s' if t['epochs'] > 1 else ''}, "
        f"{t.get('precision', 'fp32')}"
    )


def _spread(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _goals(figures: dict) -> list[dict]:
    """The issue's goals for raytrain_ddp with Ray Data (side B), each judged on its worst round."""
    goals = []

    def goal(name: str, spread: dict | None, limit: float, unit: str) -> None:
        if spread is not None:
            worst = spread["max"]
            goals.append(
                {
                    "goal": name,
                    "value": worst,
                    "median": spread["median"],
                    "limit": limit,
                    "unit": unit,
                    "met": worst <= limit,
                }
            )

    b, cold = figures.get("B", {}), figures.get("B-cold", {})
    goal("steady step time B/A", b.get("ratio_vs_a"), GOALS["ratio"], "x")
    goal("warm time to first step, B - A", b.get("ttfs_gap_vs_a_s"), GOALS["ttfs_gap_s"], "s")
    goal("cold time to first step, B cold - A", cold.get("ttfs_gap_vs_a_s"), GOALS["cold_ttfs_gap_s"], "s")
    goal("teardown, last step -> exit, B", b.get("teardown_s"), GOALS["teardown_s"], "s")
    if b.get("data_wait_per_worker"):
        worst = max(b["data_wait_per_worker"])
        goal("data wait, worst worker of B", {"max": worst, "median": worst}, GOALS["data_wait"], "%")
    for side in ("B", "B-async"):
        goal(
            f"checkpoint blocking, {side} ({'sync' if side == 'B' else 'async'})",
            figures.get(side, {}).get("checkpoint_share"),
            GOALS["checkpoint_share"],
            "%",
        )
    return goals


def markdown(results: dict) -> str:
    figures = results["figures"]
    sides = list(figures)
    m = results["machine"]
    lines = [
        f"### {m['name']}: {results['workload']}",
        "",
        f"{m['device']}; {m['cpus']} CPUs, {m['memory_gb']:.0f} GB; Python {m['python']}, torch {m['torch']}, "
        f"ray {m['ray']}, mlflow {m['mlflow']}; {m['date']}. "
        f"Median [min–max] over {results['rounds']} alternating round(s)"
        f"{', after a warm-up round (not counted)' if any(r['round'] == 0 for r in results['runs']) else ''}.",
        "",
        "| figure | " + " | ".join(_SIDE_NAMES.get(s, s) for s in sides) + " |",
        "|---|" + "---|" * len(sides),
    ]
    rows = [
        ("steady step, ms", lambda f: _cell(f.get("step_ms"), ".2f")),
        (f"throughput, {results['unit']}", lambda f: _cell(f.get("throughput"), ",.0f")),
        ("MFU at the steady step (counted FLOPs, dense peak)", lambda f: _cell(f.get("mfu"), ".1%")),
        (
            f"throughput as B reports it (last epoch), {results['unit']}",
            lambda f: _cell(f.get("reported_throughput"), ",.0f"),
        ),
        ("MFU as B reports it (last epoch)", lambda f: _cell(f.get("reported_mfu"), ".1%")),
        ("step time vs A (same round)", lambda f: _cell(f.get("ratio_vs_a"), ".3f", "1")),
        (
            "… epoch by epoch, first to last (median of the rounds)",
            lambda f: " / ".join(f"{e['median']:.2f}" for e in f.get("epoch_ratio_vs_a", [])) or "–",
        ),
        ("step time vs B-quiet (same round): the live progress", lambda f: _cell(f.get("ratio_vs_quiet"), ".3f")),
        ("time to first step, s", lambda f: _cell(f.get("ttfs_s"), ".1f")),
        ("… minus A's (same round), s", lambda f: _cell(f.get("ttfs_gap_vs_a_s"), "+.1f", "0")),
        ("data wait, per worker", lambda f: ", ".join(f"{w:.1%}" for w in f.get("data_wait_per_worker", [])) or "–"),
        ("checkpoint: training blocked, s", lambda f: _cell(f.get("checkpoint_s"), ".3f")),
        ("checkpoint: share of epoch", lambda f: _cell(f.get("checkpoint_share"), ".1%")),
        ("epoch (train + eval), s", lambda f: _cell(f.get("epoch_s"), ".2f")),
        ("teardown: last step → exit, s", lambda f: _cell(f.get("teardown_s"), ".1f")),
        ("launch → exit, s", lambda f: _cell(f.get("wall_s"), ".1f")),
        ("CPU-seconds, every process, launch → exit", lambda f: _cell(f.get("cpu_s"), ".1f")),
        ("without it, vs B / B cold (same round): first step, s", lambda f: _cell(f.get("ttfs_gap_vs_base_s"), "+.1f")),
        ("… launch → exit, s", lambda f: _cell(f.get("wall_gap_vs_base_s"), "+.1f")),
        ("… CPU-seconds", lambda f: _cell(f.get("cpu_gap_vs_base_s"), "+.1f")),
        (
            "final weights: max abs diff vs A",
            lambda f: "–" if f.get("weights_vs_a") is None else f"{f['weights_vs_a']:.1e}",
        ),
        ("torch threads per rank", lambda f: ", ".join(map(str, f.get("threads", [])))),
    ]
    for name, cell in rows:
        cells = [cell(figures[s]) for s in sides]
        if any(c != "–" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += _timeline(figures)
    lines += ["", "| goal (worst round) | worst round | median | limit | |", "|---|---|---|---|---|"]
    for g in results["goals"]:
        value, median, limit = (_goal_value(g.get(key, g["value"]), g["unit"]) for key in ("value", "median", "limit"))
        lines.append(f"| {g['goal']} | {value} | {median} | ≤ {limit} | {'met' if g['met'] else '**missed**'} |")
    return "\n".join(lines) + "\n"


def _goal_value(value: float, unit: str) -> str:
    return f"{value:.1%}" if unit == "%" else f"{value:.3g} {unit}".replace(" x", "×")


def _timeline(figures: dict) -> list[str]:
    """Where a raytrain_ddp run's wall time goes, phase by phase (the run's timeline.json), per B side."""
    sides = [s for s in figures if figures[s].get("phases")]
    if not sides:
        return []
    lines = [
        "",
        "Timeline of a run, seconds per phase (each from the mark before it; median [min–max]):",
        "",
        "| phase | " + " | ".join(_SIDE_NAMES.get(s, s) for s in sides) + " |",
        "|---|" + "---|" * len(sides),
    ]
    for phase in dict.fromkeys(p for s in sides for p in figures[s]["phases"]):
        cells = [_cell(figures[s]["phases"].get(phase), ".2f") for s in sides]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return lines


_SIDE_NAMES = {
    "A": "A: torchrun",
    "B-cold": "B cold",
    "B": "B: raytrain_ddp",
    "B-async": "B, async ckpt",
    "B'": "B′: torch DataLoader",
    "B-quiet": "B, no live progress",
    "B-cold-fresh": "B cold, workers not ahead",
    "B-fresh": "B, workers not ahead",
    "B-usage": "B, Ray Data usage collection on",
    "B-unregistered": "B, no registration",
    "B-public": "B, Ray's public API only",
    "B-cold-public": "B cold, Ray's public API only",
    **{f"B-no-{name}": f"B without {name}" for name in INTERNALS},
    **{f"B-cold-no-{name}": f"B cold without {name}" for name in INTERNALS},
}


def _cell(spread: dict | None, spec: str, same: str | None = None) -> str:
    if spread is None:
        return same or "–"
    if spread["n"] == 1 or spread["min"] == spread["max"]:
        return format(spread["median"], spec)
    return f"{format(spread['median'], spec)} [{format(spread['min'], spec)}–{format(spread['max'], spec)}]"


def _machine(gpu: bool) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if gpu else f"CPU only ({cpu})"
    return {
        "name": _machine_name(gpu),
        "device": device,
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gb": psutil.virtual_memory().total / 2**30,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": installed("ray"),
        "mlflow": installed("mlflow-skinny") if installed("mlflow") == "-" else installed("mlflow"),
        "date": time.strftime("%Y-%m-%d"),
    }


def _machine_name(gpu: bool) -> str:
    if gpu:
        return "gpu-" + "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(0).lower()).strip("-")
    return f"cpu-{os.cpu_count()}core"


if __name__ == "__main__":
    sys.exit(main())
