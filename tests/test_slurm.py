"""The main job under a real Slurm: ``srun``, ``sbatch`` + ``scancel``, requeue by SIGUSR1, a killed task, bad input.

    slurm/cluster.sh start && pytest -m slurm       # a one-node Slurm on localhost (tests/slurm_cluster.py)

Slurm starts the ranks here (Lightning's ``SLURMEnvironment``), so these reach what the simulated-Slurm test of
``test_launchers.py`` cannot: Slurm's signals, its requeue, srun's handling of a dead task, and what every task
prints.
"""

import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lit_ddp.run.start_watch import SRUN_WAITS
from tests.runner import LONG_RUN, ROOT, start_fit, step_losses
from tests.slurm_cluster import Cluster, bring_up, shut_down
from tests.test_faults import alive, left_behind
from tests.trainers import assert_same_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

CPU_SBATCH = ROOT / "slurm" / "ddp_cpu.sbatch"
# Lines Lightning prints under Slurm that the forked run does not have (one per task, and one per checkpoint).
LIGHTNING_NOISE = ("SLURM auto-requeueing enabled", "Bypassing SIGTERM", "`weights_only` was not set",
                   "requeing job")  # fmt: skip


@pytest.fixture(scope="module")
def slurm() -> Iterator[Cluster]:
    cluster = bring_up()
    yield cluster
    shut_down(cluster)


class RecordLastStep(Callback):
    """Every rank writes the step at which its training ended to ``<directory>/rank<global rank>``."""

    def __init__(self, directory: str = "steps") -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module):
        os.makedirs(self.directory, exist_ok=True)
        Path(self.directory, f"rank{trainer.global_rank}").write_text(str(trainer.global_step))


class SayOnEveryRank(Callback):
    """Every rank logs an info line through Lightning's logger at the start of training, as Lightning itself does
    for some lines (its auto-requeue's set-up, "Bypassing SIGTERM")."""

    def on_train_start(self, trainer, pl_module):
        logging.getLogger("lightning.pytorch").info(f"rank {trainer.global_rank} is training")


class SignalJobAt(Callback):
    """After step ``step`` of the job's first run, rank 0 has Slurm signal every task of the job (``scancel
    --signal``, what ``#SBATCH --signal=SIGUSR1@90`` does before the time limit), and the ``waiting`` ranks wait
    ``wait_s`` seconds in Python (``time.sleep``, where a signal's handler runs at once); the others go on, into the
    next step's collectives.

    Args:
        step: The global step after which the signal is sent.
        signal: What ``scancel --signal`` sends.
        waiting: The global ranks that wait.
        wait_s: How long they wait.
    """

    def __init__(self, step: int = 150, signal: str = "USR1", waiting: tuple[int, ...] = (0,),
                 wait_s: float = 3.0) -> None:  # fmt: skip
        self.step, self.signal, self.waiting, self.wait_s = step, signal, tuple(waiting), wait_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or int(os.environ.get("SLURM_RESTART_COUNT", "0")) > 0:
            return
        if trainer.global_rank == 0:
            subprocess.run(["scancel", f"--signal={self.signal}", os.environ["SLURM_JOB_ID"]], check=True, timeout=30)
        if trainer.global_rank in self.waiting:
            time.sleep(self.wait_s)


class SleepBeforeFit(Callback):
    """Task ``task`` of the srun step writes its pid to ``sleeper`` and sleeps ``seconds`` when the CLI makes this
    callback, before its fit: a rank that never reaches the rendezvous (a slow read before the Trainer).

    Args:
        task: The task (``SLURM_PROCID``) that sleeps.
        seconds: How long.
    """

    def __init__(self, task: int = 1, seconds: float = 3600.0) -> None:
        if os.environ.get("SLURM_PROCID") == str(task):
            Path("sleeper").write_text(str(os.getpid()))
            time.sleep(seconds)


