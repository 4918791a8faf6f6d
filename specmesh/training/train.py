"""Train the block drafter on cached target features.

Objective: for a random anchor (see :mod:`specmesh.training.corpus`) the drafter's
block positions k = 1..B-1 predict s[a+k]; the loss is the position-weighted
cross-entropy  L = sum_k w_k CE_k / sum_k w_k  with  w_k = exp(-(k-1)/gamma),
because a draft token only counts if every earlier one was accepted.
AdamW on the drafter's own (fp32 master) weights, bf16 autocast compute, linear
warm-up then cosine decay to 10 %. Checkpoints (model, optimizer, step, sampler
and global RNG state) are written every ``--ckpt-minutes`` and on exit, each also
exported as a bf16 artefact; ``--cpu-budget-minutes`` stops cleanly.

    python -m specmesh.training.train train --data .cache/train/data --export-dir artifacts/drafters/...
    python -m specmesh.training.train eval --drafter artifacts/drafters/... [--drafter other]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specmesh.drafters.artifact import export_drafter
from specmesh.drafters.block import BlockDrafter, BlockDrafterConfig
from specmesh.training.args import add_eval_args, add_train_args
from specmesh.training.corpus import IGNORE, AnchorSampler, load_corpus, make_batch
from specmesh.training.data import resolve_target_dir
from specmesh.training.evaluate import eval_drafter, load_shared_target

__all__ = ["train_drafter", "eval_drafter", "add_train_args", "add_eval_args", "main"]


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B-1] weights w_k = exp(-(k-1)/gamma) for draft positions k = 1..B-1."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def block_loss(drafter: BlockDrafter, batch: dict[str, torch.Tensor], weights: torch.Tensor):
    """batch: block_ids [N, B], ctx_feats [N, C, F], ctx_valid [N, C], targets [N, B-1];
    weights: [B-1]. -> (scalar weighted CE, per-position top-1 accuracy [B-1])."""
    # bf16 autocast where the shared head is bf16 (native bf16 hardware), plain float32 otherwise
    head = drafter.lm_head.weight
    with torch.autocast(head.device.type, dtype=torch.bfloat16, enabled=head.dtype == torch.bfloat16):
        h = drafter.hidden(batch["block_ids"], batch["ctx_feats"], batch["ctx_valid"])[:, 1:]  # [N, B-1, H]
        logits = drafter.lm_head(h.to(head.dtype))  # [N, B-1, V]
    n, k, v = logits.shape
    targets = batch["targets"]  # [N, B-1], IGNORE where a teacher-forced chain left the target's path
    # bf16 CE (fp32 accumulation inside the kernel) is ~5x faster than fp32 on CPU
    ce = F.cross_entropy(logits.reshape(n * k, v), targets.reshape(-1), reduction="none", ignore_index=IGNORE)
    kept = (targets != IGNORE).float()  # [N, B-1]
    ce = ce.float().view(n, k) * kept  # [N, B-1]
    # L = sum_{n,k} w_k CE_nk / sum_{n,k} w_k [kept]: the weighted mean over the kept targets
    loss = (ce * weights).sum() / (kept * weights).sum().clamp_min(1e-6)
    hits = ((logits.argmax(-1) == targets).float() * kept).sum(0)  # [B-1]
    acc = hits / kept.sum(0).clamp_min(1.0)  # [B-1] top-1 accuracy over kept targets
    return loss, acc.detach()


def lr_at(step: int, args) -> float:
    """Linear warm-up over ``warmup_steps`` then cosine from lr to 0.1 lr at ``max_steps``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    frac = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def config_from_args(args, vocab_size: int, hidden: int) -> BlockDrafterConfig:
    return BlockDrafterConfig(
        target_layers=tuple(args.target_layers), target_hidden_size=hidden, hidden_size=hidden,
        num_layers=args.num_layers, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        head_dim=hidden // args.num_heads, intermediate_size=args.intermediate_size,
        block_size=args.block_size, mask_token_id=args.mask_token_id,
        causal_injection=not args.no_causal_injection, injection_rank=args.injection_rank,
        context_window=args.context_window, vocab_size=vocab_size)


