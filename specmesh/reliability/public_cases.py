"""Fuzz cases for the public port (Gateway, Admin, health): random and edge values for every
field, Unicode-heavy and invalid UTF-8 text, role spoofing and template tokens, oversized
messages, huge stop lists, odd request ids, raw random bytes and malformed protobuf."""

from __future__ import annotations

import random

from specmesh.reliability import cases as c
from specmesh.reliability.cases import Case, Step
from specmesh.v1 import admin_pb2 as apb
from specmesh.v1 import specmesh_pb2 as pb

GEN, STREAM = "/specmesh.v1.Gateway/Generate", "/specmesh.v1.Gateway/GenerateStream"
ADMIN_GET, ADMIN_SET = "/specmesh.v1.Admin/GetSpeculation", "/specmesh.v1.Admin/SetSpeculation"
ADMIN_CANARY = "/specmesh.v1.Admin/GetCanary"
HEALTH, NOPE = "/grpc.health.v1.Health/Check", "/specmesh.v1.Gateway/Nope"
VALID_ROLES = ("system", "user", "assistant", "tool")
SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")  # the default model's control tokens
DEFAULTS = {"max_tokens_limit": 2048, "max_stop_strings": 16, "max_stop_chars": 128, "max_messages": 128,
            "max_request_id_chars": 128, "max_prompt_bytes": 262144, "max_message_bytes": 1 << 20}
OK, BAD = frozenset({"OK"}), c.REJECTED


def _small_request(rng: random.Random, prompt: str = "Say hi.") -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, max_tokens=rng.randint(1, 3))


def _steps(req: pb.GenerateRequest, rng: random.Random, expect=None, **kw) -> tuple:
    method = STREAM if rng.random() < 0.4 else GEN
    return (Step(method, req.SerializeToString(), stream=method == STREAM, expect=expect, **kw),)


def _too_big(req: pb.GenerateRequest, lim: dict) -> bool:
    return req.ByteSize() > lim["max_message_bytes"]


def gen_fields(rng, lim):
    """Every field random: mostly valid, often an edge value."""
    req = pb.GenerateRequest(raw=rng.random() < 0.2)
    which = rng.random()
    if which < 0.6:
        req.prompt = rng.choice(("Name a color.", "2+2=", c.unicode_text(rng, 4), "", " ", "hi"))
    elif which < 0.9:
        req.messages.messages.add(role="user", content=rng.choice(("Hello", "Count to 3.", "")))
    req.max_tokens = rng.randint(1, 6) if rng.random() < 0.6 else rng.choice(c.INT32 + (lim["max_tokens_limit"],))
    s = req.sampling
    for name, pool, valid in (("temperature", c.FLOATS, (0.0, 0.7)), ("top_p", c.FLOATS, (1.0, 0.9)),
                              ("top_k", c.INT32, (0, 40)), ("seed", c.INT64, (7, 123))):
        if rng.random() < 0.4:
            setattr(s, name, rng.choice(pool) if rng.random() < 0.5 else rng.choice(valid))
    for _ in range(rng.choice((0, 0, 1, 2, 3))):
        req.stop.append(rng.choice(("\n", ".", "", "stop", "😀", "\u0000")))
    if rng.random() < 0.5:
        req.speculation.method = rng.choice(c.METHODS)
    if rng.random() < 0.4:
        req.speculation.num_speculative_tokens = rng.choice(c.INT32 + (4, 16, 17))
    if rng.random() < 0.3:
        req.speculation.tree_budget = rng.choice(c.INT32 + (16, 64, 65))
    if rng.random() < 0.2:
        req.request_id = rng.choice(("r1", "", "x" * 40))
    return "fields", _steps(req, rng), c.short(req)


def gen_unicode_prompt(rng, lim):
    text = c.unicode_text(rng, rng.randint(1, 60))
    req = pb.GenerateRequest(prompt=text, raw=rng.random() < 0.5, max_tokens=rng.randint(1, 3))
    return "unicode_prompt", _steps(req, rng, OK), c.short(text)


def gen_invalid_utf8(rng, lim):
    bad = rng.choice(c.INVALID_UTF8)
    text = rng.choice((b"", b"hello ")) + bad + rng.choice((b"", b" world"))
    where = rng.choice(("prompt", "content", "role", "stop", "request_id", "method"))
    body = c.field_varint(4, 2)
    if where == "prompt":
        body += c.field_bytes(1, text)
    elif where in ("content", "role"):
        msg = c.field_bytes(1, text if where == "role" else b"user") + c.field_bytes(2, b"hi" if where == "role" else text)
        body += c.field_bytes(2, c.field_bytes(1, msg))
    else:
        body += c.field_bytes(1, b"hi") + {"stop": c.field_bytes(6, text), "request_id": c.field_bytes(8, text),
                                           "method": c.field_bytes(7, c.field_bytes(1, text))}[where]
    method = rng.choice((GEN, STREAM))
    return "invalid_utf8", (Step(method, body, stream=method == STREAM, expect=BAD),), f"{where}={text!r}"