def srun_exits(text: str) -> dict[int, str]:
    """What srun said of each task that did not exit 0: ``{task: "exit code 143"}`` or ``{task: "Killed"}``, from
    its ``srun: error: HOST: tasks 0-1: Exited with exit code 143`` lines (one per task, or one for several)."""
    exits = {}
    for first, last, how in re.findall(r"^srun: error: \S+: tasks? (\d+)(?:-(\d+))?: (?:Exited with )?(.+)$", text,
                                       re.M):  # fmt: skip
        for task in range(int(first), int(last or first) + 1):
            exits[task] = how
    return exits


def device_map_rows(stdout: str) -> list[tuple[str, ...]]:
    """The device map's rows (rank, local, node, host, device, CUDA_VISIBLE_DEVICES, LOCAL_RANK, SLURM_LOCALID)."""
    return [tuple(line.split()) for line in stdout.splitlines() if re.match(r"^\d+\s+\d+\s+\d+\s+\S+\s+cpu\s", line)]


def comparable(stdout: str) -> list[str]:
    """stdout without the device map and the wall time: what must be the same under srun and forked."""
    lines = [line for line in stdout.splitlines() if not line.startswith("rank ") and not device_map_rows(line)]
    return [re.sub(r"wall [0-9.]+ s", "wall - s", line) for line in lines]


@pytest.mark.timeout(150)
def test_srun_runs_the_main_job_as_the_forked_run_does(slurm, tmp_path):
    args = ("--devices", "2", "--model.dim", "64", "--checkpoint.every_n_steps", "2",
            "--trainer.callbacks+=tests.test_slurm.SayOnEveryRank")  # fmt: skip
    for name in ("srun", "forked"):
        (tmp_path / name).mkdir()
    with start_fit(*args, cwd=tmp_path / "forked") as forked_run, slurm.job_name() as name:  # both at once
        srun = slurm.srun_fit(name, *args, cwd=tmp_path / "srun")
        forked = forked_run.completed(timeout=90)
    assert srun.returncode == 0, srun.stderr[-3000:]
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert len(step_losses(srun.stdout)) == 5
    assert step_losses(srun.stdout) == step_losses(forked.stdout)
    # Slurm's local ids, not torchrun's LOCAL_RANK: Lightning's SLURMEnvironment placed the ranks.
    assert [row[0:3] + row[6:] for row in device_map_rows(srun.stdout)] == [("0", "0", "0", "-", "0"),
                                                                            ("1", "1", "0", "-", "1")]  # fmt: skip
    # Line for line the forked run's output (the sync verdict, the Done line): no Lightning banner from any task,
    # no line twice (only rank 0 speaks).
    assert comparable(srun.stdout) == comparable(forked.stdout), srun.stdout
    assert not [line for line in srun.stdout.splitlines() if line.startswith(LIGHTNING_NOISE)]
    assert "rank 0 is training" in srun.stdout and "rank 1 is training" not in srun.stdout
    assert srun.stderr == forked.stderr == "", srun.stderr


@pytest.mark.timeout(150)
def test_scancel_of_a_batch_job_stops_both_ranks_at_one_step_saves_and_exits_143(slurm, tmp_path):
    with slurm.job_name() as name:
        job_id = slurm.sbatch(name, CPU_SBATCH, *LONG_RUN, "--checkpoint.every_n_steps", "1000000",
                              "--trainer.callbacks+=tests.test_slurm.RecordLastStep", cwd=tmp_path)  # fmt: skip
        output = tmp_path / f"slurm-{job_id}.out"
        deadline = time.monotonic() + 90
        while not (output.is_file() and "Step 0, Loss" in output.read_text()):
            assert time.monotonic() < deadline, output.read_text() if output.is_file() else "no output"
            assert slurm.job(job_id).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), slurm.job(job_id)
            time.sleep(0.1)
        slurm.command("scancel", str(job_id))
        fields = slurm.wait_until_gone(job_id, timeout=60)
    text = output.read_text()
    assert fields["JobState"] == "CANCELLED", fields
    assert srun_exits(text) == {0: "exit code 143", 1: "exit code 143"}, text[-3000:]
    assert text.count("lit-ddp-fit: stopped by SIGTERM") == 1, text[-3000:]
    steps = [int((tmp_path / "steps" / f"rank{rank}").read_text()) for rank in (0, 1)]
    checkpoint = torch.load(tmp_path / "runs" / "checkpoints" / "last.ckpt", weights_only=True)
    assert steps[0] == steps[1] == checkpoint["global_step"] > 0  # saved at the SIGTERM, both ranks at one step
    assert re.search(rf"^Done: {steps[0]} steps on 2 ranks,", text, re.M), text[-3000:]
    assert not [line for line in text.splitlines() if line.startswith(LIGHTNING_NOISE)], text[-3000:]


