"""Fuzz cases for the internal services (reached with the mesh's client certificate): Prefill,
Verify, Release and Status on the target worker, Propose and Release on the draft worker, and the
coordinator's Generate / Admin. Out-of-range token ids, wrong shapes of draft probabilities,
trees whose parents are not prefix-closed, unknown sequence ids, double release, verify after
release, oversized drafts, feature requests and raw bytes."""

from __future__ import annotations

import struct

from specmesh.reliability import cases as c
from specmesh.reliability import public_cases as pub
from specmesh.reliability.cases import Case, Step
from specmesh.v1 import specmesh_pb2 as pb

T = "/specmesh.v1.TargetWorker/"
D = "/specmesh.v1.DraftWorker/"
PREFILL, VERIFY, RELEASE, STATUS = T + "Prefill", T + "Verify", T + "Release", T + "Status"
PROPOSE, DRELEASE = D + "Propose", D + "Release"
MODEL = {"vocab_size": 49152, "context_window": 8192, "num_layers": 30}
MAX_NODES = 64  # draft tokens one Verify may carry (config.MAX_DRAFT_TOKENS)
OK, BAD, OK_OR_FULL = frozenset({"OK"}), c.REJECTED, frozenset({"OK", "UNAVAILABLE"})


def _ids(rng, m, n: int, bad: bool = False) -> list[int]:
    out = [rng.randrange(m["vocab_size"]) for _ in range(n)]
    if bad and out:
        out[rng.randrange(n)] = rng.choice((-1, m["vocab_size"], 2**31 - 1, -2**31))
    return out


def _sampling(rng) -> tuple[pb.SamplingOptions, bool]:
    s = pb.SamplingOptions()
    if rng.random() < 0.3:
        s.temperature = rng.choice(c.FLOATS)
    if rng.random() < 0.2:
        s.top_p = rng.choice(c.FLOATS)
    if rng.random() < 0.2:
        s.top_k = rng.choice(c.INT32)
    if rng.random() < 0.2:
        s.seed = rng.choice(c.INT64)
    t = s.temperature if s.HasField("temperature") else 0.0
    p = s.top_p if s.HasField("top_p") else 1.0
    ok = t == t and t >= 0 and t != float("inf") and p == p and 0 < p <= 1 and (s.top_k if s.HasField("top_k") else 0) >= 0
    return s, ok


def _seq_id(rng, index: int) -> str:
    return rng.choice((f"fz-{index}", f"fz-{index}-" + "é" * 20, f"fz-{index}-" + "x" * 5000))


def _features_req(rng, m) -> tuple[pb.FeatureRequest | None, bool]:
    if rng.random() < 0.6:
        return None, True
    layers = rng.choice(([1], [0, m["num_layers"] - 1], [], [m["num_layers"]], [-1], [1] * 200, [2**31 - 1]))
    req = pb.FeatureRequest(layers=layers, max_rows=rng.choice((0, 1, 4, -1, 2**31 - 1)))
    ok = bool(layers) and len(layers) <= m["num_layers"] and all(0 <= x < m["num_layers"] for x in layers) \
        and req.max_rows >= 0
    return req, ok


def gen_prefill(rng, m, index, lim):
    sid = _seq_id(rng, index)
    # a prompt near the window takes the target minutes on a small CPU: the edge is tested from above
    n = rng.choice((1, 0, 512, m["context_window"], m["context_window"] + 100)) if rng.random() < 0.1 \
        else rng.randint(1, 24)
    bad_id = n > 0 and rng.random() < 0.25
    req = pb.PrefillRequest(seq_id=sid, prompt=_ids(rng, m, n, bad_id),
                            max_new_tokens=rng.choice((0, 4, -1, 2**31 - 1, 16)))
    req.sampling.CopyFrom(_sampling(rng)[0])
    feats, feats_ok = _features_req(rng, m)
    if feats is not None:
        req.return_features.CopyFrom(feats)
    ok = 0 < n < m["context_window"] and not bad_id and feats_ok and _sampling_ok(req.sampling) and len(sid) <= 256
    steps = (Step(PREFILL, req.SerializeToString(), expect=OK_OR_FULL if ok else BAD),
             Step(RELEASE, pb.ReleaseRequest(seq_id=sid).SerializeToString(), expect=OK))
    return "prefill", "target_worker", steps, f"{len(sid)}-char id, {n} tokens, bad_id={bad_id}, features={feats_ok}"