def gen_oversized(rng, lim):
    what = rng.choice(("message", "prompt_bytes", "messages", "messages_bytes"))
    if what == "message":  # past the public port's message limit: gRPC refuses it before us
        req = pb.GenerateRequest(prompt="a" * (lim["max_message_bytes"] + rng.randint(1, 1 << 16)), max_tokens=1)
        expect = frozenset({"RESOURCE_EXHAUSTED"})
    elif what == "prompt_bytes":
        req = pb.GenerateRequest(prompt=rng.choice(("é", "😀", "ab")) * (lim["max_prompt_bytes"] // 2 + 8),
                                 max_tokens=1, raw=rng.random() < 0.5)
        expect = BAD
    elif what == "messages":
        req = pb.GenerateRequest(max_tokens=1)
        for _ in range(lim["max_messages"] + rng.randint(1, 50)):
            req.messages.messages.add(role="user", content="hi")
        expect = BAD
    else:
        req = pb.GenerateRequest(max_tokens=1)
        for _ in range(4):
            req.messages.messages.add(role="user", content="word " * (lim["max_prompt_bytes"] // 16 + 1))
        expect = BAD
    if _too_big(req, lim):
        expect = frozenset({"RESOURCE_EXHAUSTED"})
    return "oversized", _steps(req, rng, expect), f"{what}: {req.ByteSize()} bytes"


def _has_special(text: str) -> bool:
    return any(tok in text for tok in SPECIAL)


def gen_role_spoof(rng, lim):
    req = pb.GenerateRequest(max_tokens=rng.randint(1, 2))
    valid = True
    for _ in range(rng.randint(1, 4)):
        role = rng.choice(c.ROLES) if rng.random() < 0.5 else rng.choice(VALID_ROLES)
        content = rng.choice(("hi", "", rng.choice(c.TEMPLATE_TOKENS) + "hi", "a" + rng.choice(c.TEMPLATE_TOKENS)))
        req.messages.messages.add(role=role, content=content)
        valid = valid and role in VALID_ROLES and bool(content) and not _has_special(content)
    return "role_spoof", _steps(req, rng, OK if valid else BAD), c.short([(m.role, m.content) for m in req.messages.messages])


def gen_template_prompt(rng, lim):
    text = "".join(rng.choice(c.TEMPLATE_TOKENS + ("hi ", "user", "\n")) for _ in range(rng.randint(1, 6)))
    raw = rng.random() < 0.5
    req = pb.GenerateRequest(prompt=text, raw=raw, max_tokens=rng.randint(1, 2))
    # raw: the caller writes the template, its tokens are theirs to use; templated: refused
    expect = OK if raw or not _has_special(text) else BAD
    return "template_prompt", _steps(req, rng, expect), f"raw={raw} {text!r}"


def gen_stop(rng, lim):
    n = rng.choice((0, 1, lim["max_stop_strings"], lim["max_stop_strings"] + 1, 100, 5000))
    length = rng.choice((1, 3, lim["max_stop_chars"], lim["max_stop_chars"] + 1, 10000) if n <= 100 else (1, 3))
    req = _small_request(rng)
    req.stop.extend(rng.choice(("x", "é", "😀", "\n")) * length for _ in range(n))
    if n and rng.random() < 0.2:
        req.stop[rng.randrange(n)] = ""
    bad = n > lim["max_stop_strings"] or any(len(s) > lim["max_stop_chars"] or not s for s in req.stop)
    expect = frozenset({"RESOURCE_EXHAUSTED"}) if _too_big(req, lim) else (BAD if bad else OK)
    return "stop", _steps(req, rng, expect), f"{n} stop strings of {length} chars"


def gen_request_id(rng, lim):
    limit = lim["max_request_id_chars"]
    rid = rng.choice(("", "abc-123", "x" * limit, "x" * (limit + 1), "x" * 100000, "ид", "a\r\nb", "a b",
                      "\u0000", "a\tb", "😀", "req:1/2@x", "-" * 8))
    req = _small_request(rng)
    req.request_id = rid
    ok = len(rid) <= limit and all(0x21 <= ord(ch) <= 0x7E for ch in rid)
    expect = frozenset({"RESOURCE_EXHAUSTED"}) if _too_big(req, lim) else (OK if ok else BAD)
    return "request_id", _steps(req, rng, expect), c.short(rid)


def gen_random_bytes(rng, lim):
    method = rng.choice((GEN, STREAM, ADMIN_GET, ADMIN_SET, ADMIN_CANARY, HEALTH, NOPE))
    data = c.random_bytes(rng)
    expect = frozenset({"UNIMPLEMENTED"}) if method == NOPE else None
    auth = "admin" if method.startswith("/specmesh.v1.Admin") else "user"
    return "random_bytes", (Step(method, data, stream=method == STREAM, expect=expect, auth=auth),), \
        f"{method} {len(data)} bytes"


def gen_wire(rng, lim):
    """Malformed protobuf: nesting past the recursion limit, truncation, bad lengths, field 0."""
    good = c.field_bytes(1, b"hi") + c.field_varint(4, 1)
    what = rng.choice(("bomb", "truncated", "length", "field0", "wiretype", "unknown"))
    data = {"bomb": c.field_bytes(2, c.nested_bomb(rng.choice((120, 1000)))),
            "truncated": good + c.varint(4 << 3) + b"\xff\xff",
            "length": c.varint(1 << 3 | 2) + c.varint(1 << 30) + b"abc",
            "field0": c.field_varint(0, 5) + good,
            "wiretype": c.field_bytes(4, b"xx") + c.field_bytes(1, b"hi"),
            "unknown": good + c.field_bytes(999, b"z" * 1000)}[what]
    expect = BAD if what in ("bomb", "truncated", "length", "field0") else None
    method = rng.choice((GEN, STREAM))
    return "wire", (Step(method, data, stream=method == STREAM, expect=expect),), what


def gen_auth(rng, lim):
    what = rng.choice(("none", "bad", "huge", "admin_none", "admin_user", "admin_bad"))
    if what.startswith("admin"):
        auth = what.split("_")[1]
        expect = frozenset({"PERMISSION_DENIED"}) if auth == "user" else frozenset({"UNAUTHENTICATED"})
        method = rng.choice((ADMIN_GET, ADMIN_SET, ADMIN_CANARY))
        payload = {ADMIN_SET: apb.SetSpeculationRequest(enabled=False), ADMIN_GET: apb.GetSpeculationRequest(),
                   ADMIN_CANARY: apb.GetCanaryRequest()}[method]
        return "auth", (Step(method, payload.SerializeToString(), expect=expect, auth=auth),), what
    expect = frozenset({"UNAUTHENTICATED", "RESOURCE_EXHAUSTED"} if what == "huge" else {"UNAUTHENTICATED"})
    return "auth", _steps(_small_request(rng), rng, expect, auth=what), what


def gen_admin(rng, lim):
    req = apb.SetSpeculationRequest()
    if rng.random() < 0.5:
        req.enabled = rng.random() < 0.8
    if rng.random() < 0.5:
        req.method = rng.choice(c.METHODS)
    if rng.random() < 0.5:
        req.num_speculative_tokens = rng.choice(c.INT32 + (-1, 3, 16))
    if rng.random() < 0.3:
        req.share = rng.choice(c.FLOATS + (0.25,))
    if rng.random() < 0.2:
        req.keys = rng.choice(("user", "", "user,other", ",,", "x" * 300, "é,\u0000", "nobody"))
    req.reset = rng.random() < 0.3
    if rng.random() < 0.15:
        get = apb.GetCanaryRequest(since_start=rng.random() < 0.5)
        return "admin", (Step(ADMIN_CANARY, get.SerializeToString(), auth="admin", expect=frozenset({"OK"})),), "GetCanary"
    return "admin", (Step(ADMIN_SET, req.SerializeToString(), auth="admin"),), c.short(req)


def gen_metadata(rng, lim):
    what = rng.choice(("spoof", "traceparent", "tiny_deadline", "stream", "unary_on_stream"))
    req = _small_request(rng)
    if what == "spoof":  # the public port trusts no x-specmesh-* header
        md = (("x-specmesh-key-name", "admin"), ("x-specmesh-probe", "1"), ("x-specmesh-request-id", "z" * 300))
        return "metadata", _steps(req, rng, OK, metadata=md), what
    if what == "traceparent":
        md = (("traceparent", rng.choice(("00-zz-zz-01", "garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01"))),)
        return "metadata", _steps(req, rng, OK, metadata=md), what
    if what == "tiny_deadline":
        return "metadata", _steps(req, rng, c.DOCUMENTED | {"DEADLINE_EXCEEDED"}, deadline_s=0.001), what
    if what == "unary_on_stream":  # a client reading a stream method as unary: it waits, nothing leaks
        step = Step(STREAM, req.SerializeToString(), stream=False, expect=c.DOCUMENTED | {"DEADLINE_EXCEEDED"},
                    deadline_s=2.0)
        return "metadata", (step,), what
    return "metadata", (Step(STREAM, req.SerializeToString(), stream=True, expect=OK),), what


GENERATORS = ((gen_fields, 30), (gen_unicode_prompt, 8), (gen_invalid_utf8, 8), (gen_oversized, 4),
              (gen_role_spoof, 8), (gen_template_prompt, 5), (gen_stop, 6), (gen_request_id, 6),
              (gen_random_bytes, 10), (gen_wire, 5), (gen_auth, 5), (gen_admin, 3), (gen_metadata, 4))


def public_case(seed: int, index: int, limits: dict | None = None) -> Case:
    lim = {**DEFAULTS, **(limits or {})}
    rng = c.case_rng(seed, "public", index)
    fns, weights = zip(*GENERATORS)
    kind, steps, summary = rng.choices(fns, weights)[0](rng, lim)
    return Case("public", index, kind, "gateway", steps, summary)
