"""The DDP tuner's command and callback: DDP's bucket layout as the search predicts it, the config it writes and the
script lines it prints, its one-line refusals, and real short tunes on 2 CPU ranks whose YAML ``lit_ddp.fit
--config`` runs. The search on hand-made trials: tests/test_tune_search.py."""

import dataclasses
import json
import textwrap
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lit_ddp.fit import build_cli
from lit_ddp.measure.memory import bucket_layout
from lit_ddp.tuner.callback import knobs_of
from lit_ddp.tuner.cli import TuneCLI, tuned_config
from lit_ddp.tuner.knobs import Knobs, bucket_caps, layout
from lit_ddp.tuner.verdict import script_lines
from tests.runner import free_port, run_fit, run_main, run_module


def test_a_model_under_one_mib_of_gradients_is_one_bucket_whatever_the_cap():
    assert bucket_caps([25_000], None) == [] and bucket_caps([100] * 1000, None) == []
    assert bucket_caps([8 << 20], None) == [] and bucket_caps([25_000] * 10, 1.0) == []  # one gradient; 250 kB
    # Under torch's default cap the first bucket closes at 1 MiB; under a cap of one's own, at the cap.
    assert layout([4 << 20] * 8, None) == [4 << 20, 28 << 20] and layout([4 << 20] * 8, 32) == [32 << 20]
    assert bucket_caps([4 << 20] * 8, None) == [32.0, 16.0, 8.0, 4.0]


def test_the_predicted_layout_is_ddps_own():
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)), nn.Linear(256, 10))
    grads = [p.numel() * 4 for p in reversed(list(model.parameters()))]
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for cap in (None, 0.5, 0.3, 1.0, 25.0):
            ddp = DistributedDataParallel(model, bucket_cap_mb=cap)
            for _ in range(10):  # DDP rebuilds its buckets after step 0; its logging data has them from step 10
                ddp(torch.randn(4, 256)).sum().backward()
            assert layout(grads, cap) == bucket_layout(ddp), cap
    finally:
        dist.destroy_process_group()


MODULE = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning.pytorch import LightningDataModule, LightningModule

    class MLP(LightningModule):
        def __init__(self, width: int = 64):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Data(LightningDataModule):
        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            return DataLoader(TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g)),
                              batch_size=32)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_short_tune_of_a_users_module_writes_a_config_that_fit_runs(tmp_path, monkeypatch):
    (tmp_path / "my_module.py").write_text(textwrap.dedent(MODULE))
    tune = run_module("lit_ddp.tune", "--trainer.accelerator", "cpu", "--devices", "2", "--model", "my_module.MLP",
                      "--model.width", "32", "--data", "my_module.Data", "--tune.budget_s", "20", "--tune.steps",
                      "3", "--out", "out/tuned.yaml", cwd=tmp_path, timeout=120)  # fmt: skip
    assert tune.returncode == 0, tune.stderr[-3000:]
    out = tune.stdout
    assert "DDP tuning: " in out and "configuration" in out and "\nyours" in out
    assert "smaller buckets" not in out  # a 2 kB model is one bucket whatever the cap
    assert out.count("Verdict: ") == 1 and "Wrote out/tuned.yaml (python -m lit_ddp.fit --config out/tuned.yaml)" in out
    script = "In a script, for Trainer(strategy=...):\n    from lit_ddp.run.strategy import LitDDPStrategy\n"
    assert script + "    strategy = LitDDPStrategy(" in out
    record = json.loads((tmp_path / "out" / "tuned.json").read_text())
    assert record["trials"][0]["knobs"] == record["base"] and all(t["in_sync"] for t in record["trials"])
    assert all(len(t["rounds_ms"]) >= 3 and len(t["samples_ms"]) == 3 * len(t["rounds_ms"]) for t in record["trials"])
    # No reported win is faster than the step without any all-reduce.
    if record["verdict"] is not None and record["best"]["optimizer"] == record["base"]["optimizer"]:
        assert record["verdict"]["after_ms"] >= record["verdict"]["floor_ms"], record  # in the same rounds
    # The config carries every knob the verdict names: the module builds its own Adam, so an optimizer change is
    # never in it (it would be the verdict's script change, with its own figure).
    assert record["best"]["optimizer"] == "as_configured"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    written = build_cli(["--config", "out/tuned.yaml"]).trainer.strategy
    assert knobs_of(written) == Knobs(**record["best"])
    fit = run_fit("--config", "out/tuned.yaml", "--trainer.max_steps", "2", cwd=tmp_path, timeout=120)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "Done: 2 steps on 2 ranks" in fit.stdout


