"""The OpenAI-compatible front's pure parts: OpenAI JSON -> GenerateRequest (defaults, refusals with
OpenAI's parameter names), responses / stream chunks / SSE frames, errors -> HTTP status + shape."""

from __future__ import annotations

import json

import pytest

from gateway.http.encode import DONE, Encoder
from gateway.http.errors import http_error
from gateway.http.schema import ModelNotFound, decode_chat, decode_completion, openai_param
from specmesh import errors
from specmesh.config import load_config
from specmesh.v1 import specmesh_pb2 as pb

MODEL = "smollm2-135m-instruct"


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return decode_chat(body, MODEL, 256)


def test_chat_defaults_are_openais():
    p = chat(model=MODEL)
    r = p.request
    assert r.WhichOneof("input") == "messages" and [(m.role, m.content) for m in r.messages.messages] == [("user", "hi")]
    assert r.max_tokens == 256 and r.sampling.temperature == 1.0 and not r.sampling.HasField("top_p")
    assert not r.sampling.HasField("seed") and list(r.stop) == [] and not r.raw
    assert (p.chat, p.stream, p.include_usage) == (True, False, False)


def test_chat_fields_map_to_the_request():
    p = chat(temperature=0, top_p=0.5, seed=7, stop="\n", max_completion_tokens=9, max_tokens=3, stream=True,
             stream_options={"include_usage": True}, top_k=5,
             speculation={"method": "off", "num_speculative_tokens": 0},
             messages=[{"role": "developer", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    r = p.request
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.seed, r.sampling.top_k) == (0.0, 0.5, 7, 5)
    assert list(r.stop) == ["\n"] and r.max_tokens == 9 and p.max_tokens_param == "max_completion_tokens"
    assert [(m.role, m.content) for m in r.messages.messages] == [("system", "be brief"), ("user", "ab")]
    assert r.speculation.method == "off" and r.speculation.HasField("num_speculative_tokens")
    assert p.stream and p.include_usage


def test_completion_is_raw_text():
    p = decode_completion({"prompt": ["1, 2, 3,"], "max_tokens": 5, "stop": ["7", "8"]}, MODEL, 256)
    assert p.request.prompt == "1, 2, 3," and p.request.raw and list(p.request.stop) == ["7", "8"]
    assert not p.chat


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": True}, "top_p"),
    ({"stop": [1]}, "stop"),
    ({"seed": 1.5}, "seed"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"speculation": {"num_speculative_tokens": "4"}}, "speculation.num_speculative_tokens"),
])
def test_chat_refusals_name_the_parameter(body, param):
    with pytest.raises(errors.InvalidArgument) as exc:
        chat(**body)
    assert exc.value.field == param


def test_unused_values_of_unsupported_fields_pass():
    chat(n=1, logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, tools=None,
         response_format={"type": "text"}, user="alice")


def test_completion_refuses_several_prompts_and_token_ids():
    for prompt in (["a", "b"], [1, 2, 3], "", None):
        with pytest.raises(errors.InvalidArgument, match="^prompt:"):
            decode_completion({"prompt": prompt}, MODEL, 16)


def test_an_other_model_is_not_found_and_the_body_must_be_an_object():
    with pytest.raises(ModelNotFound, match="gpt-4o"):
        chat(model="gpt-4o")
    with pytest.raises(errors.InvalidArgument, match="^body:"):
        decode_chat([1, 2], MODEL, 16)


@pytest.mark.parametrize("exc, status, kind", [
    (errors.InvalidArgument("sampling.top_p", "must be in (0, 1]"), 400, "invalid_request_error"),
    (errors.Unauthenticated("missing API key"), 401, "authentication_error"),
    (errors.PermissionDenied("not an admin key"), 403, "permission_error"),
    (ModelNotFound("no such model"), 404, "invalid_request_error"),
    (errors.ResourceExhausted("slow down", retry_after_s=2.2), 429, "rate_limit_error"),
    (errors.Unavailable("overloaded"), 503, "server_error"),
    (errors.DeadlineExceeded("deadline exceeded"), 504, "timeout_error"),
    (TimeoutError(), 504, "timeout_error"),
    (RuntimeError("boom"), 500, "server_error"),
])
def test_errors_map_to_http_status_and_openai_shape(exc, status, kind):
    err = http_error(exc, lambda f: openai_param(f, None))
    assert err.status == status and set(err.body["error"]) == {"message", "type", "param", "code"}
    assert err.body["error"]["type"] == kind and err.body["error"]["message"]
    if status == 400:
        assert err.body["error"]["param"] == "top_p" and err.message == "top_p: must be in (0, 1]"
    if status == 429:
        assert err.headers == {"retry-after": "3", "retry-after-ms": "2200"}
    if status == 404:
        assert err.body["error"]["code"] == "model_not_found"


def test_a_request_that_can_never_fit_says_do_not_retry():
    err = http_error(errors.ResourceExhausted("needs more tokens than the key may use per minute"))
    assert err.status == 429 and err.headers == {"x-should-retry": "false"}


def _frames(raw: list[bytes]) -> list:
    out = []
    for frame in raw:
        assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
        out.append(json.loads(frame[6:]))
    return out


def test_stream_chunks_end_with_finish_then_usage():
    enc = Encoder(True, MODEL, "abc", include_usage=True)
    mid = pb.GenerateChunk(text="Hel", token_ids=[1])
    last = pb.GenerateChunk(text="lo", token_ids=[2], finish_reason="eos",
                            usage=pb.Usage(prompt_tokens=5, completion_tokens=2), spec=pb.SpecStats(method="ngram"))
    assert enc.role()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    frames = _frames(enc.frames(mid) + enc.frames(last))
    assert [f["choices"][0]["delta"].get("content") for f in frames[:2]] == ["Hel", "lo"]
    assert frames[2]["choices"][0]["finish_reason"] == "stop" and frames[2]["speculation"]["method"] == "ngram"
    assert all(f["usage"] is None for f in frames[:3]) and all(f["id"] == "chatcmpl-abc" for f in frames)
    assert frames[3]["choices"] == [] and frames[3]["usage"] == {"prompt_tokens": 5, "completion_tokens": 2,
                                                                 "total_tokens": 7}
    assert DONE == b"data: [DONE]\n\n"


def test_completion_response_shape():
    resp = pb.GenerateResponse(text="4, 5", finish_reason="length", usage=pb.Usage(prompt_tokens=3, completion_tokens=4),
                               spec=pb.SpecStats(method="ngram", rounds=2, drafted_tokens=6, accepted_tokens=2))
    out = Encoder(False, MODEL, "r1").response(resp)
    assert out["object"] == "text_completion" and out["id"] == "cmpl-r1" and out["model"] == MODEL
    assert out["choices"] == [{"index": 0, "text": "4, 5", "logprobs": None, "finish_reason": "length"}]
    assert out["usage"]["total_tokens"] == 7 and out["speculation"]["accepted_tokens"] == 2


def test_http_config_keys():
    cfg = load_config(environ={"SPECMESH_HTTP__LISTEN": "127.0.0.1:8000", "SPECMESH_HTTP__DEFAULT_MAX_TOKENS": "64"})
    assert cfg.http.listen == "127.0.0.1:8000" and cfg.http.default_max_tokens == 64
    assert load_config(environ={}).http.listen is None  # off by default
    with pytest.raises(Exception, match="^http.listen:"):
        load_config(environ={"SPECMESH_HTTP__LISTEN": "8000"})
