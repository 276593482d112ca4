"""``trainer.log_dir`` read in an ``@rank_zero_only`` ``on_fit_start``: the property broadcasts the folder, a
collective that rank 1 never calls (Lightning#18148: "makes the program freeze after first step")."""

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line="print(f\"logging to {self.trainer.log_dir}\")", cause="collective on some ranks",
              certain=True)  # fmt: skip


class Case(Net):
    @rank_zero_only
    def on_fit_start(self) -> None:
        hang_starts()
        print(f"logging to {self.trainer.log_dir}")


if __name__ == "__main__":
    trainer(logger=CSVLogger("logs")).fit(Case(), loader())
