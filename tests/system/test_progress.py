"""The live progress display in a real terminal: the CLI in a tmux pane (`tests/system-deps.sh` installs
tmux). Between reports one line, redrawn in place, says the step, the loss, samples/s and the ETA
under a bar; Ctrl-C stops it cleanly. (The plain lines of a log are checked on test_training.py's run.)"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from services import user_env, wait_until

CLI = str(Path(sys.executable).parent / "raytrain-ddp")
TINY = str(Path(__file__).parents[1] / "jobs" / "tiny.py")
PROGRESS = re.compile(r"━.* step ([\d,]+)/([\d,]+) \(\d+%\)  epoch [\d.]+/40  loss [\d.]+  .*ETA (\d+[hms]|…)")


class Pane:
    """A tmux session of its own (its own server, no user config), 200 columns wide."""

    def __init__(self, directory: Path):
        self.tmux = ["tmux", "-L", f"raytrain-{directory.name}", "-f", "/dev/null"]
        self.raw = directory / "raw.log"
        env = user_env({"TERM": "xterm-256color"})
        self._run("new-session", "-d", "-s", "t", "-x", "200", "-y", "60", "bash --norc --noprofile", env=env)
        self._run("pipe-pane", "-o", "-t", "t", f"cat >> {shlex.quote(str(self.raw))}")

    def _run(self, *args: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run([*self.tmux, *args], check=True, capture_output=True, text=True, env=env).stdout

    def type(self, *keys: str) -> None:
        self._run("send-keys", "-t", "t", *keys)

    def screen(self) -> str:
        return self._run("capture-pane", "-p", "-t", "t", "-S", "-200")

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


@pytest.fixture
def pane(tmp_path):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: run `bash tests/system-deps.sh` (as root it installs it)")
    pane = Pane(tmp_path)
    yield pane
    pane.close()


def test_a_terminal_shows_one_live_line_with_the_eta_and_ctrl_c_clears_it(tmp_path, pane):
    command = [CLI, "train", TINY, "dataset.rows=4000", "train.epochs=40", "run.progress_s=0.5", "run.name=live"]
    pane.type(f"cd {shlex.quote(str(tmp_path))} && {shlex.join(command)}; echo EXIT=$?", "Enter")

    steps = []

    def progressed() -> bool:
        lines = [m for line in pane.screen().splitlines() if (m := PROGRESS.search(line))]
        assert len(lines) <= 1, "the live line is redrawn in place, not printed again"
        step, total = (int(lines[0].group(i).replace(",", "")) for i in (1, 2)) if lines else (0, 0)
        if lines and (not steps or step > steps[-1]):
            steps.append(step)
            assert total == 40 * 250  # 2,000 rows a worker in batches of 8: 250 steps an epoch
        return len(steps) >= 3 and re.search(r"^epoch +1/40 ", pane.screen(), re.M) is not None

    try:
        wait_until(progressed, 240, "three progress updates and a report line")
    except TimeoutError as e:
        raise AssertionError(f"{e}; the screen:\n{pane.screen()}") from None
    pane.type("C-c")
    wait_until(lambda: re.search(r"^EXIT=\d+$", pane.screen(), re.M), 120, "the CLI to exit after Ctrl-C")
    screen = pane.screen().strip()
    assert re.search(r"^EXIT=130$", screen, re.M) and "interrupted: run live was interrupted" in screen, screen
    assert not any(PROGRESS.search(line) for line in screen.splitlines()), "the live line is gone\n" + screen
    raw = pane.raw.read_text(errors="replace")
    assert len(re.findall(r"ETA", raw)) >= 3  # drawn again each update, in place (cursor moves, no newlines)
    last = raw.rindex("ETA")
    assert "\x1b[?25h" in raw[last:], "the cursor is shown again after the live display"
