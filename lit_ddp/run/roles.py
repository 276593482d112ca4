"""The roles a callback plays for the strategy, declared: ``LitDDPStrategy`` finds the callbacks that play one by
these Protocols, where the error is raised (a ``ddp_spawn``/``ddp_fork`` rank reaches no callback's
``on_exception``), and knows no callback class. PhaseTimer reports an out-of-memory error; CommMonitor names the
all-reduce a rank waits for.

    python -m lit_ddp.fit --config configs/mini_train_profile.yaml --devices 2    # both roles played
"""

from typing import Optional, Protocol, runtime_checkable

from lightning.pytorch import Trainer


@runtime_checkable
class ReportsOutOfMemory(Protocol):
    """Says, on the rank that ran out of memory and before the job ends, where and what held it (once per fit)."""

    def on_out_of_memory(self, trainer: Trainer, exception: BaseException) -> None: ...


@runtime_checkable
class NamesPendingCollective(Protocol):
    """Names the collective this rank is waiting for, if any (``lit_ddp.run.hangs`` says it after a timeout)."""

    def waiting_for(self) -> Optional[str]: ...
