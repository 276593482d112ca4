"""``python -m lit_ddp.fit`` as a user runs it: the real ``ddp`` launcher in a subprocess, and ``cli_main``."""

import re
import shutil
import sys

import pytest
import yaml

from lit_ddp.fit import build_cli, main
from tests.runner import ROOT, STEP_LINE, TORCHRUN, pythonpath, run_fit, run_main, step_losses, step_numbers

CPU = ("--trainer.accelerator", "cpu")  # for build_cli and main(): the subprocess helpers add it themselves
SMALL = ("--devices", "2", "--model.dim", "64")


# A sitecustomize that tells torch it has one GPU, inherited by the ranks through PYTHONPATH: a GPU machine, as far
# as Lightning can tell without using the GPU.
# Lightning is told there is a GPU; torch is not: faked in torch (is_available, device_count), a CUDA build without a
# driver initialises CUDA inside Adam's step (torch 2.14's graph-capture health check) and the rank dies.
ONE_FAKE_GPU = (
    "from lightning.pytorch.accelerators.cuda import CUDAAccelerator\n"
    "CUDAAccelerator.is_available = staticmethod(lambda: True)\n"
)


def assert_notes_output(result, version: int) -> list[float]:
    """The default run's whole output: the device map, the 5 step lines, the sync verdict, the Done line; no
    banner, no warning. Returns the losses."""
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 10, result.stdout  # the map (header + 2 ranks), 5 steps, the sync verdict, Done
    assert lines[0].split()[:3] == ["rank", "local", "node"]  # the device map, printed once
    assert [line.split()[0] for line in lines[1:3]] == ["0", "1"]
    assert step_numbers("\n".join(lines[3:8])) == [0, 1, 2, 3, 4]
    losses = step_losses(result.stdout)
    assert all(a > b for a, b in zip(losses, losses[1:], strict=False)), losses
    assert lines[8] == "weights in sync across 2 ranks after step 4: max |diff| = 0 (1,049,600 parameters)"
    # No checkpoint written (--checkpoint.every_n_steps 0): the Done line names none.
    assert re.fullmatch(r"Done: 5 steps on 2 ranks, backend gloo, device cpu, wall [0-9.]+ s, "
                        rf"logs in runs/mini_train/version_{version}", lines[9])  # fmt: skip
    for banner in ("GPU available", "TPU available", "Seed set to", "Tip:", "Initializing distributed"):
        assert banner not in result.stdout + result.stderr, banner
    assert not re.search("warn|Traceback", result.stderr, re.I), result.stderr
    return losses


def test_default_run_prints_the_notes_output_and_nothing_else(notes_run, tmp_path):
    losses = assert_notes_output(notes_run.result, version=0)
    # Again where torch reports a GPU (--trainer.accelerator cpu on a GPU machine), in a copy of the first run's
    # directory: the same output, in a new run directory rather than a clash with the first run's config.yaml.
    shutil.copytree(notes_run.cwd / "runs", tmp_path / "runs")
    fake = tmp_path / "one_fake_gpu"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(ONE_FAKE_GPU)
    second = run_fit("--devices", "2", cwd=tmp_path, env={"PYTHONPATH": pythonpath(fake)})
    assert assert_notes_output(second, version=1) == losses
    runs = sorted(p.name for p in (tmp_path / "runs" / "mini_train").iterdir())
    assert runs == ["version_0", "version_1"]
    assert (tmp_path / "runs" / "mini_train" / "version_1" / "config.yaml").is_file()


