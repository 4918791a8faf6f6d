"""model.device: where the workers put their models and KV caches (auto | cpu | cuda | cuda:N).
This machine has no GPU: the cuda paths are checked for their refusal here, the compute on a GPU
is not exercised by this suite (see docs/deployment.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from specmesh.config import ConfigError, load_config
from specmesh.engine.pool import KVPool
from specmesh.engine.loader import resolve_device
from specmesh.errors import ModelIntegrityError

NO_GPU = not torch.cuda.is_available()


def test_config_accepts_devices_and_names_the_key_on_a_bad_one():
    for ok in ("auto", "cpu", "cuda", "cuda:1"):
        assert load_config(environ={"SPECMESH_MODEL__DEVICE": ok}).model.device == ok
    for bad in ("gpu", "cuda:", "mps:0", ""):
        with pytest.raises(ConfigError, match="model.device"):
            load_config(environ={}, overrides={"model": {"device": bad}})


def test_auto_and_cpu_resolve_to_what_torch_has():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cpu" if NO_GPU else "cuda")


@pytest.mark.skipif(not NO_GPU, reason="this torch sees a GPU")
def test_asking_for_a_gpu_torch_cannot_see_is_refused_clearly():
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ModelIntegrityError, match="sees no CUDA GPU"):
            resolve_device(spec)


@pytest.mark.skipif(not NO_GPU, reason="this torch sees a GPU")
def test_target_worker_refuses_to_start_on_a_missing_gpu_before_loading_weights():
    env = {"SPECMESH_MODEL__DEVICE": "cuda", "SPECMESH_MODEL__REQUIRE_MANIFEST": "false",
           "SPECMESH_MODEL__PATH": "/nonexistent-model-dir", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "target_worker.server", "--listen", "127.0.0.1:1"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "refusing to start" in out.stderr and "sees no CUDA GPU" in out.stderr


def test_kv_pool_lives_on_the_given_device_and_keep_indices_follow_it():
    pool = KVPool(num_layers=2, kv_heads=1, head_dim=4, max_tokens=2, dtype=torch.float32, device="cpu", private=True)
    kv = pool.allocate(2)
    assert kv.device == torch.device("cpu") and kv.keys(0, 1).device == kv.device
    kv.ensure(3)  # a private pool grows past its 2 slots
    new = torch.arange(12, dtype=torch.float32).view(1, 3, 4)  # [kv_heads, Q=3, D]
    for layer in range(2):
        kv.write(layer, new, new + 100)
    kv.commit(0, keep=torch.tensor([0, 2]))  # keeps written slots 0 and 2, slot 2 moved down to 1
    assert kv.length == 2 and kv.capacity >= 3
    assert torch.equal(kv.keys(1, 2), new[:, [0, 2]]) and torch.equal(kv.values(0, 2), new[:, [0, 2]] + 100)


def test_dtype_auto_follows_native_bf16():
    """auto: bfloat16 only where the CPU multiplies bf16 in hardware; explicit names pass through."""
    import torch

    from specmesh.engine import loader

    intel = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile amx_bf16\n"
    amd = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
    assert loader.cpu_has_native_bf16(intel) and not loader.cpu_has_native_bf16(amd)
    assert loader.cpu_has_native_bf16("") is False
    expected = torch.bfloat16 if loader.cpu_has_native_bf16() else torch.float32
    assert loader.resolve_dtype("auto", "cpu") is expected
    assert loader.resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    assert loader.resolve_dtype("fp32") is torch.float32
