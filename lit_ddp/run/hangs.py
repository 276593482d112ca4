"""Why it hung, when a collective times out or fails: the live ranks compare their records and name the cause.

    python tests/hang_scripts.py logkeys     # rank 1 logs a key rank 0 does not: one line names rank 1's call

A collective that times out says only that this rank waited. So every rank that fails (a timeout, a collective
error, or an exception of its own) writes its report (``lit_ddp.analysis.divergence.RankReport``: its last
collectives from its record, what it was doing, the user's line) into the job's rendezvous store, which is not the
process group that just failed; a rank whose collective failed waits a few seconds for the others' and then compares
them (``divergences``): one line per divergence, printed once and made its error's whole message, the job's last
line (the rank's own error is chained above it). A rank that raised on its own only leaves its report (its own error
is the cause) and goes. Nothing of this runs before a failure. A rank cut off from the store (it lives on rank 0's
node) cannot ask it: the store's client has no timeout of its own there, so its calls are bounded here, and that
rank names rank 0's node as lost.
"""

import atexit
import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional, Protocol, runtime_checkable

import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from lit_ddp import _torch
from lit_ddp.analysis.divergence import RankReport, divergences, first_cause, never_arrived, ranks_named
from lit_ddp.analysis.flight_recorder import dumps_divergence
from lit_ddp.analysis.stopped import FIX_PARTITION, said_at_the_timeout
from lit_ddp.errors import EXIT_FAILED
from lit_ddp.measure.collectives import CollectiveRecord, frame_of
from lit_ddp.measure.gradients import name_unused
from lit_ddp.run import console, frozen, launched
from lit_ddp.run.roles import NamesPendingCollective

WAIT_S = 5.0  # for the other ranks that failed to fail too and leave their reports
ANSWER_S = 2.0  # for the store's first answer: without one, this rank is cut off from it
KEY = "lit_ddp/failure/"  # + rank: that rank's report, as JSON
# Words of an error that a rank sees because another failed: a peer's socket closed (its process died).
COLLECTIVE_FAILURES = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl")
FAILING = threading.Event()  # this process is reporting a failure (not hung, whatever its last step boundary)


@runtime_checkable
class KeepsCollectiveRecord(Protocol):
    """A callback with this rank's record of its collectives (CollectiveRecorder)."""

    collective_record: CollectiveRecord


def is_timeout(exception: BaseException) -> bool:
    text = str(exception).lower()
    return "timed out" in text or "timeout" in text


def failure_kind(exception: BaseException) -> str:
    """``timeout``, ``collective error`` (a peer's socket closed: its process died), or ``exception``."""
    if is_timeout(exception):
        return "timeout"
    text = str(exception).lower()
    if isinstance(exception, dist.DistError) or any(word in text for word in COLLECTIVE_FAILURES):
        return "collective error"
    return "exception"


def first_line(exception: BaseException) -> str:
    text = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {text[0] if text else ''}"[:300]


def rank_report(trainer: Trainer, kind: str, error: str, where: str) -> RankReport:
    record = next((c.collective_record for c in trainer.callbacks if isinstance(c, KeepsCollectiveRecord)), None)
    if record is None:
        return RankReport(trainer.global_rank, time.time(), kind, error, where, trainer.global_step)
    return record.report(trainer.global_rank, kind, error, where)


def exchange(store: dist.Store, report: RankReport, world_size: int, wait_s: float = WAIT_S,
             answered: Optional[threading.Event] = None) -> dict[int, RankReport]:  # fmt: skip
    """Writes ``report`` and returns every rank's that is there within ``wait_s`` (not waiting for the others
    when ``wait_s`` is 0); sets ``answered`` once the store has answered."""
    store.set(f"{KEY}{report.rank}", json.dumps(report.as_json()))
    deadline = time.monotonic() + wait_s
    while True:
        present = [r for r in range(world_size) if store.check([f"{KEY}{r}"])]
        if answered is not None:
            answered.set()
        if len(present) == world_size or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return {r: RankReport.from_json(json.loads(store.get(f"{KEY}{r}"))) for r in present}


def exchange_unless_cut_off(store: dist.Store, report: RankReport, world_size: int,
                            wait_s: float = WAIT_S) -> Optional[dict[int, RankReport]]:  # fmt: skip
    """``exchange``, or None when the store gives no answer within ``ANSWER_S`` (or none in the end).

    ``TCPStore.check`` and ``set`` wait for the store's reply without a timeout (``set_timeout`` bounds ``get`` and
    ``wait`` only), and a store behind a cut link never replies: TCP retransmits for some 15 minutes. So the calls
    run in a daemon thread, which is left behind, blocked, when they do not return; the process can still exit."""
    answered = threading.Event()
    result: list = []

    def run() -> None:
        try:
            result.append(exchange(store, report, world_size, wait_s, answered))
        except Exception as err:  # handed to the caller
            result.append(err)
        finally:
            answered.set()

    thread = threading.Thread(target=run, name="lit_ddp-store", daemon=True)
    thread.start()
    if not answered.wait(ANSWER_S):
        return None
    thread.join(wait_s + ANSWER_S)
    if not result:
        return None
    if isinstance(result[0], Exception):
        raise result[0]
    return result[0]


