"""The house's floors as a contract: ``lint-imports`` (pyproject's layers and no-cycle contracts) on the package as
it is, and on a copy with a cycle planted, which it must refuse; at most 12 modules at the top of ``lit_ddp/``;
short module docstrings."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
needs_linter = pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is in the test extra")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(cwd)}
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@needs_linter
def test_the_floors_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "floors KEPT" in result.stdout and "no import cycle inside any package KEPT" in result.stdout


@needs_linter
@pytest.mark.parametrize(
    ("module", "planted", "broken"),
    [
        (
            "callbacks/shared.py",
            "from lit_ddp.callbacks import comm_monitor",
            "no import cycle inside any package BROKEN",
        ),
        ("measure/clock.py", "from lit_ddp import report", "floors BROKEN"),
        ("errors.py", "from lit_ddp.records import schema", "floors BROKEN"),
    ],
)
def test_a_planted_breach_is_refused(tmp_path, module, planted, broken):
    shutil.copytree(ROOT / "lit_ddp", tmp_path / "lit_ddp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "lit_ddp" / module, "a") as f:
        f.write(f"\n{planted}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and broken in result.stdout, result.stdout[-3000:]


def test_at_most_twelve_modules_at_the_top():
    top = sorted(p.name for p in (ROOT / "lit_ddp").glob("*.py"))
    assert len(top) <= 12, top


def test_module_docstrings_are_short():
    """A module docstring says what the module is and the command that runs it (about 12 lines at most); the
    derivations live in docs/, and "a step" is defined once, in docs/architecture.md."""
    long = {}
    for path in sorted((ROOT / "lit_ddp").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > 15:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert not long, f"module docstrings over 15 lines (move the detail to docs/): {long}"
