"""``python -m lit_ddp.fit`` as a user runs it: the real ``ddp`` launcher in a subprocess, and ``cli_main``."""

import re
import sys

import pytest
import yaml

from lit_ddp.fit import build_cli, main
from tests.helpers import ROOT, run_module

STEP_LINE = re.compile(r"^Step (\d+), Loss ([0-9.]+)$", re.M)


def step_losses(stdout: str) -> list[float]:
    return [float(loss) for _, loss in STEP_LINE.findall(stdout)]


def test_default_run_prints_five_decreasing_steps_once(tmp_path):
    first = run_module("lit_ddp.fit", "--devices", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    losses = step_losses(first.stdout)
    assert [int(i) for i, _ in STEP_LINE.findall(first.stdout)] == [0, 1, 2, 3, 4]
    assert all(a > b for a, b in zip(losses, losses[1:], strict=False)), losses
    lines = first.stdout.splitlines()
    assert lines[0].split()[:3] == ["rank", "local", "node"]  # the device map, printed once
    assert sum(line.startswith("rank ") for line in lines) == 1
    assert lines[-2] == "weights in sync across 2 ranks after step 4: max |diff| = 0 (1,049,600 parameters)"
    assert re.match(r"Done: 5 steps on 2 ranks, backend gloo, device cpu, wall [0-9.]+ s", lines[-1])
    assert "Traceback" not in first.stderr
    # The same command again: a new run directory, not a clash with the first run's config.yaml.
    second = run_module("lit_ddp.fit", "--devices", "2", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert step_losses(second.stdout) == losses
    runs = sorted(p.name for p in (tmp_path / "runs" / "mini_train").iterdir())
    assert runs == ["version_0", "version_1"]
    assert (tmp_path / "runs" / "mini_train" / "version_1" / "config.yaml").is_file()


@pytest.mark.slow
def test_four_cpu_processes_print_the_steps_once(tmp_path):
    result = run_module("lit_ddp.fit", "--devices", "4", "--model.dim", "256", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(STEP_LINE.findall(result.stdout)) == 5
    assert "on 4 ranks" in result.stdout


def test_two_ranks_and_one_rank_with_double_batch_print_the_same_losses(tmp_path, capsys):
    two = run_module("lit_ddp.fit", "--devices", "2", "--model.dim", "128", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    # One process launches nothing, so it can run in this process.
    sys_argv = ["lit-ddp-fit", "--devices", "1", "--data.batch_size", "64", "--model.dim", "128",
                f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"]  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", sys_argv)
        main()
    one = capsys.readouterr().out
    assert len(step_losses(one)) == 5
    assert step_losses(one) == step_losses(two.stdout)


def test_model_dim_sets_the_data_dim_and_options_reach_the_objects():
    cli = build_cli(["--model.dim", "48", "--model.fused", "false", "--data.seed", "3", "--trainer.max_steps", "7",
                     "--trainer.strategy.bucket_cap_mb", "1", "--trainer.strategy.static_graph", "true"])  # fmt: skip
    assert cli.model.hparams.dim == cli.datamodule.hparams.dim == 48
    assert cli.model.hparams.fused is False
    assert cli.datamodule.hparams.seed == 3
    assert cli.trainer.max_steps == 7
    assert cli.trainer.strategy.ddp_kwargs == {
        "static_graph": True,
        "gradient_as_bucket_view": False,
        "find_unused_parameters": False,
        "bucket_cap_mb": 1.0,
    }


def test_explicit_options_win_over_config_files_wherever_written(tmp_path):
    config = str(ROOT / "configs" / "cpu_small.yaml")  # devices: 2, dim: 256
    for args in (["--devices", "1", "--config", config], ["--config", config, "--devices", "1"]):
        cli = build_cli([*args, "--model.dim", "32"])
        assert cli.trainer.num_devices == 1 and cli.model.hparams.dim == 32, args
    two_files = build_cli(["--config", config, "--config", str(ROOT / "configs" / "mini_train.yaml")])
    assert two_files.model.hparams.dim == 1024  # files keep their order: the later one wins


def test_print_config_round_trips(tmp_path):
    result = run_module("lit_ddp.fit", "--devices", "2", "--model.dim", "64", "--print_config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert int(config["trainer"]["devices"]) == 2 and config["model"]["dim"] == 64
    assert config["trainer"]["strategy"]["class_path"] == "lit_ddp.strategy.LitDDPStrategy"
    (tmp_path / "printed.yaml").write_text(result.stdout)
    cli = build_cli(["--config", str(tmp_path / "printed.yaml")])
    assert cli.model.hparams.dim == 64


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_parses_and_instantiates(config):
    cli = build_cli(["--config", str(config)])
    assert cli.trainer.max_steps > 0
    assert cli.model.hparams.dim == cli.datamodule.hparams.dim


BAD_INPUTS = [
    (["--devices", "0"], "--trainer.devices"),
    (["--devices", "-2"], "--trainer.devices"),
    (["--devices", "two"], "--trainer.devices"),
    (["--trainer.accelerator", "mps"], "accelerator"),  # refused on Linux, with or without GPUs
    (["--trainer.strategy", "nonsense"], "strategy"),
    (["--model.dim", "0"], "model.dim"),
    (["--model.dim", "wide"], "model.dim"),
    (["--model.lr", "-1e-3"], "model.lr"),
    (["--data.batch_size", "0"], "data.batch_size"),
    (["--trainer.max_steps", "-5"], "max_steps"),
    (["--no_such_option", "1"], "no_such_option"),
    (["--config", "missing.yaml"], "missing.yaml"),
]


@pytest.mark.skipif(sys.platform != "linux", reason="messages checked on Linux")
@pytest.mark.parametrize("args, names", BAD_INPUTS, ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_bad_input_is_one_line_and_exit_2(args, names, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit-ddp-fit", *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("lit-ddp-fit: error:"), err
    assert names in err


def test_bad_yaml_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "unknown_key.yaml").write_text("model:\n  width: 3\n")
    (tmp_path / "wrong_type.yaml").write_text("trainer:\n  max_steps: many\n")
    (tmp_path / "not_yaml.yaml").write_text("model: [dim: 3\n")
    for name in ("unknown_key", "wrong_type", "not_yaml"):
        monkeypatch.setattr(sys, "argv", ["lit-ddp-fit", "--config", str(tmp_path / f"{name}.yaml")])
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert exit_info.value.code == 2, name
        assert len(capsys.readouterr().err.strip().splitlines()) == 1, name


def test_bad_input_exits_2_without_traceback_or_spawn(tmp_path):
    result = run_module("lit_ddp.fit", "--devices", "2", "--model.dim", "-4", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        'lit-ddp-fit: error: Parser key "model.dim": Not of type PositiveInt: -4 does not conform to restriction v>0'
    ]
    assert not (tmp_path / "runs").exists()
