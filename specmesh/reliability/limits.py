"""The limits part: every size the public API accepts, at its limit and one past it, and the bounds
the internal services keep. A row passes when the request at the limit is not refused by that
limit and the one past it is answered with the documented status."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import grpc

from specmesh.reliability.cases import field_bytes
from specmesh.reliability.streams_probe import key_limit_row, connection_limit_row
from specmesh.v1 import specmesh_pb2 as pb

GEN = "/specmesh.v1.Gateway/Generate"


@dataclass
class LimitRow:
    limit: str
    key: str  # the config key (or the constant) that sets it
    value: int
    status_at: str  # the answer at the limit
    status_past: str  # the answer one past it
    expected_past: str
    passed: bool
    note: str = ""


def _call(channel, method: str, payload: bytes, metadata, timeout: float = 120.0) -> tuple[str, str]:
    try:
        channel.unary_unary(method)(payload, timeout=timeout, metadata=metadata)
        return "OK", ""
    except grpc.RpcError as err:
        return err.code().name, err.details() or ""


def _row(name, key, value, at, past, expected, refused_word: str) -> LimitRow:
    """at / past: (status, details). At the limit, any refusal must not be this limit's (its word)."""
    at_ok = at[0] == "OK" or refused_word not in at[1]
    past_ok = past[0] == expected and (expected != "INVALID_ARGUMENT" or refused_word in past[1])
    note = "" if at_ok and past_ok else f"at: {at[1][:120]} | past: {past[1][:120]}"
    if at_ok and past_ok and at[0] != "OK":
        note = f"at the limit, refused by another check: {at[1][:100]}"
    return LimitRow(name, key, value, at[0], past[0], expected, at_ok and past_ok, note)


def _padded(req: pb.GenerateRequest, total: int) -> bytes:
    """req's bytes plus an unknown field, `total` bytes in all (protobuf skips unknown fields)."""
    base = req.SerializeToString()
    pad = total - len(base) - 6
    data = base + field_bytes(999, b"z" * pad)
    return base + field_bytes(999, b"z" * (pad + total - len(data)))


class _Requests:
    """Requests at and past the public limits, sent on one connection with the user key."""

    def __init__(self, mesh, encoder):
        self.channel, self.md, self.encoder = mesh.channel("gateway", own_connection=True), mesh.metadata("user"), encoder
        self.small = pb.GenerateRequest(prompt="Say hi.", max_tokens=1)

    def send(self, req: pb.GenerateRequest | bytes) -> tuple[str, str]:
        return _call(self.channel, GEN, req if isinstance(req, bytes) else req.SerializeToString(), self.md)

    def small_with(self, **fields) -> pb.GenerateRequest:
        req = pb.GenerateRequest()
        req.CopyFrom(self.small)
        for name, value in fields.items():
            if isinstance(value, list):
                getattr(req, name).extend(value)
            else:
                setattr(req, name, value)
        return req

    @staticmethod
    def messages(n: int) -> pb.GenerateRequest:
        req = pb.GenerateRequest(max_tokens=1)
        for _ in range(n):
            req.messages.messages.add(role="user", content="hi")
        return req

    def raw_tokens(self, n: int) -> pb.GenerateRequest:
        text = " hello" * n  # one token per word for this tokenizer; trimmed if not
        while len(self.encoder.encode(text, None, raw=True)) > n:
            text = text[:-6]
        return pb.GenerateRequest(prompt=text, raw=True, max_tokens=1)


def public_rows(mesh, encoder) -> list[LimitRow]:
    gw, r = mesh.cfg.gateway, _Requests(mesh, encoder)
    send, small_with = r.send, r.small_with
    tokens = gw.max_prompt_tokens or encoder.context_window - 1
    rows = [
        _row("request message", "gateway.max_message_bytes", gw.max_message_bytes,
             send(_padded(r.small, gw.max_message_bytes)), send(_padded(r.small, gw.max_message_bytes + 1)),
             "RESOURCE_EXHAUSTED", "larger than max"),
        _row("prompt text", "gateway.max_prompt_bytes", gw.max_prompt_bytes,
             send(small_with(prompt="a" * gw.max_prompt_bytes, raw=True)),
             send(small_with(prompt="a" * (gw.max_prompt_bytes + 1), raw=True)), "INVALID_ARGUMENT", "bytes of text"),
        _row("prompt tokens", "gateway.max_prompt_tokens", tokens, send(r.raw_tokens(tokens)),
             send(r.raw_tokens(tokens + 1)), "INVALID_ARGUMENT", "prompt tokens"),
        _row("messages", "gateway.max_messages", gw.max_messages, send(r.messages(gw.max_messages)),
             send(r.messages(gw.max_messages + 1)), "INVALID_ARGUMENT", "messages"),
        _row("stop strings", "gateway.max_stop_strings", gw.max_stop_strings,
             send(small_with(stop=[f"#{i}#" for i in range(gw.max_stop_strings)])),
             send(small_with(stop=[f"#{i}#" for i in range(gw.max_stop_strings + 1)])), "INVALID_ARGUMENT", "stop"),
        _row("stop string length", "gateway.max_stop_chars", gw.max_stop_chars,
             send(small_with(stop=["é" * gw.max_stop_chars])), send(small_with(stop=["é" * (gw.max_stop_chars + 1)])),
             "INVALID_ARGUMENT", "characters"),
        _row("request_id length", "gateway.max_request_id_chars", gw.max_request_id_chars,
             send(small_with(request_id="r" * gw.max_request_id_chars)),
             send(small_with(request_id="r" * (gw.max_request_id_chars + 1))), "INVALID_ARGUMENT", "request_id"),
        _row("max_tokens", "gateway.max_tokens_limit", gw.max_tokens_limit,
             send(small_with(max_tokens=gw.max_tokens_limit, stop=["."])),
             send(small_with(max_tokens=gw.max_tokens_limit + 1)), "INVALID_ARGUMENT", "max_tokens"),
    ]
    r.channel.close()
    return rows + [connection_limit_row(mesh, LimitRow), key_limit_row(mesh, LimitRow)]