def leave_error_file() -> None:
    """Under torchrun, in a rank that raised on its own (inside its ``except``): its traceback and time in the
    error file torchrun names (``TORCHELASTIC_ERROR_FILE``), as ``@record`` would. torchrun's summary then shows
    it as the root cause, the earliest error file's, instead of "To enable traceback see ..."; a peer's timeout or
    closed connection leaves none (a consequence)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        ErrorHandler().record_exception(sys.exc_info()[1] or RuntimeError("unknown"))


LINE_CHARS = 200  # about the most a diagnosis line holds: the job's last line, read whole (issue 52)


def _conclude(exception: BaseException, line: str) -> None:
    """``line`` becomes the error's whole message, so that the job's last line is the diagnosis alone; the rank's
    own message (a page of gloo's text, "Got the following error when running the callback: ...") is chained before
    it, as the cause Python prints above the traceback."""
    own = RuntimeError(f"{type(exception).__name__}: {exception}")
    own.__cause__, own.__context__ = exception.__cause__, exception.__context__
    exception.__cause__ = own
    exception.args = (line,)


def _raised_first(cause: RankReport, waiting: RankReport) -> str:
    """``rank 1 raised first: ERROR (WHERE); rank 0 waited for it in collective #25 (all_reduce at step 3,
    backward)``, the user's code left out of WHERE when the line would pass ``LINE_CHARS`` (its file, line and
    function stay)."""
    waited = f"; rank {waiting.rank} waited for it"
    if waiting.collectives:
        last = waiting.collectives[-1]
        at = f"at step {last.step}, {last.phase}" if last.step is not None else last.phase  # "before training"
        waited += f" in collective #{last.seq} ({last.op} {at})"
    line = f"rank {cause.rank} raised first: {cause.error}{f' ({cause.where})' if cause.where else ''}{waited}"
    if len(line) > LINE_CHARS and ": " in cause.where:
        line = f"rank {cause.rank} raised first: {cause.error} ({cause.where.split(': ')[0]}){waited}"
    return line


def diagnose(trainer: Trainer, exception: BaseException, ranks_per_node: Optional[int] = None) -> None:
    """On every rank that fails, once per exception, never raising itself and never waiting more than
    ``WAIT_S + 2 * ANSWER_S``: leaves this rank's report; after a timeout or a collective error, compares the
    reports there, prints the divergence (the lowest such rank does) and makes it the error's whole message.
    ``ranks_per_node`` (several nodes only) adds each rank's node: ``rank // ranks_per_node``."""
    world_size, rank = trainer.world_size, trainer.global_rank
    if getattr(exception, "lit_ddp_named", False):
        return
    # A parameter this rank left out of a step after the first (DDP's error at the next forward): named, by rank
    name_unused(exception, trainer.lightning_module, trainer.global_step, console.advice(trainer), rank)
    kind = failure_kind(exception)
    # A peer's failure seen from here, not a cause of its own (the launcher ends the job with the first cause).
    exception.lit_ddp_consequence = kind != "exception"
    if world_size < 2:
        return
    if kind == "exception":
        leave_error_file()
    store = _torch.default_store()
    if store is None:
        return
    exception.lit_ddp_named = True
    FAILING.set()
    if ranks_per_node is None and trainer.num_nodes > 1:  # several nodes: name each rank's node
        ranks_per_node = trainer.num_devices
    report = rank_report(trainer, kind, first_line(exception), frame_of(exception.__traceback__))
    try:
        store.set_timeout(timedelta(seconds=WAIT_S))  # rank 0 hosts the store: it may be the one that hangs
        reports = exchange_unless_cut_off(store, report, world_size, 0.0 if kind == "exception" else WAIT_S)
    except Exception:  # the store is gone too: nothing to add
        return
    if kind == "exception":
        return  # this rank's own error is the cause; its report tells the others
    if reports is None:
        # The store never answered: its host, rank 0's node, is out of this rank's reach (a partition, or it is
        # down). Every rank there is lost to this one; of the others nothing can be learned without the store.
        host_ranks = list(range(ranks_per_node or 1))
        if rank not in host_ranks:
            _conclude(exception, f"{ranks_named(host_ranks, ranks_per_node)} lost at the collective of step "
                                f"{report.step}: the rendezvous store they host did not answer for {ANSWER_S:g} s "
                                "either (a network partition, or their node is down); "
                                f"{ranks_named([rank], ranks_per_node)} waited there until the timeout -> "
                                f"{FIX_PARTITION}")  # fmt: skip
        return
    lines = divergences(reports, world_size)
    if not lines:
        where = next((w for c in trainer.callbacks if isinstance(c, NamesPendingCollective) and (w := c.waiting_for())),
                     f"the collective of step {report.step}")  # fmt: skip
        seen = frozen.read(store, [r for r in range(world_size) if r not in reports])  # on this host, from /proc
        seen.update(_outside(store, [r for r in range(world_size) if r not in reports and r not in seen]))
        line = never_arrived(reports, world_size, where, ranks_per_node, seen)
        lines = [line] if line else []
    cause = first_cause(reports)
    if cause is not None and cause.kind == "exception" and cause.rank != rank:
        # A peer raised on its own: its error is the job's cause, first on the line this rank's traceback ends
        # with (under the `ddp` launcher and torchrun, this rank's error is the job's last line).
        lines = [_raised_first(cause, reports.get(rank, report))]
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # torchrun's root cause: the earliest failure, to the second
            time.sleep(max(0.0, math.floor(cause.failed_at) + 1.05 - time.time()))  # (a tie goes to rank 0)
    if not lines:
        return
    _conclude(exception, lines[0])  # the job's last line (the launcher's, or the rank's traceback) is it


