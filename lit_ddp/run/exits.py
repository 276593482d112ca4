"""The ranks' meeting at exit, after their fit: each waits in the rendezvous store until every rank has come, and
the store's host (rank 0) names a rank that does not come, and ends the job with its line at the timeout.

    python -m benchmarks.hang_zoo --cases fit_end_rank1_sleeps     # rank 1 asleep in on_fit_end: named in ~10 s

A rank stuck after its fit (a sleep, a tool or a lock in ``on_fit_end`` or ``teardown``) calls no collective, so no
peer waits in one and no timeout fires: rank 0 used to wait 30 s, exit 0 and take the store with it, the stuck rank
running on with nobody to end it. Its watchdog still publishes where it is (``stopped.said_at_the_timeout``): rank 0
says it as the watchdog does in a fit (at ``HANG_AFTER_S``, then as the wait doubles, never "hung"), and at the
process group's timeout ends the job with one line, the ranks it launched and every process below it first, exit 1.
Of a rank that comes late, rank 0 says ``moved on``. The other ranks wait as before, silent: their leaving ends nothing.
"""

import json
import os
import sys
import time
from typing import Any

from lit_ddp.analysis.divergence import RankReport
from lit_ddp.analysis.stopped import FIX_LONGER, said_at_the_timeout, waiting_line
from lit_ddp.errors import EXIT_FAILED, prog
from lit_ddp.run import frozen, launched, watchdog

EXIT_KEY = "lit_ddp/exit"  # counts the ranks that came to their exit


def wait_for_the_others(store: Any, world_size: int, wait_s: float, host: bool) -> None:
    """Until every rank has come (``EXIT_KEY``), a peer's watchdog has ended the job, or ``wait_s`` has passed; the
    ``host`` names the ranks that have not come and, at ``wait_s``, ends the job (``_end``: does not return)."""
    start, next_line, said = time.monotonic(), watchdog.HANG_AFTER_S, False
    while store.add(EXIT_KEY, 0) < world_size and not store.check([watchdog.ENDED_KEY]):
        waited = time.monotonic() - start
        if waited >= wait_s:
            if host:
                _end(store, world_size, waited)
            return
        if host and waited >= next_line:
            next_line *= 2
            states = watchdog_states(store, world_size)
            _say(waiting_line(states, world_size, frozen.read_silent(store, states, world_size)))
            said = True
        time.sleep(0.05)
    if said and store.add(EXIT_KEY, 0) >= world_size:
        _say(f"moved on after {time.monotonic() - start:.0f} s")


def watchdog_states(store: Any, world_size: int) -> dict[int, dict[str, Any]]:
    keys = {r: f"{watchdog.KEY}{r}" for r in range(world_size)}
    return {r: json.loads(store.get(k)) for r, k in keys.items() if store.check([k])}


def _end(store: Any, world_size: int, waited: float) -> None:
    states = watchdog_states(store, world_size)
    kinds = {r: RankReport.from_json(state["report"]).kind for r, state in states.items()}
    late = [r for r in range(world_size) if kinds.get(r) != "left"]
    said = {r: said_at_the_timeout(states[r]) for r in late if kinds.get(r) == "busy"}
    doing = "; ".join(f"rank {r} {said[r][0]}" for r in late if r in said) or "they sent no state"
    fix = next(iter(said.values()))[1] if said else FIX_LONGER
    _say(f"rank(s) {late} did not come to their exit within {waited:.0f} s of rank 0 (the process group's timeout): "
         f"{doing} -> {fix}")  # fmt: skip
    launched.stop_all()  # rank 0 of Lightning's ddp launcher: the ranks it started (and what they started)
    launched.kill_below(os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FAILED)


def _say(text: str) -> None:
    print(f"{prog()}: {text}", file=sys.stderr, flush=True)
