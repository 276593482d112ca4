"""Beyond Lightning's own launcher: Slurm's variables, torchrun, two "nodes" on one machine."""

import os

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment

from lit_ddp.fit import build_cli
from lit_ddp.measure.placement import problems, this_rank
from tests.runner import STEP_LINE, TORCHRUN, free_port, run_fits, start_fit, start_long_run, step_numbers
from tests.trainers import assert_same_checkpoint

SLURM_RANK_3_OF_4 = {
    "SLURM_JOB_ID": "1234",
    "SLURM_JOB_NAME": "lit_ddp",
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "node[01-02]",
}


def test_simulated_slurm_rank_gets_its_rank_and_device(monkeypatch):
    for name, value in SLURM_RANK_3_OF_4.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cli = build_cli(["--devices", "2", "--trainer.num_nodes", "2", "--trainer.accelerator", "cpu"])
    trainer = cli.trainer
    assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size) == (3, 1, 1, 4)
    assert trainer.strategy.cluster_environment.main_address == "node01"
    row = this_rank(trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.strategy.root_device)
    assert row["slurm_localid"] == "1" and problems([row]) == []


STANDALONE_2 = (*TORCHRUN, "--standalone", "--nproc_per_node", "2")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_nodes_on_one_machine(tmp_path):
    port = str(free_port())
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()

    def node(rank: int):
        launcher = (*TORCHRUN, "--nnodes", "2", "--node_rank", str(rank), "--master_addr", "127.0.0.1",
                    "--master_port", port, "--nproc_per_node", "1")  # fmt: skip
        return start_fit("--devices", "1", "--trainer.num_nodes", "2", "--model.dim", "64", launcher=launcher,
                         cwd=tmp_path / f"node{rank}")  # fmt: skip

    with node(0) as node0, node(1) as node1:
        codes = [node0.wait(timeout=120), node1.wait(timeout=120)]
    assert codes == [0, 0], [node0.stderr[-1500:], node1.stderr[-1500:]]
    assert len(STEP_LINE.findall(node0.stdout)) == 5 and "on 2 ranks" in node0.stdout
    assert not STEP_LINE.findall(node1.stdout)  # printed once, by global rank 0


def listening_addresses(pids: list[int]) -> list[str]:
    """Local addresses ("hex_ip:hex_port") of the TCP sockets these processes listen on."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(fields[1])
    return found


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_single_node_run_listens_on_loopback_only(tmp_path):
    with start_long_run(tmp_path) as (run, ranks):
        addresses = listening_addresses([run.pid, *ranks])
    assert addresses, "found no listening socket at all: the check would be vacuous"
    loopback = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1, ::1
    assert all(a.startswith(loopback) for a in addresses), addresses


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchrun_restart_resumes_from_last_checkpoint_and_ends_like_an_undisturbed_run(tmp_path):
    """The undisturbed run is a torchrun run too: each step printed once, by global rank 0."""
    args = ("--devices", "2", "--model.dim", "64", "--trainer.max_steps", "8", "--checkpoint.every_n_steps", "2",
            "--ckpt_path", "auto")  # fmt: skip
    # pytorch#135712 / #167288: a restarted gloo job can hang when the workers share the agent's TCP store.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    torchrun = (*STANDALONE_2, "--max-restarts", "1")
    faulty, clean = run_fits(  # both at once
        ((*args, "--trainer.logger.init_args.name", "faulty", "--trainer.callbacks+=tests.faults.FailOnRank",
          "--trainer.callbacks.step=5", "--trainer.callbacks.how=exit", "--trainer.callbacks.first_attempt_only=true"),
         tmp_path),
        ((*args, "--trainer.logger.init_args.name", "clean"), tmp_path),
        launcher=torchrun, timeout=200, env=env,
    )  # fmt: skip
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    assert "Step 4, Loss" in faulty.stdout and "Step 7, Loss" in faulty.stdout
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert step_numbers(clean.stdout) == list(range(8)) and "on 2 ranks" in clean.stdout, clean.stdout
    assert_same_checkpoint(tmp_path / "runs/faulty/checkpoints/last.ckpt",
                           tmp_path / "runs/clean/checkpoints/last.ckpt", global_step=8)  # fmt: skip
