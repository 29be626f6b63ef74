"""StepInputs: the exact rows, slots and metadata of a step, written into stable buffers."""

from __future__ import annotations

import pytest

from pdserve.core.sampling import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_inputs import StepInputs

BS = 4


def _seq(name: str, prompt: list[int], computed: int, table: list[int], outputs=()) -> Sequence:
    s = Sequence(name, prompt, SamplingParams())
    for t in outputs:
        s.append_token(t)
    s.num_computed_tokens = computed
    s.block_table = list(table)
    return s


def _inputs() -> StepInputs:
    return StepInputs(max_tokens=32, max_seqs=8, max_blocks=6, block_size=BS, device="cpu")


def test_decode_rows_first_then_prefill_chunks_with_exact_slots():
    decode = _seq("d", [5, 6, 7, 8, 9], 5, [3, 7], outputs=[10])  # position 5, in block 7
    chunk = _seq("c", list(range(100, 110)), 4, [2, 0, 5])  # tokens 4..8 of 10: no sample
    last = _seq("l", [40, 41, 42], 0, [1])  # the whole prompt: sampled
    inputs = _inputs()
    step = inputs.prepare([chunk, decode, last], [5, 1, 3])
    assert step.num_tokens == 9 and step.num_decode == 1 and step.num_real_decode == 1
    ids = inputs.input_ids[:9].tolist()
    assert ids == [10, 104, 105, 106, 107, 108, 40, 41, 42]
    assert inputs.positions[:9].tolist() == [5, 4, 5, 6, 7, 8, 0, 1, 2]
    # slot = block_table[p // 4] * 4 + p % 4
    assert step.meta.slot_mapping.tolist() == [29, 0, 1, 2, 3, 20, 4, 5, 6]
    meta = step.meta
    assert meta.num_decode_tokens == 1
    assert meta.decode_seq_lens.tolist() == [6]
    assert meta.decode_block_tables[0, :2].tolist() == [3, 7]
    assert meta.decode_max_seq_len == 6
    assert meta.prefill_seq_lens.tolist() == [9, 3]
    assert meta.prefill_query_start_loc.tolist() == [0, 5, 8]
    assert meta.prefill_block_tables[0, :3].tolist() == [2, 0, 5]
    assert meta.prefill_block_tables[1, :1].tolist() == [1]
    assert (meta.prefill_max_query_len, meta.prefill_max_seq_len) == (5, 9)
    # Sampled: the decode row (batch index 1) and the finished prompt's last row (index 2).
    assert step.logit_rows.tolist() == [0, 8]
    assert step.sample_order == [1, 2]


def test_a_one_token_chunk_inside_a_prompt_is_a_decode_row_that_samples_nothing():
    inside = _seq("i", [1, 2, 3, 4, 5, 6], 2, [4, 9])  # token 2 of 6
    step = _inputs().prepare([inside], [1])
    assert step.num_decode == 1
    assert step.meta.decode_seq_lens.tolist() == [3]
    assert step.logit_rows.tolist() == [] and step.sample_order == []


def test_padding_rows_write_nowhere_and_attend_to_nothing():
    a = _seq("a", [1, 2, 3], 3, [6], outputs=[4])
    inputs = _inputs()
    step = inputs.prepare([a], [1], pad_decode_to=4)
    assert step.num_tokens == 4 and step.num_decode == 4 and step.num_real_decode == 1
    assert step.meta.slot_mapping.tolist() == [6 * BS + 3, -1, -1, -1]
    assert step.meta.decode_seq_lens.tolist() == [4, 0, 0, 0]
    assert inputs.input_ids[:4].tolist() == [4, 0, 0, 0]
    assert step.logit_rows.tolist() == [0]
    # Padding only: the rows a CUDA graph is captured on.
    empty = inputs.prepare([], [], pad_decode_to=2)
    assert empty.meta.slot_mapping.tolist() == [-1, -1]
    assert empty.meta.decode_seq_lens.tolist() == [0, 0]


def test_buffers_are_the_same_storage_every_step():
    inputs = _inputs()
    first = inputs.prepare([_seq("a", [1, 2], 0, [0])], [2])
    ptrs = (inputs.input_ids.data_ptr(), first.meta.slot_mapping.data_ptr())
    second = inputs.prepare([_seq("b", [3, 4, 5], 0, [1])], [3])
    assert (inputs.input_ids.data_ptr(), second.meta.slot_mapping.data_ptr()) == ptrs


def test_a_step_larger_than_the_buffers_is_a_bug():
    with pytest.raises(RuntimeError, match="bug: a step of 40 tokens"):
        _inputs().prepare([_seq("a", list(range(40)), 0, list(range(10)))], [40])


def test_a_speculating_sequence_writes_its_last_token_and_drafts_and_samples_each_row():
    decode = _seq("d", [5, 6, 7, 8, 9], 5, [3, 7], outputs=[10])
    spec = _seq("s", [1, 2, 3, 4, 5], 5, [2, 6], outputs=[6])  # last token at position 5
    inputs = _inputs()
    step = inputs.prepare([spec, decode], [3, 1], draft_token_ids={"s": [7, 8]})
    assert inputs.input_ids[:4].tolist() == [10, 6, 7, 8]
    assert inputs.positions[:4].tolist() == [5, 5, 6, 7]
    assert step.meta.slot_mapping.tolist() == [29, 25, 26, 27]
    assert step.meta.prefill_seq_lens.tolist() == [8]
    assert step.logit_rows.tolist() == [0, 1, 2, 3]
    assert step.sample_order == [1, 0, 0, 0]