@pytest.mark.slow
def test_four_cpu_processes_print_the_steps_once(tmp_path):
    result = run_fit("--devices", "4", "--model.dim", "256", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(STEP_LINE.findall(result.stdout)) == 5
    assert "on 4 ranks" in result.stdout


def test_two_ranks_and_one_rank_with_double_batch_print_the_same_losses(notes_run, tmp_path, monkeypatch, capsys):
    """README's pair: ``--devices 2`` (the notes' run) and ``--devices 1 --data.batch_size 64``."""
    two = notes_run.result
    assert two.returncode == 0, two.stderr[-3000:]
    # One process launches nothing, so it can run in this process.
    one = run_main(monkeypatch, capsys, *CPU, "--devices", "1", "--data.batch_size", "64",
                   f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}")  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    assert len(step_losses(one.stdout)) == 5
    assert step_losses(one.stdout) == step_losses(two.stdout)


def screen_lines(raw: str) -> list[str]:
    """The lines a terminal shows for ``raw``: a carriage return goes back to the start of the line, and what
    follows overwrites what was there (tqdm redraws its bar this way)."""
    lines = []
    for line in raw.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part) :]
        lines.append(shown.rstrip())
    return lines


# Lightning draws Rich's bar and model summary when rich is installed (what `enable_*` true give there), tqdm's
# and its plain table otherwise (named as callbacks here): both are tested wherever rich is installed. Each with
# the bar's last state as it writes it, and its table's column rule.
BARS = {
    "tqdm": (("--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar",
              "--trainer.callbacks+=lightning.pytorch.callbacks.ModelSummary"), "Epoch 2: 100%", "|"),
    "rich": (("--trainer.enable_model_summary", "true"), "4/4 ", "┃"),
}  # fmt: skip
EPOCHS = ("--trainer.max_steps", "-1", "--trainer.max_epochs", "3", "--data.steps_per_epoch", "4")  # 12 steps


@pytest.fixture(scope="module", params=list(BARS))
def with_bar(request, tmp_path_factory) -> tuple[str, list[str]]:
    """One run per bar with the bar, the model summary and the simple profiler on (each only adds text), over 3
    epochs of 4 steps (the bar starts again each epoch; the epochs end the run): its bar's name and the screen
    lines of its stdout."""
    if request.param == "rich":
        pytest.importorskip("rich")
    args, drawn, _ = BARS[request.param]
    result = run_fit(*SMALL, *EPOCHS, "--trainer.profiler", "simple", "--trainer.enable_progress_bar", "true", *args,
                     cwd=tmp_path_factory.mktemp(request.param))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert drawn in result.stdout + result.stderr  # the bar was drawn
    return request.param, screen_lines(result.stdout)


def test_max_epochs_ends_after_the_last_epoch(with_bar):
    shown = "\n".join(with_bar[1])
    assert step_numbers(shown) == list(range(12))
    assert "weights in sync across 2 ranks after step 11:" in shown
    assert re.search(r"^Done: 12 steps on 2 ranks,", shown, re.M), shown


def test_the_simple_profiler_prints_its_report(with_bar):
    assert any("FIT Profiler Report" in line for line in with_bar[1]), with_bar


def test_the_model_summary_is_printed_when_asked(with_bar):
    rule = re.escape(BARS[with_bar[0]][2])
    assert any(re.search(rf"{rule} Name +{rule} Type", line) for line in with_bar[1]), with_bar


def test_with_the_progress_bar_every_step_line_is_a_line_of_its_own(with_bar):
    with_steps = [line for line in with_bar[1] if "Step " in line]
    assert [STEP_LINE.fullmatch(line) is not None for line in with_steps] == [True] * 12, with_steps


def test_with_the_progress_bar_the_device_map_and_the_done_line_remain(with_bar):
    lines = with_bar[1]
    assert any(line.split()[:3] == ["rank", "local", "node"] for line in lines), lines
    assert any(line.startswith("Done: 12 steps on 2 ranks") for line in lines), lines