def test_tune_help_explains_itself_and_bad_options_are_one_line(monkeypatch, capsys):
    shown = run_main(monkeypatch, capsys, "--help", command="tune")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: lit-ddp-tune")
    shown = shown.stdout
    assert "instead of training, measures DDP configurations on the model's first batch" in " ".join(shown.split())
    for option in ("--tune.budget_s", "--tune.allow_lossy", "--out", "--devices", "--model CONFIG | CLASS_PATH_OR_NAME",
                   "--model.help", "--data CONFIG | CLASS_PATH_OR_NAME"):  # fmt: skip
        assert option in shown, option
    bad = run_main(monkeypatch, capsys, "--tune.rounds", "1", "--trainer.accelerator", "cpu", command="tune")
    code, err = bad.returncode, bad.stderr
    assert code == 2 and err.count("\n") == 1 and err.startswith("lit-ddp-tune: error: "), err
    assert "rounds >= 2" in err
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ('[{"bucket_cap": 4}]', "compare takes dicts of broadcast_buffers, bucket_cap_mb, "),
        ('[{"comm_hook": "powersgd"}]', "comm_hook is one of none, fp16, bf16, powersgd1, powersgd4; got 'powersgd'"),
        ('[{"static_graph": 2}]', "compare's static_graph is true or false; got 2"),
        ('[{"bucket_cap_mb": -1}]', "compare's bucket_cap_mb is a number of MiB > 0 (or null: torch's); got -1"),
        ('[{"comm_hook": "bf16"}]', "--tune.compare asks for bf16 compression, which only NCCL (CUDA) runs"),
        ('[{"comm_hook": "powersgd1"}]', "PowerSGD (tried with allow_lossy, or asked in compare) all-reduces plainly"),
    ],
)
def test_a_configuration_to_compare_that_the_tuner_cannot_measure_is_one_line(monkeypatch, capsys, given, said):
    bad = run_main(monkeypatch, capsys, "--tune.compare", given, "--tune.warmup", "1", "--trainer.accelerator", "cpu",
                   command="tune")  # fmt: skip
    code, err = bad.returncode, bad.stderr
    assert code == 2 and err.count("\n") == 1 and err.startswith("lit-ddp-tune: error: ") and said in err, err
    assert not torch.distributed.is_initialized()


MINE = """
    from lightning.pytorch import LightningDataModule, LightningModule

    class M(LightningModule):
        def __init__(self, lr: float = 0.5, dim: int = 3):
            super().__init__()
            self.lr, self.dim = lr, dim

    class D(LightningDataModule):
        def __init__(self, batch_size: int = 8):
            super().__init__()
            self.batch_size = batch_size
"""


