"""Figures and advice as the tool writes them, in one module: SI prefixes, bytes, times, bandwidths, text tables,
and a setting phrased for where it is read (a command line's ``--trainer.strategy.*`` options, or a script's
``DDPStrategy(...)``).

    python -m lit_ddp.report runs/mini_train_profile/version_0     # its tables use them
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lit_ddp.records.schema import DDPMemory, OutOfMemory


def fmt_si(value: float, unit: str) -> str:
    """``value`` in ``unit`` with the SI prefix its magnitude calls for: ``469.9 MB``, ``1.07 GFLOP``, ``64 FLOP``."""
    prefix, scale = next(((p, k) for p, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)) if abs(value) >= k),
                         ("", 1.0))  # fmt: skip
    scaled = value / scale
    digits = 2 if abs(scaled) < 10 else 1 if abs(scaled) < 1000 else 0
    return f"{scaled:.0f} {unit}" if not prefix and scaled == int(scaled) else f"{scaled:.{digits}f} {prefix}{unit}"


def fmt_bytes(value: float) -> str:
    return fmt_si(value, "B")


def fmt_ms(value: float) -> str:
    """Milliseconds, or seconds from 1000 ms on (as printed: 999.996 ms is 1.00 s, not 1000.00 ms)."""
    return f"{value:.2f} ms" if round(value, 2) < 1000 else f"{value / 1000:.2f} s"


def fmt_rate(per_s: float) -> str:
    """A rate per second (samples/s): ``3,368/s``, ``12.5/s``."""
    return f"{per_s:,.0f}/s" if per_s >= 100 else f"{per_s:.1f}/s"


def fmt_us(us: float) -> str:
    """Microseconds (a time per sample), or as ``fmt_ms`` from 1000 µs on: ``296.88 µs``, ``1.20 ms``."""
    return f"{us:.2f} µs" if round(us, 2) < 1000 else fmt_ms(us / 1e3)


def fmt_bandwidth(gb_per_s: float) -> str:
    """A bandwidth given in GB/s (1e9 bytes/s), with the prefix its magnitude calls for as ``fmt_si`` chooses it,
    to three significant figures: ``82.0 kB/s``, ``25.3 MB/s``, ``514 MB/s``, ``1.23 GB/s``; ``-`` when it is not
    known (NaN)."""
    if math.isnan(gb_per_s):
        return "-"
    value = float(f"{gb_per_s * 1e9:.3g}")  # rounded first: 999.6 MB/s is 1.00 GB/s, not 1000 MB/s
    prefix, scale = next(((p, k) for p, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)) if abs(value) >= k),
                         ("", 1.0))  # fmt: skip
    scaled = value / scale
    return f"{scaled:.{2 if abs(scaled) < 10 else 1 if abs(scaled) < 100 else 0}f} {prefix}B/s"


def table(header: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1) -> str:
    """Columns padded to their widest cell; the first ``left`` left-aligned (names), the rest right-aligned."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in cells]  # fmt: skip
    return "\n".join(line.rstrip() for line in lines)


@dataclass(frozen=True)
class Advice:
    """Where a suggestion is read: under ``python -m lit_ddp.fit`` (``cli``) it names options, in a script the
    strategy class to construct (``strategy``: ``DDPStrategy``, or ``LitDDPStrategy``)."""

    cli: bool = True
    strategy: str = "DDPStrategy"

    def strategy_settings(self, **settings: Any) -> str:
        """``--trainer.strategy.find_unused_parameters true``, or ``DDPStrategy(find_unused_parameters=True)``."""
        if self.cli:
            return " ".join(f"--trainer.strategy.{key} {_option_value(value)}" for key, value in settings.items())
        return f"{self.strategy}({', '.join(f'{key}={value!r}' for key, value in settings.items())})"


CLI = Advice()


def _option_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def holders(held: DDPMemory, allocated: Optional[int]) -> list[tuple[str, int]]:
    """What held memory, largest first; ``the rest`` (activations, workspace) where the allocator's total is
    known (CUDA)."""
    parts = [("parameters", held.parameters), ("gradients", held.own_gradients), ("DDP's buckets", sum(held.buckets)),
             ("optimizer state", held.optimizer_state)]  # fmt: skip
    if allocated is not None:
        parts.append(("the rest (activations, workspace)", max(allocated - held.held, 0)))
    return sorted((p for p in parts if p[1]), key=lambda p: -p[1])


def oom_line(oom: OutOfMemory, path: Optional[str] = None) -> str:
    """One line: where the rank ran out of memory, where memory peaked, and what held it."""
    held = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in holders(oom.held, oom.allocated))
    rest = "" if oom.allocated is not None else " (the rest is not measured on CPU)"
    peak = ""
    if oom.peak is not None:
        peak = f"; memory peaked at {fmt_bytes(oom.peak)} in step {oom.peak_step}, {oom.peak_phase}"
    saved = f"; record: {path}" if path else ""
    snapshot = f"; snapshot: {oom.snapshot}" if oom.snapshot else ""
    return (
        f"rank {oom.rank} ran out of memory in step {oom.step}, {oom.phase} ({oom.error}){peak}; held then: "
        f"{held or 'nothing the tool sees'}{rest}{saved}{snapshot}"
    )
