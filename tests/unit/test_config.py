"""specmesh.config: defaults, YAML file, env overrides, unknown keys, validation, immutability."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from specmesh.config import (
    DEFAULT_CONFIG,
    CacheConfig,
    ConfigError,
    MeshConfig,
    env_overrides,
    load_config,
)

NO_ENV: dict = {}


def write_yaml(tmp_path, data, name="mesh.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def raises_naming(key: str):
    """ConfigError whose message starts with the key path (as the loader formats it)."""
    return pytest.raises(ConfigError, match="^" + re.escape(key) + ":")


# ------------------------------------------------------------------------------------ defaults

def test_shipped_default_yaml_loads_and_matches_dataclass_defaults():
    cfg = load_config(environ=NO_ENV)
    assert cfg == MeshConfig()  # the YAML restates the dataclass defaults, no drift
    cfg.validate()


def test_dataclass_defaults_validate():
    MeshConfig().validate()


def test_default_values():
    cfg = load_config(environ=NO_ENV)
    assert cfg.model.name == "smollm2-135m-instruct"
    assert cfg.model.path is None
    assert cfg.speculative.method == "ngram"
    assert cfg.speculative.num_speculative_tokens == 4
    assert cfg.coordinator.draft_workers == ("127.0.0.1:50053",)
    assert isinstance(cfg.coordinator.target_workers, tuple)
    assert cfg.target_worker.cache.idle_timeout_s == 300.0
    assert isinstance(cfg.target_worker.cache.idle_timeout_s, float)  # YAML int -> float field
    assert isinstance(cfg.gateway.max_deadline_s, float)


def test_config_path_from_env_variable(tmp_path):
    path = write_yaml(tmp_path, {"gateway": {"max_tokens_limit": 7}})
    cfg = load_config(environ={"SPECMESH_CONFIG": str(path)})
    assert cfg.gateway.max_tokens_limit == 7


def test_missing_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", environ=NO_ENV)


def test_unparseable_yaml_is_config_error(tmp_path):
    path = write_yaml(tmp_path, "gateway: [unclosed\n")
    with pytest.raises(ConfigError):
        load_config(path, environ=NO_ENV)


def test_empty_yaml_file_gives_defaults(tmp_path):
    path = write_yaml(tmp_path, "")
    assert load_config(path, environ=NO_ENV) == MeshConfig()


# ------------------------------------------------------------------------------------ YAML file

def test_yaml_overrides_only_what_it_sets(tmp_path):
    path = write_yaml(tmp_path, {
        "gateway": {"listen": "0.0.0.0:6000", "max_tokens_limit": 32},
        "target_worker": {"cache": {"idle_timeout_s": 12}},
        "coordinator": {"draft_workers": ["127.0.0.1:7001", "127.0.0.1:7002"]},
        "speculative": {"method": "draft_model", "num_speculative_tokens": 8},
    })
    cfg = load_config(path, environ=NO_ENV)
    assert cfg.gateway.listen == "0.0.0.0:6000"
    assert cfg.gateway.max_tokens_limit == 32
    assert cfg.gateway.coordinator == "127.0.0.1:50052"  # untouched sibling keeps its default
    assert cfg.target_worker.cache.idle_timeout_s == 12.0
    assert cfg.target_worker.cache.max_sequences == CacheConfig().max_sequences
    assert cfg.coordinator.draft_workers == ("127.0.0.1:7001", "127.0.0.1:7002")
    assert cfg.speculative.method == "draft_model"
    assert cfg.speculative.num_speculative_tokens == 8


def test_yaml_empty_draft_worker_list_is_allowed(tmp_path):
    path = write_yaml(tmp_path, {"coordinator": {"draft_workers": []}})
    assert load_config(path, environ=NO_ENV).coordinator.draft_workers == ()


def test_explicit_overrides_argument_wins_over_env_and_file(tmp_path):
    path = write_yaml(tmp_path, {"gateway": {"max_tokens_limit": 10}})
    env = {"SPECMESH_GATEWAY__MAX_TOKENS_LIMIT": "20"}
    cfg = load_config(path, environ=env, overrides={"gateway": {"max_tokens_limit": 30}})
    assert cfg.gateway.max_tokens_limit == 30


# ------------------------------------------------------------------------------------ env

def test_env_overrides_yaml(tmp_path):
    path = write_yaml(tmp_path, {"gateway": {"max_tokens_limit": 10}})
    cfg = load_config(path, environ={"SPECMESH_GATEWAY__MAX_TOKENS_LIMIT": "99"})
    assert cfg.gateway.max_tokens_limit == 99


def test_env_nested_override():
    cfg = load_config(environ={"SPECMESH_TARGET_WORKER__CACHE__IDLE_TIMEOUT_S": "30"})
    assert cfg.target_worker.cache.idle_timeout_s == 30.0
    assert cfg.target_worker.cache.max_sequences == CacheConfig().max_sequences


def test_env_nested_override_keeps_yaml_siblings(tmp_path):
    path = write_yaml(tmp_path, {"target_worker": {"cache": {"max_sequences": 5}}})
    cfg = load_config(path, environ={"SPECMESH_TARGET_WORKER__CACHE__IDLE_TIMEOUT_S": "30"})
    assert cfg.target_worker.cache.idle_timeout_s == 30.0
    assert cfg.target_worker.cache.max_sequences == 5


def test_env_list_as_yaml_flow_sequence():
    env = {"SPECMESH_COORDINATOR__DRAFT_WORKERS": "[127.0.0.1:6000, 127.0.0.1:6001]"}
    cfg = load_config(environ=env)
    assert cfg.coordinator.draft_workers == ("127.0.0.1:6000", "127.0.0.1:6001")


def test_env_list_as_comma_separated_string():
    env = {"SPECMESH_COORDINATOR__TARGET_WORKERS": "127.0.0.1:6000,127.0.0.1:6001"}
    cfg = load_config(environ=env)
    assert cfg.coordinator.target_workers == ("127.0.0.1:6000", "127.0.0.1:6001")


def test_env_string_and_bool_values():
    env = {"SPECMESH_SPECULATIVE__METHOD": "draft_model", "SPECMESH_MODEL__REQUIRE_MANIFEST": "false",
           "SPECMESH_MODEL__PATH": "/models/x", "SPECMESH_RUNTIME__LOG_LEVEL": "DEBUG"}
    cfg = load_config(environ=env)
    assert cfg.speculative.method == "draft_model"
    assert cfg.model.require_manifest is False
    assert cfg.model.path == "/models/x"
    assert cfg.runtime.log_level == "DEBUG"


def test_batch_invariant_takes_true_false_auto_or_own():
    for value, want in (("own", "own"), ("auto", "auto"), ("true", True), ("false", False)):
        cfg = load_config(environ={"SPECMESH_TARGET_WORKER__BATCH_INVARIANT": value})
        assert cfg.target_worker.batch_invariant == want
    with raises_naming("target_worker.batch_invariant"):
        load_config(environ={"SPECMESH_TARGET_WORKER__BATCH_INVARIANT": "mine"})


def test_env_empty_value_means_null():
    cfg = load_config(environ={"SPECMESH_DRAFT_WORKER__DRAFT_MODEL__NAME": ""})
    assert cfg.draft_worker.draft_model.name is None


def test_env_method_off_as_documented():
    cfg = load_config(environ={"SPECMESH_SPECULATIVE__METHOD": "off"})
    assert cfg.speculative.method == "off"


def test_env_method_off_quoted_works():
    cfg = load_config(environ={"SPECMESH_SPECULATIVE__METHOD": "'off'"})
    assert cfg.speculative.method == "off"


def test_env_ignores_unrelated_variables():
    env = {"SPECMESH_CONFIG_X": "1", "SPECMESH_HOME": "/tmp", "SPECMESH_OTHER__THING": "1", "PATH": "/bin",
           "NOT_SPECMESH_GATEWAY__LISTEN": "bad"}
    assert env_overrides(env) == {}
    assert load_config(environ=env) == MeshConfig()


def test_env_overrides_shape():
    env = {"SPECMESH_TARGET_WORKER__CACHE__IDLE_TIMEOUT_S": "30", "SPECMESH_GATEWAY__LISTEN": "h:1"}
    assert env_overrides(env) == {"target_worker": {"cache": {"idle_timeout_s": 30}}, "gateway": {"listen": "h:1"}}


def test_env_unparseable_value_names_variable():
    with pytest.raises(ConfigError, match="SPECMESH_GATEWAY__LISTEN"):
        load_config(environ={"SPECMESH_GATEWAY__LISTEN": "[unclosed"})


def test_env_wrong_type_names_key_path():
    with raises_naming("gateway.max_tokens_limit"):
        load_config(environ={"SPECMESH_GATEWAY__MAX_TOKENS_LIMIT": "lots"})
    with raises_naming("target_worker.cache.idle_timeout_s"):
        load_config(environ={"SPECMESH_TARGET_WORKER__CACHE__IDLE_TIMEOUT_S": "soon"})


# ------------------------------------------------------------------------------------ unknown keys

def test_unknown_top_level_section(tmp_path):
    path = write_yaml(tmp_path, {"gatewy": {"listen": "127.0.0.1:1"}})
    with pytest.raises(ConfigError, match="gatewy"):
        load_config(path, environ=NO_ENV)


def test_unknown_key_names_section_and_key(tmp_path):
    path = write_yaml(tmp_path, {"gateway": {"max_token_limit": 5}})
    with pytest.raises(ConfigError, match=r"^gateway\b.*max_token_limit"):
        load_config(path, environ=NO_ENV)


def test_unknown_nested_key_names_full_path(tmp_path):
    path = write_yaml(tmp_path, {"target_worker": {"cache": {"idle_timeout": 5}}})
    with pytest.raises(ConfigError, match=r"^target_worker\.cache\b.*idle_timeout"):
        load_config(path, environ=NO_ENV)


def test_unknown_key_from_env_names_path():
    with pytest.raises(ConfigError, match=r"^target_worker\.cache\b.*bogus"):
        load_config(environ={"SPECMESH_TARGET_WORKER__CACHE__BOGUS": "1"})


def test_section_must_be_mapping(tmp_path):
    path = write_yaml(tmp_path, {"gateway": 5})
    with raises_naming("gateway"):
        load_config(path, environ=NO_ENV)


# ------------------------------------------------------------------------------------ validation

BAD_VALUES = [
    # (yaml overrides, key path the error must name)
    ({"gateway": {"listen": "no-port"}}, "gateway.listen"),
    ({"gateway": {"listen": "127.0.0.1:"}}, "gateway.listen"),
    ({"gateway": {"listen": ":50051"}}, "gateway.listen"),
    ({"gateway": {"listen": "127.0.0.1:0"}}, "gateway.listen"),
    ({"gateway": {"listen": "127.0.0.1:70000"}}, "gateway.listen"),
    ({"gateway": {"listen": "127.0.0.1:http"}}, "gateway.listen"),
    ({"gateway": {"coordinator": "localhost"}}, "gateway.coordinator"),
    ({"gateway": {"max_tokens_limit": 0}}, "gateway.max_tokens_limit"),
    ({"gateway": {"max_deadline_s": 0}}, "gateway.max_deadline_s"),
    ({"gateway": {"max_workers": 0}}, "gateway.max_workers"),
    ({"coordinator": {"listen": "x"}}, "coordinator.listen"),
    ({"coordinator": {"draft_workers": ["127.0.0.1:1", "bad"]}}, "coordinator.draft_workers[1]"),
    ({"coordinator": {"target_workers": ["bad"]}}, "coordinator.target_workers[0]"),
    ({"coordinator": {"target_workers": []}}, "coordinator.target_workers"),
    ({"coordinator": {"draft_timeout_s": 0}}, "coordinator.draft_timeout_s"),
    ({"coordinator": {"max_workers": -1}}, "coordinator.max_workers"),
    ({"speculative": {"method": "medusa"}}, "speculative.method"),
    ({"speculative": {"num_speculative_tokens": 17}}, "speculative.num_speculative_tokens"),  # k > max (16)
    ({"speculative": {"num_speculative_tokens": 5, "max_speculative_tokens": 4}},
     "speculative.num_speculative_tokens"),
    ({"speculative": {"num_speculative_tokens": -1}}, "speculative.num_speculative_tokens"),
    ({"speculative": {"max_speculative_tokens": 65, "num_speculative_tokens": 4}},
     "speculative.max_speculative_tokens"),
    ({"speculative": {"max_speculative_tokens": 0, "num_speculative_tokens": 0}}, "speculative.max_speculative_tokens"),
    ({"speculative": {"verify_mode": "graph"}}, "speculative.verify_mode"),
    ({"speculative": {"tree_budget": 0}}, "speculative.tree_budget"),
    ({"speculative": {"tree_budget": 65}}, "speculative.tree_budget"),
    ({"speculative": {"feature_layers": []}}, "speculative.feature_layers"),
    ({"draft_worker": {"block": {"dtype": "int4"}}}, "draft_worker.block.dtype"),
    ({"model": {"dtype": "int8"}}, "model.dtype"),
    ({"model": {"name": "", "path": None}}, "model"),
    ({"runtime": {"torch_threads": -1}}, "runtime.torch_threads"),
    ({"runtime": {"log_level": "LOUD"}}, "runtime.log_level"),
    ({"draft_worker": {"listen": "nope"}}, "draft_worker.listen"),
    ({"draft_worker": {"methods": ["ngram", "eagle"]}}, "draft_worker.methods"),
    ({"draft_worker": {"ngram": {"min_n": 3, "max_n": 2}}}, "draft_worker.ngram"),
    ({"draft_worker": {"ngram": {"min_n": 0}}}, "draft_worker.ngram"),
    ({"draft_worker": {"draft_model": {"dtype": "fp8"}}}, "draft_worker.draft_model.dtype"),
    ({"draft_worker": {"max_batch_size": 0}}, "draft_worker.max_batch_size"),
    ({"draft_worker": {"cache_max_sequences": 0}}, "draft_worker.cache_max_sequences"),
    ({"target_worker": {"listen": "1.2.3.4"}}, "target_worker.listen"),
    ({"target_worker": {"max_batch_size": 0}}, "target_worker.max_batch_size"),
    ({"target_worker": {"cache": {"max_sequences": 0}}}, "target_worker.cache.max_sequences"),
    ({"target_worker": {"cache": {"max_tokens": 0}}}, "target_worker.cache.max_tokens"),
    ({"target_worker": {"cache": {"idle_timeout_s": -5}}}, "target_worker.cache.idle_timeout_s"),
    ({"target_worker": {"cache": {"reclaim_interval_s": 0}}}, "target_worker.cache.reclaim_interval_s"),
    # type errors name the key too
    ({"gateway": {"max_tokens_limit": "many"}}, "gateway.max_tokens_limit"),
    ({"gateway": {"max_tokens_limit": 1.5}}, "gateway.max_tokens_limit"),
    ({"gateway": {"max_tokens_limit": True}}, "gateway.max_tokens_limit"),
    ({"gateway": {"max_deadline_s": "long"}}, "gateway.max_deadline_s"),
    ({"model": {"require_manifest": "yes please"}}, "model.require_manifest"),
    ({"model": {"dtype": None}}, "model.dtype"),
    ({"coordinator": {"draft_workers": 5}}, "coordinator.draft_workers"),
    ({"gateway": {"listen": ["a", "b"]}}, "gateway.listen"),
]


@pytest.mark.parametrize("data,key", BAD_VALUES, ids=[f"{k}={list(d.values())[0]}" for d, k in BAD_VALUES])
def test_invalid_value_names_field(tmp_path, data, key):
    path = write_yaml(tmp_path, data)
    with raises_naming(key):
        load_config(path, environ=NO_ENV)


@pytest.mark.parametrize("data,key", BAD_VALUES[:10], ids=[k for _, k in BAD_VALUES[:10]])
def test_invalid_value_via_overrides_argument(data, key):
    with raises_naming(key):
        load_config(environ=NO_ENV, overrides=data)


def test_validation_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_good_edge_values(tmp_path):
    # `off` is quoted: unquoted, YAML 1.1 reads it as false (see test_env_method_off_as_documented)
    path = write_yaml(tmp_path,
                      "gateway: {listen: '[::1]:50051', max_tokens_limit: 1}\n"
                      "speculative: {method: 'off', num_speculative_tokens: 0, max_speculative_tokens: 64}\n"
                      "runtime: {torch_threads: 0}\n"
                      "draft_worker: {methods: [], ngram: {min_n: 2, max_n: 2}}\n"
                      "model: {name: '', path: /some/dir, dtype: float32}\n")
    cfg = load_config(path, environ=NO_ENV)
    assert cfg.gateway.listen == "[::1]:50051"
    assert cfg.speculative.method == "off"
    assert cfg.speculative.max_speculative_tokens == 64
    assert cfg.draft_worker.methods == ()
    assert cfg.model.path == "/some/dir"


# ------------------------------------------------------------------------------------ frozen

def test_configs_are_frozen():
    cfg = load_config(environ=NO_ENV)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gateway = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gateway.listen = "127.0.0.1:1"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.target_worker.cache.idle_timeout_s = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.draft_worker.ngram.max_n = 9  # type: ignore[misc]


def test_lists_become_immutable_tuples():
    cfg = load_config(environ={"SPECMESH_COORDINATOR__DRAFT_WORKERS": "[127.0.0.1:6000]"})
    assert isinstance(cfg.coordinator.draft_workers, tuple)
    assert isinstance(cfg.draft_worker.methods, tuple)
    hash(cfg)  # frozen + tuples: the whole config is hashable


def test_replace_returns_new_config_and_leaves_original():
    cfg = load_config(environ=NO_ENV)
    new = cfg.replace(gateway=dataclasses.replace(cfg.gateway, listen="127.0.0.1:1"))
    assert new.gateway.listen == "127.0.0.1:1"
    assert cfg.gateway.listen == "127.0.0.1:50051"


def test_default_config_path_is_packaged():
    assert DEFAULT_CONFIG.is_file()
