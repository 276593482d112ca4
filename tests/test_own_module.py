"""The callbacks in a user's own script: a plain ``Trainer(strategy="ddp")``, a model that is not ours (Lightning's
demo Transformer on random tokens, SGD), 2 CPU ranks. Tables and verdict print once, on rank 0."""

import re

import pytest

from tests.runner import run_module

SCRIPT = """
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.demos import LightningTransformer
from torch.utils.data import DataLoader, TensorDataset

from lit_ddp.callbacks import CommMonitor, DeviceMap, PhaseTimer, SyncCheck


class RandomTokens(LightningTransformer):
    def prepare_data(self):  # the demo downloads WikiText2 here; random tokens need nothing
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    seed_everything(0)
    tokens = torch.randint(0, 1000, (64, 17))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[PhaseTimer(), CommMonitor(), SyncCheck(), DeviceMap()])
    trainer.fit(RandomTokens(vocab_size=1000), data)
"""


@pytest.mark.timeout(150)
def test_callbacks_print_once_in_a_plain_script(tmp_path):
    (tmp_path / "own_script.py").write_text(SCRIPT)
    result = run_module("own_script", cwd=tmp_path, timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr  # Lightning's own log handler writes to stderr
    for line in (
        "Phase times (perf_counter: host time), 2 rank(s), step 0 = warm-up, then 3 steady step(s):",
        "Roofline (rank 0, steady median):",
        "Gradient all-reduce per step (2 ranks, compression none, all ranks, steady median):",
        "weights in sync across 2 ranks after step 3: max |diff| = 0 (1,692,200 parameters)",
    ):
        assert out.count(line) == 1, (line, out[-3000:])
    assert len(re.findall(r"^rank\s+local\s+node", out, re.M)) == 1  # the device map
    assert out.count("Step 0\n forward : ") == 1
    # The roofline is right for a model that is not a stack of Linears: FLOPs counted on the real batch
    # (FlopCounterMode gives 388.7 MFLOP for this forward), SGD's 3 x 4 bytes per parameter.
    assert re.search(r"^forward\s+388\.7 MFLOP", out, re.M), out[-2000:]
    assert re.search(r"^update\s+20\.3 MB", out, re.M)  # 12 x 1,692,200 bytes
    assert "6,768,800 bytes reduced per step (6,768,800 bytes of gradients)" in out
