"""Real servers on loopback for the tests that run the service where users run it: an MLflow tracking
server (`mlflow server`), an S3 server (moto's server mode), a 2-node Ray cluster (`ray start`), and
the helpers the `ray up` test's sshd needs: free ports, waiting for them, ending processes.

Each runs with its files in a directory the test owns and is stopped by PID, never by name: never
`ray stop`, which would end every Ray on the machine, the test session's own included.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil

BIN = Path(sys.executable).parent  # the venv's executables: mlflow, moto_server, ray, raytrain-ddp
REPO = Path(__file__).resolve().parents[2]


def user_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a user's shell: no tracking URI or Ray address inherited from the test
    session, plus `extra`."""
    return {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")} | (extra or {})


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """`raytrain-ddp ARGS` in a fresh process, as a user runs it."""
    return subprocess.run(
        [str(BIN / "raytrain-ddp"), *args], cwd=cwd, env=user_env(env), capture_output=True, text=True, timeout=timeout
    )


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.2) -> None:
    """`every_s`: 1 s where asking costs a process or a server's queries, the run's cores meanwhile."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout_s:g} s")
        time.sleep(every_s)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def serve(
    command: list, log: Path, ready_url: str, env: dict[str, str] | None = None, timeout_s: float = 120
) -> subprocess.Popen:
    """Start a server in its own process group, its output in `log`, and wait until `ready_url`
    answers; a server that exits first fails at once, with the end of its log."""
    with log.open("a") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=out, start_new_session=True)

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        return answers(ready_url)

    wait_until(ready, timeout_s, str(command[0]))
    return process


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL what is left after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
            process.wait(wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def free_port() -> int:
    """A TCP port free on every local address right now (the kernel's pick). Another process may take
    it before the caller binds it: good enough for tests, which each pick their own."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float = 30, process: subprocess.Popen | None = None) -> None:
    """Return once something accepts TCP connections on host:port. Raises TimeoutError after
    timeout_s, or RuntimeError at once if `process` (the server being waited for) has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"{process.args[0]} exited with {process.returncode} before listening on {host}:{port}"
                ) from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:g} s") from None
            time.sleep(0.1)


def kill_tree(pid: int, timeout_s: float = 3) -> list[int]:
    """End a process and all its descendants: SIGTERM, then SIGKILL for those still alive after
    timeout_s. Returns the PIDs it signalled (none if the process is already gone)."""
    try:
        root = psutil.Process(pid)
        return _terminate([root, *root.children(recursive=True)], timeout_s)
    except psutil.NoSuchProcess:
        return []


def processes_with(needle: str) -> list[psutil.Process]:
    """The processes whose command line contains `needle`, never the calling process or its ancestors."""
    spared = _self_and_ancestors()
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if p.pid not in spared and needle in " ".join(p.info["cmdline"] or ())
    ]


def tiny_passes(log: Path) -> list[tuple[str, list[str]]]:
    """tests/jobs/tiny.py's fault_log/rows<R>.log, pass after pass: its "<world size>:<pid>" tag and the
    rows it trained on (each by its first feature)."""
    return [(tag, rows) for tag, *rows in map(str.split, log.read_text().splitlines())]


def kill_processes_with(needle: str, timeout_s: float = 3) -> list[int]:
    """End every process whose command line contains `needle` (an absolute path of at least two
    levels, such as a test's own temporary directory), and all their descendants; never the calling
    process or its ancestors: SIGTERM, then SIGKILL for those still alive after timeout_s. Returns
    the PIDs it signalled.

    How a test stops a Ray node it started with RAY_TMPDIR=<its temp dir>: every Ray process of that
    node names its session directory on its command line, and its workers are their children. (Ray's
    GCS server and autoscaler outlive a SIGTERM by more than 15 s, the raylet by ~10 s: hence the
    short grace.)
    """
    if not os.path.isabs(needle) or needle.rstrip("/").count("/") < 2:
        raise ValueError(f"refusing to match processes by {needle!r}: give an absolute path of at least two levels")
    family = {}
    for process in processes_with(needle):
        family[process.pid] = process
        try:
            family.update((child.pid, child) for child in process.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    spared = _self_and_ancestors()
    return _terminate([p for pid, p in family.items() if pid not in spared], timeout_s)


def _self_and_ancestors() -> set[int]:
    me = psutil.Process()
    return {me.pid, *(p.pid for p in me.parents())}


def _terminate(processes: list[psutil.Process], timeout_s: float) -> list[int]:
    signalled = []
    for process in processes:
        try:
            process.terminate()
            signalled.append(process.pid)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return signalled


@dataclass
class S3Server:
    """moto's S3 in server mode; `env` is the standard AWS environment that points at it."""

    root: Path
    bucket: str = "raytrain"
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> S3Server:
        self.process = serve(
            [BIN / "moto_server", "-H", "127.0.0.1", "-p", str(self.port)], self.root / "moto.log", self.endpoint
        )
        self.client().create_bucket(Bucket=self.bucket)
        return self

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def keys(self, prefix: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def stop(self) -> None:
        if self.process:
            stop_group(self.process)


@dataclass
class FaultyS3:
    """A proxy in front of an S3 server that answers S3's "503 SlowDown" to the writes (PUT, POST) of
    keys containing a given text, instead of passing them on: `fail(text, times)` the next `times`
    writes (None: every write, until `heal()`). `injected` counts the errors it answered. `env`
    points the standard AWS environment at the proxy."""

    upstream: S3Server
    port: int = field(default_factory=free_port)
    injected: int = 0
    _rules: dict[str, int | None] = field(default_factory=dict)
    _server: ThreadingHTTPServer | None = None

    @property
    def env(self) -> dict[str, str]:
        return self.upstream.env | {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}"}

    def fail(self, text: str, times: int | None) -> None:
        self._rules[text] = times

    def heal(self) -> None:
        self._rules.clear()

    def _fails(self, method: str, path: str) -> bool:
        if method not in ("PUT", "POST"):
            return False
        for text, left in self._rules.items():
            if text in path and (left is None or left > 0):
                if left is not None:
                    self._rules[text] = left - 1
                self.injected += 1
                return True
        return False

    def start(self) -> FaultyS3:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def handle_one(self) -> None:
                body = self._body()
                if proxy._fails(self.command, self.path):
                    said = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(said)))
                    self.end_headers()
                    self.wfile.write(said)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "transfer-encoding")}
                if "chunked" in self.headers.get("Transfer-Encoding", ""):
                    headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream.port, timeout=60)
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(answer.getheader("Content-Length") or len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            def _body(self) -> bytes:
                if "chunked" not in self.headers.get("Transfer-Encoding", ""):
                    return self.rfile.read(int(self.headers.get("Content-Length", 0)))
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return b"".join(chunks)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = handle_one

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()


@dataclass
class MLflowServer:
    """`mlflow server` with a sqlite store and proxied artifacts (a directory, or s3:// with `env`
    pointing at an S3 server); `auth=True` runs MLflow's basic-auth app, whose admin password is
    `password`. Stop and start it again to take it away and bring it back with the same data."""

    root: Path
    artifacts: str | None = None
    auth: bool = False
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    password: str = field(default_factory=lambda: "pw-" + secrets.token_hex(8))
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def credentials(self) -> dict[str, str]:
        """MLflow's standard environment variables for a client of this server."""
        return {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": self.password} if self.auth else {}

    def start(self) -> MLflowServer:
        store = self.root / "mlflow.db"
        if not store.exists():  # as the driver makes a new store: MLflow's migrations ran once
            from raytrain_ddp.registry import sqlite_store  # here: torch, which `ray stop` on a test host needs not

            sqlite_store.copy_empty_schema(store)
        # No job runner: MLflow 3 starts eight more processes for its GenAI jobs (~25 CPU-seconds a
        # start on 2 cores), which training never uses.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **self.env}
        command = [
            BIN / "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{store}",
            "--artifacts-destination",
            self.artifacts or str(self.root / "artifacts"),
        ]
        if self.auth:
            config = self.root / "auth.ini"
            # MLflow's cache of good credentials, as a busy server would have it: without it every
            # request pays the password's scrypt check (0.26 s on 2 cores; a registration makes ~60).
            config.write_text(
                "[mlflow]\ndefault_permission = READ\n"
                f"database_uri = sqlite:///{self.root / 'auth.db'}\n"
                f"admin_username = admin\nadmin_password = {self.password}\n"
                "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                "auth_cache_ttl_seconds = 600\n"
            )
            env |= {"MLFLOW_AUTH_CONFIG_PATH": str(config), "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)}
            command += ["--app-name", "basic-auth"]
        self.process = serve(command, self.root / "mlflow-server.log", f"{self.url}/health", env)
        return self

    def stop(self) -> None:
        if self.process:
            stop_group(self.process)
            self.process = None

    def client(self):
        """An MlflowClient of this server; with auth, the caller sets `credentials` in the
        environment (MLflow reads them per request), e.g. with monkeypatch.setenv."""
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.url)


@contextlib.contextmanager
def loopback_cluster() -> Iterator[LoopbackCluster]:
    """A LoopbackCluster started in a directory of its own, stopped and removed at the end."""
    # A short private directory: Ray's socket paths under it must stay below the OS limit.
    root = Path(tempfile.mkdtemp(prefix="rtc", dir="/tmp"))
    cluster = LoopbackCluster(root)
    try:
        yield cluster.start()
    finally:
        cluster.stop()  # by its directory: whatever of it started
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class LoopbackCluster:
    """A real 2-node Ray cluster on this machine: `ray start --head` and `ray start --address`, token
    authentication on, the dashboard on 127.0.0.1, each node with its own temp dir (so the processes
    of each are found, and stopped, by it), the head labelled role=train and the other role=data.
    `node_local` is a directory that only the worker node sees as it is: that node runs in its own
    mount namespace with a tmpfs mounted over it. More nodes join with `add_node`; `kill_node` ends
    one as a machine's death does."""

    root: Path
    cpus_per_node: int = 2
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    node_local_isolated: bool = False
    workers: dict[str, str] = field(default_factory=dict)  # the worker nodes alive: name -> node id

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def node_local(self) -> Path:
        return self.root / "node-local"

    @property
    def env(self) -> dict[str, str]:
        """What a client of this cluster needs: its token, and the venv's executables first on PATH."""
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))},
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.root / "token"),
            "RAY_ADDRESS": self.address,
            "PATH": f"{BIN}:{os.environ['PATH']}",
        }

    def _node_env(self, name: str) -> dict[str, str]:
        temp = self.root / name
        temp.mkdir(exist_ok=True)
        env = {k: v for k, v in self.env.items() if k != "RAY_ADDRESS"}
        # The GCS marks a killed node dead after 3 failed health checks a second apart, not Ray's
        # default 5 checks 3 s apart (~15 s that the lost-node and elastic tests would wait, twice in
        # the elastic one); each check's timeout stays Ray's 10 s, so a busy node is not taken for dead.
        checks = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
        return env | checks | {"RAY_TMPDIR": str(temp), "TMPDIR": str(temp)}

    def start(self) -> LoopbackCluster:
        (self.root / "token").write_text(secrets.token_hex(32))
        self.node_local.mkdir(exist_ok=True)
        common = ["--node-ip-address=127.0.0.1", f"--num-cpus={self.cpus_per_node}", "--disable-usage-stats"]
        head = [
            str(BIN / "ray"),
            "start",
            "--head",
            f"--port={self.gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--temp-dir={self.root / 'head'}",
            "--labels=role=train",
            *common,
        ]
        self._run(head, self._node_env("head"))
        # The worker node's own view of node_local, where the machine allows a mount namespace (root):
        # a tmpfs the head never sees.
        unshare = ["unshare", "--mount", "--propagation", "private"]
        self.node_local_isolated = (
            bool(shutil.which("unshare")) and subprocess.run([*unshare, "true"], capture_output=True).returncode == 0
        )
        self.add_node("worker", isolated=self.node_local_isolated)
        return self

    def add_node(self, name: str, isolated: bool = False) -> None:
        """A worker node joins (labelled role=data), with its own temp dir named `name`; `isolated`: in
        a mount namespace of its own, where node_local is a tmpfs. Returns once the cluster counts it."""
        before = {node["node_id"] for node in self.nodes()}
        worker = [
            str(BIN / "ray"),
            "start",
            f"--address=127.0.0.1:{self.gcs_port}",
            f"--temp-dir={self.root / name}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--labels=role=data",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={self.cpus_per_node}",
            "--disable-usage-stats",
        ]
        if isolated:
            unshare = ["unshare", "--mount", "--propagation", "private"]
            worker = [*unshare, "sh", "-c", f"mount -t tmpfs tmpfs {self.node_local} && exec {' '.join(worker)}"]
        self._run(worker, self._node_env(name))
        # A new node id, not a count: a node killed a moment ago may be marked dead meanwhile.
        new: set[str] = set()

        def joined() -> bool:
            new.update({node["node_id"] for node in self.nodes()} - before)
            return bool(new)

        wait_until(joined, 60, f"node {name} in the cluster")
        [self.workers[name]] = new

    def kill_node(self, name: str) -> list[int]:
        """The node `name` dies as a machine does: every one of its processes SIGKILLed at once."""
        family = {}
        for process in processes_with(str(self.root / name)):
            family[process.pid] = process
            with contextlib.suppress(psutil.NoSuchProcess):
                family.update((child.pid, child) for child in process.children(recursive=True))
        for process in family.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(list(family.values()), timeout=10)
        self.workers.pop(name, None)
        return list(family)

    def nodes(self) -> list[dict]:
        """The nodes alive; [] while the dashboard does not answer."""
        try:
            return [node for node in self.state("nodes") if node["state"] == "ALIVE"]
        except OSError:
            return []

    def state(self, kind: str, detail: bool = False) -> list[dict]:
        """What `ray list KIND [--detail]` lists (nodes, jobs, actors, tasks, workers), from the
        dashboard's state API that command asks."""
        return self._dashboard(f"/api/v0/{kind}?limit=10000&detail={str(detail).lower()}")["data"]["result"]["result"]

    def job_logs(self, submission_id: str) -> str:
        """What `ray job logs SUBMISSION_ID` prints."""
        return self._dashboard(f"/api/jobs/{submission_id}/logs")["logs"]

    def _dashboard(self, path: str) -> dict:
        """The dashboard's answer to a GET, with the cluster's token, as the ray CLI asks it: not the
        CLI itself, a new process importing Ray for each question (~2 s on 2 cores; a join is polled)."""
        token = (self.root / "token").read_text().strip()
        request = urllib.request.Request(f"{self.address}{path}", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)

    def ray(self, *args: str, check: bool = True, timeout: int = 120) -> subprocess.CompletedProcess:
        """The ray CLI, as a user of this cluster runs it."""
        return subprocess.run(
            [str(BIN / "ray"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            cwd=REPO,
        )

    def stop(self) -> None:
        kill_processes_with(str(self.root))  # both nodes at once: one grace period, not one each

    def _run(self, command: list[str], env: dict[str, str]) -> None:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
