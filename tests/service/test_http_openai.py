"""The OpenAI-compatible HTTP front at a real mesh: in-process gRPC services with the real model, a
real redis-server for API keys and rate limits, the HTTP front on a free port, called over TCP
with the real `openai` client (sync, async, streaming) and with curl.

Output is compared with the gRPC front's at temperature 0 (and at a fixed seed), usage with the
token counts; errors in OpenAI's shape with their HTTP codes; 429 with Retry-After; a deadline
504; a full gateway 503; a client that disconnects mid-stream frees the target's KV; the access
log and the trace go on across hops as for gRPC. The gateway admits one request at a time
(max_inflight 1, no queue), so a second concurrent request is refused: tests run one by one.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import shutil
import subprocess
import uuid
from types import SimpleNamespace

import openai
import pytest

from prod_helpers import bearer, live_sequences, redis_server, start_http, start_mesh, wait_until  # noqa: F401
from specmesh.auth.store import KeyStore, connect
from specmesh.logs import JsonFormatter
from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service
PREFIX = "httptest"
MODEL = "smollm2-135m-instruct"
MESSAGES = [("system", "You answer in one short sentence."), ("user", "Name a prime number.")]
COUNTING = "1, 2, 3, 4, 5,"  # a raw prompt the model continues for a long time


@pytest.fixture(scope="module")
def h(redis_server, target_model, prompt_encoder):  # noqa: F811
    mesh = start_mesh(target_model, prompt_encoder, {
        "auth": {"required": True, "redis_url": redis_server.url, "key_prefix": PREFIX},
        "backpressure": {"gateway": {"max_inflight": 1, "max_queue": 0}}})
    stream, handler = io.StringIO(), logging.StreamHandler()
    handler.stream = stream
    handler.setFormatter(JsonFormatter("test"))
    access = logging.getLogger("specmesh.access")
    access.addHandler(handler)
    old_level = access.level
    access.setLevel(logging.INFO)
    try:
        front = start_http(mesh)
        store = KeyStore(connect(redis_server.url), PREFIX)
        key, _ = store.create("http-user")
        yield SimpleNamespace(mesh=mesh, url=front.url, store=store, key=key, log=stream, encoder=prompt_encoder)
    finally:
        access.removeHandler(handler)
        access.setLevel(old_level)
        mesh.stop()


@pytest.fixture(autouse=True)
def one_at_a_time(h):
    """The gateway admits one request: wait for the last test's to leave before the next starts."""
    assert wait_until(lambda: h.mesh.gateway.admission.inflight == 0, 30)
    yield


def client(h, key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.url, api_key=key or h.key, max_retries=0, timeout=120)


def grpc_generate(h, *, messages=None, prompt=None, raw=False, max_tokens, stop=(), **sampling):
    req = pb.GenerateRequest(max_tokens=max_tokens, stop=list(stop), raw=raw)
    if messages is not None:
        req.messages.CopyFrom(pb.MessageList(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]))
    else:
        req.prompt = prompt
    for name, value in sampling.items():
        setattr(req.sampling, name, value)
    return h.mesh.gateway_stub.Generate(req, timeout=120, metadata=bearer(h.key))


