"""The links a DDP all-reduce runs over, as the scaling forecast models them: presets with their published
sources, a fit to a measured probe, and the time of one all-reduce of S bytes on N ranks.

    python -m lit_ddp.allreduce_probe --nproc 2 --out probe.json             # measure a link
    python -m lit_ddp.report RUN --forecast 8,64 --link measured --probe probe.json

``busbw`` is nccl-tests' bus bandwidth, the figure that does not depend on n; ``a`` is the latency of one step.
The formulas, and the presets checked against nccl-tests: docs/forecast.md.
"""

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lit_ddp.errors import ForecastError
from lit_ddp.maths.bus_factors import allreduce_bus_factor
from lit_ddp.records.probe import ProbePoint

BYTES_PER_MS_PER_GBPS = 1e6  # bytes per ms in one GB/s: times are ms, sizes bytes


@dataclass(frozen=True)
class Link:
    """One kind of link: per-GPU bus bandwidth and the latency of one ring step.

    Args:
        name: The spec name (``nvlink``, ``ib400``, ...).
        busbw_gbps: nccl-tests' busbw at large sizes, GB/s per GPU.
        hop_latency_us: Latency of one step of a ring (or one tree level), microseconds.
        source: The published figure (or measurement) the numbers come from.
        node_only: The link joins the GPUs of one node only (NVLink), so it cannot be the inter-node link.
    """

    name: str
    busbw_gbps: float
    hop_latency_us: float
    source: str
    node_only: bool = False


# Hop latency for every preset: NCCL's own cost model (src/graph/tuning.cc, hwLat[...][Ring][Simple]): 3.4 us for
# NVLink and 14 us for the network (one NET class for IB and RoCE). Simple is NCCL's protocol for MB-sized buckets.
PRESETS = {
    "nvlink": Link("nvlink", 450.0, 3.4, node_only=True, source=(
        "NVLink 4 on H100/H200 SXM: 900 GB/s bidirectional = 450 GB/s per direction per GPU (NVIDIA datasheets); "
        "nccl-tests all_reduce_perf on 8x H100 SXM: busbw 460-480 GB/s at large sizes, with NVLS "
        "(docs.alayanew.com, 'NCCL-tests in practice'); 3.4 us: NCCL tuning.cc hwLat[NVLINK][Ring][Simple]")),
    "ib400": Link("ib400", 45.0, 14.0, source=(
        "InfiniBand NDR, one 400 Gb/s ConnectX-7 per GPU = 50 GB/s line rate; nccl-tests busbw 40-50 GB/s over IB "
        "NDR without NVLink, 400-450 GB/s for 8x H100 nodes with NVLink + NDR (Saturn Cloud, 'Validating "
        "multi-node GPU clusters with NCCL tests'); 14 us: NCCL tuning.cc hwLat[NET][Ring][Simple]")),
    "roce200": Link("roce200", 22.5, 14.0, source=(
        "RoCE v2 at 200 Gb/s per GPU = 25 GB/s line rate, at the 90% of line rate IB NDR reaches (45 of 50 GB/s); "
        "14 us: NCCL tuning.cc hwLat[NET][Ring][Simple]")),
    "roce100": Link("roce100", 11.25, 14.0, source=(
        "RoCE v2 / Ethernet at 100 Gb/s per GPU = 12.5 GB/s line rate, at 90% as roce200; "
        "14 us: NCCL tuning.cc hwLat[NET][Ring][Simple]")),
}  # fmt: skip
LINK_NAMES = (*PRESETS, "measured")


@dataclass(frozen=True)
class Topology:
    """Where the ranks sit: ``gpus_per_node`` GPUs joined by ``intra``, nodes joined by ``inter``."""

    intra: Link
    inter: Link
    gpus_per_node: int


def ring_ms(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes`` on ``n`` ranks: 2(n-1) steps, each rank sends 2(n-1)/n x S."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * link.hop_latency_us / 1e3 + allreduce_bus_factor(n) * nbytes / (
        link.busbw_gbps * BYTES_PER_MS_PER_GBPS
    )


def allreduce_ms(nbytes: float, ranks: int, topo: Topology) -> float:
    """T(S, N): a ring inside one node, NCCL's hierarchical form across nodes (see the module docstring)."""
    g = topo.gpus_per_node
    if ranks <= g:  # < alike: at ranks == g the form below is the ring (m = 1: no tree level, bus factor 0)
        return ring_ms(nbytes, ranks, topo.intra)
    m = ranks // g  # / alike: check_ranks lets through whole nodes only
    latency = 2 * (g - 1) * topo.intra.hop_latency_us + 2 * math.ceil(math.log2(m)) * topo.inter.hop_latency_us
    intra = allreduce_bus_factor(g) * nbytes / (topo.intra.busbw_gbps * BYTES_PER_MS_PER_GBPS)
    inter = allreduce_bus_factor(m) * (nbytes / g) / (topo.inter.busbw_gbps * BYTES_PER_MS_PER_GBPS)
    return latency / 1e3 + max(intra, inter)


def _slope(pts: Sequence[tuple[float, float]], weights: Sequence[float]) -> float:
    """The slope of the weighted least-squares line through ``(size, time)`` points."""
    sw = sum(weights)
    sx = sum(w * s for w, (s, _) in zip(weights, pts, strict=True))
    sy = sum(w * t for w, (_, t) in zip(weights, pts, strict=True))
    sxx = sum(w * s * s for w, (s, _) in zip(weights, pts, strict=True))
    sxy = sum(w * s * t for w, (s, t) in zip(weights, pts, strict=True))
    return (sw * sxy - sx * sy) / (sw * sxx - sx * sx)


LARGE_SHARE = 1 / 16  # the sizes whose times give the bandwidth: from a sixteenth of the largest up (5 sizes)


