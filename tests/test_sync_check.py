"""SyncCheck on real 2-process runs, with faults injected through DDP comm hooks."""

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import SyncCheck
from lit_ddp.callbacks.sync_check import fingerprints
from tests.faults import FlipOneBit, NudgeWeight, StopAfterStep
from tests.recorders import RecordLogs
from tests.runner import run_fit
from tests.trainers import fast_trainer


def perturb_rank1_hook(state, bucket):
    """All-reduces, then nudges rank 1's averaged gradient: the all-reduce 'happened' but ranks disagree."""

    def nudge(fut):
        grad = fut.value()[0]
        if dist.get_rank() == 1:
            grad.add_(1e-3)
        return grad

    return allreduce_hook(state, bucket).then(nudge)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)
def test_fingerprints_see_a_single_bit(device):
    t = torch.randn(1000, device=device)
    flipped = t.clone()
    flipped.view(torch.int32)[123] ^= 1  # the lowest mantissa bit of one element
    assert torch.equal(fingerprints([t]), fingerprints([t.clone()]))
    assert not torch.equal(fingerprints([t]), fingerprints([flipped]))
    zeros = torch.zeros(3, device=device)
    assert not torch.equal(fingerprints([zeros]), fingerprints([-zeros]))


def test_the_views_kept_between_checks_follow_updates_and_a_replaced_parameter():
    """A step's check reads the parameters through views made once: an in-place update shows through them, a
    parameter whose storage was replaced (``p.data = ...``), made non-contiguous or frozen gets fresh ones; the
    fingerprints are always those of the parameters as they are."""
    model = torch.nn.Linear(4, 3)
    check = SyncCheck()
    check._params = list(model.parameters())

    def checked():
        trainable, views = check._trainable()
        assert torch.equal(
            fingerprints(trainable, views), fingerprints([p for p in model.parameters() if p.requires_grad])
        )
        return views

    first = checked()
    with torch.no_grad():
        model.weight.add_(1.0)  # an optimizer's in-place update
    assert checked() is first
    model.weight.data = torch.randn(3, 4)  # new storage
    replaced = checked()
    assert replaced is not first and replaced[0][0].data_ptr() == model.weight.data_ptr()
    model.weight.data = torch.randn(4, 3).t()  # not contiguous: copied every time
    assert checked() is not checked()
    model.bias.requires_grad_(False)
    assert len(checked()[0]) == 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="every_n_steps=-1"):
        SyncCheck(every_n_steps=-1)
    with pytest.raises(ValueError, match="mode='loud'"):
        SyncCheck(mode="loud")


def fit(make_trainer, sync_check, **strategy_kwargs) -> bool:
    """Trains 3 steps on 2 ranks; True when rank 0's weights (which ddp_spawn brings back) have moved."""
    model = LinearRegression(dim=32, num_layers=2)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = make_trainer(max_steps=3, callbacks=[sync_check], **strategy_kwargs)
    trainer.fit(model, FixedBatchDataModule(dim=32, batch_size=4))
    return all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    "strategy_kwargs",
    [{}, {"static_graph": True}, {"gradient_as_bucket_view": True}, {"bucket_cap_mb": 0.001}],
    ids=["default", "static_graph", "gradient_as_bucket_view", "small_buckets"],
)
def test_healthy_ddp_passes(make_trainer, strategy_kwargs):
    assert fit(make_trainer, SyncCheck(check_grads=True), **strategy_kwargs)


def test_skipped_all_reduce_is_caught(make_trainer):
    with pytest.raises(Exception, match=r"SyncError: weights out of sync across 2 ranks after step 0: net\.\d\.\w+ "
                                        r"differs on rank\(s\) \[1\] from rank 0"):  # fmt: skip
        fit(make_trainer, SyncCheck(), ddp_comm_hook=noop_hook)


def test_skipped_all_reduce_is_caught_in_the_gradients(make_trainer):
    with pytest.raises(Exception, match=r"SyncError: gradients out of sync across 2 ranks at step 0"):
        fit(make_trainer, SyncCheck(check_grads=True), ddp_comm_hook=noop_hook)