def save_checkpoint(path: Path, drafter, opt, step: int, gen: torch.Generator, extra: dict) -> None:
    """Atomic write of everything needed to continue bit-for-bit."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step,
             "sampler_rng": gen.get_state(), "torch_rng": torch.get_rng_state(),
             "python_rng": random.getstate(), "config": json.loads(drafter.cfg.to_json()), "extra": extra}
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def load_checkpoint(path: Path, drafter, opt, gen: torch.Generator) -> tuple[int, dict]:
    state = torch.load(path, weights_only=False, map_location=drafter.lm_head.weight.device)
    drafter.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    gen.set_state(state["sampler_rng"].cpu())  # RNG states are host tensors whatever map_location did
    torch.set_rng_state(state["torch_rng"].cpu())
    random.setstate(state["python_rng"])
    return int(state["step"]), dict(state["extra"])


def build(args, embed, lm_head, norm_weight: torch.Tensor | None):
    """Fresh drafter (+ optimizer, sampler generator); resumes from ``ckpt`` if present."""
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    cfg = config_from_args(args, embed.weight.shape[0], embed.weight.shape[1])
    drafter = BlockDrafter(cfg, embed, lm_head).to(embed.weight.device)  # on the shared modules' device
    if norm_weight is not None:  # 0.2 x target final-norm scale: initial logits ~N(0, 1), CE ~ ln V
        drafter.final_norm.weight.data.copy_(0.2 * norm_weight.float())
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    step, extra = 0, {"samples": 0, "train_seconds": 0.0}
    ckpt = Path(args.ckpt_dir) / "last.pt"
    if ckpt.exists() and not args.no_resume:
        step, extra = load_checkpoint(ckpt, drafter, opt, gen)
        print(f"[train] resumed from {ckpt} at step {step}", flush=True)
    elif args.init_from:
        init_from_artefact(drafter, Path(args.init_from))
        extra["init_from"] = str(args.init_from)
    return drafter, opt, gen, step, extra


def init_from_artefact(drafter: BlockDrafter, directory: Path) -> None:
    """Warm start: the drafter's own weights from an exported artefact (same config), fresh
    optimizer and schedule. The bf16 weights become the fp32 master copy."""
    from specmesh.drafters.artifact import load_drafter

    # the artefact around the same shared embedding / head (not copied), manifest verified
    # (in the shared head's dtype: .to() on the artefact must not recast the modules it shares)
    theirs = load_drafter(directory, drafter.embed_tokens, drafter.lm_head, dtype=drafter.lm_head.weight.dtype)
    if theirs.cfg != drafter.cfg:
        a, b = dataclasses.asdict(theirs.cfg), dataclasses.asdict(drafter.cfg)
        raise ValueError(f"--init-from {directory}: config differs in {sorted(k for k in a if a[k] != b[k])}")
    drafter.load_state_dict(theirs.state_dict())  # copy_ into the fp32 master weights
    print(f"[train] initialised from {directory}", flush=True)


def checkpoint_and_export(args, drafter, opt, step, gen, extra) -> None:
    save_checkpoint(Path(args.ckpt_dir) / "last.pt", drafter, opt, step, gen, extra)
    if args.export_dir:
        export_drafter(drafter, args.export_dir, extra={**extra, "step": step, "args": vars_json(args)})


def vars_json(args) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}


def train_drafter(args, embed=None, lm_head=None, norm_weight=None) -> dict:
    """Run (or resume) training; returns a summary dict. ``embed``/``lm_head`` default to the target's."""
    torch.set_num_threads(args.threads)
    if embed is None:
        embed, lm_head, norm_weight = load_shared_target(resolve_target_dir(args.target_dir), args.device)
    corpus = load_corpus(Path(args.data) / "train", args.max_shards)
    drafter, opt, gen, step, extra = build(args, embed, lm_head, norm_weight)
    sampler = AnchorSampler(corpus, drafter.cfg.block_size)
    print(f"[train] {len(corpus)} sequences, {sampler.num_anchors} anchors, "
          f"{sum(p.numel() for p in drafter.parameters())} drafter params", flush=True)
    device = drafter.lm_head.weight.device
    weights = position_weights(drafter.cfg.block_size, args.gamma).to(device)
    t0 = last_ckpt = time.monotonic()
    stop_step = min(args.max_steps, args.stop_at_step or args.max_steps)
    bar = tqdm(total=stop_step, initial=step, mininterval=args.log_seconds, file=sys.stderr, desc="train")
    ema = None
    while step < stop_step and time.monotonic() - t0 < 60 * args.cpu_budget_minutes:
        batch = make_batch(corpus, sampler.sample(args.batch_size, gen), drafter.cfg.block_size,
                           drafter.cfg.context_window, drafter.cfg.mask_token_id)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss, acc = block_loss(drafter, batch, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.clip)
        opt.step()
        step += 1
        extra["samples"] += args.batch_size
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        extra.update(loss_ema=round(ema, 4), acc=[round(a, 3) for a in acc.tolist()])
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", acc1=f"{acc[0]:.2f}", refresh=False)
        if args.snapshot_step and step == args.snapshot_step and args.snapshot_dir:
            export_drafter(drafter, args.snapshot_dir, extra={**extra, "step": step})
        if time.monotonic() - last_ckpt > 60 * args.ckpt_minutes:
            extra["train_seconds"] += time.monotonic() - last_ckpt
            last_ckpt = time.monotonic()
            checkpoint_and_export(args, drafter, opt, step, gen, extra)
            print(f"\n[train] step {step} loss_ema {ema:.4f} acc {extra['acc']} (checkpoint)", flush=True)
    bar.close()
    extra["train_seconds"] += time.monotonic() - last_ckpt
    checkpoint_and_export(args, drafter, opt, step, gen, extra)
    print(f"[train] stopped at step {step}: {extra}", flush=True)
    return {"step": step, **extra}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specmesh.training.train")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_train_args(sub.add_parser("train", help="train the block drafter"))
    add_eval_args(sub.add_parser("eval", help="offline MT-Bench acceptance length"))
    args = ap.parse_args(argv)
    result = train_drafter(args) if args.cmd == "train" else eval_drafter(args)
    print(json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
