"""The notes' ``mini_train.py``: plain ``torch.distributed`` + DDP, no Lightning. The port's parity baseline.

    torchrun --nproc_per_node 2 -m lit_ddp.reference
    torchrun --nproc_per_node 4 -m lit_ddp.reference --dim 4096 --steps 50

Same seeds and data convention as ``lit_ddp.fit`` (``torch.manual_seed(seed)`` before the model, the global
batch of ``lit_ddp.lab.data``), so both print the same ``Step i, Loss x`` lines (the global mean loss) and
end with the same weights. Without torchrun it runs as a single process.
"""

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lit_ddp.lab.data import shard


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lit_ddp.reference", description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="rows per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--fused", action="store_true", help="torch's fused Adam")
    p.add_argument("--seed", type=int, default=0, help="model init seed (the port's seed_everything)")
    p.add_argument("--data-seed", type=int, default=0, help="global batch seed (the port's --data.seed)")
    p.add_argument("--save", help="rank 0 saves the final state_dict here")
    p.add_argument("--timings", help="each rank writes its step start times and peak RSS to TIMINGS/rank<r>.json")
    args = p.parse_args(argv)
    for name in ("dim", "num_layers", "batch_size", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    torch.manual_seed(args.seed)
    model = nn.Sequential(*(nn.Linear(args.dim, args.dim) for _ in range(args.num_layers))).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    # After wrapping, as the notes insist.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, fused=args.fused or None)

    x, y = (t.to(device) for t in shard(args.dim, args.batch_size, args.data_seed, rank, world))
    step_starts = []  # wall-clock time at the top of each step, for the benchmarks
    for step in range(args.steps):
        step_starts.append(time.time())
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        if rank == 0:
            print(f"Step {step}, Loss {global_loss.item() / world:.4f}", flush=True)
    step_starts.append(time.time())

    if rank == 0 and args.save:
        torch.save(model.module.state_dict(), args.save)
    if args.timings:
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(args.timings, f"rank{rank}.json").write_text(
            json.dumps({"step_starts": step_starts, "max_rss_mb": rss_mb})
        )
    # Tear DDP down while the process group is alive and every rank is past its last collective: torchrun +
    # gloo otherwise hung about 1 exit in 6 here, in the DDP reducer's destructor after main() returned
    # (see pytorch/pytorch#75097).
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