def test_a_users_classes_keep_their_own_defaults_not_the_labs(tmp_path, monkeypatch):
    """The lab's classes are the default, and a class of the user's that takes the same names (lr, dim,
    batch_size) gets its own defaults, from the command line as from a config file."""
    (tmp_path / "mine.py").write_text(textwrap.dedent(MINE))
    (tmp_path / "mine.yaml").write_text("model:\n  class_path: mine.M\ndata:\n  class_path: mine.D\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cpu = ["--trainer.accelerator", "cpu", "--devices", "1"]
    for args in (["--model", "mine.M", "--data", "mine.D"], ["--config", str(tmp_path / "mine.yaml")]):
        cli = build_cli([*cpu, *args])
        assert (cli.model.lr, cli.model.dim, cli.datamodule.batch_size) == (0.5, 3, 8), args
    lab = build_cli([*cpu, "--model.dim", "16"])
    assert type(lab.model).__name__ == "LinearRegression" and lab.datamodule.hparams.dim == 16


def test_the_tuned_config_carries_every_knob_into_a_fit_that_parses_it(tmp_path):
    cli = build_cli(["--trainer.accelerator", "cpu", "--devices", "2", "--model.dim", "32", "--out", "x.yaml"],
                    cli_class=TuneCLI, save_config_callback=None)  # fmt: skip
    knobs = Knobs(bucket_cap_mb=4.0, gradient_as_bucket_view=True, static_graph=True, comm_hook="fp16",
                  optimizer="fused", broadcast_buffers=False)  # fmt: skip
    (tmp_path / "tuned.yaml").write_text(tuned_config(cli, knobs))
    fit = build_cli(["--trainer.accelerator", "cpu", "--config", str(tmp_path / "tuned.yaml")])
    strategy = fit.trainer.strategy
    assert strategy.ddp_kwargs["bucket_cap_mb"] == 4.0 and strategy.ddp_kwargs["gradient_as_bucket_view"]
    assert strategy.ddp_kwargs["static_graph"] and strategy._ddp_comm_hook is default_hooks.fp16_compress_hook
    assert {"forward_sync_buffers", "broadcast_buffers"} & {k for k, v in strategy.ddp_kwargs.items() if v is False}
    assert fit.model.hparams.fused is True and fit.model.hparams.foreach is False and fit.model.hparams.dim == 32
    assert fit.trainer.num_devices == 2
    # ... and the script's lines build the same strategy.
    scope: dict = {}
    exec("\n".join(script_lines(knobs)), scope)  # noqa: S102 (the lines the tuner prints for a script)
    optimizer_line = "# and in configure_optimizers, the optimizer with fused=True (torch's Adam, AdamW and SGD take it"
    assert script_lines(knobs)[-1].startswith(optimizer_line)
    assert not any("fused" in line for line in script_lines(dataclasses.replace(knobs, optimizer="as_configured")))
    assert knobs_of(scope["strategy"]) == knobs_of(strategy)  # the config names the knobs left as torch has them too
    assert scope["strategy"]._ddp_comm_hook is default_hooks.fp16_compress_hook


def test_the_tuned_config_of_a_users_model_logs_under_the_models_name_not_the_labs(tmp_path, monkeypatch):
    (tmp_path / "cnn_of_mine.py").write_text(textwrap.dedent(MINE).replace("class M(", "class MyCNN("))
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["--trainer.accelerator", "cpu", "--devices", "2", "--data", "cnn_of_mine.D", "--out", "x.yaml"]
    for model, name in ((["--model", "cnn_of_mine.MyCNN"], "my_cnn"), ([], "mini_train")):
        cli = build_cli([*args, *model], cli_class=TuneCLI, save_config_callback=None)
        tuned = yaml.safe_load(tuned_config(cli, Knobs()))
        assert tuned["trainer"]["logger"]["init_args"]["name"] == name
    own = ["--model", "cnn_of_mine.MyCNN", "--trainer.logger.init_args.name", "mine"]  # a name of the user's own stays
    cli = build_cli([*args, *own], cli_class=TuneCLI, save_config_callback=None)
    assert yaml.safe_load(tuned_config(cli, Knobs()))["trainer"]["logger"]["init_args"]["name"] == "mine"


def test_another_ddp_strategys_options_are_carried_where_ours_takes_them_and_the_rest_named(tmp_path):
    from lit_ddp.tuner.cli import strategy_args

    def given(*options: str) -> tuple:
        args = ["--trainer.accelerator", "cpu", "--devices", "2", "--trainer.strategy", "DDPStrategy", *options]
        cli = build_cli(args, cli_class=TuneCLI, save_config_callback=None)
        return cli, yaml.safe_load(cli.parser.dump(cli.fit_config, skip_check=True))["trainer"]["strategy"]

    assert strategy_args(given("--trainer.strategy.init_args.process_group_backend", "gloo")[1])[1] == []  # defaults
    cli, strategy = given("--trainer.strategy.init_args.process_group_backend", "gloo",
                          "--trainer.strategy.init_args.timeout", "0:05:00",
                          "--trainer.strategy.init_args.check_reduction", "true")  # fmt: skip
    assert strategy_args(strategy)[1] == ["check_reduction"]  # DDP's deprecated option: LitDDPStrategy has none
    (tmp_path / "tuned.yaml").write_text(tuned_config(cli, Knobs(static_graph=True)))
    fit = build_cli(["--trainer.accelerator", "cpu", "--config", str(tmp_path / "tuned.yaml")]).trainer.strategy
    assert fit.process_group_backend == "gloo" and fit.ddp_kwargs["static_graph"] and fit.timeout_s == 300.0


def test_powersgd_goes_from_the_tuner_into_a_fit_config_and_a_script_line(tmp_path, monkeypatch):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from lit_ddp.run.strategy import LitDDPStrategy

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--trainer.accelerator", "cpu", "--devices", "2"], cli_class=TuneCLI)
    knobs = Knobs(comm_hook="powersgd4")
    (tmp_path / "tuned.yaml").write_text(tuned_config(cli, knobs))
    strategy = build_cli(["--trainer.accelerator", "cpu", "--config", str(tmp_path / "tuned.yaml")]).trainer.strategy
    assert strategy._ddp_comm_hook is powerSGD_hook.powerSGD_hook
    state = strategy._ddp_comm_state
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (4, 1000)  # torch's default start
    assert knobs_of(strategy) == knobs
    scope: dict = {}
    exec("\n".join(script_lines(knobs)), scope)  # noqa: S102
    assert scope["strategy"].powersgd_rank == 4 and knobs_of(scope["strategy"]) == knobs
    with pytest.raises(ValueError, match="is a communication hook: give no ddp_comm_hook"):
        LitDDPStrategy(powersgd_rank=1, ddp_comm_hook=default_hooks.fp16_compress_hook)
    with pytest.raises(ValueError, match="the rank must be >= 1, the start step >= 2"):
        LitDDPStrategy(powersgd_rank=1, powersgd_start_step=1)


def test_without_a_ddp_strategy_the_tuner_says_so_in_one_line(tmp_path):
    from lightning.pytorch import Trainer

    from lit_ddp import DDPTuner, FixedBatchDataModule, LinearRegression

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                      callbacks=[DDPTuner()])  # fmt: skip
    with pytest.raises(ValueError, match=r"^DDPTuner tunes DDP and needs a DDP strategy .*got SingleDeviceStrategy$"):
        trainer.fit(LinearRegression(dim=8), FixedBatchDataModule(dim=8, batch_size=4))


