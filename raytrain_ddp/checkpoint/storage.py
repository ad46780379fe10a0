"""Where runs live: `run.storage_path`, a local or mounted directory or a URI (s3://bucket/prefix).

Files go through pyarrow, as Ray Train's own do, so an s3:// path takes its endpoint and credentials
from the standard AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_DEFAULT_REGION, or ~/.aws/config and an instance role).

On a cluster of several nodes every node must see the same storage: rank 0 writes checkpoints on
its node, a restarted worker reads them on another, the driver registers from its own.
`check_shared` proves it before training by writing a probe file from every node (and the driver)
and reading them all back from every one.

Storage misbehaves: `upload` writes a checkpoint so that it is a checkpoint only once whole, retries
what may pass (S3 throttling) and removes what it wrote of one that failed; `is_transient`,
`is_full` and `is_refused` tell the errors apart for the message that stops the run.
"""

from __future__ import annotations

import contextlib
import errno
import secrets
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow.fs

PROBE_TIMEOUT_S = 60.0
# What S3 (through pyarrow's AWS SDK) says when it throttles or is unavailable for a while: worth a
# retry. Ray Train retries its own uploads on the first five.
TRANSIENT = (
    "AWS Error SLOW_DOWN",
    "AWS Error INTERNAL_FAILURE",
    "AWS Error SERVICE_UNAVAILABLE",
    "AWS Error NETWORK_CONNECTION",
    "AWS Error UNKNOWN",
    "AWS Error THROTTLING",
)
FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 16.0


def is_uri(path: str) -> bool:
    """Whether a storage path is a URI (s3://bucket/prefix), not a path on this machine."""
    return "://" in path


def absolute(path: str) -> str:
    """A path made absolute (the controller and the workers do not share the driver's working
    directory); a URI as given, less a trailing slash."""
    return path.rstrip("/") if is_uri(path) else str(Path(path).expanduser().resolve())