def _sampling_ok(s: pb.SamplingOptions) -> bool:
    t = s.temperature if s.HasField("temperature") else 0.0
    p = s.top_p if s.HasField("top_p") else 1.0
    k = s.top_k if s.HasField("top_k") else 0
    return t == t and 0 <= t < float("inf") and p == p and 0 < p <= 1 and k >= 0


def _dense(rng, m, tokens: list[int]) -> tuple[bytes, int, bool]:
    """(draft_probs, vocab_size, valid): one-hot rows on the drafted tokens, or a wrong shape / value."""
    v = m["vocab_size"]
    what = rng.choice(("none", "none", "good", "short", "vocab", "nan", "negative"))
    if what == "none" or not tokens:
        return b"", rng.choice((0, v)), True
    rows = []
    for t in tokens:
        row = [0.0] * v
        row[t % v] = 1.0
        rows.append(struct.pack(f"<{v}f", *row))
    data = b"".join(rows)
    if what == "short":
        return data[:-4], v, False
    if what == "vocab":
        return data, rng.choice((v - 1, v + 1, 0, -1)), False
    if what in ("nan", "negative"):
        data = struct.pack("<f", float("nan") if what == "nan" else -1.0) + data[4:]
    return data, v, what == "good"


def _sparse(rng, m, tokens: list[int]) -> tuple[pb.SparseProbs, int, bool]:
    k, v = len(tokens), m["vocab_size"]
    what = rng.choice(("good", "rows", "ids", "huge_vocab", "sum"))
    lengths = [1] * k
    ids = list(tokens)
    vals = [1.0] * k
    vocab, ok = v, True
    if what == "rows":
        lengths, ok = lengths + [1], False
    elif what == "ids":
        ids, ok = [v + 5] * k, False
    elif what == "huge_vocab":  # never allocate [k, vocab] for a vocab the worker does not have
        vocab, ok = rng.choice((2**31 - 1, v * 4096)), False
    elif what == "sum":
        vals, ok = [0.25] * k, False
    if k == 0:  # no rows: no probabilities at all, unless a row is left over
        ok, vocab = what != "rows", v
    sp = pb.SparseProbs(row_lengths=lengths, token_ids=struct.pack(f"<{len(ids)}I", *[i % 2**32 for i in ids]),
                        probs=struct.pack(f"<{len(vals)}f", *vals))
    return sp, vocab, ok


def _parents(rng, k: int) -> tuple[list[int], bool]:
    what = rng.choice(("chain", "chain", "tree", "forward", "below", "length"))
    if what == "chain" or k == 0:
        return [], True
    if what == "tree":
        return [rng.randrange(-1, i) for i in range(k)], True
    if what == "forward":  # a parent that comes later: not prefix-closed
        parents = [i - 1 for i in range(k)]
        parents[rng.randrange(k)] = k + rng.randint(0, 3)
        return parents, False
    if what == "below":
        return [-2] + [i - 1 for i in range(1, k)], False
    return [-1] * (k + 1), False


