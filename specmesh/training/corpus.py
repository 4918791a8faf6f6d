"""In-memory view of the cached shards and block/anchor sampling for drafter training.

Anchor ``a`` (an index into a sequence ``s`` of prompt + target response) plays the
role of the bonus token ``x_T`` at inference: the drafter sees target features of
``s[a-C .. a-1]`` (``C = context_window``, fewer near the start, left-padded and
masked), the block ``[s_a, MASK x (B-1)]`` and must predict ``s[a+1 .. a+B-1]``.
Anchors range over the response: ``prompt_len <= a <= len(s) - B``; sampling is uniform over all
anchors. The block targets are ``labels[a+1 .. a+B-1]``: the sequence itself for target-generated
responses, the target's own greedy next token for teacher-forced ones (specmesh.training.teacher).
A teacher-forced label at block position k is what the target emits after the ORIGINAL tokens
s[a+1 .. a+k-1]; it is the right target for the drafter's chain only while those tokens are what
the target itself would have emitted (s[a+j] == labels[a+j] for every j < k). From the first
position where the text departs from the target, the targets are IGNORE (-100): never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

IGNORE = -100  # F.cross_entropy's ignore_index


@dataclass
class Corpus:
    tokens: list[torch.Tensor] = field(default_factory=list)  # each [L] int64
    prompt_len: list[int] = field(default_factory=list)
    feat_start: list[int] = field(default_factory=list)  # features[i][j] is position feat_start[i] + j
    features: list[torch.Tensor] = field(default_factory=list)  # each [L - feat_start, F] bf16
    meta: list[dict] = field(default_factory=list)
    labels: list[torch.Tensor] = field(default_factory=list)  # each [L] int64: the training targets

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, shard: dict) -> None:
        for key in ("tokens", "prompt_len", "feat_start", "features", "meta"):
            getattr(self, key).extend(shard[key])
        self.labels.extend(shard.get("labels") or shard["tokens"])  # regenerated: the tokens themselves


def load_corpus(split_dir: str | Path, max_shards: int | None = None) -> Corpus:
    """Concatenate ``shard_*.pt`` of one split (sorted by name)."""
    paths = sorted(Path(split_dir).glob("shard_*.pt"))[:max_shards]
    if not paths:
        raise FileNotFoundError(f"no shards in {split_dir}; run `python -m specmesh.training.data` first")
    corpus = Corpus()
    for p in paths:
        corpus.add(torch.load(p, weights_only=True))
    return corpus


def gather_context(corpus: Corpus, row: int, anchor: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of positions [anchor - window, anchor) left-padded to ``window``.
    -> feats [window, F] bf16, valid [window] bool."""
    fs = corpus.feat_start[row]
    start = max(fs, anchor - window)
    if anchor <= fs:
        raise ValueError(f"anchor {anchor} has no cached context (feat_start {fs})")
    got = corpus.features[row][start - fs: anchor - fs]  # [n, F]
    feats = torch.zeros(window, got.shape[1], dtype=got.dtype)
    valid = torch.zeros(window, dtype=torch.bool)
    feats[window - got.shape[0]:] = got
    valid[window - got.shape[0]:] = True
    return feats, valid


class AnchorSampler:
    """Uniform sampling over all (row, anchor) pairs with prompt_len <= anchor <= L - B."""

    def __init__(self, corpus: Corpus, block_size: int):
        self.corpus, self.block = corpus, block_size
        counts = [max(0, len(t) - block_size - p + 1) for t, p in zip(corpus.tokens, corpus.prompt_len)]
        self.cum = torch.tensor(counts, dtype=torch.long).cumsum(0)  # [rows]
        if int(self.cum[-1]) == 0:
            raise ValueError("no sequence is long enough for one block")

    @property
    def num_anchors(self) -> int:
        return int(self.cum[-1])

    def sample(self, n: int, gen: torch.Generator) -> list[tuple[int, int]]:
        flat = torch.randint(0, self.num_anchors, (n,), generator=gen)  # [n]
        rows = torch.searchsorted(self.cum, flat, right=True)  # first row whose cum > flat
        out = []
        for f, r in zip(flat.tolist(), rows.tolist()):
            before = int(self.cum[r - 1]) if r > 0 else 0
            out.append((r, self.corpus.prompt_len[r] + f - before))
        return out


def make_batch(corpus: Corpus, picks: list[tuple[int, int]], block_size: int, window: int,
               mask_token_id: int) -> dict[str, torch.Tensor]:
    """-> block_ids [N, B], ctx_feats [N, C, F], ctx_valid [N, C], targets [N, B-1]."""
    feats, valid, blocks, targets = [], [], [], []
    for row, a in picks:
        f, v = gather_context(corpus, row, a, window)
        feats.append(f)
        valid.append(v)
        seq = corpus.tokens[row]
        blocks.append(torch.tensor([int(seq[a])] + [mask_token_id] * (block_size - 1)))
        targets.append(chain_targets(seq[a + 1: a + block_size], corpus.labels[row][a + 1: a + block_size]))
    return {"block_ids": torch.stack(blocks), "ctx_feats": torch.stack(feats),
            "ctx_valid": torch.stack(valid), "targets": torch.stack(targets)}


def chain_targets(text: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """text, labels: [B-1] -> labels, IGNORE from the position after the first text != label on
    (position k is kept iff text[j] == labels[j] for all j < k)."""
    agree = (text == labels).long()  # [B-1]
    consistent = torch.cat([torch.ones(1, dtype=torch.long), agree[:-1].cumprod(0)])  # [B-1]
    return torch.where(consistent.bool(), labels, torch.full_like(labels, IGNORE))
