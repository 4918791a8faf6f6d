"""Structured request logs of a real in-process mesh: one JSON access line per request with
request id, trace id, token counts, timing and status; the prompt and completion text never,
unless the debug flag logging.log_text is on."""

from __future__ import annotations

import io
import json
import logging
from contextlib import contextmanager

import pytest

from prod_helpers import start_mesh
from specmesh.logs import JsonFormatter
from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service
SECRET = "zebra-umbrella-4471"


@contextmanager
def captured_logs():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("test"))
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # everything, DEBUG included: the prompt must appear in none of it
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(old)


@pytest.fixture(scope="module")
def meshes(target_model, prompt_encoder):
    quiet = start_mesh(target_model, prompt_encoder)
    loud = start_mesh(target_model, prompt_encoder, {"logging": {"log_text": True}})
    yield quiet, loud
    quiet.stop()
    loud.stop()


def run(mesh, stream: bool):
    r = pb.GenerateRequest(prompt=f"Please remember the code {SECRET} and say ok.", max_tokens=5)
    with captured_logs() as logs:
        if stream:
            chunks = list(mesh.gateway_stub.GenerateStream(r, timeout=120))
            request_id, completion = chunks[-1].request_id, "".join(c.text for c in chunks)
        else:
            resp = mesh.gateway_stub.Generate(r, timeout=120)
            request_id, completion = resp.request_id, resp.text
    return logs.getvalue(), request_id, completion


@pytest.mark.parametrize("stream", [False, True])
def test_one_access_line_per_request_and_no_text(meshes, stream):
    text, request_id, completion = run(meshes[0], stream)
    lines = [json.loads(x) for x in text.splitlines()]  # every line is one JSON object
    assert SECRET not in text
    assert completion.strip() and completion.strip() not in text
    method = "GenerateStream" if stream else "Generate"
    for service in ("Gateway", "Coordinator"):
        mine = [x for x in lines if x.get("rpc") == f"specmesh.v1.{service}/{method}"]
        assert len(mine) == 1, f"{service}: {mine}"
        line = mine[0]
        assert line["request_id"] == request_id and line["status"] == "OK" and line["level"] == "INFO"
        assert len(line["trace_id"]) == 32 and line["duration_ms"] > 0
        assert line["prompt_tokens"] > 0 and line["completion_tokens"] == 5 and line["finish_reason"] == "length"
        assert "rounds" in line and "drafter" in line
    trace_ids = {x["trace_id"] for x in lines if x.get("request_id") == request_id}
    assert len(trace_ids) == 1  # every line of the request, every hop: one trace
    hops = {x["rpc"].split("/")[0] for x in lines if x.get("request_id") == request_id and "rpc" in x}
    assert hops >= {"specmesh.v1.Gateway", "specmesh.v1.Coordinator", "specmesh.v1.TargetWorker"}


def test_debug_flag_puts_text_into_the_gateway_line(meshes):
    text, request_id, completion = run(meshes[1], stream=False)
    (line,) = [json.loads(x) for x in text.splitlines() if '"rpc": "specmesh.v1.Gateway/Generate"' in x]
    assert SECRET in line["prompt"] and line["completion"] == completion