def gen_verify(rng, m, index, lim):
    sid = f"fz-{index}"
    k = rng.choice((0, 1, 2, 4, 8, MAX_NODES, MAX_NODES + 1, 1000)) if rng.random() < 0.3 else rng.randint(0, 6)
    bad_id = k > 0 and rng.random() < 0.2
    tokens = _ids(rng, m, k, bad_id)
    parents, parents_ok = _parents(rng, k)
    req = pb.VerifyRequest(seq_id=sid, draft_token_ids=tokens, draft_parents=parents)
    probs_ok = True
    if not parents and rng.random() < 0.5:
        if k <= 2 and rng.random() < 0.5:
            req.draft_probs, req.vocab_size, probs_ok = _dense(rng, m, tokens)
        else:
            sparse, req.vocab_size, probs_ok = _sparse(rng, m, tokens)
            req.draft_sparse_probs.CopyFrom(sparse)
    feats, feats_ok = _features_req(rng, m)
    if feats is not None:
        req.return_features.CopyFrom(feats)
    ok = not bad_id and parents_ok and probs_ok and feats_ok and k <= MAX_NODES
    prefill = pb.PrefillRequest(seq_id=sid, prompt=_ids(rng, m, rng.randint(1, 12)), max_new_tokens=16)
    steps = (Step(PREFILL, prefill.SerializeToString(), expect=OK_OR_FULL),
             Step(VERIFY, req.SerializeToString(), expect=frozenset({"OK", "NOT_FOUND"}) if ok else BAD),
             Step(RELEASE, pb.ReleaseRequest(seq_id=sid).SerializeToString(), expect=OK))
    return "verify", "target_worker", steps, \
        f"k={k} bad_id={bad_id} parents={parents[:6]} probs_ok={probs_ok} vocab={req.vocab_size} feats={feats_ok}"


def gen_lifecycle(rng, m, index, lim):
    sid = f"fz-{index}"
    prefill = pb.PrefillRequest(seq_id=sid, prompt=_ids(rng, m, 4), max_new_tokens=8).SerializeToString()
    verify = pb.VerifyRequest(seq_id=sid, draft_token_ids=_ids(rng, m, 2)).SerializeToString()
    release = pb.ReleaseRequest(seq_id=sid).SerializeToString()
    nf, dup = frozenset({"NOT_FOUND"}), frozenset({"FAILED_PRECONDITION"})
    what = rng.choice(("unknown", "double_release", "after_release", "duplicate", "status"))
    steps = {"unknown": (Step(VERIFY, verify, expect=nf), Step(RELEASE, release, expect=OK)),
             "double_release": (Step(PREFILL, prefill, expect=OK_OR_FULL), Step(RELEASE, release, expect=OK),
                                Step(RELEASE, release, expect=OK)),
             "after_release": (Step(PREFILL, prefill, expect=OK_OR_FULL), Step(RELEASE, release, expect=OK),
                               Step(VERIFY, verify, expect=nf)),
             "duplicate": (Step(PREFILL, prefill, expect=OK_OR_FULL), Step(PREFILL, prefill, expect=dup),
                           Step(VERIFY, verify, expect=OK), Step(RELEASE, release, expect=OK)),
             "status": (Step(STATUS, b"", expect=OK),)}[what]
    return "lifecycle", "target_worker", steps, what


def gen_propose(rng, m, index, lim):
    method = rng.choice(("ngram", "draft_model", "draft_model", "block", "", "nope"))
    n = rng.choice((0, 1, 512, m["context_window"] + 1, 20000)) if rng.random() < 0.06 else rng.randint(1, 40)
    bad_id = n > 0 and rng.random() < 0.25
    sampling, s_ok = _sampling(rng)
    k = rng.choice((0, 1, 4, 16, 17, -1, 2**31 - 1)) if rng.random() < 0.3 else rng.randint(1, 4)
    budget = rng.choice((0, 0, 0, 8, 64, 65, -1))
    req = pb.ProposeRequest(seq_id=f"fz-{index}", context=_ids(rng, m, n, bad_id), num_tokens=k, method=method,
                            round=rng.choice((0, 1, -1, 2**31 - 1)), tree_budget=budget)
    req.sampling.CopyFrom(sampling)
    feats_ok = True
    if rng.random() < 0.2:
        rows, dim = rng.choice(((1, 4), (2, 1728), (0, 0), (-1, 8), (3, -2)))
        data = b"\x00" * rng.choice((0, 8, 16))
        req.features.CopyFrom(pb.FeatureRows(data=data, rows=rows, dim=dim))
        req.features_complete = rng.random() < 0.5
        feats_ok = (rows == 0 and not data) or (rows >= 0 and dim > 0 and len(data) == 2 * rows * dim)
    served = method in ("ngram", "draft_model", "block")  # the suite's draft worker
    basic = served and 0 <= k <= 16 and 0 <= budget <= 64 and n > 0 and s_ok and feats_ok
    ok = basic and (method == "ngram" or (not bad_id and (method == "block" or n <= m["context_window"])))
    # block: the feature rows must also fit its window and feature size (a miss answers OK, empty)
    expect = BAD if not ok else (None if method == "block" else OK)
    steps = (Step(PROPOSE, req.SerializeToString(), expect=expect),
             Step(DRELEASE, pb.ReleaseDraftRequest(seq_id=req.seq_id).SerializeToString(), expect=OK))
    return "propose", "draft_worker", steps, f"{method} n={n} k={k} bad_id={bad_id} budget={budget} sampling_ok={s_ok}"


