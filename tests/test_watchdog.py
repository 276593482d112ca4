"""The watchdog's timing, on a patched clock, and what it says from the ranks' states (``lit_ddp.run.watchdog``);
the real 2-rank runs are in tests/test_hangs.py (``hung_runs``)."""

import itertools
import json
import os
import sys
import threading
import time
import traceback

import pytest

from lit_ddp.analysis.divergence import Collective, RankReport
from lit_ddp.analysis.stopped import (
    FIX_DEAD,
    FIX_EVEN_SHARES,
    FIX_PARTITION,
    FIX_PREDICT_SHARES,
    FIX_SHAPES,
    FIX_SOME_RANKS,
    FIX_SYNC_KEY,
    FIX_UNEVEN_COUNTS,
    FIX_UNEVEN_HOOK,
    certain,
    in_collective,
    waiting_line,
)
from lit_ddp.run import watchdog
from lit_ddp.run.watchdog import COMPARE_AFTER_S, GRACE_S, Watchdog


@pytest.fixture(autouse=True)
def _not_failing(monkeypatch):
    """Each test's process is not failing: a watchdog that ends (``end``, ``orphaned``) sets the flag for good."""
    monkeypatch.setattr(watchdog.hangs, "FAILING", threading.Event())


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stepped(times: list[float], **kwargs) -> tuple[Watchdog, Clock]:
    clock = Clock()
    dog = Watchdog(0, 2, clock=clock, **kwargs)
    for step, t in enumerate(times):
        clock.now = t
        dog.beat(step)
    return dog, clock


def test_a_step_counts_once_however_many_hooks_beat_it():
    dog, clock = stepped([0.0, 1.0, 2.0])
    clock.now = 2.5
    dog.beat(2)  # the same step again (the strategy's and the recorder's beats): not a boundary
    assert dog.last_progress() == 2.0
    dog.alive()  # a validation batch: progress, no step
    assert dog.last_progress() == 2.5


def test_it_waits_the_longer_of_hang_after_s_and_k_median_steps():
    assert stepped([0.0, 1.0, 2.0, 3.0])[0].limit_s() == 10.0  # 1 s steps: hang_after_s
    slow, _ = stepped([0.0, 100.0, 130.0, 160.0, 190.0])  # the first step (100 s: the start's work) is left out
    assert slow.limit_s() == 150.0
    assert stepped([0.0, 1.0], hang_after_s=4.0)[0].limit_s() == 4.0  # no step timed yet
    with pytest.raises(ValueError, match=r"Watchdog\(hang_after_s=0"):
        Watchdog(0, 2, hang_after_s=0)


def test_it_compares_soon_prints_after_the_limit_and_again_when_the_wait_doubled():
    dog, clock = stepped([0.0, 1.0, 2.0, 3.0])  # last progress at 3
    seen = {}
    for tenth in range(31, 260):
        clock.now = tenth / 10
        action = dog.due(clock.now)
        if action:
            seen[round(clock.now - 3.0, 1)] = action
    assert min(seen) == COMPARE_AFTER_S and seen[COMPARE_AFTER_S] == "publish"  # a divergence is known this soon
    assert [t for t, a in seen.items() if a == "line"] == [10.0, 20.0]  # then 40, 80, ...: growing intervals
    publishes = sorted(t for t, a in seen.items() if a == "publish")
    assert all(b - a >= 2.0 - 1e-9 for a, b in itertools.pairwise(publishes))  # the state at most every 2 s
    clock.now = 30.0
    dog.beat(4)  # it moves
    assert dog.due(30.5) == "moved"
    dog._since = None  # (tick clears it)
    assert dog.due(31.0) == ""


def test_the_first_line_waits_for_the_others_states():
    dog, clock = stepped([0.0], hang_after_s=COMPARE_AFTER_S)  # the limit is when it first publishes
    assert dog.due(COMPARE_AFTER_S) == "publish"
    assert dog.due(COMPARE_AFTER_S + GRACE_S - 0.1) == ""
    assert dog.due(COMPARE_AFTER_S + GRACE_S) == "line"