def test_in_a_script_the_tuner_steps_on_the_loaders_given_to_fit(make_trainer):
    from torch.utils.data import DataLoader, TensorDataset

    from lit_ddp import LinearRegression
    from lit_ddp.tuner import DDPTuner

    compare = [{"gradient_as_bucket_view": True}, {"comm_hook": "powersgd1"}]
    tuner = DDPTuner(budget_s=5, steps=1, warmup=2, rounds=2, compare=compare)
    x = torch.randn(12, 8)
    trainer = make_trainer(devices=2, callbacks=[tuner])
    trainer.fit(LinearRegression(dim=8), train_dataloaders=DataLoader(TensorDataset(x, x), batch_size=3))
    assert trainer.global_step == 0  # a tuning run: no training step
    assert tuner.record["samples_per_step"] == 6  # the given loader's batches of 3, on each of 2 ranks
    yours, view, powersgd = tuner.record["trials"]
    assert not yours["knobs"]["gradient_as_bucket_view"] and view["knobs"]["gradient_as_bucket_view"]
    assert all(len(t["rounds_ms"]) == 2 and t["in_sync"] for t in tuner.record["trials"])
    # PowerSGD compressed the timed step (rank 1 of an 8 x 8 weight): other weights, every rank the same ones.
    assert view["max_dw"] == 0 and powersgd["max_dw"] > 1e-4


