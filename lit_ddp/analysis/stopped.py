"""What the stopped ranks' states say (``lit_ddp.run.watchdog`` publishes them): whether waiting cannot help (a
certain divergence, a collective a rank that left will never call), and the waiting line with its likely fix.

    python tests/hang_scripts.py sleep --timeout-s 600     # the line this makes: rank 1 named in ~12 s

Pure: a state is the JSON a rank put in the rendezvous store. docs/failures.md#the-watchdog-a-hang-named-as-it-happens.
"""

import os
import re
from typing import Any, Optional

from lit_ddp.analysis.divergence import Collective, RankReport, divergences
from lit_ddp.analysis.flight_recorder import LIBRARIES, Frame

WAITS_AT_BARRIER = "waits at Lightning's barrier after prepare_data (it opens when every rank has come)"
FIX_PREPARE_DATA = "prepare_data runs on each node's local rank 0 only: no collective in it (share the data in setup)"
FIX_SOME_RANKS = ("a collective called by some ranks only: rank_zero_only for work, never for collectives; "
                  "the same sync_dist keys on every rank")  # fmt: skip
# A key that only some ranks log with sync_dist=True (Lightning#19604: in on_train_epoch_end, on rank 0 only).
FIX_SYNC_KEY = ("a sync_dist key logged on some ranks only ({keys}): log it on every rank, or on one without "
                "sync_dist (rank_zero_only=True)")  # fmt: skip
# A rank that reduces an epoch's sync_dist value while another is still in the hook that logs it: more batches there
FIX_UNEVEN_HOOK = ("uneven data, more batches on {ranks} (still in {hook}): as many batches on every rank: "
                   "Lightning's DistributedSampler (use_distributed_sampler=True)")  # fmt: skip
# Ranks whose loop has more batches than another's (each rank's count, as its loop began): the others left it.
FIX_UNEVEN_COUNTS = "uneven data, more {loop} batches on {ranks} ({counts}; still in {hook}): {fix}"
FIX_EVEN_SHARES = ("as many batches on every rank: Lightning's DistributedSampler (use_distributed_sampler=True), or a "
                   "sampler of one's own that pads (or drops) to an equal share")  # fmt: skip
# Lightning's predict sampler does not pad (UnrepeatedDistributedSamplerWrapper): its ranks may differ by a batch.
FIX_PREDICT_SHARES = ("no collective in predict_step: Lightning's predict sampler does not pad, so ranks may have a "
                      "batch more or less; gather the predictions after trainer.predict")  # fmt: skip
# The same line on every rank, with tensors of different shapes (an all_gather of each rank's own number of outputs)
FIX_SHAPES = ("one collective with different shapes or dtypes on different ranks: the same shape everywhere (pad to "
              "the largest after gathering the sizes, or all_gather_object for objects of any size)")  # fmt: skip
# A rank that set trainer.should_stop alone (Lightning#379): Lightning's loop stops where it is set, rank by rank.
FIX_STOP = ("a stop decided on some ranks only: decide it on every rank together, trainer.should_stop = "
            "trainer.strategy.reduce_boolean_decision(stop, all=False)")  # fmt: skip
FIX_WORKER = ("a DataLoader worker it waits on: the job goes on when its line above returns; where it will not (a read "
              "without a timeout, a lock), DataLoader(timeout=...) raises instead of waiting")  # fmt: skip
FIX_DEAD = ("a rank that died: its own error is in its log; killed by a signal with none, look for the kernel's "
            "out-of-memory killer (dmesg)")  # fmt: skip
# A rank outside any collective whose main thread waits in futex() with no timeout (lit_ddp.run.frozen.waits_on_lock)
FIX_LOCK = ("a wait with no timeout on a lock, event, queue or thread of its own process: work that a thread ends "
            "goes on; where none will (a deadlock, a holder that died), py-spy dump --pid shows every thread's stack, "
            "the holder's among them, and a timeout on the wait raises instead")  # fmt: skip
# A rank outside any collective whose main thread waits in wait4() for a child process (frozen.waits_on)
FIX_CHILD = ("a child process it waits for (subprocess.run, Popen.wait): the job goes on when it exits; where it "
             "will not (a tool that waits for input, a stuck upload), a timeout on the wait raises instead "
             "(subprocess.run(..., timeout=...)), and one longer than the process group's timeout needs a larger "
             "timeout_s")  # fmt: skip
FIX_LONGER = "work longer than the process group's timeout: raise timeout_s; work that never ends: its line above"
FIX_PARTITION = ("a node cut off (a partition): check that every node reaches MASTER_ADDR:MASTER_PORT and the "
                 "others' addresses (a firewall, a route, a link down)")  # fmt: skip