def _outside(store: dist.Store, ranks: list[int]) -> dict[int, tuple[str, str]]:
    """The ``ranks`` (which sent no failure report) whose watchdog's last state says they are outside any collective:
    what they do there and its fix (``stopped.said_at_the_timeout``)."""
    said = {}
    for rank in ranks:
        key = f"{frozen.STATE_KEY}{rank}"
        with contextlib.suppress(Exception):  # the store's host is gone: nothing more to learn
            state = json.loads(store.get(key)) if store.check([key]) else None
            if state is not None and RankReport.from_json(state["report"]).kind == "busy":
                said[rank] = said_at_the_timeout(state)
    return said


def leave_at_once_on_an_error() -> None:
    """Registers ``_leave_at_once`` (once per process; from the watchdog's start, so that the exit handlers of what
    the run set up later, a logger's among them, run before it)."""
    atexit.unregister(_leave_at_once)
    atexit.register(_leave_at_once)


def _leave_at_once() -> None:
    """An ``atexit`` handler: where the process ends on an uncaught error (its traceback printed), the rank leaves
    without freeing its process group. gloo's destructor joins worker threads that wait in a collective the peers
    will never call (a rank that skipped a parameter's gradient had started its end-of-step collective) until the
    timeout, and the launcher, seeing the rank alive, waits as long."""
    if getattr(sys, "last_exc", None) is None and getattr(sys, "last_value", None) is None:
        return  # the error was caught: the process goes on, and ends as any other
    if dist.is_available() and dist.is_initialized():
        launched.kill_below(os.getpid())  # a process it started (subprocess's: no at-fork hook) would outlive it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_FAILED)


# NCCL's Flight Recorder dumps on a watchdog timeout where these are set: each setting under every name torch 2.11
# to 2.14 reads for it (the TORCH_FR_* names are 2.13's, the TORCH_NCCL_* ones their older aliases, still read).
# C++ stacks (TORCH_FR_CPP_STACK / TORCH_NCCL_TRACE_CPP_STACK) stay off: a cost at every collective, and the
# diagnosis names the Python frames, which torch records without them.
NCCL_DUMP_SETTINGS = {
    ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000",  # entries kept (torch 2.13's default)
    ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
    ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): "nccl_trace_rank_",  # in the folder; + rank
}
FLIGHT_RECORDER_DIR = "flight_recorder"  # under the Trainer's default_root_dir


def prepare_nccl_dumps(backend: str, root_dir: str, environ=os.environ) -> Optional[Path]:
    """Before the process group is made (in the launcher, so that the ranks it starts inherit it): where the
    backend is NCCL, the settings above that the user left unset, the dumps' prefix in ``root_dir``/flight_recorder.
    Returns the folder the dumps go to (made here), or None: not NCCL, or no dump on a timeout (the user's
    ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` or ``TORCH_FR_BUFFER_SIZE=0``)."""
    if "nccl" not in backend:
        return None
    directory = Path(root_dir, FLIGHT_RECORDER_DIR).resolve()
    for names, value in NCCL_DUMP_SETTINGS.items():
        if not any(name in environ for name in names):
            value = str(directory / value) if names[0] == "TORCH_FR_DUMP_TEMP_FILE" else value
            environ.update(dict.fromkeys(names, value))
    buffer = environ.get("TORCH_FR_BUFFER_SIZE", environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
    if environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT") in ("0", "false", "False") or buffer.strip() in ("", "0"):
        return None
    directory = Path(environ.get("TORCH_FR_DUMP_TEMP_FILE") or environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def dumps_diagnosis(directory: Optional[Path], since: float) -> Optional[str]:
    """After the ranks died (NCCL's watchdog aborts a rank whose collective timed out, before any Python handler
    runs): the divergence that the Flight Recorder dumps written into ``directory`` since ``since`` show, with the
    folder named; None without such dumps."""
    if directory is None or not directory.is_dir():
        return None
    line = dumps_divergence(directory, since)
    return f"{line} (NCCL's Flight Recorder dumps in {directory})" if line else None


def hung_at(frame) -> Optional[str]:
    """From a hung rank's SIGTERM handler: the user's line of its stack (``""`` when it holds none); None when this
    rank is not hung but reporting a failure of its own (``diagnose``), which the launcher's SIGTERM cut short.
    (Its peers have given up on it by then: nobody reads the store any more.)"""
    return None if FAILING.is_set() else frame_of(frame=frame)
