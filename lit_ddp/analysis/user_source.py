"""The user's line of something that no stack shows any more, found in the source of the user's own classes: the
``self.log`` of a ``sync_dist`` key that Lightning reduces after its hook returned, the line that set
``trainer.should_stop``.

    python -m benchmarks.hang_zoo --cases epoch_end_log_rank0,stop_on_rank1     # the lines these name

The classes are the LightningModule's and the callbacks' (the libraries' own are left out: torch, Lightning,
lit_ddp); a line is named as a stack's user frame is (``lit_ddp.analysis.flight_recorder.user_frame``), and only
where the source says it without guessing: one line. docs/failures.md#the-watchdog-a-hang-named-as-it-happens.
"""

import inspect
import os
import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from lit_ddp.analysis.flight_recorder import LIBRARIES

# An assignment that can stop training: ``self.trainer.should_stop = True``, ``= stop`` (not ``= False``, not ``==``).
SETS_SHOULD_STOP = re.compile(r"\bshould_stop\s*=(?!=)(?!\s*False\b)")


class Line(NamedTuple):
    path: str
    lineno: int
    function: str
    text: str

    def where(self) -> str:
        """``case.py:20 on_train_epoch_end: self.log("epoch_metric", value, sync_dist=True)``"""
        return f"{os.path.basename(self.path)}:{self.lineno} {self.function}: {self.text.split('  #')[0].strip()}"


def _users(path: str) -> bool:
    path = os.path.abspath(path)
    return path.endswith(".py") and not path.startswith(LIBRARIES) and "site-packages" not in path


def lines(classes: Iterable[type]) -> Iterator[Line]:
    """Every source line of the user's own methods of ``classes`` and their bases, each class once. A method's file
    is its code's: a class's own module may have none left to name (``__main__`` at exit was seen without one)."""
    seen: set[type] = set()
    for cls in classes:
        for klass in cls.__mro__:
            if klass in seen:
                continue
            seen.add(klass)
            for name, function in vars(klass).items():
                if not inspect.isfunction(function) or not _users(function.__code__.co_filename):
                    continue
                try:
                    source, start = inspect.getsourcelines(function)
                except (OSError, TypeError):  # no source (made by exec, or the file is gone)
                    continue
                path = function.__code__.co_filename
                yield from (Line(path, start + i, name, text) for i, text in enumerate(source))


def logged_at(classes: Iterable[type], hook: str, key: str) -> str:
    """The line of ``hook`` that logs ``key``: the one that quotes it, else the hook's only ``self.log``/``log_dict``
    call; where neither is one line (a key made at run time among several calls), the hook and the key."""
    found = [line for line in lines(classes) if line.function == hook]
    quoted = [line for line in found if f'"{key}"' in line.text or f"'{key}'" in line.text]
    calls = [line for line in found if re.search(r"\.log(_dict)?\(", line.text)]
    one = quoted if len(quoted) == 1 else calls if len(calls) == 1 else []
    return one[0].where() if one else f"{hook}: self.log({key!r}, ..., sync_dist=True)"


class Stopped(NamedTuple):
    """A fit that ended on ``trainer.should_stop``: at which step, and the classes whose source may have set it."""

    step: int
    owners: tuple[type, ...]  # the LightningModule's, the callbacks'

    def text(self) -> str:
        """``stopped training at step 4 (trainer.should_stop set at case.py:15 training_step: ...)``: the line named
        where the user's own classes hold one (one only) that sets ``should_stop`` to anything but False."""
        found = [line.where() for line in lines(self.owners) if SETS_SHOULD_STOP.search(line.text.split("#")[0])]
        return f"stopped training at step {self.step}" + (
            f" (trainer.should_stop set at {found[0]})" if len(found) == 1 else ""
        )