REQUEUE_RUN = ("--model.dim", "64", "--trainer.max_steps", "300", "--checkpoint.every_n_steps", "300",
               "--loss_monitor.every_n_steps", "100", "--trainer.strategy.timeout_s", "10")  # fmt: skip


def run_requeued_job(slurm: Cluster, cwd: Path) -> tuple[dict[str, str], str]:
    """The 300-step batch job, signalled (SIGUSR1) after step 150 of its first run (in mid-epoch: 100 steps an
    epoch); its final ``scontrol`` fields and output, once it has ended."""
    with slurm.job_name() as name:
        job_id = slurm.sbatch(name, CPU_SBATCH, *REQUEUE_RUN, "--trainer.callbacks+=tests.test_slurm.SignalJobAt",
                              cwd=cwd)  # fmt: skip
        fields = slurm.wait_until_gone(job_id, timeout=200)  # twice what a loaded CI took
    return fields, (cwd / f"slurm-{job_id}.out").read_text()


@pytest.mark.timeout(300)
def test_requeue_by_sigusr1_while_a_rank_waits_in_a_collective_resumes_and_ends_like_an_uninterrupted_run(
    slurm, tmp_path
):
    """Lightning's own auto-requeue, run at a step boundary. The signal reaches both ranks at step 150
    (``SignalJobAt``) while rank 0 waits in Python and rank 1 in the next step's all-reduce, waiting for rank 0: the
    arrival a real ``--signal=SIGUSR1@90`` met in 1 try of 4 here, where Lightning's handler, run inside the signal
    handler, deadlocked (its checkpoint's barrier against the all-reduce). At a step boundary instead, the flag
    rides in StepSync's gather, and at the step that reads it every task runs Lightning's requeue handler (saves
    ``runs/hpc_ckpt_1.ckpt``: rank 0 writes it, then a barrier; rank 0 runs ``scontrol requeue``); Slurm stops the
    job (SIGTERM: exit 143) and starts it again, and Lightning resumes from that checkpoint. The gather is read one
    step later, so the checkpoint holds 151 steps."""
    for name in ("slurm", "uninterrupted"):
        (tmp_path / name).mkdir()
    with start_fit("--devices", "2", *REQUEUE_RUN, cwd=tmp_path / "uninterrupted") as uninterrupted_run:  # at once
        fields, text = run_requeued_job(slurm, tmp_path / "slurm")
        uninterrupted = uninterrupted_run.completed(timeout=120)
    assert (fields.get("JobState"), fields.get("Restarts"), fields.get("ExitCode")) == ("COMPLETED", "1", "0:0"), (
        fields, text[-3000:])  # fmt: skip
    first, _, second = text.partition("lit-ddp-fit: stopped by SIGTERM")
    assert re.search(r"^Requeued SLURM job: \d+$", first, re.M), text[-3000:]
    assert srun_exits(second) == {0: "exit code 143", 1: "exit code 143"}, text[-3000:]  # the requeue's SIGTERM
    # The requeued run trained steps 151-299, from the checkpoint of step 151, and says so.
    assert re.search(r"^Done: 149 steps on 2 ranks \(resumed at step 151 from runs/hpc_ckpt_1\.ckpt\),", second,
                     re.M), text[-3000:]  # fmt: skip
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    checkpoint = Path("runs/mini_train/checkpoints/last.ckpt")
    assert_same_checkpoint(tmp_path / "slurm" / checkpoint, tmp_path / "uninterrupted" / checkpoint, global_step=300)
    assert not [line for line in text.splitlines() if line.startswith(LIGHTNING_NOISE)], text[-3000:]
    # No warning either ("path.py:N: message"), e.g. resuming in mid-epoch: every batch is the same one.
    assert not re.search(r"^\S+\.py:\d+: ", text, re.M), text[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 1])
