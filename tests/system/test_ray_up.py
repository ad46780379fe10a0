"""`ray up` for real, with the on-premises config (cluster-local.yaml, provider: local): an OpenSSH
server on loopback plays two hosts, the head on 127.0.0.1 and a worker host on 127.0.0.2; `ray up -y`
starts the cluster, `ray job submit` trains the tiny recipe on it, `ray down -y` stops it.

The config `ray up` gets is cluster-local.yaml as committed, with only what a test must change:
the hosts, the SSH account and key, the token file, the ports (free ones, not Ray's defaults, which
other Ray instances on this machine may hold), and no setup commands (each host's HOME already puts
this checkout's venv on PATH; installing the locked 5 GB again would cost minutes; the setup commands
are checked by tests/unit/test_cluster_config.py).

This machine is shared with other tests and their Ray, so the test never runs a real `ray stop` (it
ends every Ray process of the user): each host's shell has a `ray` whose `stop` ends only that host's
processes, found by its own RAY_TMPDIR in their command lines.

    bash tests/system-deps.sh     # openssh-server and rsync
    .venv/bin/pytest tests/system/test_ray_up.py
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from services import free_port, kill_processes_with, kill_tree, processes_with, wait_for_port

ROOT = Path(__file__).parents[2]
VENV_BIN = Path(sys.executable).parent  # the venv running the tests is the one the hosts run
HEAD, WORKER = "127.0.0.1", "127.0.0.2"
SSHD = Path("/usr/sbin/sshd")
# What a host's `ray stop` runs: it ends only the processes of that host's Ray, found by its temp dir.
STOP_HOST = (
    "import sys; sys.path.insert(0, sys.argv[1]); import services; "
    'print("stopped", len(services.kill_processes_with(sys.argv[2])), "processes")'
)


@dataclass(frozen=True)
class RayUpCluster:
    """What a test needs to drive the cluster: the `ray up` config, the launcher's environment (for
    `ray up`, `ray job submit`, `ray down`), the dashboard, and each host's RAY_TMPDIR."""

    config: Path
    env: dict[str, str]
    dashboard: str
    token: str
    tmpdirs: dict[str, Path]

    def ray(self, *args: str, log: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        """The ray CLI as the launcher runs it, from the repository root; its output goes to `log`."""
        with log.open("w") as out:
            return subprocess.run(
                [str(VENV_BIN / "ray"), *args],
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )

    def api(self, path: str):
        """GET from the dashboard's REST API, with the cluster's token."""
        request = urllib.request.Request(self.dashboard + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.load(response)

    def alive_nodes(self) -> list[dict]:
        nodes = self.api("/api/v0/nodes?limit=100")["data"]["result"]["result"]
        return [node for node in nodes if node["state"] == "ALIVE"]


@pytest.fixture
def loopback_cluster(tmp_path) -> RayUpCluster:
    """sshd on 127.0.0.1 and 127.0.0.2 and the config for `ray up`; afterwards, every process the cluster
    left is ended by PID, and the hosts' Ray logs are kept in tmp_path/ray-logs, sshd's in tmp_path/sshd.log."""
    missing = [
        name for name, there in [("openssh-server", SSHD.exists()), ("rsync", shutil.which("rsync"))] if not there
    ]
    if missing:
        message = f"CI must have openssh-server and rsync: run tests/system-deps.sh (missing: {', '.join(missing)})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)

    # A short path: Ray's unix sockets live under each host's RAY_TMPDIR, and those paths are limited to 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="rayup-", dir="/tmp"))
    homes = {HEAD: root / "head", WORKER: root / "worker"}
    sshd = None
    cluster_name = f"raytrain-test-{uuid.uuid4().hex[:8]}"
    try:
        ssh_port = free_port()
        key = _keypair(root / "key")
        token = secrets.token_hex(32)
        (root / "token").write_text(token)
        bin_dir = root / "bin"
        _write_wrappers(bin_dir, ssh_port)
        for home in homes.values():
            _write_home(home, bin_dir)
        sshd = _start_sshd(root / "sshd", ssh_port, key.with_suffix(".pub"), homes)

        launcher = root / "launcher"  # `ray up`'s own HOME and temp dir: its config cache and cluster state stay here
        (launcher / "tmp").mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
        env.update(
            PATH=f"{bin_dir}:{VENV_BIN}:{env['PATH']}",
            HOME=str(launcher),
            RAY_TMPDIR=str(launcher / "tmp"),
            TMPDIR=str(launcher / "tmp"),
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(root / "token"),
            RAY_USAGE_STATS_ENABLED="0",
        )
        ports = {name: free_port() for name in ("gcs", "dashboard", "head_agent", "client", "worker_agent")}
        config = root / "cluster.yaml"
        config.write_text(yaml.safe_dump(_config(cluster_name, key, root / "token", ports)))
        yield RayUpCluster(
            config,
            env,
            f"http://{HEAD}:{ports['dashboard']}",
            token,
            {host: home / "tmp" for host, home in homes.items()},
        )
    finally:
        _close_ssh_masters(cluster_name)
        if sshd is not None:
            kill_tree(sshd.pid)
        kill_processes_with(f"{root}/")  # whatever a failed test left: both hosts' Ray, SSH sessions
        for host, home in homes.items():
            if (logs := home / "tmp" / "ray" / "session_latest" / "logs").is_dir():
                shutil.copytree(logs, tmp_path / "ray-logs" / host, ignore_dangling_symlinks=True)
        if (sshd_log := root / "sshd" / "sshd.log").is_file():
            shutil.copy(sshd_log, tmp_path / "sshd.log")
        shutil.rmtree(root, ignore_errors=True)


def test_ray_up_submit_train_and_ray_down(loopback_cluster, tmp_path):
    from mlflow import MlflowClient

    cluster, took = loopback_cluster, {}
    started = time.monotonic()
    up = cluster.ray("up", "-y", "--no-config-cache", str(cluster.config), log=tmp_path / "ray-up.log")
    took["ray up"] = time.monotonic() - started
    assert up.returncode == 0, _tail(tmp_path / "ray-up.log")

    # The head's autoscaler brings the worker host in over SSH; the head itself has no CPU for the job.
    started = time.monotonic()
    while len(cluster.alive_nodes()) < 2:
        assert time.monotonic() - started < 120, f"the worker host never joined: {cluster.alive_nodes()}"
        time.sleep(1)
    took["worker host joined"] = time.monotonic() - started

    # Token auth is on, and the dashboard (with the Jobs API) listens on loopback only.
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(cluster.dashboard + "/api/jobs/", timeout=10)
    [head_ip] = [node["node_ip"] for node in cluster.alive_nodes() if node["is_head_node"]]
    if not head_ip.startswith("127."):  # Ray gave the head the machine's routable address
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((head_ip, urllib.parse.urlsplit(cluster.dashboard).port), timeout=5)

    started = time.monotonic()
    job_id = f"tiny-{uuid.uuid4().hex[:8]}"
    cluster.ray(
        "job",
        "submit",
        "--address",
        cluster.dashboard,
        "--submission-id",
        job_id,
        "--working-dir",
        str(ROOT),
        "--",
        "raytrain-ddp",
        "train",
        "tests/jobs/tiny.py",
        "train.epochs=1",
        "run.name=on-cluster",
        f"run.storage_path={tmp_path / 'runs'}",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        log=tmp_path / "job.log",
    )
    took["job"] = time.monotonic() - started
    assert cluster.api(f"/api/jobs/{job_id}")["status"] == "SUCCEEDED", _tail(tmp_path / "job.log")
    assert (
        "on-cluster finished: 1 epoch in" in (tmp_path / "job.log").read_text()
    )  # the driver's summary, from the job's logs

    [worker_node] = [node for node in cluster.alive_nodes() if not node["is_head_node"]]
    actors = cluster.api("/api/v0/actors?limit=1000&detail=true")["data"]["result"]["result"]
    trainers = [a for a in actors if a["class_name"] == "RayTrainWorker"]
    assert {a["node_id"] for a in trainers} == {worker_node["node_id"]}
    # The job's workers are the processes its driver started ahead on the worker host (prestart.py), with
    # the job's runtime environment (its working directory) merged in as Ray merges it: launched before
    # the controller (Ray's own record), where processes Ray started for them would come after it.
    workers = cluster.api("/api/v0/workers?limit=1000&detail=true")["data"]["result"]["result"]
    launched = {(w["node_id"], w["pid"]): w["worker_launch_time_ms"] for w in workers}
    [controller] = [a for a in actors if a["class_name"] == "TrainController"]
    assert all(launched[a["node_id"], a["pid"]] < launched[controller["node_id"], controller["pid"]] for a in trainers)
    assert (tmp_path / "runs" / "on-cluster" / "epoch_0001" / "manifest.json").is_file()
    [version] = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_model_versions("name = 'tiny'")
    assert version.status == "READY"

    started = time.monotonic()
    down = cluster.ray("down", "-y", str(cluster.config), log=tmp_path / "ray-down.log")
    took["ray down"] = time.monotonic() - started
    assert down.returncode == 0, _tail(tmp_path / "ray-down.log")
    assert processes_with(f"{cluster.tmpdirs[HEAD]}/") == [], "ray down left the head's Ray running"
    # `ray down` does not stop the worker hosts of a local-provider cluster: the fixture ends theirs.
    print(", ".join(f"{step} {seconds:.1f} s" for step, seconds in took.items()))


def _tail(log: Path) -> str:
    return f"{log.read_text()[-3000:]}\n(the whole output: {log})"


def _config(cluster_name: str, key: Path, token: Path, ports: dict[str, int]) -> dict:
    """cluster-local.yaml, pointed at the loopback hosts, with free ports instead of Ray's defaults."""
    config = yaml.safe_load((ROOT / "cluster-local.yaml").read_text())
    config["cluster_name"] = cluster_name
    config["provider"].update(head_ip=HEAD, worker_ips=[WORKER])
    config["auth"] = {"ssh_user": getpass.getuser(), "ssh_private_key": str(key)}
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    config["file_mounts"]["~/.ray/auth_token"] = str(token)  # never the real ~/.ray
    config["setup_commands"] = []  # see the module docstring
    head_flags = f" --dashboard-agent-listen-port={ports['head_agent']} --ray-client-server-port={ports['client']}"
    config["head_start_ray_commands"] = [
        _replace(
            _replace(c, "--port=6379", f"--port={ports['gcs']}"),
            "--dashboard-port=8265",
            f"--dashboard-port={ports['dashboard']}",
        )
        + head_flags
        if "ray start" in c
        else c
        for c in config["head_start_ray_commands"]
    ]
    # Two nodes on one machine need what separate hosts have anyway. Their own temp dir: a worker node takes
    # the head's (whatever its RAY_TMPDIR), and its runtime-env agent would then delete the job's working
    # directory under the driver on the head. Their own address: Ray turns 127.0.0.1 into the machine's
    # routable one, and the head's autoscaler, which knows the worker host as 127.0.0.2, would hear no
    # heartbeat from it and restart its Ray every 30 s.
    worker_flags = (
        f" --dashboard-agent-listen-port={ports['worker_agent']} --temp-dir=$RAY_TMPDIR/ray --node-ip-address={WORKER}"
    )
    config["worker_start_ray_commands"] = [
        _replace(c, "$RAY_HEAD_IP:6379", f"$RAY_HEAD_IP:{ports['gcs']}") + worker_flags if "ray start" in c else c
        for c in config["worker_start_ray_commands"]
    ]
    return config


def _replace(command: str, old: str, new: str) -> str:
    assert command.count(old) == 1, f"cluster-local.yaml changed: expected {old!r} once in {command!r}"
    return command.replace(old, new)


def _keypair(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "raytrain-test", "-f", str(path)], check=True)
    return path


def _write_wrappers(bin_dir: Path, ssh_port: int) -> None:
    """`ssh` and `ray` first on PATH, for the launcher and for every host's shell."""
    bin_dir.mkdir()
    # Ray's config has no SSH port, and `ray up` drops ssh_proxy_command from the config it gives the head,
    # whose autoscaler SSHes to the worker host; ssh expands `~` (in Ray's `-i ~/ray_bootstrap_key.pem`)
    # from the passwd entry, not from the host's HOME. Only the key's `~`: the remote command's is the remote's.
    (bin_dir / "ssh").write_text(f"""#!/usr/bin/env bash
args=()
while [ $# -gt 0 ]; do
  if [ "$1" = -i ]; then args+=(-i "${{2/#\\~\\//$HOME/}}"); shift 2; else args+=("$1"); shift; fi
done
exec {shutil.which("ssh")} -p {ssh_port} "${{args[@]}}"
""")
    # `ray stop` (run by `ray up` and `ray down` on each host) ends only this host's Ray: a real one would end
    # every Ray process of this user on the machine.
    (bin_dir / "ray").write_text(f"""#!/usr/bin/env bash
if [ "${{1:-}}" = stop ]; then
  exec {sys.executable} -c {shlex.quote(STOP_HOST)} \\
    {Path(__file__).parent} "${{RAY_TMPDIR:?}}/"
fi
exec {VENV_BIN / "ray"} "$@"
""")
    for wrapper in bin_dir.iterdir():
        wrapper.chmod(0o755)


def _write_home(home: Path, bin_dir: Path) -> None:
    """A host's HOME: the wrappers and this checkout's venv on PATH, its own RAY_TMPDIR. Ray runs remote
    commands in `bash --login -i` after sourcing ~/.bashrc; Debian's /etc/profile resets PATH before."""
    (home / "tmp").mkdir(parents=True)
    (home / ".bashrc").write_text(
        f'export PATH="{bin_dir}:{VENV_BIN}:$PATH" RAY_TMPDIR="{home / "tmp"}" TMPDIR="{home / "tmp"}"\n'
        "export RAY_USAGE_STATS_ENABLED=0\n"
        "export AUTOSCALER_UPDATE_INTERVAL_S=1\n"  # the head's autoscaler: brings the worker host in seconds sooner
    )
    (home / ".profile").write_text(". ~/.bashrc\n")


def _start_sshd(directory: Path, port: int, authorized_key: Path, homes: dict[str, Path]) -> subprocess.Popen:
    """An sshd of the test's own on both loopback hosts, each address logging in to its own HOME."""
    directory.mkdir()
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation directory (no systemd here to make it)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / "host_key")], check=True)
    shutil.copy(authorized_key, directory / "authorized_keys")
    matches = "".join(f"Match LocalAddress {host}\n    SetEnv HOME={home}\n" for host, home in homes.items())
    (directory / "sshd_config").write_text(
        f"Port {port}\n" + "".join(f"ListenAddress {host}\n" for host in homes) + f"HostKey {directory / 'host_key'}\n"
        f"AuthorizedKeysFile {directory / 'authorized_keys'}\n"
        f"AllowUsers {getpass.getuser()}\n"
        "PidFile none\nUsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nMaxSessions 50\n" + matches
    )
    with open(directory / "sshd.log", "w") as log:
        sshd = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(directory / "sshd_config")], stdout=log, stderr=log)
    for host in homes:
        wait_for_port(host, port, timeout_s=10, process=sshd)
    return sshd


def _close_ssh_masters(cluster_name: str) -> None:
    """Ray's SSH control masters (the launcher's and the head autoscaler's) outlive `ray down`."""
    from ray.autoscaler._private.command_runner import HASH_MAX_LENGTH

    user, cluster = (
        hashlib.sha256(s.encode()).hexdigest()[:HASH_MAX_LENGTH] for s in (getpass.getuser(), cluster_name)
    )
    control_dir = Path(f"/tmp/ray_ssh_{user}/{cluster}")
    for control in control_dir.glob("*"):
        subprocess.run(
            ["ssh", "-o", f"ControlPath={control}", "-O", "exit", "loopback"], capture_output=True, timeout=10
        )
    shutil.rmtree(control_dir, ignore_errors=True)
