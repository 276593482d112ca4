"""A pytest plugin for Lightning's own tests: with ``--lit-ddp``, ``LitDDPStrategy`` wherever they get
``DDPStrategy``.

    python benchmarks/lightning_conformance.py LIGHTNING_CHECKOUT    # both runs: -p benchmarks.lightning_substitution,
                                                                     # the second with --lit-ddp

With ``--lit-ddp`` it replaces, before any test module is imported: the class under both names a test imports it by
(``lightning.pytorch.strategies.DDPStrategy`` and ``lightning.pytorch.strategies.ddp.DDPStrategy``), so that a
test-local ``class MyStrategy(DDPStrategy)`` derives from ``LitDDPStrategy`` too, and every name of the strategy
registry that builds a ``DDPStrategy`` (``ddp``, ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook`` and their
``find_unused_parameters`` variants), with the registered arguments kept. Lightning's own modules keep the names
they imported: their ``isinstance(strategy, DDPStrategy)`` holds for the subclass.

Loaded in both runs, so that they differ by the substitution alone, it also declares the ``flaky`` marker when
pytest-rerunfailures (in Lightning's test requirements, not in ours) is missing: the marked test then runs once.
"""

import lightning.pytorch.strategies as strategies
import lightning.pytorch.strategies.ddp as ddp
import pytest
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

HEADER = "lit_ddp substitution:"  # the header line's start: lightning_conformance.py reads it
SUBSTITUTED: list[str] = []  # the registry names now building a LitDDPStrategy


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--lit-ddp", action="store_true", help="LitDDPStrategy in place of Lightning's DDPStrategy")


def substitute() -> list[str]:
    """Puts ``LitDDPStrategy`` where the tests get ``DDPStrategy``; returns the registry names it replaced."""
    from lit_ddp.run.strategy import LitDDPStrategy  # the base run imports nothing of lit_ddp

    for module in (strategies, ddp):
        module.DDPStrategy = LitDDPStrategy
    names = [name for name, entry in StrategyRegistry.items() if entry["strategy"] is DDPStrategy]
    for name in names:
        entry = StrategyRegistry[name]
        StrategyRegistry.register(
            name, LitDDPStrategy, description=entry["description"], override=True, **entry["init_params"]
        )
    return names


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("rerunfailures"):
        config.addinivalue_line("markers", "flaky: rerun a flaky test (pytest-rerunfailures; here: run once)")
    if config.getoption("--lit-ddp"):
        SUBSTITUTED[:] = substitute()
        if "ddp" not in SUBSTITUTED:
            raise pytest.UsageError(
                f"--lit-ddp: no DDPStrategy `ddp` in the strategy registry: {sorted(StrategyRegistry)}"
            )


def pytest_report_header(config: pytest.Config) -> str:
    if not SUBSTITUTED:
        return f"{HEADER} none (Lightning's DDPStrategy)"
    return f"{HEADER} LitDDPStrategy for DDPStrategy and {len(SUBSTITUTED)} registry names: {', '.join(SUBSTITUTED)}"
