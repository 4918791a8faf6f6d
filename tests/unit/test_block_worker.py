"""Block drafter plumbing without the real model: feature windows (specmesh.core.features), the
draft worker's BlockDrafter on a tiny random block model, and the coordinator loop moving
features target -> draft tier (delta per round, whole window after a miss)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coordinator.loop import Generation
from draft_worker.drafters import BlockDrafter, ProposeJob
from specmesh.core.features import FeatureFeed, FeatureWindow
from specmesh.core.types import (DraftProposal, FeatureSpec, GenerationRequest, PrefillOutcome, SamplingParams,
                                 VerifyOutcome)
from specmesh.drafters.block import BlockDrafter as BlockModel, BlockDrafterConfig

V, H, W, F = 48, 16, 6, 32  # vocab, hidden, feature window, feature width (2 layers x 16)


def rows(start: int, end: int, width: int = F) -> torch.Tensor:
    """Feature rows of positions [start, end): row value = its position (checkable)."""
    return torch.arange(start, end, dtype=torch.float32)[:, None].expand(-1, width).to(torch.bfloat16)


def positions(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t[:, 0].float().tolist()]


# ------------------------------------------------------------------ windows

def test_window_appends_overlaps_trims_and_refuses_gaps():
    w = FeatureWindow(W, rows(0, 4), end=4)
    assert (w.start, w.end, len(w)) == (0, 4, 4)
    assert w.extend(rows(4, 7), 7) and positions(w.rows) == [1, 2, 3, 4, 5, 6]  # trimmed to W
    assert w.extend(rows(5, 9), 9) and positions(w.rows) == [3, 4, 5, 6, 7, 8]  # overlap replaced
    assert not w.extend(rows(10, 12), 12) and w.end == 9  # gap at 9: refused, unchanged
    assert positions(w.since(7)) == [7, 8] and positions(w.since(0)) == [3, 4, 5, 6, 7, 8]
    feats, valid = FeatureWindow(W, rows(0, 2), 2).padded()
    assert feats.shape == (W, F) and valid.tolist() == [False] * 4 + [True] * 2


def test_feed_sends_deltas_then_the_whole_window():
    feed = FeatureFeed(W)
    feed.reset(rows(2, 8), end=8)
    out, complete = feed.outgoing()
    assert complete and positions(out) == [2, 3, 4, 5, 6, 7]
    feed.sent()
    feed.extend(rows(8, 10), end=10)
    out, complete = feed.outgoing()
    assert not complete and positions(out) == [8, 9]
    out, complete = feed.outgoing(complete=True)  # after a miss
    assert complete and positions(out) == [4, 5, 6, 7, 8, 9]


# ------------------------------------------------------------------ the draft worker's drafter

def tiny_block_model(seed: int) -> BlockModel:
    """A random 1-layer block drafter over a tied V x H embedding / head."""
    torch.manual_seed(seed)
    embed = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    head.weight = embed.weight
    cfg = BlockDrafterConfig(target_layers=(0, 1), target_hidden_size=H, hidden_size=H, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=8, intermediate_size=32, block_size=5, context_window=W,
                             vocab_size=V)
    return BlockModel(cfg, embed, head).eval()


@pytest.fixture(scope="module")
def drafter():
    d = BlockDrafter(tiny_block_model(0), max_batch_size=4, cache_max_sequences=2)
    yield d
    d.close()


def job(seq, ctx_len, feats=None, complete=False, k=4, params=SamplingParams(), tree=0, round_=0):
    return ProposeJob(seq, list(range(1, ctx_len + 1)), k, params, round_, feats, complete, tree)


def test_miss_then_complete_then_deltas(drafter):
    assert drafter.propose(job("a", 9, rows(6, 8))).missing_features  # nothing held: a delta is a miss
    first = drafter.propose(job("a", 9, rows(2, 8), complete=True))
    assert not first.missing_features and len(first.token_ids) == 4 and first.probs is None
    assert not drafter.propose(job("a", 11, rows(8, 10))).missing_features  # contiguous delta
    assert drafter.propose(job("a", 14, rows(11, 13))).missing_features  # rows 10 missing: a gap
    assert drafter.propose(job("a", 14, rows(12, 13))).missing_features  # the miss dropped the window


def test_greedy_chain_is_the_models_argmax(drafter):
    d = drafter.propose(job("b", 9, rows(2, 8), complete=True, k=10))
    assert len(d.token_ids) == 4  # block of 5: at most 4 drafts
    feats, valid = FeatureWindow(W, rows(2, 8), 8).padded()
    want = drafter.model.draft(torch.tensor([9]), feats[None], valid[None])[0].tolist()
    assert d.token_ids == want


def test_sampled_chain_returns_its_distributions(drafter):
    params = SamplingParams(temperature=0.9, top_k=10, seed=3)
    a = drafter.propose(job("c", 9, rows(2, 8), complete=True, params=params))
    assert a.probs.shape == (4, V) and torch.allclose(a.probs.sum(-1), torch.ones(4))
    assert all(a.probs[i, t] > 0 for i, t in enumerate(a.token_ids))
    assert ((a.probs > 0).sum(-1) <= 10).all()  # warped with the request's top_k
    again = drafter.propose(job("c", 9, rows(2, 8), complete=True, params=params))
    assert again.token_ids == a.token_ids  # seeded: reproducible per (seq, round)


def test_tree_proposal(drafter):
    d = drafter.propose(job("e", 9, rows(2, 8), complete=True, k=3, tree=10))
    assert len(d.token_ids) == 10 and d.probs is None and len(d.parents) == 10
    depth = []
    for p in d.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    assert all(p < i for i, p in enumerate(d.parents)) and max(depth) <= 3


def test_a_window_fed_round_by_round_drafts_as_the_whole_window(drafter):
    # the worker keeps each position's keys and values (projected once, on arrival), not its
    # features: a window grown by deltas must draft the table one complete window drafts
    torch.manual_seed(5)
    feats = torch.randn(10, F).to(torch.bfloat16)  # positions 0..9
    table = dict(k=4, tree=4)
    whole = drafter.propose(ProposeJob("p", list(range(1, 12)), 4, SamplingParams(), 0, feats, True, 4, candidates=True))
    drafter.propose(job("q", 5, feats[:4], complete=True, **table))
    drafter.propose(job("q", 8, feats[4:7], **table))
    grown = drafter.propose(ProposeJob("q", list(range(1, 12)), 4, SamplingParams(), 0, feats[7:], False, 4,
                                       candidates=True))
    assert torch.equal(grown.candidates[1], whole.candidates[1])
    assert torch.allclose(grown.candidates[0], whole.candidates[0], atol=1e-5)
    held = drafter._cache.take("q")
    cfg = drafter.model.cfg
    assert held.rows.shape == (W, cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim)


def test_lru_keeps_at_most_the_configured_sequences(drafter):
    for s in ("x", "y", "z"):
        drafter.propose(job(s, 9, rows(2, 8), complete=True))
    assert drafter.cached_sequences() == 2
    assert drafter.propose(job("x", 11, rows(8, 10))).missing_features  # evicted


# ------------------------------------------------------------------ the loop moves the features

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
SCRIPT = [(i % 20) + 10 for i in range(100)]


class FeatureTarget:
    """Greedy continuation SCRIPT; returns feature rows whose value is their position."""

    def __init__(self):
        self.emitted = 0
        self.asked = []

    def prefill_outcome(self, seq_id, prompt, params, timeout, features=None, max_new_tokens=0):
        self.asked.append(("prefill", features))
        self.emitted = 1
        n = min(len(prompt), features.max_rows)
        return PrefillOutcome(SCRIPT[0], rows(len(prompt) - n, len(prompt)))

    def verify(self, seq_id, draft, timeout, features=None):
        self.asked.append(("verify", features))
        p, n = self.emitted, 0
        while n < len(draft.token_ids) and draft.token_ids[n] == SCRIPT[p + n]:
            n += 1
        committed = len(PROMPT) + p - 1  # cache length before the round
        self.emitted = p + n + 1
        return VerifyOutcome(n, list(draft.token_ids[:n]) + [SCRIPT[p + n]], n == len(draft.token_ids),
                             rows(committed, committed + n + 1))

    def release(self, seq_id):
        pass


def held_window(window: FeatureWindow | None, features, context: list[int]) -> FeatureWindow | None:
    """A fake draft tier's window after a Propose's (rows, complete); None: a miss. Checks that
    every held row is its position's."""
    feats, complete = features
    end = len(context) - 1
    if complete:
        window = FeatureWindow(W, feats, end)
    elif window is None or not window.extend(feats, end):
        return None
    assert positions(window.rows) == list(range(max(0, end - W), end))
    return window