def curl(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    return subprocess.run(["curl", "-sS", *args], capture_output=True, text=True, timeout=120)


def access_lines(h, request_id: str) -> list[dict]:
    lines = [json.loads(x) for x in h.log.getvalue().splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("request_id") == request_id]


def openai_messages():
    return [{"role": r, "content": c} for r, c in MESSAGES]


_grpc_cache: dict = {}


def grpc_reference(h):
    """The gRPC front's answer to MESSAGES at temperature 0 (computed once)."""
    if "chat" not in _grpc_cache:
        _grpc_cache["chat"] = grpc_generate(h, messages=MESSAGES, max_tokens=12, temperature=0.0)
    return _grpc_cache["chat"]


def test_models(h):
    c = client(h)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert c.models.retrieve(MODEL).owned_by == "specmesh"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


def test_chat_equals_grpc_and_is_logged_and_traced_like_grpc(h):
    want = grpc_reference(h)
    trace_id = uuid.uuid4().hex
    r = client(h).chat.completions.create(model=MODEL, messages=openai_messages(), max_tokens=12, temperature=0,
                                          extra_headers={"traceparent": f"00-{trace_id}-{'1' * 16}-01"})
    prompt_ids = h.encoder.encode(None, MESSAGES)  # the chat template, as the gRPC messages path
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[want.finish_reason]
    assert r.usage.prompt_tokens == want.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == want.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == len(prompt_ids) + len(want.token_ids)
    spec = r.model_extra["speculation"]
    assert spec["method"] == want.spec.method and spec["rounds"] >= 1 and r.object == "chat.completion"
    request_id = r.id.removeprefix("chatcmpl-")
    lines = access_lines(h, request_id)
    mine = [x for x in lines if x.get("event") == "http"]
    assert len(mine) == 1, lines
    line = mine[0]
    assert (line["status"], line["http_status"], line["key_name"]) == ("OK", 200, "http-user")
    assert (line["prompt_tokens"], line["completion_tokens"]) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    assert line["trace_id"] == trace_id  # the caller's traceparent is the parent ...
    hop = [x for x in lines if x.get("rpc") == "specmesh.v1.Coordinator/Generate"]
    assert len(hop) == 1 and hop[0]["trace_id"] == trace_id and hop[0]["key_name"] == "http-user"  # ... across hops
    assert h.key not in h.log.getvalue()


def test_chat_stream_with_usage_equals_grpc(h):
    want = grpc_reference(h)
    chunks = list(client(h).chat.completions.create(model=MODEL, messages=openai_messages(), max_tokens=12,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and finished[0].model_extra["speculation"]["method"] == want.spec.method
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == want.usage.prompt_tokens
    assert last.usage.completion_tokens == len(want.token_ids) and all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_async_completions_raw_prompt_and_stop_equal_grpc(h):
    want = grpc_generate(h, prompt=COUNTING, raw=True, max_tokens=12, stop=[" 9"], temperature=0.0)

    async def run():
        c = openai.AsyncOpenAI(base_url=h.url, api_key=h.key, max_retries=0, timeout=120)
        one = await c.completions.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0, stop=" 9")
        streamed = await c.completions.create(model=MODEL, prompt=COUNTING, max_tokens=12, temperature=0,
                                              stop=[" 9"], stream=True)
        parts = [chunk async for chunk in streamed]
        await c.close()
        return one, parts

    one, parts = asyncio.run(run())
    assert want.finish_reason == "stop" and " 9" not in want.text  # the stop string ended it, cut off
    assert one.choices[0].text == want.text and one.choices[0].finish_reason == "stop"
    assert one.usage.completion_tokens == len(want.token_ids) and one.object == "text_completion"
    assert "".join(p.choices[0].text for p in parts) == want.text
    assert parts[-1].choices[0].finish_reason == "stop"


def test_seed_fixes_the_sample_as_on_grpc(h):
    kwargs = dict(model=MODEL, messages=openai_messages(), max_tokens=8, temperature=0.9, seed=11,
                  extra_body={"speculation": {"method": "off"}})
    first = client(h).chat.completions.create(**kwargs)
    again = client(h).chat.completions.create(**kwargs)
    assert first.model_extra["speculation"]["method"] == "off"
    req = pb.GenerateRequest(max_tokens=8, messages=pb.MessageList(
        messages=[pb.ChatMessage(role=r, content=c) for r, c in MESSAGES]))
    req.sampling.temperature, req.sampling.seed, req.speculation.method = 0.9, 11, "off"
    want = h.mesh.gateway_stub.Generate(req, timeout=120, metadata=bearer(h.key))
    assert first.choices[0].message.content == again.choices[0].message.content == want.text


def test_curl_chat_and_stream(h):
    auth = ["-H", f"Authorization: Bearer {h.key}", "-H", "Content-Type: application/json"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    out = curl(*auth, f"{h.url}/chat/completions", "-d", json.dumps(body))
    r = json.loads(out.stdout)
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 4, "temperature": 0, "stream": True}
    out = curl("-N", *auth, f"{h.url}/completions", "-d", json.dumps(body))
    frames = [x for x in out.stdout.split("\n\n") if x.strip()]
    assert frames[-1] == "data: [DONE]" and all(f.startswith("data: ") for f in frames)
    chunks = [json.loads(f[len("data: "):]) for f in frames[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _status_and_error(out: subprocess.CompletedProcess) -> tuple[int, dict]:
    body, _, status = out.stdout.rpartition("\n")
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return int(status), err


def test_errors_have_openais_shape_and_status(h):
    url = f"{h.url}/chat/completions"
    status, err = _status_and_error(curl("-w", "\n%{http_code}", url, "-d", "{not json"))
    assert status == 401 and err["type"] == "authentication_error"  # the key is checked first
    with pytest.raises(openai.AuthenticationError):
        client(h, key="smk_unknown").chat.completions.create(model=MODEL, messages=openai_messages())
    auth = ["-w", "\n%{http_code}", "-H", f"Authorization: Bearer {h.key}"]
    status, err = _status_and_error(curl(*auth, url, "-d", "{not json"))
    assert status == 400 and err["param"] == "body"
    c = client(h)
    for kwargs, param in (({"n": 2}, "n"), ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"),
                          ({"max_tokens": 100000}, "max_tokens"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
                          ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role")):
        kwargs = {"model": MODEL, "messages": openai_messages(), **kwargs}
        with pytest.raises(openai.BadRequestError) as exc:
            c.chat.completions.create(**kwargs)
        assert exc.value.status_code == 400 and exc.value.body["param"] == param, exc.value.body
    with pytest.raises(openai.NotFoundError) as exc:
        c.chat.completions.create(model="gpt-4o", messages=openai_messages())
    assert exc.value.body["code"] == "model_not_found"
    status, err = _status_and_error(curl(*auth, f"{h.url}/embeddings", "-d", "{}"))
    assert status == 404
    status, err = _status_and_error(curl(*auth, url))  # GET
    assert status == 405


def test_rate_limit_is_429_with_retry_after(h):
    key, _ = h.store.create("http-limited", rpm=1)
    ok = client(h, key).completions.create(model=MODEL, prompt=COUNTING, max_tokens=1, temperature=0)
    assert ok.usage.completion_tokens == 1
    out = curl("-i", "-H", f"Authorization: Bearer {key}", f"{h.url}/completions",
               "-d", json.dumps({"model": MODEL, "prompt": COUNTING, "max_tokens": 1}))
    head, _, body = out.stdout.partition("\n\n")  # text mode: curl's CRLFs read as \n
    headers = dict(line.split(": ", 1) for line in head.splitlines()[1:])
    assert head.startswith("HTTP/1.1 429"), out.stdout
    assert 1 <= int(headers["retry-after"]) <= 60 and 0 < int(headers["retry-after-ms"]) <= 60000
    assert json.loads(body)["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        client(h, key).chat.completions.create(model=MODEL, messages=openai_messages(), max_tokens=1)
    tiny, _ = h.store.create("http-tiny", tpm=5)  # prompt + max_tokens can never fit: do not retry
    with pytest.raises(openai.RateLimitError) as exc:
        client(h, tiny).completions.create(model=MODEL, prompt=COUNTING, max_tokens=1)
    assert exc.value.response.headers["x-should-retry"] == "false"


def test_deadline_is_504(h):
    out = curl("-w", "\n%{http_code}", "-H", f"Authorization: Bearer {h.key}", "-H", "X-Request-Timeout: 0.05",
               f"{h.url}/completions", "-d", json.dumps({"model": MODEL, "prompt": COUNTING, "max_tokens": 64}))
    status, err = _status_and_error(out)
    assert status == 504 and err["type"] == "timeout_error"


def test_a_deadline_mid_stream_is_an_error_event(h):
    stream = client(h).completions.create(model=MODEL, prompt=COUNTING, max_tokens=500, temperature=0, stream=True,
                                          extra_headers={"X-Request-Timeout": "4"})
    got = []
    with pytest.raises(openai.APIError) as exc:  # the SSE error event, raised by the client
        for chunk in stream:
            got.append(chunk)
    assert got and exc.value.body["type"] == "timeout_error" and exc.value.body["code"] == "deadline_exceeded"
    assert wait_until(lambda: live_sequences(h.mesh) == 0, 15)


def test_disconnect_mid_stream_frees_the_kv_and_a_full_gateway_is_503(h):
    stream = client(h).completions.create(model=MODEL, prompt=COUNTING, max_tokens=500, temperature=0, stream=True)
    it = iter(stream)
    first = next(it)
    next(it)
    assert live_sequences(h.mesh) == 1
    busy = curl("-w", "\n%{http_code}", "-H", f"Authorization: Bearer {h.key}", f"{h.url}/completions",
                "-d", json.dumps({"model": MODEL, "prompt": COUNTING, "max_tokens": 1}))
    status, err = _status_and_error(busy)  # one request in flight and no queue: refused at once
    assert status == 503 and err["type"] == "server_error"
    stream.close()  # the client goes away mid-generation
    assert wait_until(lambda: live_sequences(h.mesh) == 0, 15), "the target still holds the sequence"
    request_id = first.id.removeprefix("cmpl-")

    def line(rpc):
        return [x for x in access_lines(h, request_id) if x.get("rpc") == rpc]

    assert wait_until(lambda: line("http/v1/completions") and line("specmesh.v1.Coordinator/GenerateStream"), 10)
    front, hop = line("http/v1/completions")[0], line("specmesh.v1.Coordinator/GenerateStream")[0]
    assert (front["status"], front["http_status"]) == ("CANCELLED", 499)
    assert hop["status"] == "CANCELLED" and hop.get("completion_tokens", 0) < 500  # stopped, not finished


def test_a_client_that_gives_up_on_a_completion_cancels_it(h):
    c = openai.OpenAI(base_url=h.url, api_key=h.key, max_retries=0, timeout=2.0)
    with pytest.raises(openai.APITimeoutError):  # the client closes the connection after 2 s
        c.completions.create(model=MODEL, prompt=COUNTING, max_tokens=499, temperature=0)
    assert wait_until(lambda: live_sequences(h.mesh) == 0, 15), "the target still holds the sequence"

    def gave_up():
        lines = [json.loads(x) for x in h.log.getvalue().splitlines() if x.startswith("{")]
        return [x for x in lines if x.get("event") == "http" and x.get("max_tokens") == 499]

    assert wait_until(gave_up, 10) and gave_up()[0]["status"] == "CANCELLED"


def test_https_with_the_public_certificate_and_client_certificates(h, tmp_path):
    from gateway.http.serve import HttpFront
    from prod_pki import make_pki
    from specmesh.config_ops import PublicTlsConfig, TlsConfig

    pki = make_pki(tmp_path)
    public = PublicTlsConfig(cert_file=str(pki.server_cert), key_file=str(pki.server_key),
                             client_ca_file=str(pki.ca))
    front = HttpFront(h.mesh.cfg.replace(tls=TlsConfig(public=public)), h.mesh.gateway, "127.0.0.1:0").start()
    try:
        assert front.url.startswith("https://")
        auth = ["-H", f"Authorization: Bearer {h.key}", "--cacert", str(pki.ca)]
        ok = curl(*auth, "--cert", str(pki.client_cert), "--key", str(pki.client_key), f"{front.url}/models")
        assert json.loads(ok.stdout)["data"][0]["id"] == MODEL
        assert curl(*auth, f"{front.url}/models").returncode != 0  # no client certificate: no TLS session
        assert curl(*auth, "--cert", str(pki.rogue_cert), "--key", str(pki.rogue_key),
                    f"{front.url}/models").returncode != 0
    finally:
        front.stop(0.5)
