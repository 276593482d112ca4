"""The lab notebook runs top to bottom on a fresh copy, and the committed copy shows its plots."""

import re
import shutil

import pytest

from tests.runner import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = ROOT / "notebooks" / "ddp_lab.ipynb"


def test_committed_notebook_keeps_its_plots():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    images = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 4  # loss curve, phase picture, bucket experiment, scaling forecast


@pytest.mark.slow  # over a minute: it runs the CLI several times
@pytest.mark.timeout(180)
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    # The notebook's runs take the accelerator they find, and what it shows (2 gloo ranks) means the CPU: hide
    # any GPU from the kernel and from the runs it starts.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    copy = tmp_path / "notebooks" / NOTEBOOK.name
    copy.parent.mkdir()
    shutil.copy(NOTEBOOK, copy)
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    nb = nbformat.read(copy, as_version=4)
    for cell in nb.cells:
        cell.outputs = [] if cell.cell_type == "code" else cell.get("outputs")
    resources = {"metadata": {"path": str(copy.parent)}}
    nbclient.NotebookClient(nb, timeout=150, kernel_name="python3", resources=resources).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "weights in sync across 2 ranks after step 4" in outputs
    assert "exit code 1" in outputs and "SyncError: weights out of sync" in outputs
    assert "bucket_cap_mb=4: 4 bucket(s)" in outputs
    assert re.search(r"^512\s+64\s+", outputs, re.M), "the forecast's 512-rank row"