class WindowDrafts:
    """A draft tier holding a FeatureWindow, checking every row's position; forgets on demand."""

    def __init__(self, forget_at_round: int):
        self.window = None
        self.forget_at_round = forget_at_round
        self.calls = []

    def propose(self, seq_id, context, k, method, params, round_, timeout, features=None, tree_budget=0):
        feats, complete = features
        self.calls.append((round_, feats.shape[0], complete))
        if round_ == self.forget_at_round and not complete:
            self.window = None  # e.g. the worker restarted
        self.window = held_window(self.window, features, context)
        if self.window is None:
            return DraftProposal([], None, missing_features=True)
        p = len(context) - len(PROMPT)
        return DraftProposal(SCRIPT[p:p + k] if round_ % 2 == 0 else SCRIPT[p:p + 1] + [0] * (k - 1), None)

    def release(self, seq_id):
        pass


def test_loop_sends_deltas_and_recovers_from_a_miss():
    req = GenerationRequest(list(PROMPT), 20, SamplingParams(), "block", 3, request_id="r")
    target, drafts = FeatureTarget(), WindowDrafts(forget_at_round=2)
    gen = Generation(req, target, drafts, type("Tok", (), {"decode": lambda self, ids, **kw: ""})(), {99}, 5.0,
                     feature_spec=FeatureSpec((0, 1), W))
    list(gen.run())
    assert gen.out.token_ids == SCRIPT[:20]
    assert all(spec == FeatureSpec((0, 1), W) for _, spec in target.asked)
    # round 0: the prefill window (complete); then deltas; round 2: a miss, resent complete
    assert drafts.calls[0] == (0, W, True)
    assert drafts.calls[1][2] is False and drafts.calls[1][1] == 4  # k=3 all accepted: 4 rows
    assert [c for c in drafts.calls if c[0] == 2] == [(2, 2, False), (2, W, True)]
    s = gen.stats
    assert s.draft_failures == 0
    assert s.feature_bytes == (W + s.emitted_tokens) * F * 2  # prefill rows + one row per emitted token
    assert s.draft_feature_bytes == sum(n for _, n, _ in drafts.calls) * F * 2

