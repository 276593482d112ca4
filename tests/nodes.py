"""Nodes with a shaped network between them (``nodes/cluster.sh``) for the ``nodes`` tests, and commands run on them.

    pytest -m 'slow or not slow' tests/test_nodes.py      # as root; each test makes its nodes and removes them

Every cluster here is named ``litddp-test-*`` (``LIT_DDP_NODES_PREFIX``), so a cluster a user started is left
alone, and one test's nodes are removed before the next test's are made. Where the script cannot start (not
root, no iproute2), the tests skip with its one-line reason, or fail with it when ``LIT_DDP_NODES_REQUIRED=1``
(CI). A rate is measured with a plain TCP transfer between two nodes (tests.link_rate), bounded in bytes and time.
"""

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest
from lightning.pytorch import Callback

from tests.runner import ROOT, fit_command, pythonpath, start_module

CLUSTER_SH = ROOT / "nodes" / "cluster.sh"
PREFIX = "litddp-test-"
PORT = 29500  # free in any node: each one is a fresh network namespace


def cluster_sh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "LIT_DDP_NODES_PREFIX": PREFIX}
    return subprocess.run(["bash", str(CLUSTER_SH), *args], capture_output=True, text=True, timeout=timeout, env=env)


def root_namespace() -> dict[str, list[str]]:
    """What a cluster could leave behind where everyone sees it: namespaces, the root namespace's links (a veth
    end or a bridge), its qdiscs, and the name files ``ip netns exec`` mounts."""

    def lines(*argv: str) -> list[str]:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
        return sorted(result.stdout.splitlines())

    return {
        "netns": lines("ip", "netns", "list"),
        "links": lines("ip", "-o", "link", "show"),
        "qdiscs": lines("tc", "qdisc", "show"),
        "etc": sorted(os.listdir("/etc/netns")) if os.path.isdir("/etc/netns") else [],
    }


@dataclass(frozen=True)
class Nodes:
    count: int

    @staticmethod
    def namespace(k: int) -> str:
        return f"{PREFIX}node{k}"

    @staticmethod
    def address(k: int) -> str:
        return f"198.18.0.{k + 1}"

    def on(self, k: int, ahead: bool = False) -> tuple[str, ...]:
        """The wrapper that runs a command on node ``k``; ``ahead``: at a higher CPU priority than the rest of the
        suite (``nice -n -10``, as root), for the runs that measure a link's rate: the other workers' tests on the
        same two cores would otherwise show as a slower link."""
        return (*(("nice", "-n", "-10") if ahead else ()), "ip", "netns", "exec", self.namespace(k))

    def torchrun_fit(self, k: int, ranks_per_node: int, *fit_args: str, max_restarts: int = 0) -> list[str]:
        """``python -m`` arguments of torchrun's node ``k`` of ``lit_ddp.fit FIT_ARGS``, rendezvous on node 0
        (torchrun's static rendezvous: node ranks as given)."""
        launcher = ("torch.distributed.run", "--nnodes", str(self.count), "--nproc_per_node", str(ranks_per_node),
                    "--node_rank", str(k), "--master_addr", self.address(0), "--master_port", str(PORT),
                    "--max-restarts", str(max_restarts))  # fmt: skip
        return fit_command("--devices", str(ranks_per_node), "--trainer.num_nodes", str(self.count), *fit_args,
                           launcher=launcher)  # fmt: skip

    def cut(self, k: int) -> None:
        result = cluster_sh("cut", str(k))
        assert result.returncode == 0, result.stderr

    def mend(self, k: int) -> None:
        result = cluster_sh("mend", str(k))
        assert result.returncode == 0, result.stderr


class Gate(Callback):
    """Every rank stops after optimizer step ``step`` (``global_step == step``), writes ``<directory>/arrived<rank>``
    and waits until ``<directory>/open`` exists: the test cuts a link between the two, so that every rank meets
    the cut in the same collective. A restarted job (torchrun's ``TORCHELASTIC_RESTART_COUNT``) passes."""

    def __init__(self, directory: str, step: int, timeout_s: float = 300) -> None:
        self.directory, self.step, self.timeout_s = directory, step, timeout_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
            return
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"arrived{trainer.global_rank}"), "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(os.path.join(self.directory, "open")) and time.monotonic() < deadline:
            time.sleep(0.05)