def in_collective(frames: list[Frame]) -> bool:
    """The main thread waits in a collective: its innermost frames are torch.distributed's, or DDP's backward
    (its gradient all-reduce), or the innermost is a ``.wait()`` on a collective's work (a C call: no frame below
    it). A ``.wait()`` with Python below it is an event's, a queue's, a thread's or a process's, not a collective's."""
    for depth, frame in enumerate(reversed(frames)):
        path = frame.filename.replace(os.sep, "/")
        if "/torch/distributed/" in path or path.endswith("/torch/autograd/graph.py"):
            return True
        if depth == 0 and ".wait()" in (frame.line or ""):
            return True
        if not os.path.abspath(frame.filename).startswith(LIBRARIES):
            return False  # the user's own frame: whatever it calls below is not torch.distributed's
    return False


def _report(state: dict[str, Any]) -> RankReport:
    return RankReport.from_json(state["report"])


def certain(states: dict[int, dict[str, Any]]) -> Optional[str]:
    """The line that ends the job, where the states show that waiting cannot help: two ranks' N-th collectives
    differ (``lit_ddp.analysis.divergence``), or a rank waits in a collective and another has left; else None."""
    reports = {r: _report(s) for r, s in states.items()}
    found = divergences(reports, max(reports, default=0) + 1)
    if found and " diverged: " in found[0]:
        fix = _divergence_fix(states, reports, found[0])
        # Ranks whose fit stopped on should_stop while others still train: that stop put them out of step (their
        # next collective is whatever the script does after fit)
        stopped = [r for r, state in states.items() if state.get("stopped")]
        why = "".join(f"; rank {r} {states[r]['stopped']}" for r in stopped) if len(stopped) < len(states) else ""
        return f"{found[0]}{_out_of_step(reports, found[0])}{why} -> {FIX_STOP if why else fix}"
    left = sorted(r for r, rep in reports.items() if rep.kind == "left")
    held = sorted(r for r, rep in reports.items() if rep.kind == "barrier")
    waiting = sorted(r for r, rep in reports.items() if rep.kind == "collective")
    # A rank that left, or waits at Lightning's barrier around prepare_data (which opens only when every rank has
    # come), calls nothing past its last collective: one waiting in a later one waits for nothing.
    last_call = {r: max((c.seq for c in reports[r].collectives), default=0) for r in left + held}
    waiting = [
        r
        for r in waiting
        if reports[r].collectives and reports[r].collectives[-1].seq > min(last_call.values(), default=0)
    ]
    if left and waiting:
        # A rank that left on its own trainer.should_stop is named with where it stopped; the others, as gone.
        stopped = [f"rank {r} left: it {states[r]['stopped']}" for r in left if states[r].get("stopped")]
        gone = [r for r in left if not states[r].get("stopped")]
        left_as = "; ".join([*stopped, *([f"{_ranks(gone)} left (past the end of the script)"] if gone else [])])
        calls = {r: reports[r].collectives[-1] if r in waiting else None for r in states}  # the left call none
        fix = FIX_STOP if stopped else _uneven(states, calls) or FIX_SOME_RANKS
        return f"{'; '.join(_doing(states[r]) for r in waiting)}; {left_as} and will never call it -> {fix}"
    if held and waiting:
        return (f"{'; '.join(_doing(states[r]) for r in waiting)}; {_ranks(held)} {WAITS_AT_BARRIER} and will never "
                f"call it -> {FIX_PREPARE_DATA}; {FIX_SOME_RANKS}")  # fmt: skip
    return None


def _seq(line: str) -> int:
    """The sequence number a divergence's line names: ``collective #13 diverged: ...``."""
    return int(line.split("#", 1)[1].split(" ", 1)[0])


