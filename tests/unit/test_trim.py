"""The target's batch-wide draft trim (specmesh/core/trim.py), with hand-built costs."""

import pytest

from specmesh.core.trim import cumulative, keep_counts


def amx_like(rows: int) -> float:
    """An AMX Xeon's forward (docs/bench/engine.md#20, deterministic ms): ~41.6 ms for 16 one-row
    sequences, +5.7 ms across the 16-row tile edge, ~1.1 ms per row after it."""
    return 0.0416 + (0.0057 + 0.0011 * (rows - 17) if rows > 16 else 0.0012 * (rows - 16))


def flat(rows: int) -> float:  # a GPU: rows nearly free
    return 0.020 + 1e-6 * rows


def test_cumulative_is_the_product_of_conditional_rates():
    assert cumulative([0.5, 0.5, 1.2], 4) == pytest.approx([0.5, 0.25, 0.25, 0.0])  # clamped; missing: 0
    assert cumulative([], 2) == [0.0, 0.0]


def test_sixteen_sequences_past_the_tile_edge_drop_every_draft():
    # 15 sequences at one row and one drafting 3 (p 0.45, 0.2, 0.1): the 17th row costs +14%
    accept = [None] * 15 + [[0.45, 0.2, 0.1]]
    assert keep_counts(accept, 16, 16.0, amx_like) == [None] * 15 + [0]
    # all 16 drafting one token at 0.45 each: 16 x 2 rows ~1.4x the forward for +0.45 x 16 tokens
    assert keep_counts([[0.45]] * 16, 16, 16.0, amx_like) == [0] * 16


def test_rows_nearly_free_keep_everything():
    accept = [[0.45, 0.2, 0.1]] * 16
    assert keep_counts(accept, 16, 16.0, flat) == [3] * 16


def test_the_likeliest_positions_are_kept_and_chains_keep_prefixes():
    def linear(rows: int) -> float:  # each row 5% of a one-row step
        return 1.0 + 0.05 * (rows - 1)

    # 4 sequences (1.15): a row pays while its p beats ~0.05 of the tokens per forward-second
    keep = keep_counts([[0.9, 0.81, 0.02], [0.3, 0.01], [0.02]], 4, 4.0, linear)
    assert keep == [2, 1, 0]
    # p rising along a chain is read as its running minimum: never a gap in a kept prefix
    assert keep_counts([[0.02, 0.9]], 2, 2.0, linear) == [0]


def test_untrimmable_drafts_stay_and_count_their_rows():
    def linear(rows: int) -> float:
        return 1.0 + 0.1 * rows

    # a tree (None) of 8 nodes beside a chain: its rows are priced in, never cut
    assert keep_counts([None, [0.95]], 2 + 8, 2.0, linear) == [None, 1]
    assert keep_counts([None, None], 2, 2.0, linear) == [None, None]


def test_ties_go_to_fewer_rows():
    def step(rows: int) -> float:  # one more row doubles the forward: p 1.0 exactly breaks even at B = 1
        return 1.0 if rows <= 1 else 2.0

    assert keep_counts([[1.0]], 1, 1.0, step) == [0]
