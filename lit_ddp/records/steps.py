"""Which steps a record's figures are over, and which a rank keeps: the warm-up left out (``is_steady``), and the
bounded window of per-step detail (``Window``: the fit's first ``HEAD_STEPS``, the profiled ones, the last
``TAIL_STEPS``). docs/architecture.md#steps.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2   # its record keeps this window
"""

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

WARMUP_STEPS = 1
HEAD_STEPS = 10
TAIL_STEPS = 50


def is_steady(step: int, profiled: Iterable[int] = (), first_step: int = 0) -> bool:
    """After the warm-up step of the fit that started at global step ``first_step`` (0, or where a fit resumed from
    a checkpoint), and not slowed by the profiler."""
    return step >= first_step + WARMUP_STEPS and step not in profiled


class Window:
    """The steps whose per-step detail a rank keeps: the first ``HEAD_STEPS`` of the fit (which starts at global step
    ``first_step``), the ``profiled`` ones, and the last ``TAIL_STEPS`` (older ones are dropped as new ones come)."""

    def __init__(self, profiled: Iterable[int] = (), first_step: int = 0) -> None:
        self.profiled = set(profiled)
        self.first_step = first_step
        self._kept: dict[int, Any] = {}
        self._tail: deque[int] = deque()

    def add(self, step: int, item: Any) -> None:
        self._kept[step] = item
        if step < self.first_step + HEAD_STEPS or step in self.profiled:
            return
        self._tail.append(step)
        if len(self._tail) > TAIL_STEPS:
            del self._kept[self._tail.popleft()]

    def items(self) -> Iterator[tuple[int, Any]]:
        return iter(sorted(self._kept.items()))
