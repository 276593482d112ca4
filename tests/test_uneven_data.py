"""Uneven data ends together: every rank ends each epoch at the last batch every rank has, or (uneven="error")
every rank raises naming the short rank and the step (``lit_ddp.run.even_epochs``).

The real runs are a user's script on 2 CPU ranks (``tests/hang_scripts.py``) whose ranks print the batches they
trained per epoch."""

import re

import pytest

from lit_ddp.run.even_epochs import Ahead, end_of_epoch, uneven_line
from tests.runner import run_module

LOOK_AHEAD = 3


def test_the_end_waits_for_a_count_that_is_exact():
    assert end_of_epoch([Ahead(3, False), Ahead(3, False)], LOOK_AHEAD) is None  # both may have more
    assert end_of_epoch([Ahead(3, False), Ahead(2, True)], LOOK_AHEAD) == 2
    assert end_of_epoch([Ahead(7, True), Ahead(3, False)], LOOK_AHEAD) is None  # the unsized rank may have 7
    assert end_of_epoch([Ahead(3, True), Ahead(3, False)], LOOK_AHEAD) == 3  # the sized one ends after 3
    assert end_of_epoch([Ahead(3, False), Ahead(-1, True)], LOOK_AHEAD) == -1  # a rank with no batch: none


def test_the_line_names_the_short_ranks_and_what_the_others_have():
    ahead = [Ahead(7, True), Ahead(4, True), Ahead(3, False), Ahead(4, True)]
    assert uneven_line(ahead, 1, 4, 2) == "ranks 1, 3 run out of data after 5 batches of epoch 2 (rank 0 has 8)"
    assert uneven_line([Ahead(3, False), Ahead(1, True)], 4, 1, 0) == (
        "rank 1 runs out of data after 5 batches of epoch 0 (rank 0 has more)"
    )
    assert uneven_line([Ahead(2, True), Ahead(2, True)], 4, 2, 0) is None  # even: nothing to say


def run_case(tmp_path, *args: str):
    return run_module("tests.hang_scripts", *args, "--timeout-s", "20", cwd=tmp_path, timeout=120)


def trained(stdout: str) -> dict[int, list[int]]:
    """Each rank's batches per epoch, as the script's ranks print them."""
    return {int(r): eval(b) for r, b in re.findall(r"^rank (\d): batches (\[[\d, ]*\])$", stdout, re.M)}


@pytest.mark.timeout(150)
def test_uneven_shards_of_an_iterable_dataset_end_every_epoch_together(tmp_path):
    """Rank 0's shard has 8 batches an epoch, rank 1's 5, and no length: both epochs end at batch 5 on both."""
    result = run_case(tmp_path, "uneven_shards")
    assert result.returncode == 0, result.stderr
    assert trained(result.stdout) == {0: [5, 5], 1: [5, 5]}
    output = result.stdout + result.stderr
    for epoch in (0, 1):
        line = f"rank 1 runs out of data after 5 batches of epoch {epoch} (rank 0 has more); every rank ends the epoch"
        assert line in output


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_uneven_sized_loaders_are_named_before_the_first_step_and_end_together(tmp_path):
    result = run_case(tmp_path, "uneven_sized")
    assert result.returncode == 0, result.stderr
    assert trained(result.stdout) == {0: [5, 5], 1: [5, 5]}
    output = result.stdout + result.stderr
    line = "rank 1 runs out of data after 5 batches of epoch 0 (rank 0 has 8); every rank ends the epoch there"
    assert line in output
    assert output.index(line) < output.index("Step 0, Loss")


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("uneven_shards", "rank 1 runs out of data after 5 batches of epoch 0 (rank 0 has more); seen before step 4"),
        ("uneven_sized", "rank 1 runs out of data after 5 batches of epoch 0 (rank 0 has 8); seen before step 0"),
    ],
)
def test_uneven_error_raises_on_every_rank_before_any_runs_out(tmp_path, case, message):
    result = run_case(tmp_path, case, "--uneven", "error")
    assert result.returncode == 1
    assert f"UnevenDataError: {message}" in result.stderr
    assert "Timed out" not in result.stderr  # ended by the decision, not by a collective's timeout
    assert not trained(result.stdout)  # no rank reached the end of training


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_rank_with_no_batch_at_all_is_named_as_uneven_data_and_every_rank_raises(tmp_path):
    """Rank 1's shard is empty (webdataset#188): it never reaches an epoch's first batch, where rank 0 waits for its
    count; it gives it at the epoch's end, and both ranks raise there, naming the data, not a collective."""
    result = run_case(tmp_path, "empty_shard")
    assert result.returncode == 1
    line = "rank 1 runs out of data after 0 batches of epoch 0 (rank 0 has more): no batch at all -> a share of"
    assert f"UnevenDataError: {line}" in result.stderr, result.stderr[-3000:]
    assert "Timed out" not in result.stderr and "diverged" not in result.stderr
    assert not trained(result.stdout)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_even_data_says_nothing(tmp_path):
    result = run_case(tmp_path, "even")
    assert result.returncode == 0, result.stderr
    assert trained(result.stdout) == {0: [8, 8], 1: [8, 8]}
    assert "out of data" not in result.stdout + result.stderr