def test_the_users_knobs_are_read_from_the_strategy_on_every_torch():
    from lit_ddp.run.strategy import LitDDPStrategy

    strategy = LitDDPStrategy(broadcast_buffers=False, gradient_as_bucket_view=True, bucket_cap_mb=2.0,
                              ddp_comm_hook=default_hooks.fp16_compress_hook)  # fmt: skip
    assert knobs_of(strategy) == Knobs(bucket_cap_mb=2.0, gradient_as_bucket_view=True, broadcast_buffers=False,
                                        comm_hook="fp16")  # fmt: skip


def test_the_users_knobs_come_through_the_register_and_a_missing_name_is_loud():
    from lit_ddp.run.strategy import LitDDPStrategy

    strategy = LitDDPStrategy(static_graph=True)
    del strategy._ddp_kwargs  # as if Lightning stopped keeping it: no silent "your configuration is torch's"
    with pytest.raises(RuntimeError, match="lightning changed: DDPStrategy keeps no _ddp_kwargs"):
        knobs_of(strategy)


def test_a_hook_the_tuner_cannot_measure_is_refused_in_one_line_before_any_rank_starts(monkeypatch, capsys):
    hook = "torch.distributed.algorithms.ddp_comm_hooks.quantization_hooks.quantization_pertensor_hook"
    bad = run_main(monkeypatch, capsys, "--trainer.accelerator", "cpu", "--devices", "2",
                   "--trainer.strategy.init_args.ddp_comm_hook", hook, command="tune")  # fmt: skip
    code, err = bad.returncode, bad.stderr
    assert code == 2 and err.count("\n") == 1, err
    assert err == ("lit-ddp-tune: error: DDPTuner: the strategy's communication hook quantization_pertensor_hook is "
                   "not one the tuner measures (fp16 or bf16 compression, PowerSGD at rank 1 or 4, or none): tune "
                   "without it\n")  # fmt: skip
    assert not torch.distributed.is_initialized()


def test_a_json_out_is_refused_in_one_line(monkeypatch, capsys):
    bad = run_main(monkeypatch, capsys, "--trainer.accelerator", "cpu", "--out", "tuned.json", command="tune")
    code, err = bad.returncode, bad.stderr
    assert (
        code == 2
        and err == "lit-ddp-tune: error: --out tuned.json: the config is YAML (every trial goes beside it, as .json)\n"
    )


def test_a_powersgd_start_step_of_ones_own_is_when_torchs_powersgd_starts_compressing():
    """``--trainer.strategy.init_args.powersgd_start_step 4`` reaches the PowerSGD state registered on DDP: steps
    0-3 all-reduce plainly (no error feedback kept), step 4 compresses (torch keeps each matrix's error)."""
    from lit_ddp import _lightning

    given = {"powersgd_rank": 1, "powersgd_start_step": 4}
    options = [arg for k, v in given.items() for arg in (f"--trainer.strategy.init_args.{k}", str(v))]
    strategy = build_cli(["--trainer.accelerator", "cpu", "--devices", "2", *options]).trainer.strategy
    configured = _lightning.configured_comm_hook(strategy)
    assert (configured.state.matrix_approximation_rank, configured.state.start_powerSGD_iter) == (1, 4)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(nn.Linear(32, 32, bias=False))
        _lightning.register_comm_hook(ddp, configured.state, configured.hook, configured.wrapper)
        compressed = []
        for _ in range(6):
            ddp(torch.randn(4, 32)).sum().backward()
            compressed.append(bool(configured.state.error_dict))
        assert compressed == [False] * 4 + [True] * 2
    finally:
        # gloo's worker thread drops its last all-reduce work (whose tensors need the GIL to be freed) under the
        # group's mutex a moment after the step; freeing DDP's reducer then, the group's destructor waits for that
        # mutex with the GIL held: a deadlock (seen once in .ci/run, both native stacks read with py-spy). Giving
        # the GIL up for a moment lets the worker finish first.
        time.sleep(0.2)
        dist.destroy_process_group()
