"""One DDP configuration the tuner tries (``Knobs``), what it knows of the model (``Model``), and DDP's bucket layout.

    python -m lit_ddp.tune --devices 2        # the names of Knobs are --tune.compare's and a tune's .json's

Pure data and DDP's own bucketing rule, so that the search is planned from the model's gradient sizes alone.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Optional

MIB = 1 << 20
DEFAULT_CAP_MB = 25.0  # DistributedDataParallel's bucket_cap_mb
FIRST_BUCKET_BYTES = 1 * MIB  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)

# powersgd1/powersgd4: PowerSGD at matrix rank 1 / 4; noop: no all-reduce at all, a reference only
Hook = Literal["none", "fp16", "bf16", "powersgd1", "powersgd4", "noop"]
OptimizerImpl = Literal["as_configured", "foreach", "fused"]


@dataclass(frozen=True)
class Knobs:
    """One DDP configuration: ``LitDDPStrategy``'s options, and the optimizer's implementation."""

    bucket_cap_mb: Optional[float] = None  # None: torch's default (25 MiB)
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    broadcast_buffers: bool = True
    find_unused_parameters: bool = False
    comm_hook: Hook = "none"
    optimizer: OptimizerImpl = "as_configured"

    @property
    def lossy(self) -> bool:
        return self.comm_hook != "none"

    def changes(self, base: "Knobs") -> dict[str, object]:
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(base)
        return {name: value for name, value in mine.items() if value != theirs[name]}

    def label(self, base: "Knobs") -> str:
        changes = self.changes(base)
        return ", ".join(f"{k}={_fmt(v)}" for k, v in changes.items()) if changes else "yours"


def _fmt(value: object) -> str:
    if value is None:
        return "default"
    return f"{value:g}" if isinstance(value, float) else str(value).lower() if isinstance(value, bool) else str(value)


def layout(grad_bytes: Sequence[int], cap_mb: Optional[float]) -> list[int]:
    """DDP's buckets (bytes each) after its first step, for gradients of ``grad_bytes`` in the order backward makes
    them (about the reverse of ``parameters()``): a bucket closes once it holds the cap or more (a gradient is
    never split); the first one's cap is 1 MiB under torch's default cap, the cap itself otherwise."""
    cap = (DEFAULT_CAP_MB if cap_mb is None else cap_mb) * MIB
    limit = FIRST_BUCKET_BYTES if cap_mb is None else cap
    buckets: list[int] = []
    current = 0
    for size in grad_bytes:
        current += size
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    return [*buckets, current] if current else buckets


def bucket_caps(grad_bytes: Sequence[int], current: Optional[float]) -> list[float]:
    """Caps (MiB) worth trying: each gives a layout different from the current one's and from the others' (a cap
    that only moves where a bucket ends counts). A model with one gradient, or gradients too small to split, has
    none."""
    total = sum(grad_bytes)
    seen = {tuple(layout(grad_bytes, current))}
    caps = []
    for fraction in (1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16):
        cap = round(max(total * fraction / MIB, 1.0), 2)  # under 1 MiB: latency, whatever the link
        buckets = tuple(layout(grad_bytes, cap))
        if buckets not in seen:
            seen.add(buckets)
            caps.append(cap)
    return caps


@dataclass(frozen=True)
class Model:
    """What the search needs to know of the model, the optimizer and the run."""

    grad_bytes: tuple[int, ...]  # each trainable parameter's gradient, in backward's order
    has_buffers: bool
    unused_parameters: bool  # some parameter got no gradient in the first backward
    optimizer_impls: tuple[str, ...]  # "foreach" / "fused" where the optimizer takes them
    world_size: int
    bf16: bool  # the backend all-reduces bfloat16
