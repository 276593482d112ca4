"""Uneven data ends together: every rank ends an epoch at the same batch, the last one that every rank has.

    python examples/uneven_shards.py       # rank 0 has 8 batches an epoch, rank 1 5: both epochs end at batch 5

A rank whose data runs out leaves the epoch while the others wait for it in the next gradient all-reduce, until
the timeout (lightning#3325, #20404). ``torch.distributed.algorithms.Join`` shadows the missing rank's
collectives with an all-reduce of its own every step; here the decision rides in ``StepSync``'s existing
per-step gather instead. At an epoch's first batch every rank says how many batches it has after it, in one
small gather (sized loaders: their length, so an uneven one is named before the first step). An unsized loader
(an ``IterableDataset``) cannot say; its rank counts ``2 * accumulate_grad_batches + 1`` batches ahead in
Lightning's fetcher, and puts that count into the step's row. The row is read at the end of the next step,
which is still before any rank's end: the first count that is short fixes the epoch's last batch on every rank.
``uneven="error"`` raises there instead, on every rank at the same step. docs/failures.md#uneven-data.
"""

from collections.abc import Callable
from typing import Literal, NamedTuple, Optional

import torch
from lightning.pytorch import Trainer
from torch import Tensor

from lit_ddp import _lightning
from lit_ddp.errors import UnevenDataError

Uneven = Literal["stop", "error"]
SLOT = "even_epochs"  # StepSync's slot: [epoch, batches done, batches after them, counted exactly (0/1)]
# The fixes a line ends with: a hang avoided (uneven="stop") still trains fewer batches than the data has.
FIX_UNEVEN = ("as many batches on every rank: Lightning's DistributedSampler (use_distributed_sampler=True), or "
              "shards split evenly")  # fmt: skip
FIX_EMPTY = ("a share of the data on every rank: at least as many shards as ranks, or Lightning's DistributedSampler "
             "(use_distributed_sampler=True)")  # fmt: skip


class Ahead(NamedTuple):
    """What one rank has after its current batch."""

    batches: int  # the batches after the current one; for a count that is not exact, at least this many
    exact: bool  # a sized loader's count, or an unsized one that ended within the look-ahead


def end_of_epoch(ahead: list[Ahead], look_ahead: int) -> Optional[int]:
    """The batches after the current one at which every rank ends the epoch, once the ranks' counts fix it: the
    smallest count, when it is exact. None while every rank may have more."""
    least = min(a.batches for a in ahead)
    known = any(a.batches == least and (a.exact or a.batches < look_ahead) for a in ahead)
    return least if known else None


def uneven_line(ahead: list[Ahead], done: int, end: int, epoch: int) -> Optional[str]:
    """``rank 1 runs out of data after 5 batches of epoch 0 (rank 0 has 8)``, or None when every rank ends there
    anyway. ``done``: the batches every rank has taken; ``end``: the batches after them at which the epoch ends."""
    short = [r for r, a in enumerate(ahead) if a.batches == end]
    longer = [r for r, a in enumerate(ahead) if a.batches > end]
    if not longer:
        return None
    others = ", ".join(
        f"rank {r} has {done + ahead[r].batches}" if ahead[r].exact else f"rank {r} has more" for r in longer
    )
    ranks = f"rank {short[0]}" if len(short) == 1 else f"ranks {', '.join(map(str, short))}"
    verb = "runs" if len(short) == 1 else "run"
    return f"{ranks} {verb} out of data after {done + end} batches of epoch {epoch} ({others})"


