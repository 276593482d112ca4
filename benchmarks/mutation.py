"""Mutation score of the logic floors, module by module: how many of mutmut's mutants the fast unit tests kill,
and the ones that survive.

    nice -n 19 python -m benchmarks.mutation                             # every module of [tool.mutmut]
    nice -n 19 python -m benchmarks.mutation lit_ddp/scaling/links.py    # one module (results add up in mutants/)
    nice -n 19 python -m benchmarks.mutation --again lit_ddp/scaling/links.py   # its survivors only, with new tests
    python -m benchmarks.mutation --report                               # the table of what was run, running nothing

The modules and the tests are pyproject's ``[tool.mutmut]`` (``only_mutate``, ``pytest_add_cli_args_test_selection``);
mutmut copies the tree into ``mutants/`` and, for each mutant, runs the selected tests that reached the function it
changed, with one worker. Not in CI: some 5,600 mutants at two to four a second on 2 shared cores. A survivor is
either a missing test or an equivalent mutant (a comment at the line says why); ``mutmut show NAME`` prints its diff.
What the last run found: docs/testing.md, "Mutation testing".
"""

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lit_ddp.formatting import table  # noqa: E402

KILLED = ("killed", "timeout", "segfault", "caught by type check")  # the tests (or the type checker) noticed
UNCHECKED = ("not checked", "skipped")  # not run yet: left out of the score
# mutmut's command beside this interpreter (a venv's bin/, activated or not), else on PATH.
BESIDE = Path(sys.executable).with_name("mutmut")
MUTMUT = str(BESIDE) if BESIDE.exists() else "mutmut"


def configured_modules() -> list[str]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # mutmut itself reads pyproject with toml there
        import toml as tomllib  # type: ignore[no-redef]
    text = (ROOT / "pyproject.toml").read_text()
    config = tomllib.loads(text)["tool"]["mutmut"]
    return list(config["only_mutate"])


def dotted(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def run(module: str, again: bool = False) -> None:
    """mutmut on ``module``'s mutants (``again``: only those that survived, or that no test reached), one worker;
    its progress goes to ``mutants/<module>.log``."""
    names = [f"{dotted(module)}.*"]
    if again:
        names = [n for n, status in results().items() if module_of(n, [module]) and status in ("survived", "no tests")]
        if not names:
            return
    log = ROOT / "mutants" / f"{dotted(module)}.log"
    log.parent.mkdir(exist_ok=True)
    with log.open("a") as out:
        done = subprocess.run([MUTMUT, "run", "--max-children", "1", *names], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT)  # fmt: skip
    if done.returncode:
        sys.exit(f"mutmut run {module} exited {done.returncode}: see {log}")


def results() -> dict[str, str]:
    """Every mutant's status (``killed``, ``survived``, ``no tests``, ``not checked``, ...) by name."""
    text = subprocess.run([MUTMUT, "results", "--all", "true"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    found = {}
    for line in text.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            found[name] = status
    return found


def module_of(name: str, modules: list[str]) -> str | None:
    return next((m for m in modules if name.startswith(dotted(m) + ".")), None)


def report(modules: list[str]) -> str:
    statuses = results()
    counts = {m: Counter() for m in modules}
    survivors: dict[str, list[str]] = {m: [] for m in modules}
    for name, status in statuses.items():
        module = module_of(name, modules)
        if module is None:
            continue
        counts[module][status] += 1
        if status not in KILLED and status not in UNCHECKED:
            survivors[module].append(f"{name} ({status})")
    rows = []
    for module in modules:
        c = counts[module]
        checked = sum(c.values()) - sum(c[s] for s in UNCHECKED)
        killed = sum(c[s] for s in KILLED)
        score = f"{killed / checked:.1%}" if checked else "not run"
        rows.append((module, sum(c.values()), checked, killed, checked - killed, score))
    lines = [table(("module", "mutants", "run", "killed", "survived", "score"), rows)]
    for module in modules:
        if survivors[module]:
            lines += ["", f"Survivors in {module} (mutmut show NAME):", *(f"  {s}" for s in sorted(survivors[module]))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="paths among [tool.mutmut]'s only_mutate (default: all of them)")
    parser.add_argument("--again", action="store_true", help="run only the mutants that survived (new tests)")
    parser.add_argument("--report", action="store_true", help="only print the table of the runs so far")
    args = parser.parse_args(argv)
    configured = configured_modules()
    unknown = [m for m in args.modules if m not in configured]
    if unknown:
        parser.error(f"{unknown} not in pyproject's [tool.mutmut] only_mutate: {configured}")
    if not args.report:
        for module in args.modules or configured:
            run(module, args.again)
    print(report(configured))


if __name__ == "__main__":
    main()
