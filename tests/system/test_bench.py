"""The benchmark harness (bench/), in a tiny version so it cannot rot: one short run of A and of B,
the results written, and A and B shown to train the same model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from services import REPO, user_env

from raytrain_ddp.checkpoint import format as ckpt
from raytrain_ddp.driver import timeline

# B-cold is B without a Ray running: the path of every command-line test; B' is B on a torch Dataset,
# the path of tests/system/test_ddp.py; B-async is B uploading its checkpoints in the background, the
# path of tests/system/test_training.py's run. All left out here for time.
SIDES = ["A", "B"]


def test_one_short_run_of_every_side_gives_the_table_and_equal_weights(tmp_path):
    tiny = ["dataset.rows=2048", "dataset.val_rows=512", "dataset.block_rows=256", "train.epochs=2"]
    result = subprocess.run(
        [
            sys.executable,
            "bench/harness.py",
            "--rounds",
            "1",
            "--no-warmup",
            "--sides",
            ",".join(SIDES),
            "--out",
            str(tmp_path),
            "--name",
            "smoke",
            "--settle-s",
            "0",  # no wait for idle cores: the suite's other test file keeps them busy
            *tiny,
        ],
        cwd=REPO,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    results = json.loads((tmp_path / "smoke.json").read_text())
    figures = results["figures"]
    assert list(figures) == SIDES
    for side, f in figures.items():
        assert 0 < f["step_ms"]["median"] < 1000, side
        assert 0 < f["ttfs_s"]["median"] < f["wall_s"]["median"], side
        assert 0 <= f["teardown_s"]["median"] < f["wall_s"]["median"], side
        assert len(f["data_wait_per_worker"]) == 2 and all(0 <= w < 1 for w in f["data_wait_per_worker"]), side
        assert f["epoch_s"]["n"] == 2 and f["checkpoint_s"]["n"] >= 1, side
    assert figures["B"]["ratio_vs_a"]["n"] == 1 and figures["B"]["ttfs_gap_vs_a_s"]["n"] == 1
    # B's own throughput, from its reports (and its MFU, on a GPU of known peak: none here).
    assert figures["A"]["reported_throughput"] is None and figures["B"]["reported_throughput"]["median"] > 0
    assert all(f["reported_mfu"] is None and f["mfu"] is None for f in figures.values())
    # Each rank on the threads its CPUs give it, as torchrun's: B's workers, started ahead with torch
    # loaded (raytrain_ddp/cluster/prestart.py), take Ray's count, not the machine's.
    assert all(f["threads"] == figures["A"]["threads"] == [1, 1] for f in figures.values())
    # The same batches, model, seed and optimizer: the same weights.
    assert figures["B"]["weights_vs_a"] <= 1e-6
    work = Path(re.search(r"work directory (\S+)", result.stdout).group(1))
    run = work / next(Path(r["log"]).parent for r in results["runs"] if r["side"] == "B")
    for directory in sorted((run / "runs" / "bench").glob("epoch_*")):
        assert ckpt.open_verified(directory).metrics()["epoch"] == int(directory.name.split("_")[1])

    # B's timeline has every phase of a run (bench/harness.py adds the exit after the last).
    phases = {*timeline.DRIVER_START, *timeline.WORKER_START, timeline.FIRST_STEP, *timeline.TEARDOWN, "exit"}
    assert set(figures["B"]["phases"]) == phases

    table = (tmp_path / "smoke.md").read_text()
    assert "| steady step, ms |" in table and "| step time vs A (same round) |" in table
    assert "| steady step time B/A |" in table and "| checkpoint blocking, B (sync) |" in table
    assert "| first step |" in table and "| goal (worst round) |" in table
    assert table in result.stdout