def test_block_head_on_the_cpu_kernel_drafts_a_batch_as_each_job_alone():
    """cpu_kernel: the shared float32 head from packed weights; all jobs' rows through it at once,
    each job's drafts bitwise what it drafts alone (the kernel is row-invariant)."""
    from specmesh.engine import cpu_gemm
    if cpu_gemm.load() is None:
        pytest.skip(f"kernel not usable here: {cpu_gemm.unusable_reason()}")
    d = BlockDrafter(tiny_block_model(1), max_batch_size=4, cache_max_sequences=4, cpu_kernel=True)
    try:
        assert d.cpu_kernel
        jobs = [(job(s, 9 + i, k=k, tree=t), FeatureWindow(W, rows(i, 8 + i), 8 + i))
                for i, (s, k, t) in enumerate((("x", 4, 0), ("y", 2, 0), ("z", 3, 6)))]
        together = d._run_batch("propose", jobs)
        for one, got in zip(jobs, together):
            alone = d._run_batch("propose", [one])[0]
            assert (got.token_ids, got.parents) == (alone.token_ids, alone.parents)
        assert [len(p.token_ids) for p in together] == [4, 2, 6]
        feats, valid = FeatureWindow(W, rows(0, 8), 8).padded()  # greedy chain: the model's own argmax
        assert together[0].token_ids == d.model.draft(torch.tensor([9]), feats[None], valid[None])[0].tolist()
    finally:
        d.close()


# ------------------------------------------------------------------ loading the artefact

def test_loader_checks_manifest_and_feature_config(drafter, tmp_path):
    from draft_worker.block_loader import load_block_model
    from specmesh.config import ConfigError, load_config
    from specmesh.drafters.artifact import export_drafter
    from specmesh.errors import ModelIntegrityError

    model = drafter.model
    out = export_drafter(model, tmp_path / "art")
    embed, head = model.embed_tokens, model.lm_head

    def cfg(path, layers=(0, 1), window=W):
        return load_config(environ={}, overrides={"draft_worker": {"block": {"path": str(path)}},
                                                  "speculative": {"feature_layers": list(layers),
                                                                  "feature_window": window}})

    loaded = load_block_model(cfg(out), embed, head)
    assert loaded.cfg == model.cfg
    with pytest.raises(ConfigError, match="feature_layers"):
        load_block_model(cfg(out, layers=(1, 14, 27)), embed, head)
    with pytest.raises(ModelIntegrityError):
        load_block_model(cfg(tmp_path / "absent"), embed, head)  # configured explicitly: must exist
    (out / "config.json").write_text((out / "config.json").read_text().replace('"num_layers": 1', '"num_layers": 2'))
    with pytest.raises(ModelIntegrityError, match="MANIFEST"):
        load_block_model(cfg(out), embed, head)


