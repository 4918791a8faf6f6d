"""Process logging: structured JSON, one object per line (or plain text, service name first).

Every JSON line has ts, level, service, logger, msg, and, when known, trace_id / span_id (the
current OpenTelemetry span), request_id and key_name (the current request; the API key itself
never). `extra={"fields": {...}}` adds fields (the per-request access line does). Prompt and
completion text are never logged unless logging.log_text (a debug flag) put them in the fields.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        obj.update(_request_context())
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            obj.update(fields)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


def _request_context() -> dict:
    out: dict = {}
    try:  # telemetry is optional at import time (logging must work even if it is broken)
        from specmesh.telemetry.context import current
        from specmesh.telemetry.tracing import trace_ids
    except Exception:  # noqa: BLE001
        return out
    trace_id, span_id = trace_ids()
    if trace_id:
        out["trace_id"], out["span_id"] = trace_id, span_id
    info = current()
    if info is not None:
        if info.request_id:
            out["request_id"] = info.request_id
        if info.key_name:
            out["key_name"] = info.key_name
    return out


def setup_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level, logging.INFO), handlers=[handler], force=True)
