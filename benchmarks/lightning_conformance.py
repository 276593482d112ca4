"""Lightning's own DDP tests, run as they are and with ``LitDDPStrategy`` in place of ``DDPStrategy``: every test
whose result differs is printed, and the exit code is 1 if any does.

    git clone --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning ~/pytorch-lightning
    nice -n 10 python benchmarks/lightning_conformance.py ~/pytorch-lightning

The checkout's tests run against the *installed* Lightning, so clone the tag of the installed version (a
different patch release is named in the output; another minor release is refused). The substitution is the
pytest plugin ``benchmarks/lightning_substitution.py``; the results come from pytest's JUnit XML. On CPU the
GPU tests are skipped in both runs. Two runs of the default files take several minutes on two cores.
"""

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import NamedTuple

if not __package__:  # run as a file: the repository on sys.path instead of benchmarks/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import lightning  # noqa: E402

from benchmarks.common import child_env  # noqa: E402
from benchmarks.lightning_substitution import HEADER  # noqa: E402

# Relative to tests/tests_pytorch: the files that build DDPStrategy, its launchers and its registry names.
TEST_FILES = (
    "strategies/test_ddp.py",
    "strategies/test_ddp_integration.py",
    "strategies/test_ddp_integration_comm_hook.py",
    "strategies/test_registry.py",
    "strategies/test_common.py",
    "strategies/launchers",
    "trainer/connectors/test_accelerator_connector.py",
    "trainer/test_ddp_sigterm_handling.py",
    "plugins/test_cluster_integration.py",
)
PLUGIN = "benchmarks.lightning_substitution"


class Result(NamedTuple):
    outcome: str  # passed, skipped, xfailed, failed, error, or several joined by "+" (failed+error)
    message: str  # the first line of pytest's message for a test that did not pass, else ""


class Run(NamedTuple):
    results: dict[str, Result]  # by test id: JUnit's classname (module.Class) :: test name
    header: str  # the plugin's header line: what it substituted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/lightning_conformance.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a git clone of Lightning at the installed version's tag")
    parser.add_argument("--files", nargs="+", default=TEST_FILES, help="test files or folders under tests_pytorch")
    parser.add_argument("--timeout", type=int, default=300, help="seconds any one test may run (pytest-timeout)")
    parser.add_argument("--out", type=Path, help="folder for the runs' JUnit XML and logs (default: a temporary one)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --, e.g. -- -k spawn")
    args = parser.parse_args(argv)
    tests = args.checkout / "tests" / "tests_pytorch"
    version_file = args.checkout / "src" / "version.info"
    if not (tests.is_dir() and version_file.is_file() and (args.checkout / "pyproject.toml").is_file()):
        parser.error(
            f"{args.checkout} is not a Lightning checkout (no tests/tests_pytorch, src/version.info, pyproject)"
        )
    missing = [f for f in args.files if not (tests / f).exists()]
    if missing:
        parser.error(f"not in {tests}: {', '.join(missing)}")
    checkout_version = version_file.read_text().strip()
    if checkout_version.split(".")[:2] != lightning.__version__.split(".")[:2]:
        parser.error(f"the checkout is Lightning {checkout_version}, the installed one {lightning.__version__}: "
                     "clone the installed version's tag")  # fmt: skip
    if importlib.util.find_spec("pytest_timeout") is None:
        parser.error("pytest-timeout is not installed (the test extra has it): a hung test would hang the run")
    if checkout_version != lightning.__version__:
        print(f"Note: the tests of Lightning {checkout_version}, against the installed {lightning.__version__}")

    out = args.out or Path(tempfile.mkdtemp(prefix="lightning_conformance-"))
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name, substitute in (("DDPStrategy", False), ("LitDDPStrategy", True)):
        runs[name] = run_tests(args.checkout, args.files, substitute, out / name, args.timeout, args.pytest_args)
        print(f"{name}: {counts(runs[name].results)}", flush=True)
    print(runs["LitDDPStrategy"].header)
    substituted, renamed = named_as_in_the_base_run(runs["LitDDPStrategy"].results)
    print(f"{renamed} test ids name the class they were given (LitDDPStrategy): compared by DDPStrategy's id")
    return report(runs["DDPStrategy"].results, substituted)