def test_shared_head_is_loaded_in_the_drafters_dtype(tmp_path):
    """A bf16 checkpoint's embedding and tied head, read as float32 for a float32 drafter (a bf16
    head is ~9x slower on a CPU without native bf16), or as stored."""
    from safetensors.torch import save_file

    from draft_worker.block_loader import shared_head

    weight = torch.randn(V, H).to(torch.bfloat16)
    save_file({"model.embed_tokens.weight": weight}, str(tmp_path / "model.safetensors"))
    embed, head = shared_head(tmp_path, torch.float32)
    assert embed.weight.dtype == head.weight.dtype == torch.float32
    assert head.weight.data_ptr() == embed.weight.data_ptr()  # tied: one float32 copy
    assert torch.equal(embed.weight, weight.float())
    assert shared_head(tmp_path)[1].weight.dtype == torch.bfloat16


def test_bf16_block_drafter_runs_its_linears_prepacked_and_drafts_as_plain():
    """cpu_kernel in bf16: every drafter linear and the shared head from oneDNN-prepacked copies
    (same parameters, same state_dict keys); the table's logits within bf16 rounding of the
    plain ones; cpu_kernel false prepacks nothing."""
    import copy

    from specmesh.engine import onednn
    if not onednn.available():
        pytest.skip("oneDNN's bf16 path is not available on this CPU")
    model = tiny_block_model(2)
    model.embed_tokens.to(torch.bfloat16)  # tied: the head's weight with it
    model.to(torch.bfloat16)
    keys = sorted(model.state_dict())
    plain = BlockDrafter(copy.deepcopy(model), max_batch_size=4, cache_max_sequences=4, cpu_kernel=False)
    d = BlockDrafter(model, max_batch_size=4, cache_max_sequences=4, cpu_kernel=True)
    try:
        assert d.prepacked and not d.cpu_kernel and not plain.prepacked
        assert isinstance(d.head, onednn.PrepackedLinear) and d.head.weight is model.lm_head.weight
        lins = [m for m in model.modules() if isinstance(m, nn.Linear)]
        assert lins and all(isinstance(m, onednn.PrepackedLinear) for m in lins)
        assert not any(isinstance(m, onednn.PrepackedLinear) for m in plain.model.modules())
        assert sorted(model.state_dict()) == keys
        feats, valid = FeatureWindow(W, rows(0, 8), 8).padded()
        ids = model.block_ids(torch.tensor([9]))
        got = d.head(model.hidden(ids, feats[None], valid[None]))  # [1, B, V]
        want = plain.head(plain.model.hidden(ids, feats[None], valid[None]))
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)
        jobs = [(job(s, 9 + i, k=4, tree=t), FeatureWindow(W, rows(i, 8 + i), 8 + i))
                for i, (s, t) in enumerate((("x", 0), ("y", 6)))]
        chain, tree = d._run_batch("propose", jobs)
        assert len(chain.token_ids) == 4 and len(tree.token_ids) == 6 and tree.parents
    finally:
        d.close()
        plain.close()


def test_prepacked_linear_takes_any_rows_and_leading_shape():
    from specmesh.engine import onednn
    if not onednn.available():
        pytest.skip("oneDNN's bf16 path is not available on this CPU")
    torch.manual_seed(3)
    lin = nn.Linear(40, 24, bias=True).to(torch.bfloat16)
    packed = onednn.PrepackedLinear.of(lin)
    for shape in ((1, 40), (5, 40), (3, 11, 40), (37, 40)):  # 37 rows: padded to a bucket of 40
        x = torch.randn(shape).to(torch.bfloat16)
        y = packed(x)
        assert y.shape == (*shape[:-1], 24)
        torch.testing.assert_close(y.float(), lin(x).float(), rtol=0.02, atol=0.02)
