"""The verdict's figures: what the changes that cut the bytes on the wire would make of a run's step, by the
forecast's model (``lit_ddp.scaling.model``) at the run's own rank count, over the link the run's own all-reduces
measured.

    python -m lit_ddp.report runs/mini_train_profile/version_0   # the verdict quotes them when the step is
                                                                  # communication-bound

The model and what it leaves out: docs/forecast.md; when the verdict quotes them: docs/noise.md.
"""

from dataclasses import replace
from typing import Optional

from lit_ddp.derive.stragglers import Arrivals
from lit_ddp.maths.bus_factors import allreduce_bus_factor
from lit_ddp.records.schema import CommRecord
from lit_ddp.scaling.links import BYTES_PER_MS_PER_GBPS, Link, Topology
from lit_ddp.scaling.model import Measured, simulate


def run_link(comm: CommRecord, found: Optional[Arrivals]) -> Link | None:
    """The link the run's all-reduces ran at: the buckets' bytes over their transfer (the shortest duration
    across ranks, from the run's ``found`` arrivals: no wait for a late rank in it), as nccl-tests' busbw, no
    latency term; None without one."""
    if found is None:
        return None
    transfer_ms = sum(sorted(t)[len(t) // 2] for t in found.transfer_per_bucket)
    if transfer_ms <= 0:
        return None
    n = comm.meta.world_size
    busbw = allreduce_bus_factor(n) * sum(comm.layout) / transfer_ms / BYTES_PER_MS_PER_GBPS
    return Link("this run's", busbw, 0.0, source="the run's own all-reduces (CommMonitor's transfer times)")


def wire_savings(comm: Optional[CommRecord], run: Optional[Measured], found: Optional[Arrivals]) -> dict[str, float]:
    """``{change: ms saved per step}`` for fp16/bf16 compression of a run without it: the model's step as
    measured (``run``, the forecast's inputs) less its step with half the bytes, at the run's rank count over
    ``run_link``; empty where the run cannot tell (one rank, no forecast inputs, no bucket of the final layout, or
    compression on already)."""
    if comm is None or run is None or comm.compression or comm.meta.world_size < 2:
        return {}
    link = run_link(comm, found)
    if link is None:
        return {}
    n = comm.meta.world_size
    topo = Topology(link, link, gpus_per_node=n)  # the inter-node link alike: n ranks on one node never take it
    half = tuple(replace(b, nbytes=b.nbytes / 2) for b in run.buckets)
    saving = simulate(run, n, topo).step_ms - simulate(run, n, topo, half).step_ms
    return {"fp16 compression (CommMonitor(compression=fp16): half the bytes)": saving}
