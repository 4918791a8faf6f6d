"""Process set-up shared by the service entry points."""

from __future__ import annotations

import argparse

import torch

from specmesh.config import MeshConfig, load_config
from specmesh.logs import setup_logging


def service_args(description: str, argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML config (default: $SPECMESH_CONFIG or the shipped default)")
    parser.add_argument("--listen", help="host:port to listen on (overrides the config)")
    return parser.parse_args(argv)


def start_process(service: str, args: argparse.Namespace) -> MeshConfig:
    """Load + validate config, set logging and torch threads. Raises ConfigError on bad config."""
    cfg = load_config(args.config)
    setup_logging(service, cfg.runtime.log_level)
    if cfg.runtime.torch_threads:
        torch.set_num_threads(cfg.runtime.torch_threads)
    return cfg
