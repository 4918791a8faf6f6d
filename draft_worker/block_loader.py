"""Load the block drafter for a draft worker: its artefact (checked against MANIFEST.sha256)
around the TARGET's token embedding and LM head, read from the target model directory.

The artefact holds only the drafter's own weights; the embedding [V, H] and the (tied, for
SmolLM2) LM head are the target's, frozen, so the drafter speaks the target's vocabulary.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from specmesh.config import ConfigError, MeshConfig
from specmesh.drafters.artifact import MANIFEST_NAME, RANK_NAME, head_ids, load_drafter, verify_manifest
from specmesh.engine.loader import check_model_dir, resolve_device, resolve_dtype, resolve_model_dir
from specmesh.errors import ModelIntegrityError

log = logging.getLogger(__name__)

SOURCE_ROOT = Path(__file__).resolve().parents[1]  # the checkout holding artifacts/ (editable install)


def artefact_dir(cfg: MeshConfig) -> tuple[Path, bool]:
    """(directory, explicitly configured). Default: artifacts/drafters/<model.name>-block."""
    path = cfg.draft_worker.block.path
    if path:
        return Path(path).expanduser(), True
    return SOURCE_ROOT / "artifacts" / "drafters" / f"{cfg.model.name}-block", False


def shared_head(target_dir: Path, dtype: torch.dtype | None = None) -> tuple[nn.Embedding, nn.Linear]:
    """The target's embedding and LM head (the embedding itself when tied), frozen, in `dtype`
    (None: the checkpoint's). Reads only those tensors from the safetensors files. The drafter's
    dtype, not the checkpoint's: a bf16 head on a CPU without native bf16 took 27 ms of a 35 ms
    draft (Zen 3, 4 rows), where float32 on the packed kernel takes 8."""
    found: dict[str, torch.Tensor] = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in ("model.embed_tokens.weight", "lm_head.weight"):
                if key in f.keys():
                    found[key] = f.get_tensor(key) if dtype is None else f.get_tensor(key).to(dtype)
    if "model.embed_tokens.weight" not in found:
        raise ModelIntegrityError(f"{target_dir}: no model.embed_tokens.weight in its safetensors")
    embed = nn.Embedding.from_pretrained(found["model.embed_tokens.weight"], freeze=True)
    weight = found.get("lm_head.weight", embed.weight)  # [V, H]; tied -> the embedding
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    head.weight = nn.Parameter(weight, requires_grad=False)
    return embed, head


def check_artefact(directory: Path) -> None:
    """Refuse (ModelIntegrityError) a missing manifest or any file that does not match it."""
    if not (directory / MANIFEST_NAME).is_file():
        raise ModelIntegrityError(f"block drafter {directory} has no {MANIFEST_NAME}")
    try:
        verify_manifest(directory)
    except (ValueError, OSError) as exc:
        raise ModelIntegrityError(f"block drafter {directory} fails its {MANIFEST_NAME}: {exc}") from exc


def load_block_model(cfg: MeshConfig, embed: nn.Module | None = None, head: nn.Module | None = None):
    """The block drafter model, or None when the default artefact is absent (logged). An
    explicitly configured path that is missing or any manifest mismatch raises
    ModelIntegrityError; an artefact built for other target layers / window raises ConfigError.
    embed/head: the target's modules when already loaded (tests), else read from the model dir."""
    directory, explicit = artefact_dir(cfg)
    if not directory.is_dir():
        if explicit:
            raise ModelIntegrityError(f"block drafter path {directory} is not a directory")
        log.warning("block drafter artefact %s not found; the 'block' method is not served", directory)
        return None
    check_artefact(directory)
    dtype = resolve_dtype(cfg.draft_worker.block.dtype, resolve_device(cfg.model.device))
    if embed is None or head is None:
        target_dir = resolve_model_dir(cfg.model.name, cfg.model.path)
        check_model_dir(target_dir, require_manifest=cfg.model.require_manifest and cfg.model.path is None)
        embed, head = shared_head(target_dir, dtype)
    model = load_drafter(directory, embed, head, dtype=dtype, verify=False)
    spec = cfg.speculative
    if tuple(model.cfg.target_layers) != tuple(spec.feature_layers) or model.cfg.context_window != spec.feature_window:
        raise ConfigError(f"block drafter {directory} reads layers {list(model.cfg.target_layers)} over "
                          f"{model.cfg.context_window} positions, but speculative.feature_layers / feature_window "
                          f"are {list(spec.feature_layers)} / {spec.feature_window}")
    if embed.weight.shape[0] != model.cfg.vocab_size:
        raise ConfigError(f"block drafter vocabulary {model.cfg.vocab_size} != the target's {embed.weight.shape[0]}")
    return model.to(resolve_device(cfg.model.device))  # with the shared embedding / head it holds


def head_vocab_ids(cfg: MeshConfig, vocab_size: int) -> torch.Tensor | None:
    """The token ids the block drafter's head scores (draft_worker.block.head_vocab most frequent,
    by the artefact's ranking, specmesh/training/vocab.py), or None for every token: head_vocab 0
    or >= the vocabulary, or an artefact without a ranking (logged). A ranking that does not fit
    the vocabulary raises ModelIntegrityError."""
    keep = cfg.draft_worker.block.head_vocab
    directory, _ = artefact_dir(cfg)
    if keep <= 0 or keep >= vocab_size:
        return None
    if not (directory / RANK_NAME).is_file():
        log.warning("block drafter %s has no %s: its head scores every token (run `specmesh drafter-vocab`)",
                    directory, RANK_NAME)
        return None
    try:
        return head_ids(directory, vocab_size, keep)
    except ValueError as exc:
        raise ModelIntegrityError(str(exc)) from exc

