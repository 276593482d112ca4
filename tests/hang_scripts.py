"""A user's own script that hangs DDP the ways users report, one case per name: run as the user would run it.

    python tests/hang_scripts.py logkeys                   # rank 1 logs a key rank 0 does not (lightning#19106)
    python tests/hang_scripts.py uneven_shards             # rank 0 has 8 batches an epoch, rank 1 5 (#3325)
    python tests/hang_scripts.py uneven_shards --uneven error
    python tests/hang_scripts.py empty_shard               # rank 1's shard is empty (webdataset#188)
    python tests/hang_scripts.py raise --start-method popen    # Lightning's `ddp` launcher (or under torchrun)

A plain ``Trainer`` with ``LitDDPStrategy(timeout_s=...)`` on 2 CPU ranks and the tool's callbacks; each rank
prints ``rank R: batches B`` (the batches it trained, by epoch) when training ends, for the tests to read.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset, IterableDataset

if __name__ == "__main__" and not __package__:  # run as a file: the repository on sys.path, not tests/
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from lit_ddp.callbacks import LossMonitor, StepSync  # noqa: E402
from lit_ddp.run.strategy import LitDDPStrategy  # noqa: E402

DIM = 8


class Shard(IterableDataset):
    """``batches`` batches of 4 rows on this rank (no length: an ``IterableDataset`` sharded by rank)."""

    def __init__(self, batches: dict[int, int]) -> None:
        self.batches = batches

    def __iter__(self):
        rank = int(os.environ.get("LOCAL_RANK", 0))
        for i in range(self.batches[rank]):
            x = torch.full((4, DIM), i / 8)
            yield x, x.sum(1, keepdim=True)


class RankSized(Dataset):
    """``rows[rank]`` rows on each rank, a length asked in the rank (the ranks fork from one process)."""

    def __init__(self, rows: dict[int, int], stuck: bool = False) -> None:
        self.rows, self.stuck = rows, stuck

    def __len__(self) -> int:
        return self.rows[int(os.environ.get("LOCAL_RANK", 0))]

    def __getitem__(self, i: int):
        if self.stuck and i == 12 and int(os.environ.get("LOCAL_RANK", 0)) == 1:
            time.sleep(3600)  # rank 1's worker, in its fourth batch
        x = torch.full((DIM,), i / 32)
        return x, x.sum(0, keepdim=True)


class Case(LightningModule):
    def __init__(self, case: str, fault_step: int = 3) -> None:
        super().__init__()
        self.case, self.fault_step = case, fault_step
        self.layer = torch.nn.Linear(DIM, 1)
        if case == "head_rank1":
            self.b = torch.nn.Linear(DIM, 1)  # a head only rank 1 uses, after step 3 (a data-dependent branch)
        self.trained: dict[int, int] = {}

    def setup(self, stage: str) -> None:
        if self.case == "setup_barrier" and self.global_rank == 0:
            torch.distributed.barrier()  # rank 0 only: rank 1 goes on to DDP's first broadcast

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.trained[self.current_epoch] = self.trained.get(self.current_epoch, 0) + 1
        at_fault = self.global_step == self.fault_step and self.global_rank == 1
        if self.case == "logkeys":
            self.log("loss", loss, sync_dist=True)
            if at_fault:
                self.log("rare_metric", loss, sync_dist=True)
        elif self.case == "log_dict":
            metrics = {"loss": loss, **({"rare_metric": loss} if at_fault else {})}
            self.log_dict(metrics, sync_dist=True)
        elif self.case == "gather_rank0" and self.global_step == self.fault_step and self.global_rank == 0:
            self.all_gather(loss)
        elif self.case == "raise" and self.global_step == self.fault_step:
            self.all_gather(loss)  # a collective every rank runs, then rank 1 raises before the gradients' all-reduce
            if self.global_rank == 1:
                raise RuntimeError("injected failure on rank 1 between two collectives")
        elif self.case == "sleep" and at_fault:
            time.sleep(3600)
        elif self.case == "head_rank1" and self.global_step > self.fault_step and self.global_rank == 1:
            loss = loss + self.b(x).mean()
        elif self.case == "rank0_work" and self.global_step == self.fault_step and self.global_rank == 0:
            time.sleep(14)  # rank 0's own work (an evaluation, an upload), longer than the watchdog's 10 s: healthy
        elif self.case == "sleep_rank0" and self.global_step == self.fault_step and self.global_rank == 0:
            time.sleep(3600)  # rank 0 hosts the store: its server answers while this thread sleeps
        elif self.case == "stop_rank1" and at_fault:
            self.trainer.should_stop = True  # rank 1 alone (Lightning#379): rank 0 trains on
        return loss

    def on_train_epoch_end(self) -> None:
        if self.case == "epoch_end_log" and self.global_rank == 0:  # Lightning#19604: reduced after this hook
            self.log("epoch_metric", torch.tensor(1.0), sync_dist=True)

    def on_train_end(self) -> None:
        # One write of the whole line: the ranks share the pipe, and print's text and newline can interleave.
        sys.stdout.flush()
        os.write(1, f"rank {self.global_rank}: batches {[self.trained[e] for e in sorted(self.trained)]}\n".encode())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(case: str) -> DataLoader:
    if case in ("uneven_shards", "empty_shard"):
        return DataLoader(Shard({0: 8, 1: 5 if case == "uneven_shards" else 0}), batch_size=None)
    # Sized: each rank its own rows, as a user who shards by hand does (use_distributed_sampler=False).
    if case == "stuck_worker":
        return DataLoader(RankSized({0: 32, 1: 32}, stuck=True), batch_size=4, num_workers=2)
    return DataLoader(RankSized({0: 32, 1: 20 if case == "uneven_sized" else 32}), batch_size=4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["logkeys", "log_dict", "gather_rank0", "raise", "sleep", "sleep_rank0",
                                         "uneven_shards", "empty_shard", "uneven_sized", "even", "log_dir_after_fit",
                                         "rank0_work", "head_rank1", "setup_barrier", "stuck_worker", "stop_rank1",
                                         "epoch_end_log"])  # fmt: skip
    parser.add_argument("--uneven", default="stop", choices=["stop", "error"])
    parser.add_argument("--timeout-s", type=float, default=20)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--strategy", default="lit", choices=["lit", "ddp"], help="ddp: Lightning's own DDPStrategy")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"], help="gpu: NCCL")
    parser.add_argument("--start-method", default="auto", choices=["auto", "popen", "spawn"],
                        help="popen: Lightning's `ddp` launcher (the script again for rank 1)")  # fmt: skip
    args = parser.parse_args()
    callbacks = [LossMonitor(), StepSync(uneven=args.uneven)]  # under `ddp`: Lightning's 30-minute timeout
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=2,
        strategy=LitDDPStrategy(timeout_s=args.timeout_s, start_method=args.start_method)
        if args.strategy == "lit"
        else "ddp",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        use_distributed_sampler=False,
    )
    trainer.fit(Case(args.case), loader(args.case))
    if args.case == "log_dir_after_fit" and trainer.global_rank == 0:
        print(trainer.log_dir)  # a collective (the strategy's broadcast) that rank 1, past its script, never calls


if __name__ == "__main__":
    main()
