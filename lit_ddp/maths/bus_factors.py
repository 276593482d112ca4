"""nccl-tests' bus-bandwidth factors: the share of a collective's S bytes each of n ranks sends, busbw / algbw.

    allreduce_bus_factor(8)    # 1.75: a ring all-reduce sends 2(n-1)/n x S per rank

On the floor below every reader (the trace analysis, the all-reduce table, the forecast's links, the probe), with
nothing of the tool's imported. Where the factors come from: docs/traces.md.
"""

from typing import Optional

RING_ONCE = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")  # (n-1)/n
DIRECT = ("broadcast", "reduce", "send", "recv", "send_recv")  # 1


def allreduce_bus_factor(n: int) -> float:
    """2(n-1)/n, nccl-tests' busbw / algbw of an all-reduce over ``n`` ranks: the share of its S bytes each rank
    sends (and receives) in a ring all-reduce, the notes' "2x the parameter size per step" for large n."""
    return 2 * (n - 1) / n


def bus_factor(name: str, n: int) -> Optional[float]:
    """nccl-tests' busbw / algbw of collective ``name`` over ``n`` ranks; None for one it has no factor for."""
    ring = (n - 1) / n
    return {"all_reduce": allreduce_bus_factor(n), **dict.fromkeys(RING_ONCE, ring),
            **dict.fromkeys(DIRECT, 1.0)}.get(name)  # fmt: skip