def state(rank: int, kind: str, collectives: list[Collective], where: str = "", stopped_s: float = 12.0,
          worker: str = "", step: int = 3, phase: str = "training_step") -> dict:  # fmt: skip
    report = RankReport(rank, 0.0, kind, "", where, step, phase, collectives)
    return {"rank": rank, "stopped_s": stopped_s, "report": report.as_json(), "worker": worker, "stack": ["x.py:1 f"]}


def bucket(seq: int) -> Collective:
    return Collective(seq, "all_reduce", [[9]], "Float", 3, "backward", 0)


def test_a_rank_outside_any_collective_is_named_first_with_its_line_and_the_others_collective():
    states = {0: state(0, "collective", [bucket(23), bucket(24)]),
              1: state(1, "busy", [bucket(23)], "script.py:35 training_step: time.sleep(60)")}  # fmt: skip
    assert certain(states) is None  # rank 1 may still come
    line = waiting_line(states, 3)
    assert line.startswith(
        "waiting 12 s: rank 1 has been at script.py:35 training_step: time.sleep(60) for 12 s (step 3, training_step), "
        "outside any collective; rank 0 waits in all_reduce #24 Float[9] (DDP gradient bucket 0) at step 3, backward; "
        "rank 2 sent no state"
    ), line
    assert "raise timeout_s" in line and "hung" not in line


def test_a_rank_waiting_on_its_data_worker_names_the_worker():
    worker = "DataLoader worker 1 (pid 42) at data.py:20 __getitem__: time.sleep(3600)"
    states = {1: state(1, "busy", [], "script.py:50 <module>: trainer.fit(model)", worker=worker)}
    assert waiting_line(states, 2) == (
        f"waiting 12 s: rank 1 waits for its {worker}, 12 s (step 3, training_step); rank 0 sent no state (still "
        "moving, dead, or stuck holding the GIL) -> a DataLoader worker it waits on: the job goes on when its line "
        "above returns; where it will not (a read without a timeout, a lock), DataLoader(timeout=...) raises instead "
        "of waiting (the job ends at the process group's timeout, the workers with it)"
    )


def test_ranks_that_sent_nothing_while_the_others_wait_in_a_collective_get_each_causes_fix():
    line = waiting_line({0: state(0, "collective", [bucket(24)])}, 2)
    fixes = f"dead: {FIX_DEAD}; cut off: {FIX_PARTITION}"
    assert line.endswith(" -> rank 1 sent nothing: dead, stuck in C code holding the GIL (py-spy dump --pid shows "
                         f"where), or cut off from rank 0's node; {fixes}")  # fmt: skip


def test_two_ranks_nth_collectives_that_differ_end_the_job():
    barrier = Collective(24, "barrier", [[]], "", 3, "training_step", None, "s.py:9 training_step: self.log(...)")
    states = {0: state(0, "collective", [bucket(23), bucket(24)]), 1: state(1, "collective", [bucket(23), barrier])}
    line = certain(states)
    assert line.startswith("collective #24 diverged: rank 0 called all_reduce Float[9]") and "rank_zero_only" in line
    late = {0: state(0, "collective", [bucket(23), bucket(24)]), 1: state(1, "busy", [bucket(23)])}
    assert certain(late) is None  # behind is not diverged


