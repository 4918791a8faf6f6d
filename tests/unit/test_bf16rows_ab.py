"""The interleaved on/off table of the bf16 rows kernel (specmesh/bench/bf16rows_ab.py): its
markdown from a hand-built result."""

from specmesh.bench.bf16rows_ab import markdown


def test_markdown_gives_each_forward_and_its_ratio():
    doc = {"command": "python -m specmesh.bench.bf16rows_ab", "context": 256, "rounds": 2,
           "machine": {"cpu": "Xeon", "cores": 2, "torch": "2.13.0", "date": "2026-12-06"},
           "probe": {"used": True}, "results": [
               {"batch": 1, "positions": 5, "tree": 0, "kernel_ms": 40.0, "onednn_ms": 50.0},
               {"batch": 1, "positions": 17, "tree": 16, "kernel_ms": 66.0, "onednn_ms": 60.0}]}
    text = markdown(doc)
    assert "| batch 1 x 5 positions | 40.0 | 50.0 | 0.80x |" in text
    assert "| batch 1 x tree of 16 (+ pending) | 66.0 | 60.0 | 1.10x |" in text
    assert "median of 4 forwards" in text and "Xeon, 2 cores" in text
