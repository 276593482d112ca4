"""Parameters that take no part in the loss: DDP waits for their gradients, or, with
``find_unused_parameters=True``, searches the autograd graph for them every step and still all-reduces them.

    python -m lit_ddp.fit --devices 2     # a model with an unused layer: one line, exit 2, after step 0

Without ``find_unused_parameters``, DDP's reducer waits forever for an unused parameter's gradient and raises
at the next step's forward ("Expected to have finished reduction in the prior iteration..."), naming
parameter indices. ``check_all_used`` says it after the first backward, by name, on every rank at once (the
same model and graph everywhere; a rank whose graph differs raises DDP's own error at the next forward, which
needs no collective, so no rank is left waiting).
"""

from typing import Optional

from torch import nn

from lit_ddp.errors import UnusedParametersError
from lit_ddp.formatting import CLI, Advice


def without_grad(module: nn.Module) -> list[tuple[str, int]]:
    """``(name, bytes)`` of each parameter that requires a gradient but got none in the last backward (its
    ``.grad`` is None: Lightning's ``zero_grad`` sets them to None before every step)."""
    return [(name, p.numel() * p.element_size()) for name, p in module.named_parameters()
            if p.requires_grad and p.grad is None]  # fmt: skip


def check_all_used(module: nn.Module, step: int, advice: Advice = CLI, rank: Optional[int] = None) -> None:
    """Raises ``UnusedParametersError`` naming the parameters that got no gradient in ``step``'s backward (on
    ``rank``, where given: a branch some ranks take), and the setting that lets DDP search for them (phrased for
    where it is read: ``advice``)."""
    missing = without_grad(module)
    if missing:
        raise UnusedParametersError(_unused(missing, step, advice, rank))


def name_unused(exception: BaseException, module: nn.Module, step: int, advice: Advice = CLI,
                rank: Optional[int] = None) -> None:  # fmt: skip
    """DDP's error at ``step``'s forward (or Lightning's words for it, which drop DDP's indices) where a parameter got
    no gradient in the step before, on this rank only (a branch taken after the first step, which ``check_all_used``
    read): the message made to name the rank and the parameters, read now (their ``.grad`` is still None: Lightning
    zeroes the gradients after ``training_step``, before ``backward``)."""
    text = str(exception)
    if not (DDP_UNFINISHED in text or text.startswith(LIGHTNING_UNUSED)):
        return
    missing = without_grad(module)
    if missing:
        exception.args = (_unused(missing, step - 1, advice, rank),)


DDP_UNFINISHED = "Expected to have finished reduction in the prior iteration"  # DDP's reducer, at the next forward
LIGHTNING_UNUSED = (  # DDPStrategy.on_exception's words in place of DDP's (Lightning 2.x)
    "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
    "training_step. If this is intentional"
)


def _unused(missing: list[tuple[str, int]], step: int, advice: Advice, rank: Optional[int]) -> str:
    names = ", ".join(name for name, _ in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    return (  # opening with Lightning's words for DDP's error, which users and tests look for
        "It looks like your LightningModule has parameters that were not used in producing the loss returned by "
        f"training_step: {len(missing)} parameter(s) got no gradient in step {step}"
        f"{f' on rank {rank}' if rank is not None else ''}: {names}; DDP would wait for them "
        "and fail at the next step. Use them in the loss, freeze them (requires_grad=False), or let DDP search for "
        f"them every step: {advice.strategy_settings(find_unused_parameters=True)} (static_graph=True too when the "
        "same ones are unused every step)"
    )
