"""The timeline in a real trace viewer: the file drawn from the 4-rank straggler run, opened in speedscope (run
offline from npm) in Debian's headless Chromium, loads with no error, nests everywhere, and draws every rank's
tracks; a screenshot of each rank's phases and all-reduce goes to the test's folder.

    npm ci --prefix tests/browser && pytest tests/test_timeline_browser.py -m browser -n 0     # .ci/run installs both
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from lit_ddp import write_timeline
from tests.runner import ROOT

pytestmark = [pytest.mark.browser, pytest.mark.slow]  # 10-26 s of Chromium: CI, with every marker

BROWSER = ROOT / "tests" / "browser"
CHROMIUM = os.environ.get("LIT_DDP_CHROMIUM", "/usr/bin/chromium")


def missing() -> list[str]:
    """What the test needs and this machine lacks."""
    needs = {"node": shutil.which("node"), "Chromium": Path(CHROMIUM).is_file() or None,
             "speedscope and playwright-core (npm ci --prefix tests/browser)":
                 (BROWSER / "node_modules" / "speedscope").is_dir() or None}  # fmt: skip
    return [name for name, found in needs.items() if not found]


@pytest.fixture
def viewer():
    lacking = missing()
    if lacking and os.environ.get("LIT_DDP_BROWSER_REQUIRED"):
        pytest.fail(f"the browser test needs {', '.join(lacking)} (.ci/run installs them)")
    if lacking:
        pytest.skip(f"needs {', '.join(lacking)}")


@pytest.mark.timeout(180)
def test_speedscope_in_headless_chromium_loads_it_and_draws_every_ranks_tracks(viewer, straggler_run, tmp_path):
    from matplotlib import image

    assert straggler_run.result.returncode == 0, straggler_run.result.stderr[-3000:]
    trace = write_timeline(straggler_run.cwd / "runs" / "mini_train_profile" / "version_0", tmp_path / "run.json")
    result = subprocess.run(["node", str(BROWSER / "open_timeline.mjs"), str(trace), str(tmp_path), CHROMIUM],
                            capture_output=True, text=True, timeout=150)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout)
    assert seen["errors"] == []
    # speedscope's words for slices that do not nest (a child ending after its parent leaves the parent open)
    assert [w for w in seen["warnings"] if "Tried to end" in w or "still open" in w] == []
    names = json.loads(trace.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in names if e["name"] == "process_name"}
    assert len(processes) == 4
    for rank, name in processes.items():
        for track in ("phases (tid 1)", "all-reduce (tid 2)"):
            assert any(t.startswith(f"{name} (pid {rank}), {track} (") for t in seen["titles"]), (name, seen["titles"])
    assert len(seen["shots"]) == 8  # each rank's phases and all-reduce
    for title, shot in seen["shots"].items():
        pixels = image.imread(shot)[145:160, :, :3]  # the first row of slices: steps, or all-reduces
        drawn = (pixels.min(axis=2) < 0.95).mean()  # not the chart's white
        assert drawn > (0.5 if "phases" in title else 0.02), (title, drawn)  # all-reduces: short slices too
    print(f"screenshots of each rank's tracks: {sorted(seen['shots'].values())}")
