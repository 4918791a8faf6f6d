"""Teacher-forced training data for the block drafter: ShareGPT's own responses, target labels.

Regenerating responses with the target (specmesh.training.data) costs one autoregressive step per
token (~100 tok/s on one CPU thread); this split costs one batched forward per sequence (several
times faster), so the drafter sees far more text for the same CPU. Per sequence
``s = chat(prompt) + original response`` (cut to ``--max-response-tokens``, then <|im_end|>):

* features: the target's hidden states of ``target_layers`` for positions >= feat_start, as in
  the regenerated split (the drafter's context is real text either way);
* labels[j] = argmax_v p_target(v | s_<j) for j > feat_start (else s_j): the token the target
  itself would emit after the true prefix. Training predicts labels[a+k] at block position k:
  position 1 is exactly the target's next token after the anchor; a deeper position is trained
  only while the original text before it matches the labels, i.e. while it lies on the target's
  own greedy path (specmesh.training.corpus.chain_targets; on regenerated data labels = s).

Shards ``train/shard_tf_NNNNN.pt`` sit beside the regenerated ones (load_corpus reads both) and add
the ``labels`` list. Prompts come from the same seeded ShareGPT order, after the first
``--skip`` (those the regenerated split uses), MT-Bench turns excluded.

    python -m specmesh.training.teacher --out .cache/train/data --minutes 30
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specmesh.training.args import add_data_args
from specmesh.training.data import (chat_prompt_ids, host_features, load_sharegpt_pairs, load_target,
                                    padded_hidden_states, pkg_cache_dir, write_shards)


@torch.no_grad()
def features_and_labels(model, seqs: list[list[int]], target_layers, starts: list[int]):
    """One right-padded forward -> per sequence (features [L - start, F] bf16, labels [L] int64)."""
    hs = padded_hidden_states(model, seqs)  # each [B, W, H]
    head = model.get_output_embeddings()
    out = []
    for i, s in enumerate(seqs):
        start, n = starts[i], len(s)
        feats = host_features(hs, i, start, n, target_layers)
        # row j of logits (position start + j) predicts token start + j + 1
        pred = head(hs[-1][i, start: n - 1]).float().argmax(-1).cpu()  # [n - 1 - start]
        labels = torch.tensor(s, dtype=torch.long)
        labels[start + 1: n] = pred
        out.append((feats, labels))
    return out


def build_teacher_split(model, tok, pairs: list[tuple[str, str]], out_dir: Path, args) -> None:
    """Shards of ``args.batch_size`` (prompt, original reply) pairs (forwarded tok/s logged)."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def make_shard(rows):
        p_ids = [chat_prompt_ids(tok, pairs[i][0])[-args.max_prompt_tokens:] for i in rows]
        r_ids = [tok(pairs[i][1], add_special_tokens=False)["input_ids"][: args.max_response_tokens] + [eos]
                 for i in rows]
        seqs = [p + r for p, r in zip(p_ids, r_ids)]
        starts = [max(0, len(p) - args.context_window) for p in p_ids]
        fl = features_and_labels(model, seqs, args.target_layers, starts)
        shard = {"tokens": [torch.tensor(x) for x in seqs], "prompt_len": [len(p) for p in p_ids],
                 "feat_start": starts, "features": [f for f, _ in fl], "labels": [lab for _, lab in fl],
                 "meta": [{"pair": i, "source": "sharegpt-original"} for i in rows]}
        return shard, sum(len(x) for x in seqs)

    write_shards(out_dir, "shard_tf_", len(pairs), args.batch_size, args.minutes, make_shard)


def main(argv=None) -> None:
    ap = add_data_args(argparse.ArgumentParser(description="Teacher-forced block-drafter data (ShareGPT replies)."),
                       batch_size=8, max_prompt_tokens=256)
    ap.add_argument("--num-prompts", type=int, default=20000)
    ap.add_argument("--skip", type=int, default=4000, help="prompts of the regenerated split to leave out")
    ap.add_argument("--max-response-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    tok, model = load_target(args)
    pairs = load_sharegpt_pairs(pkg_cache_dir(args.pkg_cache), args.num_prompts, seed=args.seed, skip=args.skip)
    build_teacher_split(model, tok, pairs, Path(args.out) / "train", args)


if __name__ == "__main__":
    main()
