"""The commands the docs show, run as a new user would run them, against what the pages say they print: the
options ``docs/options.md`` names exist (``--help`` lists them), the lines under ``docs/failures.md``'s "Bad input"
are what those commands print, and ``docs/forecast.md``'s commands run as shown, in order, the second printing the
excerpt the page shows, and ``docs/traces.md``'s command prints the tables the page shows: the same labels, lines
and order, numbers and column padding aside."""

import json
import math
import re
import shutil

import pytest

from lit_ddp.run.arguments import expand_shorthands
from lit_ddp.scaling import links
from tests.runner import PROFILE_RUN, ROOT, run_main, run_module

DOCS = ROOT / "docs"


def section(page: str, title: str) -> str:
    """The ``## title`` section of ``docs/<page>``, up to the next ``## `` heading."""
    text = (DOCS / page).read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)


def shape(out: str) -> list[str]:
    """The lines with each number masked and each run of spaces made one: what a table says (its labels, its
    lines, their order), not how its columns are padded."""
    # A time is a number and a unit that follows its size (fmt_ms: "940.12 ms", "1.05 s" on a slower machine).
    lines = [re.sub(r"\d[\d,.]*", "#", line) for line in out.strip().splitlines()]
    return [" ".join(re.sub(r"# (ms|s)\b", "# TIME", line).split()) for line in lines]


def test_every_option_the_options_page_names_exists(monkeypatch, capsys):
    named = set(re.findall(r"`(--[\w.]+)", (DOCS / "options.md").read_text()))
    assert {"--loss_monitor.every_n_steps", "--trainer.accumulate_grad_batches", "--trainer.precision"} <= named
    shown = run_main(monkeypatch, capsys, "--help").stdout
    # Classes' own options are listed by their --GROUP.help (the model and the data can be anyone's).
    helps = {group: run_main(monkeypatch, capsys, f"--{group}.help", path).stdout for group, path in (
        ("trainer.strategy", "lit_ddp.run.strategy.LitDDPStrategy"), ("model", "lit_ddp.lab.module.LinearRegression"),
        ("data", "lit_ddp.lab.data.FixedBatchDataModule"))}  # fmt: skip
    missing = []
    for option in sorted(named):
        if option == "--devices":  # the tool's shorthand, expanded before parsing
            assert expand_shorthands(["--devices", "2"]) == ["--trainer.devices", "2"]
        else:
            group = next((g for g in helps if option.startswith(f"--{g}.")), None)
            listed = helps[group] if group else shown
            missing += [] if re.search(rf"{re.escape(option)}(\b|\.)", listed) else [option]
    assert not missing, f"docs/options.md names options that --help does not list: {missing}"


def test_bad_input_prints_what_the_failures_page_says(tmp_path, monkeypatch, capsys):
    """Each ``$ python -m lit_ddp.fit ...`` line and the line the page shows under it, run in a fresh directory
    (with README.md in it: one command takes it for a checkpoint)."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    monkeypatch.chdir(tmp_path)
    (block,) = [b for b in code_blocks(section("failures.md", "Bad input")) if b.startswith("$ ")]
    lines = block.strip().splitlines()
    pairs = [(cmd[2:].split(), said) for cmd, said in zip(lines[::2], lines[1::2], strict=True)]
    assert len(pairs) >= 5 and all(cmd[:3] == ["python", "-m", "lit_ddp.fit"] for cmd, _ in pairs)
    for cmd, said in pairs:
        result = run_main(monkeypatch, capsys, "--trainer.accelerator", "cpu", *cmd[3:])
        assert result.returncode == 2, (cmd, result.stderr)
        assert result.stderr.strip() == said, cmd


def test_shape_ignores_padding_only():
    table = "ranks  nodes       step\n1          1  170.50 ms\n8          1  170.81 ms"
    assert shape(table) == shape("ranks nodes step\n1 1 9.5 ms\n8   1   1,170.81 ms  ")
    assert shape(table) != shape(table.replace("nodes", "hosts"))  # a label
    assert shape(table) != shape(table.replace(" ms", " us"))  # a unit
    assert shape(table) != shape("\n".join(table.splitlines()[:2]))  # a line
    assert shape(table) != shape("\n".join(table.splitlines()[::-1]))  # the order
    assert shape(table) != shape(table.replace("  170.50 ms", "  170.50 ms  0.31 ms"))  # a column


@pytest.mark.slow  # the profile run, the probe and two forecasts: about 17 s on 2 cores
@pytest.mark.timeout(300)
def test_the_forecast_page_commands_run_as_shown(profile_run, tmp_path):
    """The measured run is the session's ``profile_run`` (the page's first command, checked); the other commands go
    on from a copy of its directory. The probe's run is the real one on 2 gloo ranks that its JSON is checked on."""
    commands = [
        line.split("#")[0].split()
        for line in code_blocks(section("forecast.md", "The commands"))[0].strip().splitlines()
    ]
    assert [c[:3] for c in commands] == [["python", "-m", "lit_ddp.fit"], ["python", "-m", "lit_ddp.forecast"],
                                         ["python", "-m", "lit_ddp.allreduce_probe"],
                                         ["python", "-m", "lit_ddp.forecast"]]  # fmt: skip
    assert commands[0][3:] == list(PROFILE_RUN), "docs/forecast.md's measured run is not tests.runner.PROFILE_RUN"
    assert "--probe" in commands[3] and "probe.json" in commands[2]  # the probe's file is the one the forecast reads
    assert profile_run.result.returncode == 0, profile_run.result.stderr[-2000:]
    shutil.copytree(profile_run.cwd, tmp_path, dirs_exist_ok=True)
    outputs = [profile_run.result.stdout]
    for cmd in commands[1:]:
        result = run_module(*cmd[2:], cwd=tmp_path, timeout=200)
        assert result.returncode == 0, (cmd, result.stderr[-2000:])
        outputs.append(result.stdout)
    assert (tmp_path / "runs/mini_train_profile/version_0/forecast.png").is_file()
    (excerpt,) = code_blocks(section("forecast.md", "What it prints"))
    assert shape(outputs[1]) == shape(excerpt), "docs/forecast.md's excerpt is not what the command prints"
    assert "intra-node link measured:" in outputs[3]
    assert "all-reduce, gloo, 2 ranks, float32, median of 10 after 3 warm-up:" in outputs[2]
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert [row["nbytes"] for row in probe["rows"]] == [1024 * 2**k for k in range(17)]  # 1 KiB to 64 MiB
    for row in probe["rows"]:
        assert row["ms"] > 0
        assert row["algbw_gbps"] == pytest.approx(row["nbytes"] / row["ms"] / 1e6)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2(n-1)/n = 1 on 2 ranks
    link = links.load_probe(tmp_path / "probe.json")
    assert link.busbw_gbps > 0 and link.hop_latency_us >= 0 and math.isfinite(link.busbw_gbps)


def test_the_traces_page_command_prints_what_the_page_shows(tmp_path):
    """The report of the real A100 trace in ``tests/data``, run on a copy (it draws ``trace.png`` beside it)."""
    command, sample = code_blocks(section("traces.md", "What it prints"))[:2]
    assert command.split()[:4] == ["python", "-m", "lit_ddp.report", "--trace"]
    shutil.copytree(ROOT / "tests" / "data", tmp_path / "tests" / "data")
    result = run_module(*command.split()[2:], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert shape(result.stdout) == shape(sample), "docs/traces.md's sample is not what the command prints"
