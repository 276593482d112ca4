"""The all-reduce probe's record: the rows of ``probe.json``, as ``python -m lit_ddp.allreduce_probe`` writes them and
the forecast's measured link reads them.

    python -m lit_ddp.allreduce_probe --nproc 2 --out probe.json
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ProbePoint:
    """One size of an all-reduce probe: a row of ``probe.json`` (``lit_ddp.allreduce_probe``)."""

    nbytes: int
    ms: float
    algbw_gbps: float
    busbw_gbps: float
