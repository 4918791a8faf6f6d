"""specmesh.auth.keys (pure) and the auth switch: key format, hashing, Bearer parsing, records."""

from __future__ import annotations

import hashlib

import pytest

from specmesh.auth.guard import auth_required
from specmesh.auth.keys import KEY_PREFIX, KeyRecord, bearer_token, check_name, hash_key, key_id, new_key
from specmesh.config import AuthConfig, ConfigError, load_config


def test_new_keys_are_random_and_prefixed():
    keys = {new_key() for _ in range(50)}
    assert len(keys) == 50
    assert all(k.startswith(KEY_PREFIX) and len(k) >= 40 for k in keys)


def test_hash_is_sha256_hex_and_id_is_a_prefix():
    key = new_key()
    assert hash_key(key) == hashlib.sha256(key.encode()).hexdigest()
    assert key_id(hash_key(key)) == hash_key(key)[:12]
    assert key not in hash_key(key)


@pytest.mark.parametrize("metadata, want", [
    ([("authorization", "Bearer abc")], "abc"),
    ([("authorization", "bearer   abc  ")], "abc"),
    ([("Authorization", "Bearer abc")], "abc"),
    ([("x-other", "1"), ("authorization", "Bearer k2")], "k2"),
    ([("authorization", "Basic abc")], None),
    ([("authorization", "Bearer ")], None),
    ([("authorization", "abc")], None),
    ([], None),
    (None, None),
])
def test_bearer_token(metadata, want):
    assert bearer_token(metadata) == want


def test_record_round_trips_through_redis_fields_and_public_view_hides_the_hash():
    rec = KeyRecord("alice", "ab" * 32, rpm=3, tpm=1000, admin=True, created=12.5)
    stored = {k: str(v) for k, v in rec.to_redis().items()}  # redis hands strings back
    assert KeyRecord.from_redis(rec.key_hash, stored) == rec
    public = rec.public()
    assert public["id"] == rec.key_hash[:12] and rec.key_hash not in str(public)
    assert KeyRecord.from_redis("h", {"name": "x", "revoked": "1"}).revoked


@pytest.mark.parametrize("name", ["alice", "team-a.prod_1", "A" * 64])
def test_good_names(name):
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "-x", "a b", "a/b", "A" * 65, "é"])
def test_bad_names(name):
    with pytest.raises(ValueError):
        check_name(name)


def test_auth_required_from_config_and_env():
    assert auth_required(AuthConfig(), environ={}) is False
    assert auth_required(AuthConfig(required=True), environ={}) is True
    assert auth_required(AuthConfig(), environ={"SPECMESH_AUTH": "required"}) is True
    assert auth_required(AuthConfig(required=True), environ={"SPECMESH_AUTH": "disabled"}) is False
    with pytest.raises(ConfigError, match="^SPECMESH_AUTH:"):
        auth_required(AuthConfig(), environ={"SPECMESH_AUTH": "whatever"})
    assert load_config(environ={"SPECMESH_AUTH": "required"}).auth.required is True
    assert load_config(environ={}).auth.required is False


def test_auth_defaults_need_no_redis():
    cfg = load_config(environ={})
    assert cfg.auth.required is False and cfg.auth.redis_url is None
    assert cfg.ratelimit.on_redis_error == "open"


def test_auth_config_validation():
    with pytest.raises(ConfigError, match="^ratelimit.on_redis_error:"):
        load_config(environ={}, overrides={"ratelimit": {"on_redis_error": "maybe"}})
    with pytest.raises(ConfigError, match="^auth.redis_timeout_s:"):
        load_config(environ={}, overrides={"auth": {"redis_timeout_s": 0}})
    cfg = load_config(environ={"SPECMESH_AUTH__REQUIRED": "true", "SPECMESH_AUTH__REDIS_URL": "redis://h:1/0"})
    assert cfg.auth.required and cfg.auth.redis_url == "redis://h:1/0"


def test_cli_sends_the_key_from_the_flag_or_the_environment(monkeypatch):
    from types import SimpleNamespace

    from specmesh.auth.cli import call_metadata

    monkeypatch.delenv("SPECMESH_API_KEY", raising=False)
    assert call_metadata(SimpleNamespace(api_key=None)) == []
    assert call_metadata(SimpleNamespace(api_key="smk_a")) == [("authorization", "Bearer smk_a")]
    monkeypatch.setenv("SPECMESH_API_KEY", "smk_env")
    assert call_metadata(SimpleNamespace(api_key=None)) == [("authorization", "Bearer smk_env")]
    assert call_metadata(SimpleNamespace(api_key="smk_flag")) == [("authorization", "Bearer smk_flag")]
