"""On-disk block-drafter artefact: ``config.json`` + ``model.safetensors`` (the drafter's
own weights only, bf16; the target's embedding / LM head are never stored) +
``MANIFEST.sha256`` in ``sha256sum`` format covering every other file in the dir; optionally
``token_rank.safetensors``, the target's vocabulary ranked by frequency, from which a draft
worker's head scores only the most frequent tokens (``specmesh drafter-vocab``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from specmesh.drafters.block import BlockDrafter, BlockDrafterConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MANIFEST_NAME = "MANIFEST.sha256"
RANK_NAME = "token_rank.safetensors"  # optional: the vocabulary by frequency (specmesh/training/vocab.py)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(out_dir: Path) -> None:
    """(Re)write MANIFEST.sha256 over all regular files in ``out_dir`` (sorted, sha256sum format)."""
    lines = [f"{sha256_file(p)}  {p.name}" for p in sorted(out_dir.iterdir())
             if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith(".")]
    tmp = out_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out_dir / MANIFEST_NAME)


def verify_manifest(out_dir: Path) -> None:
    """Raise ValueError if any file listed in the manifest is missing or differs."""
    for line in (out_dir / MANIFEST_NAME).read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        if sha256_file(out_dir / name.strip()) != digest:
            raise ValueError(f"{out_dir / name} does not match {MANIFEST_NAME}")


def export_drafter(drafter: BlockDrafter, out_dir: str | Path, extra: dict | None = None) -> Path:
    """Write config + bf16 weights (+ optional ``training.json``) and the manifest, atomically per file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / (WEIGHTS_NAME + ".tmp")), metadata={"format": "pt"})
    os.replace(out / (WEIGHTS_NAME + ".tmp"), out / WEIGHTS_NAME)
    (out / CONFIG_NAME).write_text(drafter.cfg.to_json() + "\n")
    if extra is not None:
        (out / "training.json").write_text(json.dumps(extra, indent=2, sort_keys=True) + "\n")
    write_manifest(out)
    return out


def load_drafter(out_dir: str | Path, embed_tokens: nn.Module, lm_head: nn.Module,
                 dtype: torch.dtype = torch.bfloat16, verify: bool = True) -> BlockDrafter:
    """Rebuild a drafter from an artefact dir around the target's shared embedding / LM head."""
    out = Path(out_dir)
    if verify:
        verify_manifest(out)
    cfg = BlockDrafterConfig.from_dict(json.loads((out / CONFIG_NAME).read_text()))
    drafter = BlockDrafter(cfg, embed_tokens, lm_head)
    drafter.load_state_dict(load_file(str(out / WEIGHTS_NAME)))
    return drafter.to(dtype).eval()


def load_rank(directory: Path) -> torch.Tensor | None:
    """The artefact's ranking [V] int32, or None when it has none."""
    path = Path(directory) / RANK_NAME
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("rank")


def head_ids(directory: Path, vocab_size: int, keep: int) -> torch.Tensor:
    """The `keep` most frequent token ids of the artefact's ranking, sorted by id: [keep] int64.
    Raises ValueError where there is no ranking, or it is not a permutation of the vocabulary."""
    rank = load_rank(directory)
    if rank is None:
        raise ValueError(f"{directory} has no {RANK_NAME} (make one with `specmesh drafter-vocab`)")
    if rank.shape != (vocab_size,) or not torch.equal(torch.sort(rank.long()).values, torch.arange(vocab_size)):
        raise ValueError(f"{directory / RANK_NAME} is not a ranking of the {vocab_size}-token vocabulary")
    return torch.sort(rank[:keep].long()).values
