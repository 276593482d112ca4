"""benchmarks/lightning_conformance.py and its plugin, without a Lightning checkout: the substitution reaches the
class and the registry, results are read from JUnit XML and compared by the base run's ids, bad input is refused.
(The real run, against a checkout: docs/testing.md.)"""

import lightning.pytorch.strategies as strategies
import lightning.pytorch.strategies.ddp as ddp
import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from benchmarks import lightning_conformance as conformance
from benchmarks.lightning_substitution import substitute
from lit_ddp.run.strategy import LitDDPStrategy

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.tests_pytorch.strategies.test_ddp" name="test_a" time="0.1" />
<testcase classname="tests.tests_pytorch.strategies.test_ddp" name="test_b[ddp-LitDDPStrategy]" time="0.1" />
<testcase classname="tests.tests_pytorch.strategies.test_ddp" name="test_c" time="0.1">
  <failure message="AssertionError: 1 == 2&#10;more">trace</failure>
  <error message="failed on teardown with &quot;AssertionError: leaking&quot;">trace</error></testcase>
<testcase classname="tests.tests_pytorch.strategies.test_ddp" name="test_d" time="0.1">
  <skipped type="pytest.skip" message="needs a GPU">skip</skipped></testcase>
</testsuite></testsuites>"""


def test_the_substitution_reaches_the_class_and_every_ddp_name_of_the_registry(monkeypatch):
    for module in (strategies, ddp):
        monkeypatch.setattr(module, "DDPStrategy", DDPStrategy)  # put back after the test
    names = [name for name, entry in StrategyRegistry.items() if entry["strategy"] is DDPStrategy]
    for name in names:
        monkeypatch.setitem(StrategyRegistry, name, StrategyRegistry[name])
    assert substitute() == names and len(names) == 12
    assert strategies.DDPStrategy is ddp.DDPStrategy is LitDDPStrategy
    spawn = Trainer(strategy="ddp_spawn_find_unused_parameters_true", accelerator="cpu", devices=2).strategy
    assert type(spawn) is LitDDPStrategy and spawn._start_method == "spawn"
    assert spawn._ddp_kwargs == {"find_unused_parameters": True}  # the registered arguments kept


def test_results_are_read_by_test_and_compared_by_the_base_runs_ids(tmp_path, capsys):
    (tmp_path / "run.xml").write_text(JUNIT)
    results = conformance.read_junit(tmp_path / "run.xml")
    module = "tests.tests_pytorch.strategies.test_ddp"
    assert {test.split("::")[1]: r.outcome for test, r in results.items()} == {
        "test_a": "passed", "test_b[ddp-LitDDPStrategy]": "passed", "test_c": "failed+error", "test_d": "skipped"
    }  # fmt: skip
    assert results[f"{module}::test_c"].message == "AssertionError: 1 == 2"
    substituted, renamed = conformance.named_as_in_the_base_run(results)
    assert renamed == 1 and f"{module}::test_b[ddp-DDPStrategy]" in substituted
    base = {**substituted, f"{module}::test_c": conformance.Result("passed", "")}
    assert conformance.report(base, substituted) == 1
    out = capsys.readouterr().out
    assert f"  {module}::test_c: passed -> failed+error  (AssertionError: 1 == 2)\n" in out
    assert out.endswith("1 of 4 tests differ between DDPStrategy and LitDDPStrategy\n")
    assert conformance.report(substituted, substituted) == 0


def test_a_folder_that_is_no_checkout_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        conformance.main([str(tmp_path)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"benchmarks/lightning_conformance.py: error: {tmp_path} is not a Lightning checkout "
        "(no tests/tests_pytorch, src/version.info, pyproject)"
    )


def test_another_minor_release_is_refused(tmp_path, capsys):
    for name in conformance.TEST_FILES:
        path = tmp_path / "tests" / "tests_pytorch" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch() if path.suffix else path.mkdir(exist_ok=True)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "version.info").write_text("2.5.0\n")
    (tmp_path / "pyproject.toml").touch()
    with pytest.raises(SystemExit) as exited:
        conformance.main([str(tmp_path)])
    assert exited.value.code == 2
    assert "the checkout is Lightning 2.5.0, the installed one 2.6" in capsys.readouterr().err
