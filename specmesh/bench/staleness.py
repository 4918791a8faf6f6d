"""How much a block drafter's tree loses when its candidate table is stale (coordinator/tails.py).

At T=0 a round's outcome is known from the target's greedy continuation. For every anchor a of
each continuation the drafter drafts one table from the target's features of positions < a (as the
draft worker does); a tree built from that table's rows m.. is what a round at anchor a + m gets
from the table drafted m positions back (m = 0: a fresh table). The tool walks each such tree by
the continuation and reports accepted drafts per round by staleness m and node budget, and each
block position's top-1 / top-4 / top-8 accuracy. With each tree it also walks the n-gram
drafter's chain at the same anchor alone and merged into the tree (shared prefixes share nodes):
what a round drafting both at once would accept, the n-gram's nodes on top of the budget. Forward
time is not involved: this is the acceptance side of goodput only.

    python -m specmesh.bench.staleness --limit 24 --samples /tmp/greedy.jsonl --out staleness.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specmesh.core.ngram import propose_ngram
from specmesh.core.tree import DraftTree, build_tree, walk_tree
from specmesh.core.treepolicy import path_nodes

BUDGETS = (1, 2, 4, 8)
STALE = (0, 1, 2, 3)


def accepted(tree, truth: list[int]) -> int:
    """Drafts a tree's walk accepts when the target's tokens are `truth`."""
    depth = [0] + tree.depths()  # by verify-input index: 0 = the root (the pending token)
    path, _ = walk_tree(tree.tokens, tree.parents, lambda j: truth[depth[j]] if depth[j] < len(truth) else -1)
    return len(path) - 1


def merged(tree: DraftTree, chain: list[int]) -> DraftTree:
    """tree with a chain from the root merged in: the chain's prefix the tree already holds shares
    its nodes; the rest hangs below them as new nodes (score -inf: not the drafter's)."""
    shared = path_nodes(tree.parents, tree.tokens, chain)
    tokens, parents, scores = list(tree.tokens), list(tree.parents), list(tree.scores)
    node = shared[-1] if shared else -1  # -1: the root
    for tok in chain[len(shared):]:
        tokens.append(tok)
        parents.append(node)
        scores.append(float("-inf"))
        node = len(tokens) - 1
    return DraftTree(tokens, parents, scores)


def tables(drafter, feats: torch.Tensor, ids: list[int], anchors: list[int], width: int,
           head: torch.Tensor | None = None) -> dict:
    """anchor -> (log q [D, W], tokens [D, W]) from features of positions < anchor and x_anchor;
    head: the token ids the draft head scores (draft_worker.block.head_vocab), None: all."""
    window, out = drafter.cfg.context_window, {}
    for i in range(0, len(anchors), 32):
        part = anchors[i:i + 32]
        fs = torch.zeros(len(part), window, feats.shape[1], dtype=feats.dtype)
        vs = torch.zeros(len(part), window, dtype=torch.bool)
        for j, a in enumerate(part):
            got = feats[max(0, a - window):a]
            fs[j, window - got.shape[0]:], vs[j, window - got.shape[0]:] = got, True
        with torch.no_grad():
            logits = drafter(drafter.block_ids(torch.tensor([ids[a] for a in part])), fs, vs)
        logits = logits[:, 1:].float()  # [N, D, V]
        if head is not None:
            logits = torch.full_like(logits, float("-inf")).index_copy_(-1, head, logits.index_select(-1, head))
        lp, tok = torch.log_softmax(logits, -1).topk(width, dim=-1)  # [N, D, W]
        out.update({a: (lp[j], tok[j]) for j, a in enumerate(part)})
    return out


def measure(samples: list[dict], model, drafter, ngram: tuple[int, int, int] = (8, 1, 4),
            head: torch.Tensor | None = None) -> dict:
    """ngram: (k, min_n, max_n) of the n-gram chain walked alone and merged into each tree;
    head: as tables()."""
    from specmesh.drafters.features import extract_target_features

    depth = drafter.cfg.block_size - 1
    got = {(m, n, ng): [0, 0] for m in STALE for n in BUDGETS for ng in (False, True)}
    alone, hits, positions = [0, 0], torch.zeros(depth, 3), 0
    for s in samples:
        ids, start = s["prompt_ids"] + s["output_ids"], len(s["prompt_ids"])
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        feats = extract_target_features(hs, drafter.cfg.target_layers).to(torch.bfloat16)  # as on the wire
        anchors = list(range(start, len(ids) - 1))
        table = tables(drafter, feats, ids, anchors, max(BUDGETS), head)
        for a in anchors:
            lp, tok = table[a]
            for d in range(min(depth, len(ids) - a - 1)):
                row, t = tok[d].tolist(), ids[a + 1 + d]
                hits[d] += torch.tensor([t == row[0], t in row[:4], t in row], dtype=torch.float32)
            positions += 1
            truth, chain = ids[a + 1: a + 1 + max(depth, ngram[0])], propose_ngram(ids[:a + 1], *ngram)
            alone[0] += accepted(DraftTree(chain, list(range(-1, len(chain) - 1)), []), truth)
            alone[1] += 1
            for m in STALE:
                if a - m < start or m >= depth:
                    continue
                lp, tok = table[a - m][0][m:], table[a - m][1][m:]
                for n in BUDGETS:
                    tree = build_tree(lp, tok, n)
                    for ng, walked in ((False, tree), (True, merged(tree, chain))):
                        got[(m, n, ng)][0] += accepted(walked, truth)
                        got[(m, n, ng)][1] += 1
        print(f"staleness: {s['prompt_id']}", file=sys.stderr, flush=True)

    def per_round(ng: bool) -> dict:
        return {f"stale {m}": {f"{n} nodes": round(got[(m, n, ng)][0] / max(1, got[(m, n, ng)][1]), 3)
                               for n in BUDGETS} for m in STALE}
    return {"accepted_per_round": per_round(False), "accepted_per_round_ngram_merged": per_round(True),
            "accepted_per_round_ngram_alone": round(alone[0] / max(1, alone[1]), 3), "ngram": list(ngram),
            "rounds": alone[1],
            "position_accuracy_top1_top4_top8": [[round(float(x) / max(1, positions), 3) for x in h] for h in hits]}


def main(argv: list[str] | None = None) -> int:
    from specmesh.bench.ceiling import cached_samples
    from specmesh.bench.compare import command_line, machine_info
    from specmesh.bench.peers import HFPeer
    from specmesh.config import load_config
    from specmesh.drafters.artifact import head_ids, load_drafter

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config")
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--limit", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--drafter", help="the block drafter's artefact dir (default: draft_worker.block.path, "
                                     "else artifacts/drafters/<model.name>-block)")
    p.add_argument("--samples", help="a JSONL of greedy continuations: read when it exists, else written")
    p.add_argument("--head-vocab", type=int, default=0, help="score only the drafter's N most frequent tokens "
                                                              "(its artefact's ranking; 0: every token)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    samples = cached_samples(cfg, args)
    peer = HFPeer(cfg.model, cfg.draft_worker.ngram.max_n, args.threads)  # the target in the mesh's dtype
    path = args.drafter or cfg.draft_worker.block.path or f"artifacts/drafters/{cfg.model.name}-block"
    drafter = load_drafter(path, peer.model.model.embed_tokens, peer.model.lm_head,
                           dtype=peer.model.lm_head.weight.dtype)
    head = head_ids(Path(path), drafter.cfg.vocab_size, args.head_vocab) if args.head_vocab > 0 else None
    doc = {"command": "python -m specmesh.bench.staleness " + command_line().split(" ", 1)[-1], "dataset": args.dataset, "prompts": len(samples),
           "max_tokens": args.max_tokens, "machine": machine_info(),
           **measure(samples, peer.model, drafter, (cfg.speculative.goodput_k_max, cfg.draft_worker.ngram.min_n,
                                                   cfg.draft_worker.ngram.max_n), head),
           "head_vocab": args.head_vocab}
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("accepted_per_round", "accepted_per_round_ngram_merged",
                                          "accepted_per_round_ngram_alone", "position_accuracy_top1_top4_top8")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
