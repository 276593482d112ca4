"""The placement rules (``lit_ddp.measure.placement``) on hand-made maps: the notes' device-indexing pitfalls."""

import socket

import torch

from lit_ddp.measure.placement import RankPlacement, format_table, problems, this_rank


def row(rank, local_rank, device, cvd=None, slurm=None, host="n0", node=0) -> RankPlacement:
    return RankPlacement(rank=rank, local_rank=local_rank, node_rank=node, host=host, device=device,
                         cuda_visible_devices=cvd, env_local_rank=str(local_rank), slurm_localid=slurm)  # fmt: skip


def test_one_gpu_per_rank_is_fine():
    assert problems([row(0, 0, "cuda:0"), row(1, 1, "cuda:1")]) == []


def test_cpu_ranks_are_fine():
    assert problems([row(0, 0, "cpu"), row(1, 1, "cpu")]) == []


def test_slurm_style_one_visible_device_each_is_fine():
    """CUDA_VISIBLE_DEVICES=$SLURM_LOCALID and set_device(0): the notes' first style."""
    rows = [row(0, 0, "cuda:0", cvd="0", slurm="0"), row(1, 1, "cuda:0", cvd="1", slurm="1")]
    assert problems(rows) == []


def test_two_ranks_on_one_gpu_are_flagged():
    found = problems([row(0, 0, "cuda:0"), row(1, 1, "cuda:0")])
    assert any("ranks [0, 1] share GPU 0 on n0" in p for p in found), found


def test_same_index_on_different_hosts_is_not_shared():
    assert problems([row(0, 0, "cuda:0", host="a"), row(1, 0, "cuda:0", host="b", node=1)]) == []


def test_mixing_visible_devices_and_device_ids_is_flagged():
    """CUDA_VISIBLE_DEVICES=$SLURM_LOCALID *and* device_ids=[local_rank]: cuda:1 does not exist for rank 1,
    and with two devices visible, device index != local rank means the two styles were mixed."""
    rows = [row(0, 0, "cuda:0", cvd="0,1", slurm="0"), row(1, 1, "cuda:0", cvd="1,0", slurm="1")]
    found = problems(rows)
    assert any("rank 1 uses cuda:0 but its local rank is 1" in p for p in found), found


def test_visible_devices_map_to_physical_gpus():
    # Both ranks see a permuted list and pick index 0: physical GPUs 1 and 0, distinct, but indices skew.
    rows = [row(0, 0, "cuda:0", cvd="1,0"), row(1, 1, "cuda:0", cvd="0,1")]
    found = problems(rows)
    assert not any("share" in p for p in found)
    assert any("rank 1 uses cuda:0" in p for p in found)


def test_slurm_localid_disagreeing_with_local_rank_is_flagged():
    found = problems([row(0, 0, "cpu", slurm="1"), row(1, 1, "cpu", slurm="0")])
    assert len(found) == 2 and "SLURM_LOCALID=1 but local rank 0" in found[0]


def test_table_has_one_line_per_rank():
    table = format_table([row(0, 0, "cuda:0", cvd="0,1"), row(1, 1, "cuda:1", cvd="0,1")])
    lines = table.splitlines()
    assert len(lines) == 3 and lines[0].split()[0] == "rank" and "cuda:1" in lines[2]


def test_every_column_of_the_map_is_left_aligned():
    """lit_ddp.formatting.table with every column a label: the layout docs/output.md shows."""
    lines = format_table([row(0, 0, "cpu"), row(10, 10, "cpu")]).splitlines()
    assert lines[1].startswith("0     0      0     n0    cpu     -                     0           -")
    assert lines[2].startswith("10    10     0     n0    cpu     -                     10          -")


def test_a_bare_cuda_device_is_index_0():
    """``str(torch.device("cuda"))`` is ``cuda``: the current device, 0 unless set."""
    found = problems([row(0, 0, "cuda"), row(1, 1, "cuda:0")])
    assert len(found) == 2, found  # rank 0's bare cuda is its local rank's index
    assert any("ranks [0, 1] share GPU 0 on n0" in p for p in found), found
    assert any("rank 1 uses cuda:0 but its local rank is 1" in p for p in found), found


def test_comma_separated_visible_devices_name_the_physical_gpu():
    # Index 0 of "1,0" and of " 1, 2" is physical GPU 1 for both.
    found = problems([row(0, 0, "cuda:0", cvd="1,0"), row(1, 0, "cuda:0", cvd=" 1, 2")])
    assert any("ranks [0, 1] share GPU 1 on n0" in p for p in found), found


def test_an_index_past_the_visible_devices_is_named_not_a_crash():
    found = problems([row(0, 1, "cuda:1", cvd="0"), row(1, 1, "cuda:1", cvd="0")])
    assert found == ["ranks [0, 1] share GPU ?1 on n0: each rank needs its own device"]


def test_the_map_names_its_columns_and_dashes_what_is_unset():
    placement = row(0, 0, "cpu")
    placement["env_local_rank"] = None
    header, line = format_table([placement]).splitlines()
    assert header.split() == ["rank", "local", "node", "host", "device", "CUDA_VISIBLE_DEVICES", "LOCAL_RANK",
                              "SLURM_LOCALID"]  # fmt: skip
    assert line.split() == ["0", "0", "0", "n0", "cpu", "-", "-", "-"]


def test_this_rank_reads_the_host_and_the_launchers_variables(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    assert this_rank(5, 1, 2, torch.device("cuda", 1)) == {
        "rank": 5, "local_rank": 1, "node_rank": 2, "host": "node7", "device": "cuda:1",
        "cuda_visible_devices": "3,2", "env_local_rank": "1", "slurm_localid": "1",
    }  # fmt: skip
    for name in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(name)
    unset = this_rank(0, 0, 0, torch.device("cpu"))
    assert (unset["cuda_visible_devices"], unset["env_local_rank"], unset["slurm_localid"]) == (None, None, None)


def test_past_eight_ranks_the_map_is_a_line_per_run_of_alike_ranks_and_one_for_a_rank_that_differs():
    rows = [row(r, r % 16, f"cuda:{r % 16}", host=f"n{r // 16}", node=r // 16) for r in range(32)]
    rows[20] = row(20, 4, "cuda:0", host="n1", node=1)  # mixed up: cuda:0 while its local rank is 4
    assert format_table(rows).splitlines() == [
        "rank   local  node  host  device     CUDA_VISIBLE_DEVICES  LOCAL_RANK  SLURM_LOCALID",
        "0-15   0-15   0     n0    cuda:0-15  -                     0-15        -",
        "16-19  0-3    1     n1    cuda:0-3   -                     0-3         -",
        "20     4      1     n1    cuda:0     -                     4           -",
        "21-31  5-15   1     n1    cuda:5-15  -                     5-15        -",
    ]
    cpus = [row(r, r % 16, "cpu", host=f"n{r // 16}", node=r // 16) for r in range(32)]
    assert [line.split()[:3] for line in format_table(cpus).splitlines()[1:]] == [["0-15", "0-15", "0"],
                                                                                   ["16-31", "0-15", "1"]]  # fmt: skip
    assert len(format_table(cpus[:8]).splitlines()) == 9  # up to 8 ranks: one line each