def test_one_line_called_with_different_shapes_on_each_rank_gets_the_shapes_fix():
    """Every rank's all_gather of its own outputs, 4 on rank 0 and 2 on rank 1: not a collective some ranks skip."""
    where = "s.py:24 on_validation_epoch_end: self.all_gather(torch.stack(self.outputs))"
    mine = [Collective(13, "all_gather", [[n]], "Float", None, "before training", None, where) for n in (4, 2)]
    states = {r: state(r, "collective", [bucket(12), mine[r]]) for r in (0, 1)}
    line = certain(states)
    assert line.startswith("collective #13 diverged: rank 0 called all_gather Float[4]") and line.endswith(FIX_SHAPES)
    elsewhere = Collective(13, "all_gather", [[2]], "Float", None, "before training", None, "s.py:30 f: x")
    assert certain({**states, 1: state(1, "collective", [bucket(12), elsewhere])}).endswith(FIX_SOME_RANKS)


def test_a_sync_dist_value_gets_the_fix_of_what_the_other_rank_does():
    """The same self.log line on both ranks with a value of another dtype: the shapes' fix, not a key some ranks
    skip; an epoch's value reduced while the other rank is still in the hook that logs it: its batches."""
    log = "s.py:14 training_step: self.log('acc', acc, sync_dist=True)"
    acc = [Collective(31, "all_reduce", [[]], dtype, 3, "training_step", None, log) for dtype in ("Float", "Double")]
    states = {r: {**state(r, "collective", [bucket(30), acc[r]]), "logged": "acc", "logged_in": "training_step"}
              for r in (0, 1)}  # fmt: skip
    assert certain(states).endswith(FIX_SHAPES)
    gather = Collective(62, "all_gather", [[1, 1]], "Float", 15, "validation", None,
                        "s.py:17 validation_step: everyone = self.all_gather(preds)")  # fmt: skip
    epoch = Collective(62, "barrier", [[]], "", 15, "validation", None, "s.py:18 validation_step: self.log('val')")
    states = {
        0: state(0, "collective", [bucket(61), gather]),
        1: {**state(1, "collective", [bucket(61), epoch]), "logged": "val", "logged_in": "validation_step"},
    }
    assert certain(states).endswith(FIX_UNEVEN_HOOK.format(ranks="rank 0", hook="validation_step"))
    elsewhere = Collective(62, "all_reduce", [[1]], "Long", 15, "the end of epoch 0", None, "s.py:30 <module>: fit")
    states[0] = state(0, "collective", [bucket(61), elsewhere])  # Lightning#19604: a key only rank 1 logs
    assert certain(states).endswith(FIX_SYNC_KEY.format(keys="'val'"))


