"""README's commands, run as a new user would run them, against what README says they print: the options
named under "Options and configs" exist (``--help`` lists them), the lines under "When things go wrong" are
what those commands print, and the "Scaling forecast" commands run as shown, in order, the second printing the
excerpt README shows (the same lines, numbers aside)."""

import re
import shutil

import pytest

from lit_ddp.run.arguments import expand_shorthands
from tests.runner import ROOT, run_main, run_module

README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)


def test_every_option_readme_names_exists(monkeypatch, capsys):
    named = set(re.findall(r"`(--[\w.]+)", section("Options and configs")))
    assert {"--loss_monitor.every_n_steps", "--trainer.accumulate_grad_batches", "--trainer.precision"} <= named
    shown = run_main(monkeypatch, capsys, "--help").stdout
    strategy = run_main(monkeypatch, capsys, "--trainer.strategy.help", "lit_ddp.run.strategy.LitDDPStrategy").stdout
    missing = []
    for option in sorted(named):
        if option == "--devices":  # the tool's shorthand, expanded before parsing
            assert expand_shorthands(["--devices", "2"]) == ["--trainer.devices", "2"]
        else:
            listed = strategy if option.startswith("--trainer.strategy.") else shown
            missing += [] if re.search(rf"{re.escape(option)}(\b|\.)", listed) else [option]
    assert not missing, f"README names options that --help does not list: {missing}"


def test_what_goes_wrong_prints_what_readme_says(tmp_path, monkeypatch, capsys):
    """Each ``$ python -m lit_ddp.fit ...`` line and the line README shows under it, run in a fresh directory
    (with README.md in it: one command takes it for a checkpoint)."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    monkeypatch.chdir(tmp_path)
    (block,) = [b for b in code_blocks(section("When things go wrong")) if b.startswith("$ ")]
    lines = block.strip().splitlines()
    pairs = [(cmd[2:].split(), said) for cmd, said in zip(lines[::2], lines[1::2], strict=True)]
    assert len(pairs) >= 5 and all(cmd[:3] == ["python", "-m", "lit_ddp.fit"] for cmd, _ in pairs)
    for cmd, said in pairs:
        result = run_main(monkeypatch, capsys, "--trainer.accelerator", "cpu", *cmd[3:])
        assert result.returncode == 2, (cmd, result.stderr)
        assert result.stderr.strip() == said, cmd


@pytest.mark.slow  # the profile run, the probe and two forecasts: about 17 s on 2 cores
@pytest.mark.timeout(300)
def test_the_scaling_forecast_commands_run_as_shown(tmp_path):
    text = section("Scaling forecast")
    commands = [line.split("#")[0].split() for line in code_blocks(text)[0].strip().splitlines()]
    assert [c[:3] for c in commands] == [["python", "-m", "lit_ddp.fit"], ["python", "-m", "lit_ddp.forecast"],
                                         ["python", "-m", "lit_ddp.allreduce_probe"],
                                         ["python", "-m", "lit_ddp.forecast"]]  # fmt: skip
    assert "--probe" in commands[3] and "probe.json" in commands[2]  # the probe's file is the one the forecast reads
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    outputs = []
    for cmd in commands:
        extra = ("--trainer.accelerator", "cpu") if cmd[2] == "lit_ddp.fit" else ()
        result = run_module(*cmd[2:], *extra, cwd=tmp_path, timeout=200)
        assert result.returncode == 0, (cmd, result.stderr[-2000:])
        outputs.append(result.stdout)
    assert (tmp_path / "runs/mini_train_profile/version_0/forecast.png").is_file()

    def shape(out: str) -> list[str]:  # the lines with their numbers masked
        return [re.sub(r"\d[\d,.]*", "#", line).rstrip() for line in out.strip().splitlines()]

    excerpt = code_blocks(text)[1]
    assert shape(outputs[1]) == shape(excerpt), "README's forecast excerpt is not what the command prints"
    assert "intra-node link measured:" in outputs[3]