def gen_coordinator(rng, m, index, lim):
    """The public generators, straight to the coordinator's mesh port (it re-validates everything)."""
    fn = rng.choice((pub.gen_fields, pub.gen_invalid_utf8, pub.gen_role_spoof, pub.gen_stop, pub.gen_request_id,
                     pub.gen_wire, pub.gen_unicode_prompt))
    kind, steps, summary = fn(rng, lim | {"max_message_bytes": 64 << 20})  # the mesh ports' limit
    moved = tuple(Step(s.method.replace("Gateway", "Coordinator"), s.payload, s.stream, s.expect, auth="none")
                  for s in steps)
    return f"coordinator_{kind}", "coordinator", moved, summary


def gen_raw(rng, m, index, lim):
    method = rng.choice((PREFILL, VERIFY, RELEASE, STATUS, PROPOSE, DRELEASE, "/specmesh.v1.Admin/SetSpeculation",
                         "/specmesh.v1.Coordinator/Generate", "/specmesh.v1.Coordinator/GenerateStream"))
    service = {"TargetWorker": "target_worker", "DraftWorker": "draft_worker"}.get(
        method.split("/")[1].rsplit(".", 1)[1], "coordinator")
    data = c.random_bytes(rng) if rng.random() < 0.8 else c.field_bytes(2, c.nested_bomb(1000))
    steps = (Step(method, data, stream=method.endswith("Stream"), auth="none"),)
    if method == PREFILL:  # bytes that happen to decode prefill a sequence (the bomb: 2,000 token ids): free it
        try:
            steps += (Step(RELEASE, pb.ReleaseRequest(seq_id=pb.PrefillRequest.FromString(data).seq_id)
                           .SerializeToString(), auth="none"),)
        except Exception:  # noqa: BLE001 - not a PrefillRequest: nothing was held
            pass
    return "raw_bytes", service, steps, f"{method} {len(data)} bytes"


GENERATORS = ((gen_prefill, 20), (gen_verify, 30), (gen_lifecycle, 12), (gen_propose, 20), (gen_coordinator, 10),
              (gen_raw, 8))


def internal_case(seed: int, index: int, model: dict | None = None, limits: dict | None = None) -> Case:
    """model: vocab_size, context_window, num_layers of the served model; limits: the gateway section
    (the coordinator validates with the same limits)."""
    m, lim = {**MODEL, **(model or {})}, {**pub.DEFAULTS, **(limits or {})}
    rng = c.case_rng(seed, "internal", index)
    fns, weights = zip(*GENERATORS)
    kind, service, steps, summary = rng.choices(fns, weights)[0](rng, m, index, lim)
    steps = tuple(s if s.auth == "none" else Step(s.method, s.payload, s.stream, s.expect, "none", s.metadata)
                  for s in steps)
    return Case("internal", index, kind, service, steps, summary)
