"""Batch-invariant verification (specmesh/engine/rowexact.py) on the real default model in bf16,
the services' default dtype, and in float32: a verify forward over several positions, padded beside other
sequences or shaped as a tree, gives each position the logits of the one-token steps the target
alone would take — bit for bit (torch.equal), not to a tolerance. Without row_exact the same
forward is a different GEMM and its logits move (the reason this mode exists); that is measured
and printed here, not asserted, since it depends on the BLAS library. Mode 2 (the 2-row floor,
what `batch_invariant: auto` picks where only it is cheap, e.g. a Zen 4 EPYC in bf16) is checked
against its own one-token steps (its attention on the row kernel where it builds); where the
probe installed no floor its linears run as in mode 1."""

from __future__ import annotations

import pytest
import torch

from specmesh.core.tree import tree_layout
from specmesh.engine import cpu_gemm, row_attn, rowexact
from specmesh.engine.kv import batched_step
from tests.conftest import MODEL_TEST_DEVICE, on_cpu

pytestmark = pytest.mark.model


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def model(request, model_dir):
    """Each test in both dtypes: bf16 (the services' default) and float32, where any other
    summation order shows in the logits (on an H200 a float32 batch under `true` once differed).
    A model of its own: install probes and routes it, which the shared session models must not
    see (test_kernel_exact's probe of the packed kernel would read these F.linear counts)."""
    from specmesh.engine.loader import load_model

    model = rowexact.install(load_model(model_dir, request.param, MODEL_TEST_DEVICE))
    row_attn.enable_bf16(model)  # mode 2's attention on the row kernel, as the worker runs it (bf16 only)
    return model


MODES = pytest.mark.parametrize("mode", [1, 2])


def _ref_mode(mode: int) -> int:
    """The one-token steps a mode is bitwise: HF's own one-row calls (1), its own padded ones (2)."""
    return 0 if mode == 1 else mode


@MODES
def test_chain_verify_is_bitwise_the_one_token_steps(model, prefilled, one_token_steps, mode):
    prompt, drafts = _tokens(0, 90), _tokens(1, 6)
    ref = one_token_steps(model, prompt, drafts, _ref_mode(mode))
    kv = prefilled(model, prompt)
    if mode == 2 and next(model.parameters()).dtype == torch.bfloat16:  # bf16 attention rows take the row
        # kernel wherever it builds (the worker's path; float32 rows take it with the packed linears)
        assert row_attn.usable(model, [kv], 2) == (on_cpu() and cpu_gemm.load() is not None)
    exact = batched_step(model, [kv], [drafts], row_exact=mode)[0].logits
    assert torch.equal(exact, ref)
    batched = batched_step(model, [kv], [drafts])[0].logits
    print(f"without row_exact: max |logit diff| {float((batched - ref).abs().max()):.4f}")


@MODES
def test_padded_batch_rows_are_bitwise_each_sequence_alone(model, prefilled, one_token_steps, mode):
    """Three sequences of different lengths and draft counts in one packed forward."""
    prompts = [_tokens(10, 40), _tokens(11, 73), _tokens(12, 9)]
    drafts = [_tokens(20, 5), _tokens(21, 2), _tokens(22, 1)]
    refs = [one_token_steps(model, p, d, _ref_mode(mode)) for p, d in zip(prompts, drafts)]
    kvs = [prefilled(model, p) for p in prompts]
    outs = batched_step(model, kvs, drafts, row_exact=mode)
    for out, ref in zip(outs, refs):
        assert torch.equal(out.logits, ref)
    # the KV of the new tokens is the one-token steps' too: continuing after them stays exact
    for kv, d in zip(kvs, drafts):
        kv.commit(len(d))
    nxt = batched_step(model, kvs, [[7], [8, 9], [10]], row_exact=mode)
    for p, d, extra, out in zip(prompts, drafts, [[7], [8, 9], [10]], nxt):
        assert torch.equal(out.logits, one_token_steps(model, p, d + extra, _ref_mode(mode))[len(d):])


@MODES
def test_tree_nodes_are_bitwise_their_ancestor_path(model, prefilled, one_token_steps, mode):
    """Node i sees the context and its ancestors; its logits equal the one-token steps along
    root -> ... -> i, whatever its siblings."""
    prompt = _tokens(30, 50)
    toks = _tokens(31, 6)  # node 0 = root (the pending token), then 5 drafted nodes
    parents = [-1, 0, 0, 1, 1, 2]  # over [root, drafts]; tree_layout takes the drafts' (root = -1)
    mask, depth = tree_layout([p - 1 for p in parents[1:]])
    kv = prefilled(model, prompt)
    out = batched_step(model, [kv], [toks], new_masks=[mask], depths=[depth], row_exact=mode)[0]
    for node in range(len(toks)):
        path = root_path(parents, node)
        ref = one_token_steps(model, prompt, [toks[i] for i in path], _ref_mode(mode))
        assert torch.equal(out.logits[node], ref[-1]), f"node {node} (path {path})"


def root_path(parents: list[int], node: int) -> list[int]:
    """Indices root -> ... -> node (parents over [root, drafts], root's parent -1)."""
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_equal_length_one_token_rows_are_bitwise_each_alone(model, prefilled, one_token_steps):
    """Batched plain decoding (method off at concurrency > 1): sequences of the same length with
    one new token each leave nothing to mask, and the rows still take the one-token path."""
    prompts = [_tokens(50, 33), _tokens(51, 33), _tokens(52, 33)]
    kvs = [prefilled(model, p) for p in prompts]
    outs = batched_step(model, kvs, [[11], [12], [13]], row_exact=True)
    for p, t, out in zip(prompts, [11, 12, 13], outs):
        assert torch.equal(out.logits, one_token_steps(model, p, [t]))


@MODES
def test_a_packed_batch_wider_than_one_gemm_chunk_is_bitwise_each_sequence_alone(model, prefilled, mode):
    """Five 9-node trees and eight 6-position chains: 45 and 48 packed rows, past the probed row
    count of every linear here (32 on an AMX Xeon), so the linears run in several chunks. Each
    sequence's logits equal its verify alone (which the tests above tie to the one-token steps).
    A probed count that fit the probe's data but not real activations (36 for 576x576 there,
    before probe_rows rounded to a power of two) failed this with 14 of 16 trees differing."""
    from specmesh.bench.micro import tree_mask

    gen = torch.Generator().manual_seed(3)
    for trees, batch, n in ((True, 5, 8), (False, 8, 5)):
        kvs = [prefilled(model, _tokens(60 + b, 20 + 17 * b)) for b in range(batch)]
        layouts = [tree_mask(n, gen) if trees else (None, None) for _ in kvs]
        toks = [_tokens(80 + b, n + 1) for b in range(batch)]
        masks, depths = [m for m, _ in layouts], [d for _, d in layouts]
        together = batched_step(model, kvs, toks, new_masks=masks, depths=depths, row_exact=mode)
        for b, out in enumerate(together):
            alone = batched_step(model, [kvs[b]], [toks[b]], new_masks=[masks[b]], depths=[depths[b]], row_exact=mode)
            assert torch.equal(out.logits, alone[0].logits), f"trees={trees} sequence {b}"