def test_sigkill_of_a_rank_ends_the_slurm_step(slurm, tmp_path, victim):
    with slurm.job_name() as name, slurm.start_srun_fit(name, *LONG_RUN, cwd=tmp_path) as run:
        pid_files = [tmp_path / "pids" / f"rank{rank}" for rank in (0, 1)]
        run.wait_for_files(pid_files)
        run.wait_for(r"^Step 0, Loss ")
        ranks = [int(p.read_text()) for p in pid_files]
        start = time.monotonic()
        os.kill(ranks[victim], signal.SIGKILL)
        code = run.wait(timeout=60)  # README: a dead rank ends the job; a hung collective at the latest in 60 s
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 10
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in ranks if alive(p)], "a rank was left behind"
    assert code != 0
    assert elapsed < 60
    assert srun_exits(run.stderr).get(victim) == "Killed", run.stderr[-3000:]


@pytest.mark.timeout(120)
def test_the_probe_runs_under_srun_with_slurms_ranks(slurm, tmp_path):
    """``srun`` of ``allreduce_probe`` (two tasks on the one node): its ranks are Slurm's, found as Lightning's
    SLURMEnvironment finds them, and it measures within the node as under torchrun; rank 0 alone speaks. Up to 16 MB:
    at 1 MB a loopback all-reduce is ~1 ms, about its latency, and a loaded CI machine's noise once gave the large
    sizes no slope to fit (the probe then rightly exits 1)."""
    with slurm.job_name() as name:
        result = slurm.srun(name, "lit_ddp.allreduce_probe", "--max-bytes", "16M", "--warmup", "1", "--iters", "5",
                            "--out", "probe.json", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("1 node(s) x 2 rank(s)\n") and result.stdout.count("wrote probe.json") == 1, (
        result.stdout)  # fmt: skip
    record = json.loads((tmp_path / "probe.json").read_text())
    assert (record["nodes"], record["ranks_per_node"], record["world_size"]) == (1, 2, 2)
    assert [row["nbytes"] for row in record["intra_node"]["rows"]] == [1024 * 2**k for k in range(15)]
    assert "inter_node" not in record


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "args, message",
    [
        (("--model.dim", "-4"), 'error: Parser key "model.dim": Not of type PositiveInt: -4 does not conform to '
                                'restriction v>0'),
        (("--devices", "3"), "error: You set `devices=3` in Lightning, but the number of tasks per node configured in "
                             "SLURM `--ntasks-per-node=2` does not match. HINT: Set `devices=2`."),
    ],
    ids=["bad-value", "devices-not-tasks-per-node"],
)  # fmt: skip
def test_bad_input_under_srun_fails_in_one_line_once(slurm, tmp_path, args, message):
    with slurm.job_name() as name:
        result = slurm.srun_fit(name, "--devices", "2", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert srun_exits(result.stderr) == {0: "exit code 2", 1: "exit code 2"}, result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("lit-ddp-fit:")]
    assert ours == [f"lit-ddp-fit: {message}"], result.stderr[-3000:]  # once, not once per task
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stdout == ""  # no rank started: not even the device map


