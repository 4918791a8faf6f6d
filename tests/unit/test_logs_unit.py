"""specmesh.logs: one JSON object per line, request context and trace ids included."""

from __future__ import annotations

import io
import json
import logging

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from specmesh.logs import JsonFormatter, setup_logging
from specmesh.telemetry import context as reqctx


def capture(service="svc"):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(service))
    logger = logging.getLogger(f"test.logs.{service}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, stream


def lines(stream):
    return [json.loads(x) for x in stream.getvalue().splitlines()]


def test_one_json_object_per_line_with_fields():
    logger, stream = capture()
    logger.info("hello %s", "world", extra={"fields": {"event": "rpc", "completion_tokens": 5}})
    logger.warning("multi\nline")
    first, second = lines(stream)
    assert first["msg"] == "hello world" and first["service"] == "svc" and first["level"] == "INFO"
    assert first["event"] == "rpc" and first["completion_tokens"] == 5
    assert second["msg"] == "multi\nline" and "trace_id" not in second


def test_request_context_and_trace_ids_are_added():
    logger, stream = capture()
    span = TracerProvider().get_tracer("t").start_span("s")
    with reqctx.active(reqctx.RequestInfo("gateway", "Generate", request_id="r1", key_name="alice")):
        with trace.use_span(span, end_on_exit=True):
            logger.info("in a request")
    (rec,) = lines(stream)
    assert rec["request_id"] == "r1" and rec["key_name"] == "alice"
    assert rec["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert len(rec["span_id"]) == 16


def test_exceptions_stay_on_one_line():
    logger, stream = capture()
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    (rec,) = lines(stream)
    assert "ValueError: boom" in rec["exc"]


def test_setup_logging_json_and_text(capsys):
    try:
        setup_logging("gw", "INFO")
        logging.getLogger("x").info("json line")
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert json.loads(err)["msg"] == "json line"
        setup_logging("gw", "INFO", fmt="text")
        logging.getLogger("x").info("text line")
        assert "gw INFO x: text line" in capsys.readouterr().err
    finally:
        logging.getLogger().handlers[:] = []
