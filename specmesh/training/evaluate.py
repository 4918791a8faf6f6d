"""Offline acceptance-length evaluation of block drafters at temperature 0.

Reference = the target's own greedy continuation of each MT-Bench first turn (cached
with features by ``python -m specmesh.training.data --split mtbench``; MT-Bench is
never used for training). Simulated decoding, per question: start with the anchor at
the first generated token (a = prompt_len, produced by the target's prefill); each
round the drafter proposes s'[a+1 .. a+B-1] from the features of s[.. a-1]; with
n = number of leading draft tokens equal to the reference, the target would emit
n accepted tokens + 1 own token, so the round's acceptance length is n + 1 and the
next anchor is a + n + 1. Rounds run while a full block fits (a <= L - B); the
reported value is the mean acceptance length over rounds (pooled per category).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from specmesh.drafters.artifact import MANIFEST_NAME, load_drafter, write_manifest
from specmesh.drafters.block import BlockDrafter
from specmesh.engine.loader import resolve_device, resolve_dtype
from specmesh.training.corpus import Corpus, gather_context, load_corpus
from specmesh.training.data import resolve_target_dir


def load_shared_target(target_dir: Path, device: str = "cpu"):
    """-> (embed_tokens, lm_head, final-norm weight) of the target, frozen, in the compute dtype
    (resolve_dtype auto: bf16 where the CPU/GPU has it natively, else float32 -- the shared head's
    dtype then sets training's autocast, see train.block_loss)."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=resolve_dtype("auto", device)).eval().to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.model.embed_tokens, model.lm_head, model.model.norm.weight.detach()


@torch.no_grad()
def draft_round(drafter: BlockDrafter, corpus: Corpus, picks: list[tuple[int, int]]) -> list[int]:
    """Greedy-draft one block at each (row, anchor) and return n (leading matches) per pick."""
    cfg = drafter.cfg
    ctx = [gather_context(corpus, r, a, cfg.context_window) for r, a in picks]
    dev = drafter.lm_head.weight.device
    feats = torch.stack([c[0] for c in ctx]).to(dev)  # [N, C, F]
    valid = torch.stack([c[1] for c in ctx]).to(dev)  # [N, C]
    last = torch.tensor([int(corpus.tokens[r][a]) for r, a in picks], device=dev)  # [N]
    drafts = drafter.draft(last, feats, valid).cpu()  # [N, B-1]
    truth = torch.stack([corpus.tokens[r][a + 1: a + cfg.block_size] for r, a in picks])  # [N, B-1]
    return (drafts == truth).long().cumprod(dim=1).sum(dim=1).tolist()


def simulate_acceptance(drafter: BlockDrafter, corpus: Corpus, batch: int = 64) -> list[list[int]]:
    """Per row, the acceptance length of every simulated round (see module doc)."""
    b = drafter.cfg.block_size
    anchors = list(corpus.prompt_len)
    lengths: list[list[int]] = [[] for _ in range(len(corpus))]
    while True:
        active = [r for r in range(len(corpus)) if anchors[r] <= len(corpus.tokens[r]) - b]
        if not active:
            return lengths
        for i in range(0, len(active), batch):
            rows = active[i: i + batch]
            for r, n in zip(rows, draft_round(drafter, corpus, [(r, anchors[r]) for r in rows])):
                lengths[r].append(n + 1)
                anchors[r] += n + 1


def summarize(corpus: Corpus, lengths: list[list[int]]) -> dict:
    """Mean acceptance length per MT-Bench category and overall (pooled over rounds)."""
    pooled: dict[str, list[int]] = defaultdict(list)
    for meta, lens in zip(corpus.meta, lengths):
        pooled[meta.get("category", "all")].extend(lens)
        pooled["overall"].extend(lens)
    return {cat: {"mean_acceptance_length": round(sum(v) / max(1, len(v)), 4), "rounds": len(v)}
            for cat, v in sorted(pooled.items())}


def eval_drafter(args) -> dict:
    """Evaluate every ``args.drafter`` artefact dir on the cached MT-Bench split."""
    torch.set_num_threads(args.threads)
    embed, lm_head, _ = load_shared_target(resolve_target_dir(args.target_dir), args.device)
    corpus = load_corpus(Path(args.data) / "mtbench")
    results = {}
    for d in args.drafter:
        drafter = load_drafter(d, embed, lm_head, dtype=embed.weight.dtype).to(embed.weight.device)
        results[d] = {"causal_injection": drafter.cfg.causal_injection,
                      **summarize(corpus, simulate_acceptance(drafter, corpus, args.eval_batch))}
        print(f"[eval] {d}: {json.dumps(results[d]['overall'])}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
        if (Path(args.out).parent / MANIFEST_NAME).exists():  # results written into an artefact dir
            write_manifest(Path(args.out).parent)
    return results