def _divergence_fix(states: dict[int, dict[str, Any]], reports: dict[int, RankReport], line: str) -> str:
    """The fix for the diverged collective of ``line``, by what each rank called there: every rank the same line
    with different tensors (an all_gather of each rank's own number of outputs, a value of another dtype); a rank
    reducing an epoch's sync_dist value while another is still in the hook that logs it (more batches there); a key
    that only some ranks log; else a collective that only some ranks call."""
    calls = {r: next((c for c in rep.collectives if c.seq == _seq(line)), None) for r, rep in reports.items()}
    known = [c for c in calls.values() if c is not None]
    if len(known) == len(calls) > 1 and known[0].where and len({(c.op, c.where) for c in known}) == 1:
        return FIX_SHAPES
    uneven = _uneven(states, calls)
    if uneven:
        return uneven
    hooks = {s["logged_in"] for s in states.values() if s.get("logged") and s.get("logged_in")}
    in_hook = sorted(r for r, c in calls.items() if c is not None and not states[r].get("logged")
                     and any(f" {hook}: " in f" {c.where}" for hook in hooks))  # fmt: skip
    if in_hook:
        return FIX_UNEVEN_HOOK.format(ranks=_ranks(in_hook), hook=" or ".join(sorted(hooks)))
    keys = sorted({repr(s["logged"]) for s in states.values() if s.get("logged")})
    return FIX_SYNC_KEY.format(keys=", ".join(keys)) if keys else FIX_SOME_RANKS


# A fit's loops, each with the hook a batch of it runs in: a DDP gradient bucket is the training batch's
STEP_HOOKS = {"training": "training_step", "validation": "validation_step", "test": "test_step",
              "predict": "predict_step"}  # fmt: skip
_HOOK = re.compile(r"(?:^|\s)\S+:\d+ (\w+): ")  # ``s.py:17 validation_step: everyone = ...``


def _hook(call: Optional[Collective]) -> str:
    if call is None:
        return ""
    if call.bucket is not None:
        return STEP_HOOKS["training"]
    found = _HOOK.search(call.where)
    return found.group(1) if found else ""


def _uneven(states: dict[int, dict[str, Any]], calls: dict[int, Optional[Collective]]) -> Optional[str]:
    """FIX_UNEVEN_COUNTS where a loop has more batches on some ranks (the states' ``batches``, each rank's count as
    the loop began, and ``done``, those it finished) and the divergence is its end: the others finished all of theirs
    and no longer call from its hook (or reduce a value it logged, after it), while the ranks with the most, past
    every other's count, still do. None where a count is unknown (an iterable dataset) or equal."""
    for loop, hook in STEP_HOOKS.items():
        counts = {r: s.get("batches", {}).get(loop) for r, s in states.items()}
        done = {r: s.get("done", {}).get(loop) for r, s in states.items()}
        if None in counts.values() or None in done.values() or len(set(counts.values())) < 2:
            continue
        most = max(counts.values())
        more = sorted(r for r, n in counts.items() if n == most)
        fewer = [r for r in counts if r not in more]
        ended = all(done[r] >= counts[r] and (_hook(calls[r]) != hook or states[r].get("logged")) for r in fewer)
        past = all(done[r] >= max(counts[f] for f in fewer) for r in more)
        if ended and past and all(_hook(calls[r]) == hook and not states[r].get("logged") for r in more):
            told = ", ".join(f"{n} on rank {r}" for r, n in sorted(counts.items()))
            fix = FIX_PREDICT_SHARES if loop == "predict" else FIX_EVEN_SHARES
            return FIX_UNEVEN_COUNTS.format(loop=loop, ranks=_ranks(more), counts=told, hook=hook, fix=fix)
    return None


def _out_of_step(reports: dict[int, RankReport], line: str) -> str:
    """Where the ranks went out of step before the divergence ``line`` names: the last earlier collective that
    every rank called alike but from different lines (a user's barrier on rank 0 meets Lightning's on rank 1, and
    the next one differs), as ``; out of step since #4, barrier: rank 0 called it at ..., rank 1 at ...``."""
    seq = _seq(line)
    calls = [{c.seq: c for c in rep.collectives} for rep in reports.values()]
    for earlier in range(seq - 1, 0, -1):
        same = [by_seq.get(earlier) for by_seq in calls]
        if any(c is None for c in same):
            return ""
        if len({c.where for c in same}) > 1 and all(c.same_call(same[0]) for c in same):
            places = ", ".join(f"rank {r} at {c.where or 'a line of Lightning or torch'}"
                               for r, c in zip(reports, same, strict=True))  # fmt: skip
            return f"; out of step since #{earlier}, {same[0].call()}: {places}"
    return ""


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _doing(state: dict[str, Any]) -> str:
    """What one rank is doing: ``rank 1 waits in all_reduce #24 Float[9] (DDP gradient bucket 0) at step 3,
    backward`` or ``rank 0 has been at script.py:35 training_step: time.sleep(60) for 12 s, outside any
    collective``."""
    rep = _report(state)
    at = f" (step {rep.step}, {rep.phase})" if rep.step is not None else ""
    if rep.kind == "left":
        return f"rank {rep.rank} has left (past the end of its script)"
    if rep.kind == "barrier":
        return f"rank {rep.rank} {WAITS_AT_BARRIER}"
    if rep.kind == "collective" and rep.collectives:
        last = rep.collectives[-1]
        where = last.where or (rep.where if last.bucket is None else "")
        step = f" at step {last.step}, {last.phase}" if last.step is not None else f" {last.phase}".rstrip()
        call = f"{last.op} #{last.seq} {last.call().removeprefix(last.op).strip()}".rstrip()
        return f"rank {rep.rank} waits in {call}{step}" + (f" ({where})" if where else "")
    if state.get("worker"):
        return f"rank {rep.rank} waits for its {state['worker']}, {state['stopped_s']:.0f} s{at}"
    where = f"at {rep.where}" if rep.where else "in " + (state["stack"][-1] if state["stack"] else "no frame")
    on = state.get("waits_on", "")  # what its main thread waits on in the kernel: "lock", "child process 12 (...)"
    if on == "lock":
        on = ", in a wait with no timeout on a lock of its own process"
    elif on:
        on = f", waiting for its {on}"
    return f"rank {rep.rank} has been {where} for {state['stopped_s']:.0f} s{at}, outside any collective{on}"