def test_a_loop_with_more_batches_on_some_ranks_is_named_uneven_data_with_each_ranks_count():
    """torchtitan#1618: rank 0 gathers its fourth validation batch (3 done) while rank 1, its three done, is back in
    training (no sync_dist key to tell it). Not where the ranks with fewer batches still call from the loop's hook,
    nor before the rank with more is past their count (a collective of its own), nor with a rank whose loop ended
    early, nor with the counts equal or unknown; predict's fix is its own (its sampler does not pad)."""
    gather = Collective(40, "all_gather", [[2, 4]], "Float", 7, "validation", None,
                        "s.py:21 validation_step: everyone = self.all_gather(preds)")  # fmt: skip
    counted = {0: ({"training": 8, "validation": 4}, {"training": 8, "validation": 3}),
               1: ({"training": 8, "validation": 3}, {"training": 8, "validation": 3})}  # fmt: skip
    states = {
        0: {**state(0, "collective", [bucket(39), gather]), "batches": counted[0][0], "done": counted[0][1]},
        1: {**state(1, "collective", [bucket(39), bucket(40)]), "batches": counted[1][0], "done": counted[1][1]},
    }
    told = FIX_UNEVEN_COUNTS.format(loop="validation", ranks="rank 0", counts="4 on rank 0, 3 on rank 1",
                                    hook="validation_step", fix=FIX_EVEN_SHARES)  # fmt: skip
    assert certain(states).endswith(told)
    # More training batches on rank 1: its bucket (a training batch's, its eighth) against rank 0's validation
    ahead = {
        0: {**states[0], "batches": {"training": 7, "validation": 4}, "done": {"training": 7, "validation": 0}},
        1: {**states[1], "batches": {"training": 8, "validation": 4}, "done": {"training": 7, "validation": 0}},
    }
    assert "more training batches on rank 1 (7 on rank 0, 8 on rank 1; still in training_step)" in certain(ahead)
    # Rank 1 still in validation_step (a line of its own there): the loop has not ended on it
    own = Collective(40, "all_reduce", [[1]], "Float", 7, "validation", None, "s.py:25 validation_step: f(x)")
    inside = {**states, 1: {**states[1], "report": state(1, "collective", [bucket(39), own])["report"]}}
    assert certain(inside).endswith(FIX_SOME_RANKS)
    # Rank 0's gather at its second batch (1 done): a collective of its own, however the counts differ
    early = {**states, 0: {**states[0], "done": {"training": 8, "validation": 1}}}
    assert certain(early).endswith(FIX_SOME_RANKS)
    # Rank 1 left its validation after 2 of its 3 (an error, a stop): not its data's end
    cut = {**states, 1: {**states[1], "done": {"training": 8, "validation": 2}}}
    assert certain(cut).endswith(FIX_SOME_RANKS)
    # Rank 0 reduces an epoch's value it logged (its line is the hook's self.log): a key, not a batch more
    logged = {**states, 0: {**states[0], "logged": "val_acc", "logged_in": "validation_step"}}
    assert FIX_EVEN_SHARES not in certain(logged)
    for batches in ({"training": 8, "validation": 3}, {"training": 8}):  # equal, or unknown (an iterable dataset)
        assert certain({**states, 0: {**states[0], "batches": batches}}).endswith(FIX_SOME_RANKS)
    predict = Collective(40, "all_gather", [[1]], "Float", 7, "predict", None, "s.py:30 predict_step: g(y)")
    predicts = {r: {**states[r], "batches": {"predict": 4 - r}, "done": {"predict": 3}} for r in (0, 1)}
    predicts[0]["report"] = state(0, "collective", [bucket(39), predict])["report"]
    assert certain(predicts).endswith(f"still in predict_step): {FIX_PREDICT_SHARES}")


def test_a_divergence_names_where_the_ranks_went_out_of_step_before_it():
    """Rank 0's own barrier in setup met Lightning's on rank 1 (#4, alike); the next differs (#5)."""
    mine = Collective(4, "barrier", [[]], "", None, "before training", None, "s.py:7 setup: dist.barrier()")
    lightnings = Collective(4, "barrier", [[]], "", None, "before training")
    gather = Collective(5, "all_gather", [[1]], "Long", None, "before training")
    states = {0: state(0, "collective", [mine, Collective(5, "barrier", [[]], "", None, "before training")]),
              1: state(1, "collective", [lightnings, gather])}  # fmt: skip
    line = certain(states)
    assert "collective #5 diverged: " in line
    assert "; out of step since #4, barrier: rank 0 at s.py:7 setup: dist.barrier(), rank 1 at a line of " in line
    alike = {0: state(0, "collective", [lightnings, bucket(5)]), 1: state(1, "collective", [lightnings, gather])}
    assert "out of step" not in certain(alike)


def test_a_collective_that_a_rank_which_left_never_called_ends_the_job_and_one_it_called_does_not():
    broadcast = Collective(31, "broadcast", [[1]], "Long", 4, "the end of training", None, "s.py:13 <module>: x")
    left = state(1, "left", [bucket(30)], stopped_s=0.0)
    line = certain({0: state(0, "collective", [bucket(30), broadcast]), 1: left})
    assert line.startswith("rank 0 waits in broadcast #31 Long[1] at step 4, the end of training (s.py:13 <module>: "
                           "x); rank 1 left (past the end of the script) and will never call it -> ")  # fmt: skip
    assert certain({0: state(0, "collective", [bucket(30)]), 1: left}) is None  # #30: rank 1 called it; it completes


