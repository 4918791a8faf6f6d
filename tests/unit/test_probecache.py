"""The start-up probes' disk cache (specmesh/engine/probecache.py): a result comes back only for
the same probe on the same machine, software and thread count; off means every start probes;
a broken file is ignored; rowexact's and onednn's probes go through it and return what a fresh
probe finds."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specmesh.engine import onednn, probecache, rowexact


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(probecache.ENV, str(tmp_path))
    return tmp_path


def _counting(value):
    calls = []

    def compute():
        calls.append(1)
        return value

    return compute, calls


def test_a_result_is_computed_once_then_read_back(cache):
    compute, calls = _counting(17)
    args = {"weight": [[4, 8], [8, 1], "torch.float32", "cpu"], "rows": 64}
    assert probecache.cached("probe", args, "cpu", compute) == 17
    assert probecache.cached("probe", args, "cpu", compute) == 17
    assert len(calls) == 1
    (path,) = cache.glob("*.json")
    assert path.stem == probecache.fingerprint()
    assert list(json.loads(path.read_text()).values()) == [17]


def test_other_arguments_or_kind_probe_again(cache):
    compute, calls = _counting(3)
    probecache.cached("probe", {"rows": 64}, "cpu", compute)
    probecache.cached("probe", {"rows": 32}, "cpu", compute)
    probecache.cached("other", {"rows": 64}, "cpu", compute)
    assert len(calls) == 3


@pytest.mark.parametrize("value", ["off", "0", ""])
def test_off_probes_every_time(monkeypatch, tmp_path, value):
    monkeypatch.setenv(probecache.ENV, value)
    assert probecache.folder() is None
    compute, calls = _counting(1)
    probecache.cached("probe", {}, "cpu", compute)
    probecache.cached("probe", {}, "cpu", compute)
    assert len(calls) == 2


def test_not_a_cpu_probes_every_time(cache):
    compute, calls = _counting(1)
    probecache.cached("probe", {}, "meta", compute)
    probecache.cached("probe", {}, "meta", compute)
    assert len(calls) == 2 and not list(cache.glob("*.json"))


def test_the_thread_count_and_the_probing_code_are_in_the_fingerprint(monkeypatch):
    before = torch.get_num_threads()
    one = probecache.fingerprint()
    torch.set_num_threads(before + 1)
    try:
        assert probecache.fingerprint() != one
    finally:
        torch.set_num_threads(before)
    assert probecache.fingerprint() == one
    monkeypatch.setattr(probecache, "_code", lambda: "other source")
    probecache._fingerprint.cache_clear()
    try:
        assert probecache.fingerprint() != one
    finally:
        monkeypatch.undo()
        probecache._fingerprint.cache_clear()


def test_a_broken_file_counts_as_empty_and_is_rewritten(cache):
    path = cache / f"{probecache.fingerprint()}.json"
    path.write_text("{not json")
    compute, calls = _counting(5)
    assert probecache.cached("probe", {}, "cpu", compute) == 5
    assert probecache.cached("probe", {}, "cpu", compute) == 5
    assert len(calls) == 1 and json.loads(path.read_text())


def test_rowexact_probe_is_kept_and_equals_a_fresh_probe(cache, monkeypatch):
    lin = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    fresh = rowexact.probe_rows(lin.weight, lin.bias, 16, trials=2)
    assert rowexact._kept(lin.weight, lin.bias, 16, F.linear, 2, 1) == fresh

    def refuse(*a, **k):
        raise AssertionError("probed again")

    monkeypatch.setattr(rowexact, "probe_rows", refuse)
    assert rowexact._kept(lin.weight, lin.bias, 16, F.linear, 2, 1) == fresh
    with pytest.raises(AssertionError):  # another row floor is another probe
        rowexact._kept(lin.weight, lin.bias, 16, F.linear, 2, 2)
    with pytest.raises(AssertionError):  # ... and so is a kernel without a name
        rowexact._kept(lin.weight, lin.bias, 16, lambda x, w, b=None: F.linear(x, w, b), 2, 1)


@pytest.mark.skipif(not onednn.available(), reason="torch without oneDNN's prepacked bf16 linears on this CPU")
def test_onednn_install_reads_its_equal_rows_back(cache, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    def model():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()

    first = onednn.install(model())

    def refuse(*a, **k):
        raise AssertionError("probed again")

    monkeypatch.setattr(onednn, "equal_rows", refuse)
    second = onednn.install(model())
    assert {k: v["equal_rows"] for k, v in second.items()} == {k: v["equal_rows"] for k, v in first.items()}


def test_an_unwritable_folder_probes_and_warns_once(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(probecache.ENV, str(blocker / "probes"))  # a folder under a file: cannot exist
    compute, calls = _counting(2)
    with caplog.at_level("WARNING", logger=probecache.__name__):
        assert probecache.cached("probe", {"a": 1}, "cpu", compute) == 2
        assert probecache.cached("probe", {"a": 2}, "cpu", compute) == 2
    assert len(calls) == 2
    assert sum("probe cache not written" in r.getMessage() for r in caplog.records) == 1
