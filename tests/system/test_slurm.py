"""`slurm.sbatch` against a real Slurm on this machine: munged, slurmctld and two slurmd (nodes n1 and
n2, both on this host, 2 CPUs each), started by the test from Debian's packages (`tests/system-deps.sh`
installs slurmctld, slurmd, slurm-client and munge). The job starts a Ray head on n1 and a Ray worker
on n2, trains, and stops Ray; `scancel` mid-run leaves a run that the same `sbatch` resumes.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from services import BIN, REPO, free_port, kill_processes_with, processes_with, user_env, wait_until

TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")


class Slurm:
    """A Slurm cluster of its own in `root`: its own munge key and socket, slurm.conf, ports, state
    and logs; jobs run as this user (root, as CI runs). Ray's files of each job go under `root` too
    (RAY_TEMP_BASE), so everything of it is found, and stopped, by that path."""

    def __init__(self, root: Path):
        self.root, self.processes = root, []
        self.conf = root / "slurm.conf"
        self.env = user_env(
            {
                "SLURM_CONF": str(self.conf),
                "PATH": f"{BIN}:{user_env()['PATH']}",
                "RAY_AUTH_TOKEN_PATH": str(root / "ray-token"),  # never the user's ~/.ray
                "RAY_TEMP_BASE": str(root),
            }
        )

    def start(self) -> Slurm:
        key, socket = self.root / "munge.key", self.root / "munge.sock"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True)
        key.chmod(0o400)
        files = [f"--{name}-file={self.root / f'munge.{name}'}" for name in ("pid", "log", "seed")]
        self._daemon(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket}", *files])
        wait_until(socket.exists, 30, "munged's socket")
        host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
        self.conf.write_text(_slurm_conf(self.root, host, socket))
        self._daemon(["slurmctld", "-D", "-i"])
        for node in ("n1", "n2"):
            self._daemon(["slurmd", "-D", "-N", node])
        wait_until(lambda: self.run("sinfo", "-h", "-o", "%T %D").stdout.split() == ["idle", "2"], 60, "2 idle nodes")
        return self

    def _daemon(self, command: list[str]) -> None:
        log = (self.root / f"{command[0]}-{len(self.processes)}.out").open("w")
        self.processes.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def run(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)

    def sbatch(self, cwd: Path, *args: str) -> str:
        out = self.run("sbatch", "--parsable", f"--chdir={cwd}", str(REPO / "slurm.sbatch"), *args)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields as `scontrol show job` has them ({} once Slurm has forgotten it)."""
        shown = self.run("scontrol", "show", "job", job_id, "-o").stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def wait_for(self, job_id: str, states: tuple[str, ...], timeout_s: float) -> dict[str, str]:
        wait_until(lambda: self.job(job_id).get("JobState") in states, timeout_s, f"job {job_id} {states}", every_s=1)
        return self.job(job_id)

    def stop(self) -> None:
        self.run("scancel", "--user=root")
        for process in reversed(self.processes):
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        kill_processes_with(str(self.root))