# gloo's sockets on the node's one interface (its own address, not a loopback guess from the host name).
NODE_ENV = {"GLOO_SOCKET_IFNAME": "eth0"}


@contextmanager
def nodes(count: int, *rates: str) -> Iterator[Nodes]:
    """``count`` nodes for the ``with`` block (``nodes/cluster.sh start COUNT RATES...``), removed afterwards
    whatever happened; skips, or fails where required, when the script cannot start."""
    cluster_sh("stop")  # a cluster of an earlier, killed test session
    start = cluster_sh("start", str(count), *rates)
    if start.returncode:
        reason = (start.stderr.strip().splitlines() or [f"exit code {start.returncode}"])[-1]
        if os.environ.get("LIT_DDP_NODES_REQUIRED") == "1":
            pytest.fail(f"no nodes, and LIT_DDP_NODES_REQUIRED=1: {reason}")
        pytest.skip(f"no nodes here: {reason}")
    try:
        yield Nodes(count)
    finally:
        stop = cluster_sh("stop")
        assert stop.returncode == 0, stop.stderr


@contextmanager
def start_on(cluster: Nodes, k: int, *module_args: str, cwd, env: dict | None = None, ahead: bool = False):
    """``python -m MODULE_ARGS`` on node ``k`` in the background (``tests.runner.start_module``); ``ahead``: see
    ``Nodes.on``."""
    with start_module(*module_args, cwd=cwd, env={**NODE_ENV, **(env or {})}, wrapper=cluster.on(k, ahead)) as run:
        yield run


def run_fit_on(cluster: Nodes, ranks_per_node: int, *fit_args: str, cwd, timeout: float = 300,
               env: dict | None = None, ahead: bool = False) -> list[subprocess.CompletedProcess]:  # fmt: skip
    """``lit_ddp.fit FIT_ARGS`` under torchrun on every node at once, to completion (within ``timeout``): each
    node's exit code, stdout and stderr; ``ahead``: see ``Nodes.on``."""
    with ExitStack() as stack:
        runs = [stack.enter_context(start_on(cluster, k, *cluster.torchrun_fit(k, ranks_per_node, *fit_args),
                                             cwd=cwd, env=env, ahead=ahead)) for k in range(cluster.count)]  # fmt: skip
        deadline = time.monotonic() + timeout
        codes = [run.wait(timeout=max(1.0, deadline - time.monotonic())) for run in runs]
        return [subprocess.CompletedProcess(run.proc.args, code, run.stdout, run.stderr)
                for run, code in zip(runs, codes, strict=True)]  # fmt: skip


def measure_rate(
    cluster: Nodes, sender: int, receiver: int, nbytes: int, repeat: int = 5, timeout: float = 60
) -> float:
    """Bits per second of a TCP transfer of ``nbytes`` from node ``sender`` to node ``receiver``, from the
    receiver's first byte to its last: the best of ``repeat`` transfers (the link's rate bounds each from above;
    on a busy machine a sender or receiver that waits for a core falls below it)."""
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    args = (cluster.address(receiver), str(nbytes), str(repeat))
    receive = subprocess.Popen([*cluster.on(receiver), sys.executable, "-m", "tests.link_rate", "receive", *args],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        send = subprocess.run([*cluster.on(sender), sys.executable, "-m", "tests.link_rate", "send", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout, env=env)  # fmt: skip
        assert send.returncode == 0, send.stderr
        out, _ = receive.communicate(timeout=timeout)
    finally:
        receive.kill()
        receive.wait()
    transfers = json.loads(out)
    assert [t["bytes"] for t in transfers] == [nbytes] * repeat, transfers
    return max(t["bits_per_s"] for t in transfers)