@pytest.mark.timeout(150)
def test_a_task_that_never_reaches_fit_in_a_script_of_ones_own_is_named_and_the_step_ends(slurm, tmp_path,
                                                                                          monkeypatch):  # fmt: skip
    """The zoo's ``rank1_never_joins`` under srun: a user's script with the callbacks and a plain
    ``DDPStrategy(timeout=20 s)``, whose task 1 sleeps before its Trainer (Lightning#10098). Rank 0's start watch
    says who joined 5 s into the wait and every 10 s after, names rank 1 at the timeout less 1.5 s and exits 1;
    ``--kill-on-bad-exit`` (slurm/*.sbatch) then ends task 1, which srun would otherwise wait for as long as it
    sleeps (an hour)."""
    monkeypatch.setenv("HANG_ZOO_TIMEOUT_S", "20")
    monkeypatch.setenv("HANG_ZOO_DIR", str(tmp_path))  # rank 1 writes start-<its pid> there (hang_starts)
    with slurm.job_name() as name:
        result = slurm.srun(name, "benchmarks.hang_zoo.cases.rank1_never_joins", cwd=tmp_path, timeout=90,
                            kill_on_bad_exit=True)  # fmt: skip
        sleeper = [int(path.name.removeprefix("start-")) for path in tmp_path.glob("start-*")]
        assert len(sleeper) == 1 and not left_behind(sleeper), "task 1 was left behind"
    assert result.returncode != 0, result.stderr[-3000:]
    assert srun_exits(result.stderr) == {0: "exit code 1", 1: "Terminated"}, result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("lit_ddp:")]
    assert len(ours) >= 2 and ours[0].startswith("lit_ddp: waiting 5 s "), result.stderr[-3000:]
    joined = r"joined: rank 0 \(node 0, host \S+, world_size 2, num_nodes 1, devices 2\)"
    for line in ours[:-1]:  # at 5 s, and at 15 s where the watch began soon enough (the deadline is 18.5 s)
        assert re.fullmatch(rf"lit_ddp: waiting \d+ s for rank 1 \(node 0\) to join rank 0's store at \S+; {joined}",
                            line), ours  # fmt: skip
    fix = rf"a rank that started on its node but never reached fit: .*; {re.escape(SRUN_WAITS)}"
    assert re.fullmatch(rf"lit_ddp: rank 1 \(node 0\) never joined rank 0's store at \S+ in \d+ s; {joined} -> {fix}",
                        ours[-1]), ours  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.timeout(150)
def test_a_batch_job_whose_task_never_reaches_fit_ends_at_the_start_timeout(slurm, tmp_path):
    """``slurm/ddp_cpu.sbatch`` with the CLI's 20 s timeout, task 1 asleep before its fit: rank 0 names it at the
    timeout less 1.5 s and exits 1, and the job ends (the sbatch's ``--kill-on-bad-exit=1``), not an hour later."""
    with slurm.job_name() as name:
        job_id = slurm.sbatch(name, CPU_SBATCH, "--trainer.strategy.timeout_s", "20",
                              "--trainer.callbacks+=tests.test_slurm.SleepBeforeFit", cwd=tmp_path)  # fmt: skip
        fields = slurm.wait_until_gone(job_id, timeout=90)
        assert not left_behind([int((tmp_path / "sleeper").read_text())]), "task 1 was left behind"
    text = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert fields["JobState"] == "FAILED", (fields, text[-3000:])
    assert srun_exits(text) == {0: "exit code 1", 1: "Terminated"}, text[-3000:]
    ours = [line for line in text.splitlines() if line.startswith("lit-ddp-fit:")]
    said = [line.split(" (node 0)")[0] for line in ours]
    assert said[0] == "lit-ddp-fit: waiting 5 s for rank 1" and said[-1] == "lit-ddp-fit: rank 1", text[-3000:]
    assert all(re.fullmatch(r"lit-ddp-fit: waiting \d+ s for rank 1", line) for line in said[:-1]), ours
    assert "never joined rank 0's store" in ours[-1] and ours[-1].endswith(SRUN_WAITS), ours
    assert "Traceback" not in text, text[-3000:]