def test_help_names_the_program_as_it_is_run(tmp_path):
    result = run_fit("--help", cwd=tmp_path, accelerator=None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("usage: python -m lit_ddp.fit ")
    assert "fit.py" not in result.stdout


def test_help_opens_with_the_tool_and_its_own_options(monkeypatch, capsys):
    """What the tool is, --devices and the callbacks' groups come before Lightning's --trainer.* options."""
    result = run_main(monkeypatch, capsys, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # however the terminal's width wrapped it
    usage = "usage: lit-ddp-fit [-h] [--devices N] [-c CONFIG] [--print_config] [--GROUP.OPTION VALUE ...]"
    assert text.startswith(f"{usage} lit_ddp: the notes' DDP lab experiment in PyTorch Lightning, instrumented.")
    assert "--devices N Shorthand for --trainer.devices N" in text
    assert "Lightning Trainer command line tool" not in text  # LightningCLI's own title
    lines = result.stdout.splitlines()
    option = [i for i, line in enumerate(lines) if re.match(r"  --\w", line)]  # option lines, not the text's
    names = ("devices", "loss_monitor.", "sync_check.", "step_sync.", "checkpoint.", "trainer.", "model.")
    first = {name: next(i for i in option if lines[i].startswith(f"  --{name}")) for name in names}
    assert first["devices"] < first["loss_monitor."] < first["sync_check."] < first["step_sync."]
    assert first["step_sync."] < first["checkpoint."] < first["trainer."] < first["model."]


@pytest.mark.slow
def test_lightning_s_own_ddp_strategy_runs_the_profile_config(tmp_path):
    result = run_fit("--trainer.strategy", "ddp", "--config", str(ROOT / "configs" / "mini_train_profile.yaml"),
                     "--devices", "2", "--trainer.max_steps", "3", "--model.dim", "256", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert step_numbers(result.stdout) == [0, 1, 2]
    assert "Phase times (perf_counter: host time), 2 rank(s)" in result.stdout
    assert "Gradient all-reduce per step (2 ranks" in result.stdout
    assert "263,168 bytes reduced per step" in result.stdout  # 4 * (256 * 256 + 256)
    assert re.search(r"^Done: 3 steps on 2 ranks, backend gloo", result.stdout, re.M), result.stdout


def test_model_dim_sets_the_data_dim_and_options_reach_the_objects():
    cli = build_cli([*CPU, "--model.dim", "48", "--model.fused", "false", "--data.seed", "3",
                     "--trainer.max_steps", "7", "--trainer.strategy.bucket_cap_mb", "1",
                     "--trainer.strategy.static_graph", "true"])  # fmt: skip
    assert cli.model.hparams.dim == cli.datamodule.hparams.dim == 48
    assert cli.model.hparams.fused is False
    assert cli.datamodule.hparams.seed == 3
    assert cli.trainer.max_steps == 7
    assert cli.trainer.strategy.ddp_kwargs == {"static_graph": True, "bucket_cap_mb": 1.0}  # only those given


def test_explicit_options_win_over_config_files_wherever_written(tmp_path):
    config = str(ROOT / "configs" / "cpu_small.yaml")  # devices: 2, dim: 256
    for args in (["--devices", "1", "--config", config], ["--config", config, "--devices", "1"]):
        cli = build_cli([*CPU, *args, "--model.dim", "32"])
        assert cli.trainer.num_devices == 1 and cli.model.hparams.dim == 32, args
    two_files = build_cli([*CPU, "--config", config, "--config", str(ROOT / "configs" / "mini_train.yaml")])
    assert two_files.model.hparams.dim == 1024  # files keep their order: the later one wins


def test_print_config_round_trips(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # It prints and exits before any rank starts, so it can run in this process.
    result = run_main(monkeypatch, capsys, *CPU, "--devices", "2", "--model.dim", "64", "--print_config")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert int(config["trainer"]["devices"]) == 2 and config["model"]["init_args"]["dim"] == 64
    assert config["trainer"]["strategy"]["class_path"] == "lit_ddp.LitDDPStrategy"  # by its public name
    (tmp_path / "printed.yaml").write_text(result.stdout)
    cli = build_cli([*CPU, "--config", str(tmp_path / "printed.yaml")])
    assert cli.model.hparams.dim == 64


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_parses_and_instantiates(config):
    cli = build_cli([*CPU, "--config", str(config)])
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
    (["--trainer.max_step", "20"], "unrecognized arguments: --trainer.max_step 20"),  # no prefix of max_steps
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


TYPOS = [
    (["--trainer.max_stpes", "3"], "unrecognized arguments: --trainer.max_stpes 3; did you mean --trainer.max_steps?"),
    (["--loss_monitor.every_n_stpes", "3"], "did you mean --loss_monitor.every_n_steps?"),
    (["--devcies", "2"], "unrecognized arguments: --devcies 2; did you mean --devices?"),  # the shorthand too
    (["--model.dimm", "3"], "Option 'dimm' is not accepted; did you mean dim?"),
    (
        ["--trainer.strategy.init_args.timeout_ss", "3"],
        "(lit_ddp.LitDDPStrategy): Option 'timeout_ss' is not accepted; did you mean timeout_s?",
    ),  # fmt: skip
    (
        ["--config", "callback.yaml"],
        'Parser key "trainer.callbacks" (lit_ddp.callbacks.PhaseTimer): Option '
        "'print_stepz' is not accepted; did you mean print_steps?",
    ),  # fmt: skip
    (["--config", "trainer.yaml"], "Group 'trainer' does not accept option 'max_stpes'; did you mean max_steps?"),
    (["--trainer.zzz", "3"], "unrecognized arguments: --trainer.zzz 3"),  # nothing near: no guess
]


@pytest.mark.parametrize("args, message", TYPOS, ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_a_mistyped_name_is_one_short_line_with_the_nearest_name(args, message, capsys, monkeypatch, tmp_path):
    """A callback's init_args typo was a 900-character Union dump; a mistyped option had no suggestion."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "callback.yaml").write_text("trainer:\n  callbacks:\n    - class_path: lit_ddp.callbacks.PhaseTimer\n"
                                            "      init_args:\n        print_stepz: 3\n")  # fmt: skip
    (tmp_path / "trainer.yaml").write_text("trainer:\n  max_stpes: 3\n")
    result = run_main(monkeypatch, capsys, *CPU, *args)
    err = result.stderr.strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1 and len(err) < 200, err
    assert err.endswith(message), err


def test_bad_yaml_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "unknown_key.yaml").write_text("model:\n  width: 3\n")
    (tmp_path / "wrong_type.yaml").write_text("trainer:\n  max_steps: many\n")
    (tmp_path / "not_yaml.yaml").write_text("model: [dim: 3\n")
    (tmp_path / "devices.yaml").write_text("devices: 2\n")  # the command line's shorthand is no config key
    for name in ("unknown_key", "wrong_type", "not_yaml", "devices"):
        monkeypatch.setattr(sys, "argv", ["lit-ddp-fit", "--config", str(tmp_path / f"{name}.yaml")])
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert exit_info.value.code == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, name
    assert err.endswith("--devices is a command-line shorthand; a config file says trainer.devices"), err


def test_bad_input_exits_2_without_traceback_or_spawn(tmp_path):
    result = run_fit("--devices", "2", "--model.dim", "-4", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        'lit-ddp-fit: error: Parser key "model.dim": Not of type PositiveInt: -4 does not conform to restriction v>0'
    ]
    assert not (tmp_path / "runs").exists()


def test_help_gives_each_option_the_default_the_command_takes_and_stays_short(monkeypatch, capsys):
    result = run_main(monkeypatch, capsys, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    # Lightning's docstring said "Default: ``True``." before the tool's own default, False.
    assert "--trainer.enable_progress_bar {true,false,null} Whether to enable to progress bar by default. (type: " \
           "Optional[bool], default: False)" in text  # fmt: skip
    assert "Default:" not in text and "known subclasses" not in text
    assert "--loss_monitor CONFIG" not in text and "-c CONFIG, --config CONFIG" in text
    assert len(result.stdout.splitlines()) < 320, len(result.stdout.splitlines())  # 482 before


def test_done_names_the_checkpoint_and_a_run_without_a_step_limit_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    result = run_main(monkeypatch, capsys, *CPU, "--devices", "1", "--model.dim", "8", "--trainer.max_steps", "-1",
                      "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3", "--checkpoint.every_n_steps",
                      "2", "--loss_monitor.every_n_steps", "0")  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    # At the start, under the device map (header, one rank), before any step.
    limit = "No step limit (max_steps=-1): 2 epoch(s) of 3 batch(es), 6 steps; --trainer.max_steps N sets one"
    assert lines[2] == limit, lines
    done = (
        r"Done: 6 steps on 1 rank, backend \S+, device cpu, wall [0-9.]+ s, logs in runs/mini_train/version_0, "
        r"checkpoint runs/mini_train/checkpoints/last\.ckpt"
    )
    assert re.fullmatch(done, lines[-1]), lines[-1]
    assert (tmp_path / "runs/mini_train/checkpoints/last.ckpt").is_file()
    assert "max_epochs` was not set" not in result.stdout + result.stderr


# What torchrun sets in each worker it starts (rank 0 of 2 on one node).
TORCHRUN_RANK_0_OF_2 = {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}  # fmt: skip


def test_under_torchrun_the_devices_are_torchrun_s_and_a_mismatch_is_one_line(monkeypatch, capsys):
    for name, value in TORCHRUN_RANK_0_OF_2.items():
        monkeypatch.setenv(name, value)
    cli = build_cli([*CPU, "--model.dim", "8"])
    assert (cli.trainer.num_devices, cli.trainer.num_nodes) == (2, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")  # two nodes of two
    cli = build_cli([*CPU, "--model.dim", "8"])
    assert (cli.trainer.num_devices, cli.trainer.num_nodes) == (2, 2)
    for args, line in (
        (("--devices", "3"), "--trainer.devices 3 under torchrun --nproc_per_node 2: leave it out (torchrun's count "
                             "is taken) or make it 2"),
        (("--trainer.num_nodes", "3"), "--trainer.num_nodes 3 under torchrun with 2 node(s) of 2 process(es): leave "
                                       "it out or make it 2"),
    ):  # fmt: skip
        result = run_main(monkeypatch, capsys, *CPU, *args)
        assert (result.returncode, result.stderr.splitlines()) == (2, [f"lit-ddp-fit: error: {line}"])


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_torchrun_without_devices_runs_on_its_processes(tmp_path):
    launcher = (*TORCHRUN, "--standalone", "--nproc_per_node", "2")
    result = run_fit("--model.dim", "64", "--trainer.max_steps", "2", launcher=launcher, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^Done: 2 steps on 2 ranks, backend gloo", result.stdout, re.M), result.stdout
    refused = run_fit("--devices", "3", launcher=launcher, cwd=tmp_path, timeout=120)
    assert refused.returncode != 0
    ours = [line for line in refused.stderr.splitlines() if line.startswith("lit-ddp-fit: error:")]
    line = (
        "lit-ddp-fit: error: --trainer.devices 3 under torchrun --nproc_per_node 2: leave it out (torchrun's "
        "count is taken) or make it 2"
    )
    assert ours and set(ours) == {line}, refused.stderr[-3000:]  # each rank that says it says that


def test_under_the_cli_advice_names_the_options_to_type(profile_run):
    out = profile_run.result.stdout
    assert profile_run.result.returncode == 0, profile_run.result.stderr[-2000:]
    assert "copy of the gradients: --trainer.strategy.gradient_as_bucket_view true gives back 67,125,248 bytes" in out
    assert "DDPStrategy(" not in out  # a script's phrasing (tests/test_own_module.py)
