"""A target worker serving another model than its coordinator's (changed weights with a rebuilt
manifest, another version) is never routed to: the registry record carries the manifest's
fingerprint and the coordinator's TargetPool drops records that differ."""

from __future__ import annotations

from coordinator.clients import TargetPool
from specmesh.engine.manifest import model_fingerprint, write_manifest
from specmesh.registry.records import WorkerRecord


def _record(address: str, fingerprint: str) -> WorkerRecord:
    return WorkerRecord(f"target-{address}", "target", address, "m", fingerprint,
                        capacity={"max_sequences": 8, "max_tokens": 1024})


def test_fingerprint_names_the_manifest(tmp_path):
    assert model_fingerprint(tmp_path) == ""  # no manifest: unknown
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    write_manifest(tmp_path)
    first = model_fingerprint(tmp_path)
    assert first.startswith("sha256:") and len(first) == 23
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    write_manifest(tmp_path)
    assert model_fingerprint(tmp_path) != first


def test_pool_never_routes_to_another_model(caplog):
    pool = TargetPool(fingerprint="sha256:aaaa")
    pool.update([_record("127.0.0.1:1", "sha256:aaaa"), _record("127.0.0.1:2", "sha256:bbbb"),
                 _record("127.0.0.1:3", "")])
    assert sorted(m.address for m in pool.members.snapshot()) == ["127.0.0.1:1", "127.0.0.1:3"]
    assert "127.0.0.1:2" in caplog.text and "sha256:bbbb" in caplog.text
    for _ in range(6):
        lease = pool.pick()
        assert lease.member.address != "127.0.0.1:2"
        pool.members.done(lease.member)


def test_pool_without_fingerprint_compares_nothing():
    pool = TargetPool()
    pool.update([_record("127.0.0.1:1", "sha256:aaaa"), _record("127.0.0.1:2", "sha256:bbbb")])
    assert len(pool.members.snapshot()) == 2
