"""Figures and advice as the tool writes them: SI prefixes, bytes, and a setting phrased for where it is read (a
command line's ``--trainer.strategy.*`` options, or a script's ``DDPStrategy(...)``).

    python -m lit_ddp.report runs/mini_train_profile/version_0     # its tables use them
"""

from dataclasses import dataclass
from typing import Any


def fmt_si(value: float, unit: str) -> str:
    """``value`` in ``unit`` with the SI prefix its magnitude calls for: ``469.9 MB``, ``1.07 GFLOP``, ``64 FLOP``."""
    prefix, scale = next(((p, k) for p, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)) if abs(value) >= k),
                         ("", 1.0))  # fmt: skip
    scaled = value / scale
    digits = 2 if abs(scaled) < 10 else 1 if abs(scaled) < 1000 else 0
    return f"{scaled:.0f} {unit}" if not prefix and scaled == int(scaled) else f"{scaled:.{digits}f} {prefix}{unit}"


def fmt_bytes(value: float) -> str:
    return fmt_si(value, "B")


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
