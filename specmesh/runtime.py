"""Process set-up shared by the service entry points."""

from __future__ import annotations

import argparse
import logging
import os

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
    pin(service, tuple(getattr(cfg.runtime.cpu_affinity, service, ())))
    if cfg.runtime.torch_threads:
        torch.set_num_threads(cfg.runtime.torch_threads)
    return cfg


def pin(service: str, cpus: tuple[int, ...]) -> set[int] | None:
    """Pin this process to `cpus` (runtime.cpu_affinity.<service>), those of them this machine
    has; logs what it did. None: not pinned (none asked, none present, or no sched_setaffinity)."""
    log = logging.getLogger(__name__)
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    have = os.sched_getaffinity(0)
    use = set(cpus) & have
    if not use:
        log.warning("%s: runtime.cpu_affinity %s names no CPU of this machine (%s); not pinned",
                    service, sorted(cpus), sorted(have))
        return None
    os.sched_setaffinity(0, use)
    log.info("%s: pinned to CPU(s) %s", service, sorted(use))
    return use
