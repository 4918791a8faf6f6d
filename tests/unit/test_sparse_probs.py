"""Draft distributions on the wire: dense float32 rows, or sparse rows when the drafter truncated
its proposal (SparseProbs). The receiver validates a sparse row as strictly as a dense one."""

from __future__ import annotations

import pytest
import torch

from specmesh.core.sampling import truncate
from specmesh.errors import InvalidArgument
from specmesh.rpc.convert import probs_to_wire, proposal_from_pb
from specmesh.v1 import specmesh_pb2 as pb

V = 1000


def _rows(k: int, keep: int) -> torch.Tensor:
    return truncate(torch.softmax(torch.randn(k, V, generator=torch.Generator().manual_seed(k)), -1), keep)


def test_truncated_rows_travel_sparse_and_come_back_exact() -> None:
    q = _rows(3, 64)  # [3, V], 64 tokens per row
    tokens = [int(q[i].argmax()) for i in range(3)]
    dense, sparse = probs_to_wire(q)
    assert dense == b"" and list(sparse.row_lengths) == [64] * 3
    assert sparse.ByteSize() < 3 * 64 * 8 + 64 < 3 * V * 4 // 5  # 8 bytes per kept entry, not 4 per token
    back = proposal_from_pb(tokens, dense, V, sparse=sparse).probs
    assert torch.equal(back, q)
    full = torch.softmax(torch.randn(2, V), -1)  # untruncated rows stay dense
    dense, sparse = probs_to_wire(full)
    assert sparse is None and len(dense) == 2 * V * 4
    assert torch.equal(proposal_from_pb([1, 2], dense, V).probs, full)


@pytest.mark.parametrize("break_it, match", [
    (lambda s: s.row_lengths.append(1), "rows"),
    (lambda s: setattr(s, "token_ids", s.token_ids[:-4] + (V).to_bytes(4, "little")), r"ids must be in \[0, 1000\)"),
    (lambda s: setattr(s, "probs", s.probs[:-4] + bytes.fromhex("0000c03f")), "sum to 1"),  # last value 1.5
])
def test_a_malformed_sparse_row_is_invalid_argument(break_it, match) -> None:
    q = _rows(1, 8)
    _, sparse = probs_to_wire(q)
    break_it(sparse)
    with pytest.raises(InvalidArgument, match=match):
        proposal_from_pb([int(q[0].argmax())], b"", V, sparse=sparse)


def test_a_drafted_token_outside_its_row_is_invalid_argument() -> None:
    q = _rows(1, 8)
    outside = int(q[0].argmin())  # probability 0 after truncation
    _, sparse = probs_to_wire(q)
    with pytest.raises(InvalidArgument, match="outside the distribution"):
        proposal_from_pb([outside], b"", V, sparse=sparse)
    assert isinstance(sparse, pb.SparseProbs)
