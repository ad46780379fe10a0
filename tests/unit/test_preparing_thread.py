"""The driver does the one-time work of registering the model (torch.export's imports, MLflow's model
flavor, requirements check and context tags: 2-4 CPU-seconds on a small machine) on a thread while Ray
Train starts, under SCHED_IDLE: it takes the CPU time the training workers leave and yields the
moment one wakes (`bench/preload_cost.py` measures what each policy costs a DDP run on the same
cores). Only that thread: the driver's others keep their own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

from raytrain_ddp.registry import model_logging


def test_a_thread_that_yields_the_cpu_runs_under_sched_idle_and_the_callers_thread_does_not():
    seen = {}

    def prepare() -> None:
        model_logging.yield_the_cpu()
        seen["policy"] = os.sched_getscheduler(threading.get_native_id())

    thread = threading.Thread(target=prepare)
    thread.start()
    thread.join()
    assert seen["policy"] == os.SCHED_IDLE
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


LOG_AFTER_REHEARSAL = """
import json, sys
import numpy as np, torch
from raytrain_ddp.registry import tracking
from raytrain_ddp.registry import model_logging
from mlflow.tracking import MlflowClient
model_logging.rehearse_model_logging()
uri = "sqlite:///mlflow.db"
run_id = MlflowClient(uri).create_run("0").info.run_id
before = set(sys.modules)
with tracking.active_run(uri, run_id):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model_logging.log_pytorch_model(model, np.zeros((2, 4), dtype=np.float32), name="model")
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_after_the_rehearsal_logging_a_model_imports_none_of_what_it_loads_once(tmp_path):
    """In a fresh process (a driver's), as after a last epoch: logging a real model to a run then
    finds torch.export, MLflow's PyTorch flavor, and git and IPython for its context tags, loaded
    (without the rehearsal it loads each of them: checked), and the rehearsal left no file behind
    (its model went to a temporary directory) nor a warning: its example has the registration's 2
    rows (a batch of 1 makes torch.export warn that it specializes the batch dimension)."""
    (tmp_path / "tmp").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", LOG_AFTER_REHEARSAL],
        cwd=tmp_path,
        env=os.environ | {"TMPDIR": str(tmp_path / "tmp")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not re.search(r"^[WE]\d{4} ", done.stderr, re.M), done.stderr  # torch's warnings: none from the rehearsal
    new = json.loads(done.stdout.splitlines()[-1])
    assert [m for m in new if m.split(".")[0] in ("git", "IPython") or m in ("torch._dynamo", "mlflow.pytorch")] == []
    left = [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor")]
    assert left == []  # (torch keeps its compiler's cache there)