def test_a_test_loop_with_more_batches_on_a_rank_whose_peer_left_is_uneven_data():
    """trainer.test with 4 batches on rank 0 and 3 on rank 1: rank 1 ended its test and its script, rank 0 gathers
    its fourth batch. With the counts equal, a rank that left is a collective some ranks skip."""
    gather = Collective(31, "all_gather", [[1]], "Float", 4, "test", None, "s.py:9 test_step: self.all_gather(y)")
    waits = {**state(0, "collective", [bucket(30), gather]), "batches": {"training": 8, "test": 4},
             "done": {"training": 8, "test": 3}}  # fmt: skip
    left = {**state(1, "left", [bucket(30)], stopped_s=0.0), "batches": {"training": 8, "test": 3},
            "done": {"training": 8, "test": 3}}  # fmt: skip
    told = FIX_UNEVEN_COUNTS.format(loop="test", ranks="rank 0", counts="4 on rank 0, 3 on rank 1", hook="test_step",
                                    fix=FIX_EVEN_SHARES)  # fmt: skip
    assert certain({0: waits, 1: left}).endswith(f"will never call it -> {told}")
    even = {**left, "batches": {"training": 8, "test": 4}}
    assert certain({0: waits, 1: even}).endswith(f"will never call it -> {FIX_SOME_RANKS}")


def test_a_rank_that_stopped_on_its_own_should_stop_is_named_with_the_line_and_the_fix_to_decide_together():
    left = {**state(1, "left", [bucket(30)], stopped_s=0.0), "stopped": "stopped training after step 4 (x)"}
    line = certain({0: state(0, "collective", [bucket(30), bucket(31)]), 1: left})
    assert "; rank 1 left: it stopped training after step 4 (x) and will never call it -> a stop decided on some " \
           "ranks only: decide it on every rank together, trainer.should_stop = " \
           "trainer.strategy.reduce_boolean_decision(stop, all=False)" in line  # fmt: skip


def test_a_rank_that_stopped_alone_and_went_on_to_a_collective_after_its_fit_is_named_with_its_stop():
    """Rank 1 stopped on its own should_stop and saves a checkpoint after fit (a barrier); rank 0 still trains."""
    barrier = Collective(31, "barrier", [[]], "", 4, "the end of training", None, "s.py:20 <module>: x")
    stopped = {**state(1, "collective", [bucket(30), barrier]), "stopped": "stopped training after step 4 (y)"}
    line = certain({0: state(0, "collective", [bucket(30), bucket(31)]), 1: stopped})
    assert line.startswith("collective #31 diverged: ")
    assert line.endswith("; rank 1 stopped training after step 4 (y) -> a stop decided on some ranks only: decide "
                         "it on every rank together, trainer.should_stop = trainer.strategy.reduce_boolean_decision("
                         "stop, all=False)")  # fmt: skip
    both = {
        0: {**state(0, "collective", [bucket(30), bucket(31)]), "stopped": "stopped training after step 4"},
        1: stopped,
    }
    assert "rank_zero_only" in certain(both)  # every rank stopped (EarlyStopping): the stop is not the cause


def test_a_divergence_in_a_sync_dist_keys_reduction_ends_with_that_keys_fix():
    barrier = Collective(24, "barrier", [[]], "", 3, "the end of epoch 0", None, "s.py:9 on_train_epoch_end: x")
    states = {0: {**state(0, "collective", [bucket(23), barrier]), "logged": "epoch_metric"},
              1: state(1, "collective", [bucket(23), bucket(24)])}  # fmt: skip
    assert certain(states).endswith(" -> a sync_dist key logged on some ranks only ('epoch_metric'): log it on every "
                                    "rank, or on one without sync_dist (rank_zero_only=True)")  # fmt: skip