def _slurm_conf(root: Path, host: str, munge_socket: Path) -> str:
    ports = [free_port() for _ in range(3)]
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2 RealMemory=4000"
        for name, port in zip(("n1", "n2"), ports[1:])
    )
    return f"""\
ClusterName=raytrain-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=600
KillWait=5
{nodes}
PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="module")
def slurm():
    if missing := [name for name in ("mungekey", "munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(name)]:
        pytest.fail(f"{', '.join(missing)} missing: run `bash tests/system-deps.sh` (as root it installs them)")
    root = Path(tempfile.mkdtemp(prefix="rts", dir="/tmp"))  # short: Ray's socket paths live under it
    cluster = Slurm(root)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_sbatch_trains_on_the_allocation_and_a_stopped_or_cancelled_job_resumes_with_the_same_sbatch(slurm, tmp_path):
    """Job 1 is stopped as before a time limit (`scancel --batch --signal=TERM`: the batch script's
    trap, then the driver's SIGTERM): exit 143, the MLflow run KILLED, the resume command in its log,
    Ray stopped. Job 2, the same sbatch, resumes and is `scancel`ed outright: every process of the job
    ends at once, Ray's included. Job 3, the same sbatch again, resumes from job 2's latest checkpoint
    (taking over the killed driver's lease), finishes and registers the model."""
    from mlflow.tracking import MlflowClient

    args = (TINY, "dataset.rows=2048", "train.epochs=6", "run.name=slurm")
    runs = tmp_path / "runs" / "slurm"
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")

    first = slurm.sbatch(tmp_path, *args)
    _wait_for_the_job(slurm, tmp_path, first, lambda: (runs / "epoch_0001").exists(), "epoch 1's checkpoint")
    raylets = [p for p in processes_with(f"{slurm.root}/ray-{first}-") if p.name() == "raylet"]
    kept = [p.environ().get("RAY_idle_worker_killing_time_threshold_ms") for p in raylets]
    assert kept == ["60000", "60000"], kept  # each node keeps an idle worker process a minute
    slurm.run("scancel", "--batch", "--signal=TERM", first)
    stopped = slurm.wait_for(first, ("FAILED", "COMPLETED", "CANCELLED"), 120)
    log = _log(tmp_path, first)
    assert "Ray cluster at " in log and ": 2 nodes, 4 CPUs, 0 GPUs" in log, log[-3000:]
    assert re.search(r"^interrupted: run slurm was interrupted \(SIGTERM\)$", log, re.M), log[-3000:]
    assert stopped["ExitCode"] == "143:0" and "resume: raytrain-ddp train" in log
    [killed] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert killed.info.status == "KILLED" and client.search_registered_models() == []
    wait_until(lambda: not processes_with(f"{slurm.root}/ray-{first}-"), 60, "job 1's Ray to stop")

    resumed_at = max(p.name for p in runs.glob("epoch_????"))  # job 1's newest: looked for before job 2 runs
    second = slurm.sbatch(tmp_path, *args)
    after = int(resumed_at[-4:]) + 1
    _wait_for_the_job(slurm, tmp_path, second, lambda: (runs / f"epoch_{after:04d}").exists(), f"epoch {after}")
    slurm.run("scancel", second)
    slurm.wait_for(second, ("CANCELLED",), 120)
    wait_until(lambda: not processes_with(f"{slurm.root}/ray-{second}-"), 60, "job 2's Ray to stop")
    assert f"resuming from {resumed_at}" in _log(tmp_path, second)
    latest = max(p.name for p in runs.glob("epoch_????"))

    started = time.monotonic()
    third = slurm.sbatch(tmp_path, *args)
    done = slurm.wait_for(third, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 420)
    wall = time.monotonic() - started
    log = _log(tmp_path, third)
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", log[-3000:]
    assert f"resuming from {latest}" in log, log[-3000:]
    assert "slurm finished: 6 epochs" in log and re.search(r"registered model +tiny  version 1", log)
    [run] = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])  # one, continued
    assert run.info.status == "FINISHED"
    assert not processes_with(f"{slurm.root}/ray-{third}-"), "Ray stopped with the job"
    print(f"\nslurm: the job that resumed at {latest} took {wall:.0f} s, sbatch to COMPLETED")


def _wait_for_the_job(slurm: Slurm, directory: Path, job_id: str, ready, what: str) -> None:
    """Wait for `what` of job `job_id`; if it does not come, fail with the ends of the job's log and
    of its Ray nodes' logs (the Slurm root, where they are, goes with the fixture)."""
    try:
        wait_until(ready, 300, what)
    except TimeoutError as e:
        logs = [directory / f"raytrain-{job_id}.log", *sorted(slurm.root.glob(f"ray-{job_id}-*.log"))]
        tails = "\n".join(f"--- {log.name}:\n{log.read_text()[-2000:]}" for log in logs if log.is_file())
        raise AssertionError(f"{e}; job {slurm.job(job_id).get('JobState')}\n{tails}") from None


def _log(directory: Path, job_id: str) -> str:
    return (directory / f"raytrain-{job_id}.log").read_text()
