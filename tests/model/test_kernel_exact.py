"""Deterministic verification on the real default model in float32 with the CPU verify kernel
(specmesh/engine/cpu_gemm.py), the configuration `batch_invariant: auto` picks where the kernel
runs: chains, packed batches and trees give each position bitwise the one-token steps' logits."""

from __future__ import annotations

import pytest
import torch

from specmesh.core.tree import tree_layout
from specmesh.engine import cpu_gemm, rowexact
from specmesh.engine.kv import batched_step
from tests.conftest import on_cpu
from tests.model.test_row_exact import root_path

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not on_cpu(), reason="the CPU verify kernel: the model tier runs elsewhere"),
              pytest.mark.skipif(on_cpu() and cpu_gemm.load() is None, reason="the CPU verify kernel is not usable here")]


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model(target_model):
    assert target_model.dtype == torch.float32 and cpu_gemm.install(target_model)
    model = rowexact.install(target_model)
    assert rowexact.cheap(model)  # what batch_invariant auto reads: on
    return model


def test_packed_batch_and_chains_are_bitwise_the_one_token_steps(model, prefilled, one_token_steps):
    prompts = [_tokens(60, 40), _tokens(61, 75), _tokens(62, 12)]
    drafts = [_tokens(70, 5), _tokens(71, 9), _tokens(72, 1)]
    outs = batched_step(model, [prefilled(model, p) for p in prompts], drafts, row_exact=True)
    for p, d, out in zip(prompts, drafts, outs):
        assert torch.equal(out.logits, one_token_steps(model, p, d))


def test_tree_nodes_are_bitwise_their_ancestor_path(model, prefilled, one_token_steps):
    prompt, toks = _tokens(80, 50), _tokens(81, 8)
    parents = [-1, 0, 0, 1, 1, 2, 4, 6]  # over [root, drafts]
    mask, depth = tree_layout([p - 1 for p in parents[1:]])
    kv = prefilled(model, prompt)
    before = kv.keys(3, kv.length + len(toks)).clone()
    out = batched_step(model, [kv], [toks], new_masks=[mask], depths=[depth], row_exact=True)[0]
    for node in range(len(toks)):
        ref = one_token_steps(model, prompt, [toks[i] for i in root_path(parents, node)])
        assert torch.equal(out.logits[node], ref[-1]), f"node {node}"
    after = kv.keys(3, kv.length + len(toks))
    assert torch.equal(after[:, : kv.length], before[:, : kv.length])  # the cache is untouched