class Store:
    """The rendezvous store's calls the watchdog makes, in a dict."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def set(self, key, value):
        self.data[key] = value

    def get(self, key):
        return self.data[key].encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def delete_key(self, key):
        return self.data.pop(key, None) is not None


def test_the_lowest_rank_that_published_speaks_and_a_certain_divergence_ends_every_rank(monkeypatch, capsys):
    store, ended = Store(), []
    # Each rank's end, mocked: a process of its own, whose failing flag the next rank's does not share
    monkeypatch.setattr(watchdog, "_exit", lambda: (ended.append(True), watchdog.hangs.FAILING.clear()))
    monkeypatch.setattr(watchdog.console, "silence", lambda: None)  # this process is pytest's
    monkeypatch.setattr(watchdog.time, "sleep", lambda s: None)
    dogs = []
    for rank, collectives in ((0, [bucket(23), bucket(24)]), (1, [bucket(23)])):
        dog, clock = stepped([0.0, 1.0])
        dog.rank, dog.store = rank, store
        dog.state = lambda s, rank=rank, collectives=collectives: state(
            rank, "collective" if rank == 0 else "busy", collectives, "u.py:3 f: g()", stopped_s=s
        )
        dogs.append((dog, clock))
    for t in (1.0 + COMPARE_AFTER_S, 1.0 + 10.0, 1.0 + 20.0):
        for dog, clock in reversed(dogs):  # rank 1 first: rank 0 still speaks
            clock.now = t
            dog.tick(t)
    said = capsys.readouterr().err.splitlines()
    assert [line[:22] for line in said] == ["lit_ddp: waiting 10 s:", "lit_ddp: waiting 20 s:"]
    assert dogs[0][0].lines == said and dogs[1][0].lines == [] and not ended
    barrier = Collective(24, "barrier", [[]], "", 3, "training_step")
    dogs[1][0].state = lambda s: state(1, "collective", [bucket(23), barrier], stopped_s=s)
    monkeypatch.setattr(watchdog, "SPEAKER_WAIT_S", 0.2)
    dogs[1][0].tick(23.0)  # rank 1 finds it first: rank 0 has not said it, so rank 1 does, after waiting
    assert ended == [True] and dogs[1][0].ended.startswith("collective #24 diverged")
    assert capsys.readouterr().err == f"lit_ddp: {dogs[1][0].ended}\n"
    del store.data[watchdog.ENDED_KEY]
    dogs[0][1].now = 23.0
    dogs[0][0].tick(23.0)  # rank 0, the lowest, says it and leaves the word for the others
    assert ended == [True, True] and capsys.readouterr().err == f"lit_ddp: {dogs[1][0].ended}\n"
    assert store.data[watchdog.ENDED_KEY] == dogs[1][0].ended  # the ranks at exit stop waiting
    dogs[1][0].tick(23.5)
    assert ended == [True, True, True] and capsys.readouterr().err == ""  # said already: rank 1 ends without a word
    assert f"{watchdog.SEEN_KEY}1" in store.data  # and says it saw the line: the speaker waits for that to leave
    dog, clock = dogs[0]
    dog.beat(2)
    dog.tick(24.0)
    assert json.loads(store.data[f"{watchdog.KEY}1"])["rank"] == 1 and f"{watchdog.KEY}0" not in store.data
    assert capsys.readouterr().err == "lit_ddp: moved on after 23 s\n"  # (ended is mocked: it went on)


def test_a_rank_reporting_its_failure_says_nothing_of_its_own(monkeypatch, capsys):
    """Rank 0's collective timed out and it compares the reports (``hangs.diagnose``: its main thread joins the
    store's thread): read from its stack it looked busy "in threading.py _wait_for_tstate_lock, outside any
    collective". Its last state stays in the store; the diagnosis speaks."""
    store = Store()
    dog, clock = stepped([0.0, 1.0])
    dog.store = store
    dog.state = lambda s: state(0, "busy", [bucket(23)], stopped_s=s)
    watchdog.hangs.FAILING.set()
    for t in (1.0 + COMPARE_AFTER_S, 11.0, 21.0):
        clock.now = t
        dog.tick(t)
    assert store.data == {} and capsys.readouterr().err == "" and dog.lines == []
    watchdog.hangs.FAILING.clear()  # (a process that fails ends: this one goes on for the test)
    dog.tick(21.5)
    assert f"{watchdog.KEY}0" in store.data


