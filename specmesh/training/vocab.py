"""The block drafter's head vocabulary: the target's tokens ranked by how often ShareGPT's
conversations use them, so a draft worker can score only the most frequent ones
(`draft_worker.block.head_vocab`; the frequency-ranked draft head of FR-Spec, Zhao et al. 2025).

The drafter shares the target's LM head (49,152 x 576 for SmolLM2): one candidate table scores
7 positions against every token, 3.5 of its 8 ms on a 2-core Zen 4. Draft tokens outside the
kept set are never proposed (only acceptance is at stake: the target verifies every draft, and a
sampled chain's proposal distribution is zero outside the set, which rejection sampling allows).
The ranking is an artefact file beside the drafter's weights, covered by its MANIFEST.sha256:

    specmesh drafter-vocab --export-dir artifacts/drafters/smollm2-135m-instruct-block

Counted: the chat-templated first human turn and the reply of --conversations ShareGPT
conversations (MT-Bench turns excluded, as in training), tokenized by the target's tokenizer;
special tokens (EOS, the chat template's) first, then by count, ties by id.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from specmesh.drafters.artifact import RANK_NAME, write_manifest


def count_tokens(sequences, vocab_size: int) -> torch.Tensor:
    """sequences: iterable of token-id lists -> counts [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids in sequences:
        counts += torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=vocab_size)[:vocab_size]
    return counts


def rank_tokens(counts: torch.Tensor, first: list[int]) -> torch.Tensor:
    """Every token id, `first` (in order) then by count descending, ties by id: [V] int32."""
    v = counts.shape[0]
    order = torch.argsort(counts, descending=True, stable=True).tolist()  # stable: equal counts by id
    head = [t for t in dict.fromkeys(first) if 0 <= t < v]
    taken = set(head)
    return torch.tensor(head + [t for t in order if t not in taken], dtype=torch.int32)


def write_vocab(args) -> int:
    """`specmesh drafter-vocab` (arguments: specmesh.training.args.add_vocab_args)."""
    from transformers import AutoTokenizer

    from specmesh.training.data import SHAREGPT_WHEEL, _sharegpt_items, chat_prompt_ids, pkg_cache_dir, \
        resolve_target_dir

    out = Path(args.export_dir)
    if not (out / "config.json").is_file():
        print(f"drafter-vocab: {out} is not a block drafter artefact (no config.json)", file=sys.stderr)
        return 2
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    tok = AutoTokenizer.from_pretrained(resolve_target_dir(args.target_dir))
    tok.model_max_length = 1 << 30  # long replies are only counted, never run through a model
    items = _sharegpt_items(pkg_cache_dir(args.cache_dir), args.seed)[: args.conversations]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    seqs = (chat_prompt_ids(tok, q) + (tok(r, add_special_tokens=False)["input_ids"] + eos if r else [])
            for q, r in items)
    counts = count_tokens(seqs, vocab)
    rank = rank_tokens(counts, [*eos, *tok.all_special_ids])
    meta = {"source": SHAREGPT_WHEEL.pip, "conversations": str(len(items)), "seed": str(args.seed),
            "tokens": str(int(counts.sum())), "seen": str(int((counts > 0).sum()))}
    save_file({"rank": rank}, str(out / RANK_NAME), metadata=meta)
    write_manifest(out)
    covered = {n: round(float(counts[rank[:n].long()].sum()) / max(1, int(counts.sum())), 4)
               for n in (4096, 8192, 16384, 32768)}
    print(json.dumps({**meta, "share_of_tokens_in_top_n": covered}, indent=1))
    return 0