def fit_probe(points: Sequence[ProbePoint], world_size: int, name: str = "measured", source: str = "") -> Link:
    """Fits t = A + B x S to a probe and reads the ring's terms off it: A = 2(n-1) a, B = 2(n-1)/n / busbw. B comes
    from the large sizes (least squares over those from ``LARGE_SHARE`` of the largest up): the buckets a forecast
    sends are MBs, and the small sizes' times are latency and noise (over a shaped link a few KB also pass in the
    link's burst; weighted in, they read up to 17% more bandwidth than the largest sizes ran at over 100 Mbit/s,
    and 59% more over 1 Gbit/s). A is then the mean of t - B x S weighted by relative error, which the small,
    latency-bound sizes carry (never below 0)."""
    if world_size < 2:
        raise ForecastError(f"a probe needs >= 2 ranks to measure a link, got world_size={world_size!r}")
    pts = [(p.nbytes, p.ms) for p in points if p.ms > 0]
    if len({s for s, _ in pts}) < 2:
        raise ForecastError(f"a fit needs >= 2 sizes with a positive time, got {[(p.nbytes, p.ms) for p in points]}")
    largest = max(s for s, _ in pts)
    large = [(s, t) for s, t in pts if s >= LARGE_SHARE * largest]
    weights = [1 / t**2 for _, t in pts]  # one a point (zip strict= alike); 2 / t**2, [2.0] below alike: factors cancel
    slope = _slope(large, [1.0] * len(large)) if len({s for s, _ in large}) >= 2 else 0.0
    if slope <= 0:  # too few large sizes, or only noise among them (a probe of KBs): every size, by relative error
        slope = _slope(pts, weights)
    if slope <= 0:
        raise ForecastError(f"the probe's times do not grow with size (slope {slope!r} ms/byte): no bandwidth to fit")
    intercept = sum(w * (t - slope * s) for w, (s, t) in zip(weights, pts, strict=True)) / sum(weights)
    intercept = intercept if intercept > 1e-9 else 0.0  # a picosecond or less: rounding, not a latency
    return Link(
        name,
        busbw_gbps=allreduce_bus_factor(world_size) / slope / BYTES_PER_MS_PER_GBPS,
        hop_latency_us=intercept / (2 * (world_size - 1)) * 1e3,  # 2(n-1) steps of a ring
        source=source,
    )


def load_probe(path: Path, hop: str = "intra") -> Link:
    """The ``measured`` link of ``hop`` (``intra`` or ``inter``): a fit to an ``allreduce_probe`` JSON. A probe
    across nodes (under torchrun) measured each hop apart: within node 0 and between the nodes; a probe of one
    machine measured one link, which serves both."""
    record = _read_json(path)
    part, what = record, ""
    if "nodes" in record:  # across nodes
        key = f"{hop}_node"
        if key not in record:
            missing, example = (("within a node (one rank per node)", "nvlink+measured") if hop == "intra" else
                                ("between nodes (one node)", "measured+ib400"))  # fmt: skip
            raise ForecastError(f"{path} measured no link {missing}: name that one, e.g. --link {example}")
        part, what = record[key], " within a node" if hop == "intra" else " between nodes"
    try:
        points = [ProbePoint(**row) for row in part["rows"]]
        n = part["world_size"]
    except (KeyError, TypeError) as e:
        raise ForecastError(f"{path} is not an allreduce_probe JSON ({e!r})") from None
    sizes = f"{min(p.nbytes for p in points):,}..{max(p.nbytes for p in points):,} bytes"
    return fit_probe(
        points, n, source=f"fit to {path}{what}: {record.get('backend')}, {n} ranks, {len(points)} sizes {sizes}"
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ForecastError(f"no {path.name} at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ForecastError(f"{path} is not JSON: {e}") from None


def topology(
    spec: tuple[str, str | None], gpus_per_node: int, probe: Path | None, across_nodes: bool = True
) -> Topology:
    """``("nvlink", "ib400")`` -> links; one name alone means every hop uses that link (``measured`` alone: each hop
    the probe's measurement of it, where it measured them apart). ``across_nodes=False``: no rank count to forecast
    crosses a node, so a probe that measured no hop between nodes is enough."""

    def link(name: str, hop: str) -> Link:
        if name != "measured":
            return PRESETS[name]
        if probe is None:
            raise ForecastError("--link measured needs a probe: --probe probe.json "
                                "(python -m lit_ddp.allreduce_probe --out probe.json)")  # fmt: skip
        return load_probe(probe, hop)

    try:
        inter = link(spec[1] or spec[0], "inter")
    except ForecastError:
        if across_nodes or spec[1]:
            raise
        intra = link(spec[0], "intra")
        return Topology(intra, intra, gpus_per_node)  # the hop between nodes is never taken
    # One rank per node has no hop within a node, and a probe with one rank per node measured none.
    intra = inter if gpus_per_node == 1 and spec[0] == "measured" else link(spec[0], "intra")
    intra = inter if intra == inter else intra  # one link (a probe of one machine): one object, named once
    if spec[1] and inter.node_only:
        raise ForecastError(f"{inter.name} joins the GPUs of one node: it cannot link nodes (try nvlink+ib400)")
    return Topology(intra, inter, gpus_per_node)


def check_ranks(ranks: int, topo: Topology, spec: str) -> None:
    g = topo.gpus_per_node
    if ranks > g and topo.inter.node_only:
        raise ForecastError(f"--link {spec} reaches {g} GPUs (one node); {ranks} ranks need an inter-node link, "
                            f"e.g. --link {spec}+ib400")  # fmt: skip
    if ranks > g and ranks % g:  # >= alike: g % g is 0
        raise ForecastError(f"{ranks} ranks do not fill whole nodes of --gpus-per-node {g}")
