"""Writes real Flight Recorder dumps, one per rank, of a 2-rank gloo DDP job in which rank 1 calls one collective
more than rank 0: what ``python -m lit_ddp.report --flight-recorder DIR`` reads.

    python -m tests.flight_dumps DIR       # DIR/fr_trace_rank0, DIR/fr_trace_rank1 (torch's own pickles)
                                           # and DIR/json/fr_trace_rank{0,1}.json (torch's JSON)
    python -m tests.flight_dumps DIR --nccl  # one GPU, world 1: DIR/nccl_trace_rank_0, NCCL's own pickle
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.runner import free_port

STEPS = 3


def rank_main(rank: int, directory: str, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    for _ in range(STEPS):
        model(torch.randn(4, 8)).sum().backward()  # one gradient bucket's all-reduce per step
    if rank == 1:
        dist.all_reduce(torch.ones(1), async_op=True)  # rank 0 never calls it: the job would hang here
    dump = torch._C._distributed_c10d._dump_fr_trace()  # what NCCL writes on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT)
    Path(directory, f"fr_trace_rank{rank}").write_bytes(dump)
    Path(directory, "json").mkdir(exist_ok=True)  # torch's JSON of the same: no Python stacks
    Path(directory, "json", f"fr_trace_rank{rank}.json").write_bytes(torch._C._distributed_c10d._dump_fr_trace_json())
    sys.stdout.flush()
    os._exit(0)  # the unmatched collective would keep the process group from closing


def nccl_main(directory: str, port: int) -> None:
    """One GPU, world 1, NCCL: the dump NCCL's watchdog would write (``_dump_nccl_trace``, a CUDA build's)."""
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1).cuda(), device_ids=[0])
    for _ in range(STEPS):
        model(torch.randn(4, 8, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    Path(directory, "nccl_trace_rank_0").write_bytes(torch._C._distributed_c10d._dump_nccl_trace(True, True, False))
    dist.destroy_process_group()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if sys.argv[2:] == ["--nccl"]:
        nccl_main(str(out), free_port())
    else:
        mp.start_processes(rank_main, args=(str(out), free_port()), nprocs=2, start_method="fork")
