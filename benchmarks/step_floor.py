"""The physical floor of one DDP step of the notes' task: forward + backward, one all-reduce of every gradient, one
fused Adam update, each timed alone on every rank, with nothing else (no Python loop of a framework, no hooks, no
printing). No loop can do less work per step; ``benchmarks/step_time.py`` compares the runs with it.

    python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.step_floor --dim 4096 --out DIR

Each rank runs ``Linear(dim, dim)`` on its fixed batch of ``--batch-size`` rows (MSE), its gradients views of one
flat buffer (as DDP's ``gradient_as_bucket_view``), that buffer all-reduced in one call, then ``Adam(fused=True)``
and the buffer zeroed (in the update's time). The parts are timed apart (on a GPU with a synchronize at each
boundary). DDP overlaps the all-reduce with the backward at best, so the floor is forward + max(backward,
all-reduce) + update; their plain sum is the step without overlap. Each rank writes ``DIR/rank<r>.json``: per
step, the ms of ``forward``, ``backward``, ``allreduce`` and ``update``. It imports nothing of ``lit_ddp``.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

PARTS = ("forward", "backward", "allreduce", "update")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_floor", description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--out", required=True, help="each rank writes OUT/rank<r>.json")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Linear(args.dim, args.dim).to(device)
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), device=device)
    offset = 0
    for p in params:  # the gradients live in the all-reduced buffer: no copy in or out
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    opt = torch.optim.Adam(params, lr=1e-3, fused=True)
    gen = torch.Generator().manual_seed(rank)
    x, y = (torch.randn(args.batch_size, args.dim, generator=gen).to(device) for _ in range(2))

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    steps = []
    for _ in range(args.steps):
        t0 = now()
        loss = ((model(x) - y) ** 2).mean()
        tf = now()
        loss.backward()
        t1 = now()
        dist.all_reduce(flat)
        t2 = now()
        opt.step()
        flat.zero_()
        t3 = now()
        steps.append(
            {
                "forward": (tf - t0) * 1e3,
                "backward": (t1 - tf) * 1e3,
                "allreduce": (t2 - t1) * 1e3,
                "update": (t3 - t2) * 1e3,
            }
        )
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"steps": steps}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