def test_in_a_collective_is_read_from_the_main_threads_stack():
    from lit_ddp.analysis.flight_recorder import Frame

    torch_dist = "/x/site-packages/torch/distributed/distributed_c10d.py"
    user = Frame("/home/u/train.py", 9, "training_step", "dist.barrier()")
    assert in_collective([user, Frame(torch_dist, 1, "barrier", "work.wait()")])
    assert not in_collective([user])
    assert not in_collective([Frame(torch_dist, 1, "barrier"), user])  # the user's frame is innermost
    assert in_collective([user, Frame("/x/site-packages/torch/autograd/graph.py", 9, "_engine_run_backward")])


@pytest.mark.parametrize("how", ["event", "queue", "child"])
def test_a_wait_on_an_event_a_queue_or_a_child_process_is_not_a_collectives(how, tmp_path):
    """Their ``.wait()`` has Python below it (threading's, queue's, subprocess's frames): only a ``.wait()`` that is
    the innermost frame (a Work's: C below it) is a collective's. Read from a real thread's real stack."""
    import queue
    import subprocess

    from lit_ddp.analysis.flight_recorder import Frame

    event, box = threading.Event(), queue.Queue()
    child = subprocess.Popen(["sleep", "30"]) if how == "child" else None
    waits = {"event": lambda: event.wait(), "queue": lambda: box.get(), "child": lambda: child.wait()}[how]
    thread = threading.Thread(target=waits, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        stack = traceback.extract_stack(sys._current_frames()[thread.ident])
        frames = [Frame(f.filename, f.lineno or 0, f.name, f.line or "") for f in stack]
        assert any(".wait()" in f.line or ".get()" in f.line for f in frames)  # the user's line is a wait
        assert not in_collective(frames)
        assert in_collective([*frames[:-2], Frame(frames[-1].filename, 1, "wait", "work.wait()")])  # innermost
    finally:
        event.set()
        box.put(None)
        if child is not None:
            child.kill()
            child.wait()
        thread.join(5)


def test_a_watchdog_carried_over_by_a_fork_or_left_by_an_ended_fit_is_not_used(monkeypatch):
    """A rank forked from a process whose own watchdog ran (a test worker that was rank 0 of an earlier fit) got
    that object, its dead thread and its store, whose lock the parent's thread may hold: the rank's teardown waited
    on that lock for ever (tests/test_loggers.py under the full suite). Each process and each fit gets its own."""
    monkeypatch.setattr(watchdog, "_WATCHDOG", None)
    monkeypatch.setattr(Watchdog, "start", lambda self: None)  # no thread: only which object is used
    first = watchdog.start(0, 2)
    assert watchdog.start(1, 2) is first and watchdog.current() is first and first.rank == 1
    first.leave()  # its fit ended
    second = watchdog.start(0, 2)
    assert second is not first and first._stopped.is_set()
    second.pid = -1  # as a forked child sees it: another process's
    assert watchdog.current() is None
    third = watchdog.start(0, 2)
    assert third is not second and not second._stopped.is_set()  # the parent's: not this process's to stop
    assert watchdog.current() is third


def test_its_thread_ends_when_stopped(monkeypatch):
    dog = Watchdog(0, 2)
    monkeypatch.setattr(dog, "_prepare", lambda: None)  # no handler left in the test's process
    dog.start()
    assert dog._thread.is_alive()
    dog.stop()
    dog._thread.join(timeout=5 * watchdog.POLL_S)
    assert not dog._thread.is_alive()


def test_what_it_says_is_kept_with_the_step_and_the_host_clocks_time(monkeypatch, capsys):
    """For the fit's record (PhaseTimer takes them for the timeline's markers): the step and ``host_now``."""
    monkeypatch.setattr(watchdog, "host_now", lambda: 123.5)
    dog, clock = stepped([0.0, 1.0])
    dog._say("moved on after 14 s")
    assert list(dog.said) == [(1, 123.5, "moved on after 14 s")]
    assert capsys.readouterr().err == "lit_ddp: moved on after 14 s\n"


@pytest.mark.parametrize("fit_over", [False, True])
def test_a_rank_stopped_in_training_exits_when_the_stores_host_is_gone_but_not_after_its_fit(monkeypatch, fit_over):
    """The job ended elsewhere (rank 0, the store's host, gone): a rank stopped in training has nothing else to end
    it (the zoo's rank1_sleeps, worker_stuck); after its fit, its own work alone is the user's, never ended."""
    from torch.distributed import DistNetworkError

    monkeypatch.setattr(watchdog, "POLL_S", 0.001)
    dog, clock = stepped([0.0, 1.0])
    dog._since, dog.fit_over, orphaned = 1.0, fit_over, []

    def gone(now):
        raise DistNetworkError("Connection reset by peer")

    monkeypatch.setattr(dog, "tick", gone)
    monkeypatch.setattr(dog, "orphaned", orphaned.append)
    clock.now = 20.0
    dog._run()  # returns at the error, either way
    assert orphaned == ([] if fit_over else [19.0])


def test_the_launchers_file_holds_the_line_before_any_peer_can_see_it_and_exit(monkeypatch, tmp_path):
    """Under ddp_spawn/ddp_fork the parent reads the ended file as soon as a rank exits, and a peer exits as soon as
    it sees the ended key: written after the key, the parent raised a bare 'process 1 terminated with exit code 1'
    as the job's last line (CI of 3c668b3, test_hangs' setup_barrier)."""
    store, seen_at_key = Store(), []
    launcher = os.getpid() + 1  # a parent that is not this process
    monkeypatch.setenv("LIT_DDP_LAUNCHER_PID", str(launcher))
    monkeypatch.setattr(watchdog, "ended_file", lambda pid: str(tmp_path / f"ended-{pid}"))
    monkeypatch.setattr(watchdog, "_exit", lambda: watchdog.hangs.FAILING.clear())
    monkeypatch.setattr(watchdog.console, "silence", lambda: None)
    monkeypatch.setattr(watchdog.time, "sleep", lambda s: None)

    def set_key(key, value):
        if key == watchdog.ENDED_KEY:
            seen_at_key.append(os.path.exists(watchdog.ended_file(launcher)))
        store.data[key] = value

    monkeypatch.setattr(store, "set", set_key)
    dog, _ = stepped([0.0, 1.0])
    dog.store = store
    dog.end("collective #24 diverged: ...", peers=[1])
    assert seen_at_key == [True]
    assert (tmp_path / f"ended-{launcher}").read_text() == "collective #24 diverged: ..."


@pytest.mark.parametrize("hook", ["on_validation_batch_end", "on_test_batch_end", "on_predict_batch_end"])
def test_an_evaluation_batch_is_progress_for_the_watchdog(monkeypatch, hook):
    """A long validation, test or predict moves batch by batch: without it, a healthy test of 20 one-second batches
    was said to have been at its line for 10 s (the zoo's ok_long_test)."""
    from lit_ddp.callbacks.collective_recorder import CollectiveRecorder

    dog = Watchdog(0, 2, clock=lambda: 100.0)
    monkeypatch.setattr(watchdog, "_WATCHDOG", dog)
    dog.alive_at = 0.0
    getattr(CollectiveRecorder(), hook)(None, None, None, None, 0)
    assert dog.alive_at == 100.0
