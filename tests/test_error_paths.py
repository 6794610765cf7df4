"""Documented error paths, each raised with its one-line message (the exact text is asserted,
so a removed check, a reworded message or a check that no longer fires fails here):

  pack_documents   a document longer than a row ("does not fit a row"), never truncated;
                   a row length that is not a multiple of the document multiple
  zigzag_shard     a stream whose length is not the layout's
  the RL loop      a rollout that does not fit training.seq_len names the knobs to turn
"""

import re

import pytest
import torch

import titan_spec  # noqa: F401
from helpers.rl_loop_stub import rollout_step
from titan_spec.parallelisms.context_parallel import ZigzagLayout, zigzag_shard
from titan_spec.data.packing import Document, pack_documents


def _raises_exactly(exc, message):
    """pytest.raises for exactly this one-line message."""
    assert "\n" not in message
    return pytest.raises(exc, match=f"^{re.escape(message)}$")


def test_pack_documents_rejects_a_document_longer_than_a_row():
    # Boundary: a document of exactly row_len tokens fits (one full row) ...
    packed, used = pack_documents([Document(list(range(1, 9)))], None, 8, pad_id=0)
    assert used == 1 and packed.input_BL[0].tolist() == list(range(1, 9))
    # ... one more token is an error, also after documents that did fit, and with rows given.
    for rows in (None, 3):
        with _raises_exactly(ValueError, "a document of 9 tokens does not fit a row of 8 tokens"):
            pack_documents([Document([1, 2, 3]), Document(list(range(1, 10)))], rows, 8, pad_id=0)
    # Padded to a multiple of 4, a 5-token document takes 8 tokens: it fits a row of 8, not of 4.
    packed, _ = pack_documents([Document([1, 2, 3, 4, 5])], None, 8, pad_id=0, multiple=4)
    assert packed.positions_BL[0].tolist() == list(range(8))
    with _raises_exactly(ValueError, "a document of 5 tokens does not fit a row of 4 tokens"):
        pack_documents([Document([1, 2, 3, 4, 5])], None, 4, pad_id=0, multiple=4)


def test_pack_documents_rejects_rows_that_are_not_a_multiple_of_the_document_multiple():
    pack_documents([Document([1, 2])], None, 12, pad_id=0, multiple=4)  # 12 = 3 x 4 is fine
    with _raises_exactly(ValueError, "rows of 10 tokens do not hold documents padded to multiples of 4"):
        pack_documents([Document([1, 2])], None, 10, pad_id=0, multiple=4)


def test_zigzag_shard_rejects_a_stream_of_the_wrong_length():
    layout = ZigzagLayout((5, 3), cp=2)  # 8 tokens
    assert zigzag_shard(torch.arange(8), layout, rank=0).shape == (layout.local_len,)
    for n in (7, 9):
        with _raises_exactly(ValueError, f"zigzag_shard: {n} rows for a layout of 8 tokens"):
            zigzag_shard(torch.arange(n), layout, rank=1)


def test_rl_loop_names_the_settings_when_a_rollout_does_not_fit_the_sequence_length():
    """RLTrainer.pack packs prompt + completion documents into training.seq_len
    rows; one that is too long stops the run with the packing error and what to change."""
    # BOS + 2 prompt characters + a 6-character completion = 9 tokens
    problems = [("qa", "5", ["5", "123456"]), ("qb", "7", ["7", "8"])]
    rollout_step(problems, seq_len=9)  # fits exactly
    with _raises_exactly(
        ValueError,
        "a document of 9 tokens does not fit a row of 8 tokens: raise training.seq_len or lower rl.max_new_tokens",
    ):
        rollout_step(problems, seq_len=8)


def test_rl_loop_under_pipeline_parallelism_packs_a_minibatch_into_local_batch_size_rows():
    """Under PP the schedule's microbatches have static shapes: the minibatch is exactly
    training.local_batch_size rows (empty ones carry no labels), and completions that need
    more rows stop the run with what to change, not dropped silently."""
    problems = [("qa", "5", ["5", "123456"]), ("qb", "7", ["7", "8"])]
    _, flat_BL, _ = rollout_step(problems, seq_len=9)  # as many rows as the documents need
    n = flat_BL.shape[0]
    assert n == 3
    _, labels_BL, _ = rollout_step(problems, seq_len=9, pp_rows=n + 2)
    assert labels_BL.shape == (n + 2, 9) and torch.equal(labels_BL[:n], flat_BL) and (labels_BL[n:] == -100).all()
    with _raises_exactly(
        ValueError,
        "under pipeline parallelism a minibatch is packed into "
        "training.local_batch_size = 2 rows of 9 tokens (the schedule's microbatches), "
        "but only 2 of its 4 completions fit: raise training.local_batch_size (a multiple "
        "of parallelism.pipeline_parallel_microbatch_size), training.seq_len or rl.minibatches",
    ):
        rollout_step(problems, seq_len=9, pp_rows=n - 1)
