"""The reliability tier (issue 14): a CI-sized slice of `specmesh chaos` against the in-process
mesh of tests/reliability/inprocess.py (real servicers, real gRPC with mTLS, real redis-server)."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="module")
def rmesh(tmp_path_factory, target_model, prompt_encoder):
    """The suite's mesh for one test module; stopped (and mesh mTLS turned off) at module end."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    pytest.importorskip("cryptography")
    from inprocess import start_inprocess

    mesh = start_inprocess(tmp_path_factory.mktemp("reliability"), target_model, prompt_encoder)
    yield mesh
    mesh.stop()