def test_one_perturbed_rank_is_named(make_trainer):
    with pytest.raises(Exception, match=r"gradients out of sync .* differs on rank\(s\) \[1\] .*max \|diff\| = 0\.001"):
        fit(make_trainer, SyncCheck(check_grads=True), ddp_comm_hook=perturb_rank1_hook)


@pytest.fixture(scope="module")
def warn_mode_log(tmp_path_factory) -> str:
    """What rank 0 of a 3-step run without the all-reduce, in warn mode, logged and warned (rank_zero_warn in a
    ddp_spawn worker: RecordLogs writes it where this process can read it)."""
    out = tmp_path_factory.mktemp("warn_mode")
    callbacks = [RecordLogs(out), SyncCheck(every_n_steps=1, mode="warn")]
    trainer = fast_trainer(out, max_steps=3, callbacks=callbacks, ddp_comm_hook=noop_hook)
    trainer.fit(LinearRegression(dim=32, num_layers=2), FixedBatchDataModule(dim=32, batch_size=4))
    return RecordLogs.read(out, 0)


def test_warn_mode_warns_and_goes_on(warn_mode_log):
    for step in range(3):  # every step, to the last one
        assert re.search(rf"UserWarning: weights out of sync across 2 ranks after step {step}: net\.\d\.\w+ "
                         r"differs on rank\(s\) \[1\] from rank 0", warn_mode_log), warn_mode_log  # fmt: skip


def test_warn_mode_does_not_end_with_weights_in_sync(warn_mode_log):
    assert "weights in sync" not in warn_mode_log, warn_mode_log
    assert re.search(r"weights OUT OF SYNC across 2 ranks at 3 check\(s\), last after step 2", warn_mode_log)


def test_cli_run_without_all_reduce_fails_fast_with_sync_error(tmp_path):
    hook = "torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks.noop_hook"
    result = run_fit("--devices", "2", "--trainer.strategy.ddp_comm_hook", hook, cwd=tmp_path, timeout=60)
    assert result.returncode == 1
    assert re.search(r"^lit-ddp-fit: SyncError: weights out of sync across 2 ranks after step 0: net\.0\.weight "
                     r"differs on rank\(s\) \[1\]", result.stderr, re.M), result.stderr[-2000:]  # fmt: skip
    assert "Step 1," not in result.stdout


def test_a_one_bit_divergence_is_caught_and_named(make_trainer):
    # One weight of rank 1 differs in its lowest bit after step 2, invisible to any float sum of the model: only
    # the fingerprint's bit sums see it. Its parameter is named from the fingerprints of that step (by the time
    # the row is read, a step later, the update may have rounded the difference away).
    model = LinearRegression(dim=32, num_layers=2)
    trainer = make_trainer(max_steps=5, callbacks=[FlipOneBit(rank=1, step=2), SyncCheck(every_n_steps=1)])
    with pytest.raises(Exception, match=r"SyncError: weights out of sync across 2 ranks after step 2: "
                                        r"net\.\d\.bias differs on rank\(s\) \[1\] from rank 0"):  # fmt: skip
        trainer.fit(model, FixedBatchDataModule(dim=32, batch_size=4))


@pytest.mark.parametrize(
    ("sync_check", "stop", "found_after"),
    [(SyncCheck(every_n_steps=3), [], 3), (SyncCheck(), [StopAfterStep(2)], 2)],
    ids=["checked after steps 0, 3 and 4", "checked after step 0, training stopped after step 2"],
)
def test_a_check_between_steps_says_when_the_ranks_were_last_seen_in_sync(make_trainer, sync_check, stop,
                                                                         found_after):  # fmt: skip
    # Rank 1's weight moves after step 1, and stays apart: the next check finds it, and a run stopped before any
    # has the weights it ends with compared at the end.
    model = LinearRegression(dim=32, num_layers=2)
    trainer = make_trainer(max_steps=5, callbacks=[NudgeWeight(rank=1, step=1), sync_check, *stop])
    found = rf"SyncError: weights out of sync across 2 ranks after step {found_after} \(in sync after step 0\): "
    with pytest.raises(Exception, match=found + r"net\.0\.weight differs on rank\(s\) \[1\]"):
        trainer.fit(model, FixedBatchDataModule(dim=32, batch_size=4))