def internal_rows(mesh, model: dict) -> list[LimitRow]:
    """The bounds the mesh ports keep whatever a (buggy) coordinator sends."""
    from specmesh.config import MAX_DRAFT_TOKENS, MAX_SEQ_ID_CHARS
    from specmesh.reliability.internal_cases import DRELEASE, PREFILL, PROPOSE, RELEASE, VERIFY

    t, d = mesh.channel("target_worker", own_connection=True), mesh.channel("draft_worker", own_connection=True)
    vocab, layers = model["vocab_size"], model["num_layers"]

    def prefill(sid: str, **kw):
        return _call(t, PREFILL, pb.PrefillRequest(seq_id=sid, prompt=[1, 2, 3], max_new_tokens=8, **kw)
                     .SerializeToString(), [])

    def release(sid: str):
        _call(t, RELEASE, pb.ReleaseRequest(seq_id=sid).SerializeToString(), [])

    def verify(sid: str, k: int, **kw):
        at = prefill(sid)
        out = _call(t, VERIFY, pb.VerifyRequest(seq_id=sid, draft_token_ids=[5] * k, **kw).SerializeToString(), [])
        release(sid)
        return out if at[0] == "OK" else at

    def propose(n: int, method: str = "draft_model"):
        req = pb.ProposeRequest(seq_id="limits", context=[7] * n, num_tokens=1, method=method)
        out = _call(d, PROPOSE, req.SerializeToString(), [])
        _call(d, DRELEASE, pb.ReleaseDraftRequest(seq_id="limits").SerializeToString(), [])
        return out

    def layers_req(n: int):
        return pb.FeatureRequest(layers=[0] * n, max_rows=1)

    sparse = pb.SparseProbs(row_lengths=[1], token_ids=(5).to_bytes(4, "little"), probs=b"\x00\x00\x80\x3f")
    rows = [
        _row("draft tokens per Verify", "MAX_DRAFT_TOKENS", MAX_DRAFT_TOKENS, verify("lim-k", MAX_DRAFT_TOKENS),
             verify("lim-k", MAX_DRAFT_TOKENS + 1), "INVALID_ARGUMENT", "draft tokens"),
        _row("sequence id (Prefill, Propose)", "MAX_SEQ_ID_CHARS", MAX_SEQ_ID_CHARS,
             prefill("s" * MAX_SEQ_ID_CHARS), prefill("s" * (MAX_SEQ_ID_CHARS + 1)), "INVALID_ARGUMENT", "seq_id"),
        _row("draft probabilities' vocabulary", "the model's vocab_size", vocab,
             verify("lim-v", 1, draft_sparse_probs=sparse, vocab_size=vocab),
             verify("lim-v", 1, draft_sparse_probs=sparse, vocab_size=2**31 - 1), "INVALID_ARGUMENT", "vocab_size"),
        _row("feature layers per call", "the model's decoder layers", layers,
             prefill("lim-f", return_features=layers_req(layers)), prefill("lim-f2", return_features=layers_req(layers + 1)),
             "INVALID_ARGUMENT", "decoder layers"),
        _row("Propose context (draft_model)", "the draft model's context window", model["context_window"],
             propose(16), propose(model["context_window"] + 1), "INVALID_ARGUMENT", "reads at most"),
    ]
    for sid in ("s" * MAX_SEQ_ID_CHARS, "lim-f"):
        release(sid)
    rows[-1].note = "at: a 16-token context (a full window takes minutes on this CPU)"
    t.close()
    d.close()
    return rows


def to_json(rows: list[LimitRow]) -> dict:
    return {"rows": [asdict(r) for r in rows], "passed": all(r.passed for r in rows)}
