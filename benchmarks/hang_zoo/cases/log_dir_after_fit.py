"""``trainer.log_dir`` under ``if trainer.global_rank == 0`` after ``fit``: rank 0 broadcasts, rank 1 has finished
(lit_ddp#52: 129 s and no diagnosis with the callbacks, 7.4 s without; Lightning#18148)."""

from lightning.pytorch.loggers import CSVLogger

from benchmarks.hang_zoo.expect import Hang
from benchmarks.hang_zoo.user import Net, hang_starts, loader, trainer

EXPECT = Hang(rank=0, line='print(f"logs in {fitted.log_dir}")', cause="collective on some ranks", certain=True)

if __name__ == "__main__":
    fitted = trainer(logger=CSVLogger("logs"), max_epochs=1)
    fitted.fit(Net(), loader())
    if fitted.global_rank == 0:
        hang_starts()
        print(f"logs in {fitted.log_dir}")