def waiting_line(states: dict[int, dict[str, Any]], world_size: int,
                 seen: Optional[dict[int, tuple[str, str]]] = None) -> str:  # fmt: skip
    """``waiting 12 s: rank 0 has been at ...; rank 1 waits in all_reduce #24 ...; rank 2 sent no state``.
    ``seen``: what a peer on its host read of a rank that sent none (``lit_ddp.run.frozen``), as (doing, fix)."""
    stopped = max((s["stopped_s"] for s in states.values()), default=0.0)
    seen = seen or {}
    # The ranks outside any collective first: the others wait for them.
    order = sorted(states, key=lambda r: (_report(states[r]).kind in ("collective", "barrier", "left"), r))
    parts = [f"rank {r} {doing}" for r, (doing, _) in sorted(seen.items())] + [_doing(states[r]) for r in order]
    silent = [r for r in range(world_size) if r not in states and r not in seen]
    if silent:
        parts.append(f"{_ranks(silent)} sent no state (still moving, dead, or stuck holding the GIL)")
    fix = f" -> {next(iter(seen.values()))[1]}" if seen and not silent else _fix(states, silent)
    return f"waiting {stopped:.0f} s: " + "; ".join(parts) + fix


def _fix(states: dict[int, dict[str, Any]], silent: list[int]) -> str:
    """The likely cause's fix, in one line, from what the ranks do."""
    kinds = {_report(s).kind for s in states.values()}
    if any(s.get("worker") for s in states.values()):
        return f" -> {FIX_WORKER} (the job ends at the process group's timeout, the workers with it)"
    waits = [_WAIT_FIXES[w] for s in states.values() if (w := _waits_on(s)) in _WAIT_FIXES]
    if "busy" in kinds and kinds & {"collective", "barrier", "left"} and waits:
        return f" -> {waits[0]}"
    if "busy" in kinds and kinds & {"collective", "barrier", "left"}:  # left: at its exit, the others wait there
        return (" -> the others wait for it: work (a checkpoint, an evaluation) ends and the job goes on; "
                "work longer than the process group's timeout: raise timeout_s (work that never ends stops "
                "there)")  # fmt: skip
    if silent and kinds == {"collective"}:
        return (f" -> {_ranks(silent)} sent nothing: dead, stuck in C code holding the GIL (py-spy dump --pid "
                f"shows where), or cut off from rank 0's node; dead: {FIX_DEAD}; cut off: {FIX_PARTITION}")  # fmt: skip
    return ""


def said_at_the_timeout(state: dict[str, Any]) -> tuple[str, str]:
    """(doing, fix) of a rank outside any collective, from its watchdog's last state, for the line the timeout ends
    the job with (``divergence.never_arrived``'s ``seen``): where it is and what it waits on, not "sent no report"."""
    doing = _doing(state).removeprefix(f"rank {state['rank']} ")
    return doing, FIX_WORKER if state.get("worker") else _WAIT_FIXES.get(_waits_on(state), FIX_LONGER)


_WAIT_FIXES = {"lock": FIX_LOCK, "child": FIX_CHILD}  # by what a rank outside any collective waits on in the kernel


def _waits_on(state: dict[str, Any]) -> str:
    """``lock``, ``child`` or ``""``: the first word of the state's ``waits_on`` (``lit_ddp.run.frozen.waits_on``)."""
    return state.get("waits_on", "").partition(" ")[0]