class EvenEpochs:
    """One fit's uneven-data state, kept by StepSync (its ``uneven`` option).

    Args:
        uneven: ``stop`` ends every rank's epoch at the last batch every rank has, and says so; ``error`` raises
            ``UnevenDataError`` on every rank instead, before any rank has run out.
        accumulate: The Trainer's ``accumulate_grad_batches``.
        say: Prints a line once (rank 0).
    """

    def __init__(self, uneven: Uneven, accumulate: int, say: Callable[[str], None]) -> None:
        self.uneven = uneven
        self.look_ahead = 2 * accumulate + 1  # the row read a step late still comes before the end it fixes
        self._say = say
        self._epoch = -1  # the epoch whose first batch was seen
        self._rows = False  # this epoch's end is not known yet: every step's row carries the count
        self._restore: Optional[tuple] = None  # a sized loader's (max_batches, val_check_batch) before a cut
        self._trainer: Optional[Trainer] = None

    def _ahead(self, trainer: Trainer) -> Ahead:
        counted = batches_ahead(trainer, self.look_ahead)
        if counted is None:  # sized
            return Ahead(int(trainer.num_training_batches) - trainer.fit_loop.epoch_loop.batch_idx - 1, True)
        return Ahead(counted, counted < self.look_ahead)

    def batch_start(self, trainer: Trainer) -> None:
        """From StepSync's ``on_train_batch_start``: at an epoch's first batch (or the first after a resume), one
        gather of every rank's count, the only collective of its own, once an epoch."""
        if trainer.current_epoch == self._epoch:
            return
        self._epoch, self._trainer = trainer.current_epoch, trainer
        if self._restore is not None:  # the last epoch's cut, undone: this epoch's lengths may differ
            trainer.fit_loop.max_batches, trainer.val_check_batch = self._restore
            self._restore = None
        self._rows = not self._count(trainer, self._ahead(trainer), trainer.fit_loop.epoch_loop.batch_idx + 1)

    def epoch_end(self, trainer: Trainer) -> None:
        """From StepSync's ``on_train_epoch_end``: a rank that had no batch at all this epoch (an empty shard,
        webdataset#188) never reached the first batch's count, where the others wait for it; it gives its count
        here, none (one before the current batch that it never had), and every rank raises at that count."""
        if trainer.current_epoch == self._epoch:
            return
        self._epoch, self._trainer, self._rows = trainer.current_epoch, trainer, False
        self._count(trainer, Ahead(-1, True), trainer.fit_loop.epoch_loop.batch_idx + 2)

    def _count(self, trainer: Trainer, mine: Ahead, done: int) -> bool:
        """The epoch's one gather of every rank's count, and the decision on it (``_decide``)."""
        row = torch.tensor([float(mine.batches), float(mine.exact)], dtype=torch.float64)
        gathered = trainer.strategy.all_gather(row.to(trainer.strategy.root_device)).cpu()
        return self._decide(trainer, [Ahead(int(b), bool(e)) for b, e in gathered.tolist()], done)

    def step_end(
        self, trainer: Trainer, put: Callable[[str, list[float], Callable[[int, Tensor], None]], None]
    ) -> None:
        """From StepSync's ``on_train_batch_end`` at a step's end, before its row is sent."""
        if self._rows:
            mine = self._ahead(trainer)
            done = trainer.fit_loop.epoch_loop.batch_idx + 1
            put(SLOT, [float(trainer.current_epoch), float(done), float(mine.batches), float(mine.exact)], self._read)

    def _read(self, step: int, gathered: Tensor) -> None:
        epoch, done = int(gathered[0, 0]), int(gathered[0, 1])
        trainer = self._trainer
        if not self._rows or epoch != trainer.current_epoch:
            return  # read after its epoch ended (at the next epoch's first step, or at the end of training)
        ahead = [Ahead(int(b), bool(e)) for b, e in gathered[:, 2:].tolist()]
        self._rows = not self._decide(trainer, ahead, done)

    def _decide(self, trainer: Trainer, ahead: list[Ahead], done: int) -> bool:
        """Acts on the counts every rank has (the same on every rank), taken after ``done`` batches of the epoch;
        True once the epoch's end is fixed."""
        end = end_of_epoch(ahead, self.look_ahead)
        if end is None:
            return False
        line = uneven_line(ahead, done, end, trainer.current_epoch)
        if line is None:
            return True
        if end < 0:  # a rank with no batch: an epoch no rank can train, whatever ``uneven`` says
            raise UnevenDataError(f"{line}: no batch at all -> {FIX_EMPTY}")
        if self.uneven == "error":
            raise UnevenDataError(f"{line}; seen before step {trainer.global_step} (uneven='error'; 'stop' ends "
                                  f"every rank's epoch there) -> {FIX_UNEVEN}")  # fmt: skip
        left = done + end - trainer.fit_loop.epoch_loop.batch_idx - 1  # the batches this rank still takes
        if left < 0:  # cannot be: the count came a step ahead of the end
            raise RuntimeError(f"lit_ddp: uneven data seen {-left} batch(es) too late ({line})")
        if self._restore is None:
            self._restore = (trainer.fit_loop.max_batches, trainer.val_check_batch)
        end_epoch_after(trainer, left)
        self._say(f"{line}; every rank ends the epoch there (to train on every batch: {FIX_UNEVEN})")
        return True


def batches_ahead(trainer: Trainer, at_least: int) -> Optional[int]:
    """For an unsized training loader (an ``IterableDataset``): how many batches this rank has after the current
    one, counted up to ``at_least`` (so ``at_least`` means that many or more); None for a sized loader (its length
    says it). Lightning's fetcher knows one batch ahead (``prefetch_batches=1``): it is topped up here to
    ``at_least`` and fetches as many ahead from the next epoch on."""
    fetcher = _lightning.prefetcher(trainer)
    if fetcher is None or fetcher.length is not None:
        return None
    fetcher.prefetch_batches = max(fetcher.prefetch_batches, at_least)
    while len(fetcher.batches) < at_least and not fetcher.done:
        try:  # the loader's own iterator, not the fetcher's __next__, which would hand a batch on
            fetcher.batches.append(next(fetcher.iterator))
        except StopIteration:  # exhausted: the fetcher's next refill raises again and it sets done
            break
    return min(len(fetcher.batches), at_least)


def end_epoch_after(trainer: Trainer, batches: int) -> None:
    """This rank's epoch ends ``batches`` batches after the current one, wherever its loader would: sized, as
    ``limit_train_batches`` ends it (``max_batches``, and the batch that validates); unsized, its fetcher keeps
    that many batches and no more, so that Lightning sees the last one as the last (``is_last_batch``)."""
    fit_loop, epoch_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
    end = epoch_loop.batch_idx + 1 + batches
    fetcher = _lightning.prefetcher(trainer)
    if fetcher is not None and fetcher.length is None:
        del fetcher.batches[batches:]
        fetcher.iterator = iter(())
    elif end < fit_loop.max_batches:
        fit_loop.max_batches = end
        if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch not in (None, float("inf")):
            trainer.val_check_batch = max(1, int(end * trainer.val_check_interval))  # as Lightning's setup_data
    if batches == 0:  # the current batch is the last: set before the step decides to accumulate or to step
        epoch_loop.batch_progress.is_last_batch = True
