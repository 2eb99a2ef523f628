"""``python -m benchmarks.copies``: per-visited-block lowering copies of the library's forward
and stash backward, by kind, from the emulator's run profile."""
import pytest

import popxl_flash as pf
from benchmarks import copies
from benchmarks.graphs import Case
from popxl_flash.plan import steps

pytestmark = pytest.mark.skipif(pf.BACKEND != "emulator", reason="emulator run profile")


def test_per_block_figures_are_the_profile_over_the_visited_blocks():
    """Causal 2 x 2 chunks: 3 visited blocks, the two diagonal ones split into two steps each
    (4 loop iterations; the one full block is a group of one step, inline). The figures are per
    visited block (the schedule's), not per step."""
    case = Case("fwd", 256, 32, 2, "float16", "causal", (2, 2))
    blocks, total, kinds, iters = copies.per_block(case)
    schedule = case.config().schedule
    assert blocks == schedule.visited_blocks == 3
    assert iters == steps.loop_steps(schedule) == 4
    assert total == pytest.approx(sum(kinds.values())) and total > 0


def test_cli_prints_one_row_per_length_and_pass(capsys):
    assert copies.main(["--seq-len", "256", "--head-dim", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["pass", "L", "blocks", "iters", "B/block"]
    assert [line.split()[:2] for line in lines[1:]] == [["fwd", "256"], ["bwd", "256"]]


def test_cli_refuses_a_length_not_a_multiple_of_the_chunk():
    with pytest.raises(SystemExit):
        copies.main(["--seq-len", "200"])
