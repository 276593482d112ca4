"""The GPU check's host-sync section: host syncs per steady step, and where they come from, captured live.

    python benchmarks/gpu_check.py out.txt --sections syncs

``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call torch knows of (a blocking copy to
the host: ``.item()``, ``.cpu()``, ``.tolist()``; a stream or device synchronize) emit a UserWarning, attributed
to the Python line that called into torch. ``SyncCounter`` turns it on for steps 11..20 only and sorts the
warnings by step.
"""

import contextlib
import linecache
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple, Optional

import torch
from typing_extensions import override

from benchmarks.common import ROOT, median
from benchmarks.gpu_fits import BATCH, DIM, Budget, Section, StepWindow, fit
from lit_ddp.callbacks import CommMonitor, LossMonitor, PhaseTimer, SyncCheck
from lit_ddp.formatting import table

SYNC_MESSAGE = "synchronizing CUDA operation"  # the TORCH_WARN of c10::cuda::warn_or_error_on_sync


class SyncSite(NamedTuple):
    path: str  # relative to the repository, or to site-packages
    line: int
    code: str


def short_path(filename: str) -> str:
    path = Path(filename)
    with contextlib.suppress(ValueError, OSError):
        return str(path.resolve().relative_to(ROOT))
    for anchor in ("site-packages", "dist-packages"):
        if anchor in path.parts:
            return "/".join(path.parts[path.parts.index(anchor) + 1 :])
    return filename


def sync_sites(caught: Iterable[warnings.WarningMessage]) -> list[SyncSite]:
    """The sync warnings among ``caught``, each as the Python line that called into torch."""
    return [
        SyncSite(short_path(w.filename), w.lineno, linecache.getline(w.filename, w.lineno).strip())
        for w in caught
        if SYNC_MESSAGE in str(w.message)
    ]


def is_loss_read(site: SyncSite) -> bool:
    return site.path.endswith(("callbacks/step_sync.py", "callbacks/loss_monitor.py"))


def sync_rows(results: dict[str, list[list[SyncSite]]]) -> list[tuple]:
    return [
        (label, " ".join(str(len(s)) for s in per_step) or "-", f"{median(len(s) for s in per_step):g}")
        for label, per_step in results.items()
    ]


def sync_verdicts(quiet: list[list[SyncSite]], printing: list[list[SyncSite]]) -> list[str]:
    """The quiet run's syncs per step (target 0), and whether the printing run has exactly one more per step,
    from LossMonitor/StepSync (the counter works)."""
    quiet_counts, printing_counts = [len(s) for s in quiet], [len(s) for s in printing]
    if not quiet_counts:
        target = "syncs: NOT MEASURED (no step was counted)"
    elif not any(quiet_counts):
        target = f"syncs: OK, 0 host syncs per steady step over {len(quiet_counts)} steps (target 0)"
    else:
        top = Counter(site for step in quiet for site in step).most_common(3)
        where = ", ".join(f"{site.path}:{site.line}" for site, _ in top)
        target = f"syncs: MISSED, {median(quiet_counts):g} host syncs per steady step (target 0), from {where}"
    extra = median(printing_counts) - median(quiet_counts)
    loss_reads = [sum(is_loss_read(site) for site in step) for step in printing]
    if printing_counts and not any(printing_counts):
        counter = (
            "counter: BROKEN, no sync seen although LossMonitor reads the loss on the host every step "
            "(the sync warnings did not reach Python's warnings)"
        )
    elif extra == 1 and loss_reads and all(n == 1 for n in loss_reads):
        site = next(site for step in printing for site in step if is_loss_read(site))
        counter = f"counter: OK, printing the loss adds 1 sync per step: StepSync's host read, {site.path}:{site.line}"
    else:
        counter = (
            f"counter: UNEXPECTED, printing the loss adds {extra:g} syncs per step "
            f"(per step from LossMonitor/StepSync: {loss_reads})"
        )
    return [target, counter]


class SyncCounter(StepWindow):
    """Counts host syncs step by step: ``set_sync_debug_mode("warn")`` over its window of steps, recording the
    warnings. Put it first among the callbacks.

    Args:
        first: The first counted step.
        steps: How many steps to count; the fit must run at least ``first + steps + 1`` steps.
    """

    def __init__(self, first: int, steps: int) -> None:
        super().__init__(first, steps)
        self.per_step: list[list[SyncSite]] = []
        self._catcher: Optional[warnings.catch_warnings] = None
        self._log: list[warnings.WarningMessage] = []
        self._seen = 0

    @override
    def begin(self) -> None:
        self._catcher = warnings.catch_warnings(record=True)
        self._log = self._catcher.__enter__()
        warnings.simplefilter("always")  # every occurrence, not once per call site
        torch.cuda.set_sync_debug_mode("warn")

    @override
    def step_done(self) -> None:
        self.per_step.append(sync_sites(self._log[self._seen :]))
        self._seen = len(self._log)

    @override
    def end(self) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._catcher.__exit__(None, None, None)
        self._catcher = None


def syncs_section(budget: Budget) -> Section:
    """Host syncs per steady step, and where they come from.

    Steps 11..20: after warm-up, and after DDP's first 10 iterations, which wait for the previous step's events
    at forward start for its runtime stats, unseen by the debug mode (``Budget.sync_first``). Limits: the mode is
    process-wide, but a warning reaches Python only on a thread that runs Python; autograd collects its worker
    threads' warnings and replays them on the calling thread when backward ends, so a sync inside backward (DDP's
    hooks) is counted but shows at the ``backward()`` call, not where it happened; torch.distributed's own
    operations are not covered (torch's docs). Two runs: the tool's per-step work off (PhaseTimer + CommMonitor
    on, LossMonitor quiet, SyncCheck at the end only), target 0; and the same with LossMonitor printing every
    step, whose host read of the loss (StepSync's ``.cpu()``) must show as exactly 1 more per step: proof that
    the counter sees syncs at all.
    """
    last = budget.sync_first + budget.sync_steps - 1
    section = Section(f"Host syncs per steady step (steps {budget.sync_first}..{last}, dim {DIM}, batch {BATCH})")
    runs = {"PhaseTimer + CommMonitor, loss printing off": 0, "the same, LossMonitor printing every step": 1}
    results: dict[str, list[list[SyncSite]]] = {}
    for label, every in runs.items():
        counter = SyncCounter(budget.sync_first, budget.sync_steps)
        callbacks = [counter, PhaseTimer(print_steps=0, kernel_steps=0), CommMonitor(),
                     LossMonitor(every_n_steps=every, check_finite=False), SyncCheck(every_n_steps=0)]  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            try:
                fit(callbacks, budget.sync_first + budget.sync_steps + 1, Path(tmp))
            finally:
                counter.close()
        results[label] = counter.per_step
    section.lines += table(("run", "syncs per step", "median"), sync_rows(results)).splitlines()
    for label, per_step in results.items():
        sites = Counter(site for step in per_step for site in step)
        if sites:
            section.lines.append(f"call sites, {label} (count over {len(per_step)} steps, file:line, code):")
            section.lines += [f"  {n:>4}  {site.path}:{site.line}  {site.code}" for site, n in sites.most_common()]
    section.lines.append(
        "(a sync inside backward is replayed by autograd at the backward() call; torch.distributed's own syncs "
        "are not covered by set_sync_debug_mode)"
    )
    section.verdicts += sync_verdicts(*results.values())
    return section
