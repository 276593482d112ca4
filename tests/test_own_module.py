"""The callbacks in a user's own script, ``examples/own_module.py``: a plain ``Trainer(strategy="ddp")``, a model
that is not ours (Lightning's demo Transformer on random tokens, SGD), 2 CPU ranks. Tables and verdict print once,
on rank 0, then where the record went; Lightning's start-up lines and warnings are hidden as the CLI hides them. On
one device the same callbacks list runs to the end: CommMonitor and SyncCheck stand aside, one line each."""

import atexit
import logging
import os
import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from lit_ddp.callbacks.shared import exit_cleanly
from lit_ddp.run import console, lifecycle
from tests.runner import ROOT, pythonpath, run_module

# What Lightning prints in a script and the tool's callbacks hide (LeafSpec: torch >= 2.13 against Lightning 2.6).
NOISE = ("Tip:", "GPU available", "Initializing distributed", "distributed_backend", "Seed set", "LeafSpec",
         "`Trainer.fit` stopped", "terminate called")  # fmt: skip


def run_example(tmp_path, devices: int) -> str:
    result = run_module("examples.own_module", "--devices", str(devices), cwd=tmp_path, timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr  # Lightning's own log handler writes to stderr


@pytest.mark.timeout(150)
def test_callbacks_print_once_in_a_plain_script(tmp_path):
    out = run_example(tmp_path, devices=2)
    for line in (
        "Phase times (perf_counter: host time), 2 rank(s), step 0 = warm-up, then 3 steady step(s):",
        "Roofline (rank 0, steady median):",
        "Gradient all-reduce per step (2 ranks, compression none, all ranks, steady median):",
        "weights in sync across 2 ranks after step 3: max |diff| = 0 (1,692,200 parameters)",
        # Advice for a script: the strategy to construct, not the CLI's --trainer.strategy.* option.
        "The buckets are a second copy of the gradients: DDPStrategy(gradient_as_bucket_view=True) gives back "
        "6,768,800 bytes (6.77 MB) per rank.",
        # Where the record went, the command ready to paste (the default logger's folder, under the cwd).
        "Record in lightning_logs/version_0 (phases.json, comm.json); the tables again: python -m lit_ddp.report "
        "lightning_logs/version_0",
        "timeline: python -m lit_ddp.report lightning_logs/version_0 --timeline run.json, open in Perfetto's UI",
    ):
        assert out.count(line) == 1, (line, out[-3000:])
    assert (tmp_path / "lightning_logs" / "version_0" / "comm.json").is_file()
    assert len(re.findall(r"^rank\s+local\s+node", out, re.M)) == 1  # the device map
    assert "Step 0\n forward : " not in out  # PhaseTimer's per-step blocks are off by default
    assert [noise for noise in NOISE if noise in out] == [], out[-3000:]
    # The roofline is right for a model that is not a stack of Linears: FLOPs counted on the real batch
    # (FlopCounterMode gives 388.7 MFLOP for this forward), SGD's 3 x 4 bytes per parameter.
    assert re.search(r"^forward\s+388\.7 MFLOP", out, re.M), out[-2000:]
    assert re.search(r"^update\s+20\.3 MB", out, re.M)  # 12 x 1,692,200 bytes
    assert "6,768,800 bytes reduced per step (6,768,800 bytes of gradients)" in out


@pytest.mark.timeout(150)
def test_on_one_device_comm_monitor_and_sync_check_stand_aside_and_the_run_goes_on(tmp_path):
    out = run_example(tmp_path, devices=1)
    aside = [line.split(": ", 1)[1] for line in out.splitlines() if "stands aside" in line]
    assert aside == [
        "CommMonitor times DDP's gradient buckets and needs a DDP strategy, got SingleDeviceStrategy: it stands aside",
        "SyncCheck compares DDP's ranks and needs a DDP strategy, got SingleDeviceStrategy: it stands aside",
    ], out[-3000:]
    assert "Traceback" not in out and "warnings.warn" not in out and "rank_zero_warn(" not in out  # one line each
    assert "Phase times (perf_counter: host time), 1 rank(s), step 0 = warm-up, then 3 steady step(s):" in out
    assert "all-reduce with backward" not in out and "Gradient all-reduce per step" not in out  # one rank: none
    assert "Record in lightning_logs/version_0 (phases.json); the tables again:" in out


def test_lightning_s_noise_is_hidden_in_a_script_and_can_be_kept(monkeypatch):
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    record = rank_zero.makeRecord(rank_zero.name, logging.INFO, __file__, 1, "💡 Tip: install litlogger", (), None)
    ours = rank_zero.makeRecord(rank_zero.name, logging.INFO, __file__, 1, "Phase times (perf_counter...", (), None)
    leaf_spec = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)` instead."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_lightning()  # what a script calls (lit_ddp.quiet_lightning); a second call changes nothing
        console.quiet_lightning()
        warnings.warn(leaf_spec, DeprecationWarning, stacklevel=1)
    assert not rank_zero.filter(record) and rank_zero.filter(ours)
    assert caught == []
    # LIT_DDP_QUIET_LIGHTNING=0: nothing hidden.
    for name in console.LIGHTNING_LOGGERS:
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    monkeypatch.setenv(console.QUIET_ENV, "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_lightning()
        warnings.warn(leaf_spec, DeprecationWarning, stacklevel=1)
    assert rank_zero.filter(record) and len(caught) == 1


def test_quiet_lightning_also_drops_the_amp_line_the_model_summary_and_the_logging_interval_warning(monkeypatch):
    monkeypatch.delenv(console.QUIET_ENV, raising=False)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    summary = logging.getLogger(console.MODEL_SUMMARY_LOGGER)
    monkeypatch.setattr(summary, "filters", [])
    amp = rank_zero.makeRecord(rank_zero.name, logging.INFO, __file__, 1, "Using bfloat16 Automatic Mixed Precision "
                               "(AMP)", (), None)  # fmt: skip
    table = summary.makeRecord(summary.name, logging.INFO, __file__, 1, "\n  | Name | Type | Params", (), None)
    interval = (
        "The number of training batches (4) is smaller than the logging interval Trainer(log_every_n_steps="
        "50). Set a lower value for log_every_n_steps if you want to see logs for the training epoch."
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_lightning()
        warnings.warn(interval, UserWarning, stacklevel=1)
    assert not rank_zero.filter(amp) and not summary.filter(table) and caught == []
    console.quiet_lightning(model_summary=True)  # the summary asked for: shown, in this process and the ranks'
    assert summary.filter(table) and os.environ[console.QUIET_ENV] == console.KEEP_SUMMARY
    console.quiet_if_asked()  # a spawned rank, reading the script's choice
    assert summary.filter(table) and not rank_zero.filter(amp)


def test_quiet_lightning_also_quiets_the_summary_rich_draws_where_rich_is_installed(monkeypatch):
    """With rich installed, Lightning's default summary is RichModelSummary, drawn on rich's console (no logger)."""
    from lightning.pytorch.callbacks import RichModelSummary

    drawn = []
    monkeypatch.setattr(RichModelSummary, "summarize", staticmethod(lambda *args, **kwargs: drawn.append(args)))
    monkeypatch.delenv(console.QUIET_ENV, raising=False)
    console.quiet_lightning()
    console.quiet_lightning()  # wrapped once
    RichModelSummary.summarize("rows", 10, 10, 0.1, 1)
    assert drawn == []
    console.quiet_lightning(model_summary=True)  # asked for: drawn
    RichModelSummary.summarize("rows", 10, 10, 0.1, 1)
    assert drawn == [("rows", 10, 10, 0.1, 1)]


def test_a_script_s_process_group_is_torn_down_at_exit_once_training_ended_normally(monkeypatch):
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", lambda f: registered.remove(f) if f in registered else None)
    trainer = SimpleNamespace(callbacks=[])
    exit_cleanly(trainer)  # as each tool callback does
    exit_cleanly(trainer)
    (watcher,) = trainer.callbacks
    assert registered == []  # a rank whose training fails may leave others hung in a collective: no barrier then
    watcher.on_train_end(trainer, None)
    watcher.on_train_end(trainer, None)  # a second fit
    assert registered == [lifecycle.teardown_at_exit]
    # At exit: the group torn down, unless an uncaught exception ended the script.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(sys, "last_value", RuntimeError("the script failed"), raising=False)
    lifecycle.teardown_at_exit()  # the other ranks may never come to a barrier: left alone
    assert dist.is_initialized()
    monkeypatch.delattr(sys, "last_value")
    monkeypatch.delattr(sys, "last_exc", raising=False)
    lifecycle.teardown_at_exit()
    assert not dist.is_initialized()


# The public surface, as README shows it.
PUBLIC_IMPORT = (
    "from lit_ddp import PhaseTimer, CommMonitor, SyncCheck, DeviceMap, LossMonitor, LitDDPStrategy, DDPTuner, load_run"
)

# In a fresh interpreter: the process's warning filters and every logger's level, filters, handlers and propagation
# before and after importing the public surface (Lightning imported first: its own set-up is not the tool's).
IMPORT_CHANGES = """
import logging, sys, warnings
import lit_ddp.report
assert not [m for m in sys.modules if m.split(".")[0] == "lightning"], "report imported Lightning"
import lightning.pytorch

def state():
    loggers = {name: (lg.level, list(lg.filters), list(lg.handlers), lg.propagate)
               for name, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    return list(warnings.filters), (logging.root.level, list(logging.root.handlers)), loggers

before = state()
PUBLIC_IMPORT
import lit_ddp.callbacks, lit_ddp.fit
after = state()
assert after[:2] == before[:2], [f for f in after[0] if f not in before[0]]
changed = [name for name, kept in before[2].items() if after[2][name] != kept]
assert not changed, changed
import lit_ddp.callbacks.phase_timer, lit_ddp.run.strategy, lit_ddp.records.schema
assert PhaseTimer is lit_ddp.callbacks.phase_timer.PhaseTimer and LitDDPStrategy is lit_ddp.run.strategy.LitDDPStrategy
# DDPTuner from the tuner's room.
assert load_run is lit_ddp.records.schema.load_run and DDPTuner is lit_ddp.tuner.DDPTuner
lit_ddp.quiet_lightning()  # the opt-in
assert state()[0] != before[0]
print("unchanged")
"""


@pytest.mark.timeout(60)
def test_the_public_surface_imports_and_changes_nothing_in_the_process():
    env = {name: value for name, value in os.environ.items() if not name.startswith("LIT_DDP_")}
    assert PUBLIC_IMPORT in (ROOT / "README.md").read_text().splitlines()
    code = IMPORT_CHANGES.replace("PUBLIC_IMPORT", PUBLIC_IMPORT)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                            env={**env, "PYTHONPATH": pythonpath()}, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0 and result.stdout.split() == ["unchanged"], result.stderr[-3000:]


SPAWNED_SCRIPT = """
import lit_ddp
from lightning.pytorch import Trainer
from lit_ddp import DeviceMap, FixedBatchDataModule, LinearRegression

lit_ddp.quiet_lightning()
trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[DeviceMap()])
trainer.fit(LinearRegression(dim=8), FixedBatchDataModule(dim=8, batch_size=4))
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ranks_that_ddp_spawn_starts_follow_the_script_s_quiet_lightning():
    """Each spawned rank is a fresh interpreter: it logs "Initializing distributed" itself, and is quiet only because
    the script's choice reaches it (LIT_DDP_QUIET_LIGHTNING=1, read when it imports the callbacks to unpickle them)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("LIT_DDP_")}
    result = subprocess.run([sys.executable, "-c", SPAWNED_SCRIPT], capture_output=True, text=True, timeout=140,
                            env={**env, "PYTHONPATH": pythonpath()}, cwd=ROOT)  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert len(re.findall(r"^rank\s+local\s+node", out, re.M)) == 1  # the run happened, and printed
    assert [noise for noise in NOISE if noise in out] == [], out[-3000:]


def test_the_step_lines_go_straight_to_the_clis_stream_only_where_no_filter_of_the_users_would_see_them(monkeypatch):
    monkeypatch.setattr(console, "_HANDLER", None)  # put back after the test, with the loggers (conftest)
    assert console.stream() is None  # a script: no console of the CLI's
    console.setup()  # what python -m lit_ddp.fit does: its handler on stdout, the banners dropped
    assert console.stream() is sys.stdout
    rank_zero = logging.getLogger(console.RANK_ZERO_LOGGER)
    monkeypatch.setattr(rank_zero, "filters", [console._DROP_LIGHTNING_BANNERS])  # quiet_lightning's
    assert console.stream() is sys.stdout  # the tool's own filters pass a Step line
    monkeypatch.setattr(rank_zero, "filters", [*rank_zero.filters, logging.Filter("mine")])
    assert console.stream() is None  # a filter of the user's on the logger: the line goes through logging
    monkeypatch.setattr(rank_zero, "filters", [])
    monkeypatch.setattr(console._HANDLER, "filters", [*console._HANDLER.filters, lambda record: True])
    assert console.stream() is None  # ... or on the handler
