"""`benchmarks.mixed_step`'s step language and the staged inputs it builds (the timing itself needs a GPU)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from benchmarks.mixed_step import parse_step, step_inputs


def test_parse_step_reads_decodes_and_chunks_in_order() -> None:
    assert parse_step("2x100+30:50") == [(1, 101), (1, 101), (30, 50)]
    assert parse_step("1352:3400") == [(1352, 3400)]


@pytest.mark.parametrize("text", ["", "2x", "30:20", "0:5", "ax3", "1:2:3"])
def test_parse_step_rejects_what_it_cannot_run(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_step(text)


def test_step_inputs_put_new_tokens_at_the_end_of_each_context() -> None:
    inputs = step_inputs([(1, 5), (3, 20)], block_size=4)
    assert inputs.query_lens == [1, 3] and inputs.context_lens == [5, 20]
    assert inputs.block_tables == [[0, 1], [2, 3, 4, 5, 6]]
    # Token 4 of sequence 0 is slot 4 of its blocks (block 1, offset 0); tokens 17-19 of sequence 1 sit in
    # its fifth block (6), offsets 1-3.
    assert inputs.slots.tolist() == [4, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3]
    assert np.array_equal(inputs.positions, np.array([[4, 17, 18, 19]] * 3))
    assert inputs.rows == [0, 3]
