"""The house's floors as a contract: ``lint-imports`` (pyproject's layers, no-cycle and forbidden contracts) on the
package as it is, and on a copy with a breach of each rule planted, which it must refuse; at most 12 modules at the
top of ``lit_ddp/``; short module docstrings."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
needs_linter = pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is in the test extra")
COLLECTION = "collection and measurement import neither presentation nor the forecast"
READERS = "the record's readers import neither torch nor Lightning"


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(cwd)}
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@needs_linter
def test_the_floors_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    for contract in (
        "floors",
        "no import cycle inside any package",
        "collection and measurement import neither presentation nor the forecast",
        "the record's readers import neither torch nor Lightning",
    ):
        assert f"{contract} KEPT" in result.stdout, result.stdout[-3000:]


# Each rule's breach, planted in one copy of the package (one lint-imports run for all): (the module, the line
# planted in it, the contract that must refuse it, the import that contract must name).
PLANTED = [
    ("callbacks/shared.py", "from lit_ddp.callbacks import comm_monitor", "no import cycle inside any package",
     ".shared -> .comm_monitor"),
    ("measure/clock.py", "from lit_ddp import report", "floors", "lit_ddp.measure.clock -> lit_ddp.report"),
    ("errors.py", "from lit_ddp.records import schema", "floors", "lit_ddp.errors -> lit_ddp.records.schema"),
    # derive: pure figures just above the record, below the forecast, the analysis and the text
    ("derive/summaries.py", "from lit_ddp.scaling import model", "floors",
     "lit_ddp.derive.summaries -> lit_ddp.scaling.model"),
    ("derive/noise.py", "from lit_ddp import formatting", "floors", "lit_ddp.derive.noise -> lit_ddp.formatting"),
    ("records/sketch.py", "from lit_ddp.derive import noise", "floors",
     "lit_ddp.records.sketch -> lit_ddp.derive.noise"),
    # present: beside the commands, above what it renders; the analysis renders nothing
    ("analysis/run_analysis.py", "from lit_ddp.present import phases", "floors",
     "lit_ddp.analysis.run_analysis -> lit_ddp.present.phases"),
    # collection and measurement import no presentation and no forecast, but for the end of fit's one door
    ("callbacks/phase_timer.py", "from lit_ddp.present import phases", COLLECTION,
     "lit_ddp.callbacks.phase_timer -> lit_ddp.present.phases"),
    ("callbacks/end_of_fit.py", "from lit_ddp.present import plots", COLLECTION,
     "lit_ddp.callbacks.end_of_fit -> lit_ddp.present.plots"),
    ("callbacks/loss_monitor.py", "from lit_ddp.scaling import links", COLLECTION,
     "lit_ddp.callbacks.loss_monitor -> lit_ddp.scaling.links"),
    ("measure/placement.py", "from lit_ddp.present import comm", COLLECTION,
     "lit_ddp.measure.placement -> lit_ddp.present.comm"),
    ("measure/allreduce.py", "from lit_ddp.scaling import links", COLLECTION,
     "lit_ddp.measure.allreduce -> lit_ddp.scaling.links"),
    # the record's readers: no torch, no Lightning
    ("derive/stragglers.py", "import torch", READERS, "lit_ddp.derive.stragglers -> torch"),
    ("present/plots.py", "import lightning", READERS, "lit_ddp.present.plots -> lightning"),
    ("scaling/links.py", "from lit_ddp import _torch", READERS, "lit_ddp._torch -> torch"),
]  # fmt: skip


@pytest.fixture(scope="module")
def planted_report(tmp_path_factory) -> str:
    """lint-imports' report on a copy of the package with every breach of ``PLANTED`` in it: its broken
    contracts, each with the imports it refuses."""
    root = tmp_path_factory.mktemp("planted")
    shutil.copytree(ROOT / "lit_ddp", root / "lit_ddp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root)
    for module, planted, _, _ in PLANTED:
        with open(root / "lit_ddp" / module, "a") as f:
            f.write(f"\n{planted}  # noqa\n")
    result = lint_imports(root)
    assert result.returncode != 0, result.stdout[-3000:]
    return result.stdout.partition("Broken contracts")[2]


@needs_linter
@pytest.mark.parametrize(("module", "planted", "contract", "shown"), PLANTED, ids=[p[0] + ": " + p[1] for p in PLANTED])
def test_a_planted_breach_is_refused(planted_report, module, planted, contract, shown):
    sections = re.split(r"\n(.+)\n-+\n", planted_report)
    found = dict(zip(sections[1::2], sections[2::2], strict=True))
    assert contract in found, f"{contract} KEPT with {planted!r} in {module}"
    assert shown in found[contract], found[contract]


def test_at_most_twelve_modules_at_the_top():
    top = sorted(p.name for p in (ROOT / "lit_ddp").glob("*.py"))
    assert len(top) <= 12, top


def test_no_module_of_the_package_is_over_400_lines():
    """One job per file: a module past 400 lines holds two (the house's floor, issue 49)."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "lit_ddp").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"modules over 400 lines: {long}"


def test_module_docstrings_are_short():
    """A module docstring says what the module is and the command that runs it (about 12 lines at most); the
    derivations live in docs/, and "a step" is defined once, in docs/architecture.md."""
    long = {}
    for path in sorted((ROOT / "lit_ddp").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > 15:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert not long, f"module docstrings over 15 lines (move the detail to docs/): {long}"