def run_tests(checkout: Path, files, substitute: bool, stem: Path, timeout: int, extra: list[str]) -> Run:
    """One pytest run of ``files`` in the checkout's own configuration (its pyproject), with the plugin, which
    substitutes ``LitDDPStrategy`` if ``substitute``; its log at ``<stem>.log``, its JUnit XML at ``<stem>.xml``."""
    junit = stem.with_suffix(".xml")
    cmd = [sys.executable, "-m", "pytest", "-c", str(checkout / "pyproject.toml"), "--rootdir", str(checkout),
           "-p", "no:cacheprovider", "-p", "no:xdist", f"--timeout={timeout}", f"--junitxml={junit}", "-rN",
           "--color=no", "-p", PLUGIN, *(["--lit-ddp"] if substitute else []), *files, *extra]  # fmt: skip
    with open(stem.with_suffix(".log"), "w") as log:
        code = subprocess.run(cmd, cwd=checkout / "tests" / "tests_pytorch", env=child_env(), stdout=log,
                              stderr=subprocess.STDOUT).returncode  # fmt: skip
    text = stem.with_suffix(".log").read_text()
    if code not in (0, 1) or not junit.is_file():  # 0: all passed, 1: some failed; else pytest itself failed
        print(text[-3000:], file=sys.stderr)
        raise SystemExit(f"pytest exited with code {code} (log: {stem.with_suffix('.log')})")
    header = next((line for line in text.splitlines() if line.startswith(HEADER)), "")
    if substitute != ("LitDDPStrategy for" in header):  # the plugin says what it did, or nothing when not loaded
        raise SystemExit(f"the substitution plugin's header is {header!r} (log: {stem.with_suffix('.log')})")
    return Run(read_junit(junit), header)


def read_junit(path: Path) -> dict[str, Result]:
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds, message = [], ""
        for child in case:
            kind = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(child.tag)
            if kind is None:
                continue
            if kind == "skipped" and child.get("type") == "pytest.xfail":
                kind = "xfailed"
            kinds.append(kind)
            if kind in ("failed", "error") and not message:
                message = (child.get("message") or "").strip().splitlines()[0][:200] if child.get("message") else ""
        test = f"{case.get('classname')}::{case.get('name')}"
        results[test] = Result("+".join(kinds) or "passed", message)
    return results


def named_as_in_the_base_run(results: dict[str, Result]) -> tuple[dict[str, Result], int]:
    """The substituted run's results by the base run's ids: a test parametrized by the strategy class has the
    class's name in its id (``test_strategy_choice_cpu_str[ddp-LitDDPStrategy]``). Also: how many ids had it."""
    renamed = {test.replace("LitDDPStrategy", "DDPStrategy"): result for test, result in results.items()}
    return renamed, sum("LitDDPStrategy" in test for test in results)


def counts(results: dict[str, Result]) -> str:
    tally = Counter(r.outcome for r in results.values())
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(tally.items(), key=lambda kv: -kv[1])) or "no tests"


def report(base: dict[str, Result], substituted: dict[str, Result]) -> int:
    def outcome(results: dict[str, Result], test: str) -> str:
        return results[test].outcome if test in results else "absent"

    differ = sorted(t for t in base.keys() | substituted.keys() if outcome(base, t) != outcome(substituted, t))
    for test in differ:
        message = substituted[test].message if test in substituted else ""
        print(
            f"  {test}: {outcome(base, test)} -> {outcome(substituted, test)}" + (f"  ({message})" if message else "")
        )
    print(f"{len(differ)} of {len(base)} tests differ between DDPStrategy and LitDDPStrategy")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