def write_text(path: str, text: str) -> None:
    """Write a whole text file at a storage path or URI, creating its directory."""
    fs, where = locate(path)
    fs.create_dir(where.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(where) as f:
        f.write(text.encode())


def read_text(path: str) -> str | None:
    """A whole text file at a storage path or URI; None where there is none."""
    import pyarrow.fs

    fs, where = locate(path)
    if fs.get_file_info(where).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(where) as f:
        return f.read().decode()


def locate(path: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem of a storage path or URI, and the path within it."""
    import pyarrow.fs  # here, not above: the command's config checks and `--help` go without it

    if is_uri(path):
        return pyarrow.fs.FileSystem.from_uri(path)
    return pyarrow.fs.LocalFileSystem(), path


def upload(
    source: str, fs: pyarrow.fs.FileSystem, where: str, files: Sequence[str], retry_s: float, retried: list[str]
) -> None:
    """Copy `files` of the local directory `source` to the directory `where` of `fs`, in their order:
    a checkpoint's manifest goes last, so that nothing there is a checkpoint until it is whole. A
    transient error (S3 throttling or unavailable: `TRANSIENT`), once pyarrow's S3 client has retried
    it a few times within a second, is retried with exponential backoff until the storage has failed
    for `retry_s` seconds in a row (a large checkpoint's upload may take longer than that), each retry
    noted in `retried`. An error that is not transient, or lasts, removes what was written of `where`
    (what cannot be removed has no manifest) and raises OSError."""

    def retrying(action, *args, **kwargs) -> None:
        failing_since, backoff = None, FIRST_BACKOFF_S
        while True:
            try:
                return action(*args, **kwargs)
            except OSError as e:
                failing_since = failing_since or time.monotonic()
                left = retry_s - (time.monotonic() - failing_since)
                if not is_transient(e) or left <= 0:
                    raise
                retried.append(f"{type(e).__name__}: {e}")
                time.sleep(min(backoff, left))
                backoff = min(2 * backoff, MAX_BACKOFF_S)

    def copy(name: str) -> None:
        with open(f"{source}/{name}", "rb") as f, fs.open_output_stream(f"{where}/{name}") as out:
            while chunk := f.read(64 << 20):
                out.write(chunk)

    try:
        retrying(fs.create_dir, where, recursive=True)
        for name in files:
            retrying(copy, name)
    except OSError:
        with contextlib.suppress(OSError):
            fs.delete_dir(where)
        raise


def is_transient(error: OSError) -> bool:
    """Whether a storage error may pass if tried again a little later."""
    return any(token in str(error) for token in TRANSIENT)


def is_full(error: OSError) -> bool:
    """Whether a storage error says the disk is full."""
    return error.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(error)


def is_refused(error: OSError) -> bool:
    """Whether a storage error says this writer may not write there: no retry or restart will change it."""
    refused = ("AWS Error ACCESS_DENIED", "AWS Error NO_SUCH_BUCKET", "Permission denied", "Read-only file system")
    return error.errno in (errno.EACCES, errno.EPERM, errno.EROFS) or any(s in str(error) for s in refused)


def check_shared(storage_path: str) -> list[str]:
    """On a cluster of more than one node: whether every node, and this driver, can write to
    `storage_path` and see what every other one wrote there. Returns the problems (none on one node)."""
    import ray  # here, not at the top: the lease, which needs `locate`, is imported by the CLI
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
    if len(nodes) < 2:
        return []
    probe_dir = f"{storage_path.rstrip('/')}/.raytrain_ddp-probe-{secrets.token_hex(4)}"
    where = {"driver": f"the driver ({socket.gethostname()})"} | {
        node_id: f"node {address} ({node_id[:8]})" for node_id, address in nodes.items()
    }

    probe = ray.remote(num_cpus=0, max_retries=0)(_probe_here)

    def on_every_node(step: str) -> dict[str, str | list[str]]:
        """Each of `nodes`' answer to `step`, and the driver's; a node lost meanwhile leaves `nodes`."""
        refs = {
            node_id: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
                step, probe_dir, node_id
            )
            for node_id in nodes
        }
        answers = {"driver": _probe_here(step, probe_dir, "driver")}
        for node_id, ref in refs.items():
            try:
                answers[node_id] = ray.get(ref, timeout=PROBE_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                answers[node_id] = f"no answer within {PROBE_TIMEOUT_S:g} s"
            except (
                ray.exceptions.TaskUnschedulableError,
                ray.exceptions.NodeDiedError,
                ray.exceptions.WorkerCrashedError,
            ):
                del nodes[node_id], where[node_id]  # lost since Ray listed it alive: no node, no storage problem
        return answers

    problems = []
    try:
        failed = {who: error for who, error in on_every_node("write").items() if error}
        problems += [
            f"run.storage_path: {where[who]} cannot write to {storage_path}: {error}" for who, error in failed.items()
        ]
        if not failed:
            for who, seen in on_every_node("list").items():
                if isinstance(seen, str):
                    problems.append(f"run.storage_path: {where[who]} cannot list {storage_path}: {seen}")
                elif missing := sorted(where[other] for other in where if other not in seen):
                    problems.append(
                        f"run.storage_path: {storage_path} is not shared by the cluster's nodes: {where[who]} does "
                        f"not see the files written there by {', '.join(missing)}. Use a path every node mounts "
                        "(NFS, EFS) or an s3:// URI"
                    )
    finally:
        on_every_node("delete")
    return problems


def _probe_here(step: str, probe_dir: str, me: str) -> str | list[str]:
    """One step of the probe, on this process's node: "write" this node's file (returns an error or
    ""), "list" the names found (or an error), "delete" this node's file."""
    import pyarrow.fs

    fs, directory = locate(probe_dir)
    try:
        if step == "write":
            fs.create_dir(directory, recursive=True)
            with fs.open_output_stream(f"{directory}/{me}") as f:
                f.write(b"probe")
        elif step == "list":
            return [
                info.base_name for info in fs.get_file_info(pyarrow.fs.FileSelector(directory, allow_not_found=True))
            ]
        else:
            fs.delete_file(f"{directory}/{me}")
            if not fs.get_file_info(pyarrow.fs.FileSelector(directory, allow_not_found=True)):
                fs.delete_dir(directory)
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return ""
