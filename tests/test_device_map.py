"""The DeviceMap callback on 2 real ranks: rank 0 prints every rank's row once and warns about a pitfall."""

from lit_ddp import FixedBatchDataModule, LinearRegression
from lit_ddp.callbacks import DeviceMap
from tests.recorders import RecordLogs


def test_rank_0_prints_every_rank_once_and_warns_about_a_pitfall(make_trainer, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_LOCALID", "1")  # both ranks inherit it: right for rank 1, wrong for rank 0
    trainer = make_trainer(max_steps=1, callbacks=[RecordLogs(tmp_path), DeviceMap()])
    trainer.fit(LinearRegression(dim=8), FixedBatchDataModule(dim=8, batch_size=4))
    rank0, rank1 = RecordLogs.read(tmp_path, 0), RecordLogs.read(tmp_path, 1)
    lines = rank0.splitlines()
    header = [i for i, line in enumerate(lines) if line.split()[:2] == ["rank", "local"]]
    assert len(header) == 1, rank0
    assert lines[header[0]].split() == ["rank", "local", "node", "host", "device", "CUDA_VISIBLE_DEVICES",
                                        "LOCAL_RANK", "SLURM_LOCALID"]  # fmt: skip
    rows = [line.split() for line in lines[header[0] + 1 : header[0] + 3]]
    assert [(row[0], row[1], row[2], row[4], row[7]) for row in rows] == [
        ("0", "0", "0", "cpu", "1"),
        ("1", "1", "0", "cpu", "1"),
    ], rank0
    assert "device map: rank 0: SLURM_LOCALID=1 but local rank 0" in rank0
    assert "device map: rank 1" not in rank0
    assert "rank  local" not in rank1 and "device map:" not in rank1  # rank 1 prints and warns nothing
