"""Nodes with a network between them on this machine (``nodes/cluster.sh``): the script leaves nothing behind, a
shaped link runs at its rate, multi-node runs over it, and a partition that ends on every node."""

import os
import subprocess

import pytest

from tests.nodes import PREFIX, cluster_sh, measure_rate, nodes, root_namespace

pytestmark = pytest.mark.nodes


def test_start_and_stop_leave_no_namespace_link_bridge_or_qdisc_behind():
    before = root_namespace()
    with nodes(2, "--rate", "100mbit", "--rate-1", "50mbit"):
        during = root_namespace()
        switch = subprocess.run(["ip", "-n", f"{PREFIX}switch", "-o", "link", "show"], capture_output=True,
                                text=True, check=True).stdout  # fmt: skip
        node1 = subprocess.run(["tc", "-n", f"{PREFIX}node1", "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        status = cluster_sh("status")
    # The cluster was there: three namespaces, a bridge with a port per node, shaped links.
    assert [line.split()[0] for line in during["netns"] if line.startswith(PREFIX)] == [
        f"{PREFIX}node0", f"{PREFIX}node1", f"{PREFIX}switch"]  # fmt: skip
    assert "br0:" in switch and "sw0@" in switch and "sw1@" in switch and "master br0" in switch
    assert "tbf" in node1 and "rate 50Mbit" in node1
    assert status.returncode == 0 and status.stdout.splitlines() == [
        f"{PREFIX}node0 198.18.0.1/24 rate 100Mbit link up",
        f"{PREFIX}node1 198.18.0.2/24 rate 50Mbit link up",
    ]
    # ... and the root namespace never saw a link or qdisc of it, and nothing is left once it is stopped.
    assert (during["links"], during["qdiscs"]) == (before["links"], before["qdiscs"])
    assert root_namespace() == before
    assert cluster_sh("status").returncode != 0


def test_a_start_that_fails_half_way_removes_what_it_made():
    before = root_namespace()
    os.makedirs("/etc/netns", exist_ok=True)
    blocker = f"/etc/netns/{PREFIX}node1"
    with open(blocker, "w"):  # a file where the script makes node 1's directory: its last step fails
        pass
    try:
        start = cluster_sh("start", "2", "--rate", "100mbit")
    finally:
        cluster_sh("stop")
        if os.path.isfile(blocker):
            os.remove(blocker)
        if os.path.isdir("/etc/netns") and not os.listdir("/etc/netns") and not before["etc"]:
            os.rmdir("/etc/netns")
    if "needs root" in start.stderr:
        pytest.skip(start.stderr.strip())
    assert start.returncode == 1, start.stderr
    assert "did not come up" in start.stderr and "removing what was made" in start.stderr
    assert root_namespace() == before


def test_bad_input_is_one_line_and_exit_2():
    for args, message in [
        (("start", "0"), "start needs a number of nodes from 1 to 250, got '0'"),
        (("start", "2", "--rate", "fast"), "rate 'fast' is not a number with kbit, mbit or gbit (e.g. 100mbit)"),
        (("start", "2", "--rate-2", "10mbit"), "--rate-2: there is no node 2 among 2"),
        (("cut", "x"), "a node number is needed, got 'x'"),
    ]:
        result = cluster_sh(*args)
        assert (result.returncode, result.stderr) == (2, f"cluster.sh: {message}\n"), args


def test_a_shaped_link_runs_at_its_rate():
    """A plain TCP transfer between two nodes runs at the slower of their links' rates, within 10% (jumbo frames:
    the headers are 0.7% of the bytes); node 2's link is shaped apart from the others'."""
    with nodes(3, "--rate", "200mbit", "--rate-2", "100mbit") as cluster:
        fast = measure_rate(cluster, 0, 1, 5_000_000)
        slow = measure_rate(cluster, 2, 0, 2_500_000)
    assert fast == pytest.approx(200e6, rel=0.1)
    assert slow == pytest.approx(100e6, rel=0.1)
