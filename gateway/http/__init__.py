"""The OpenAI-compatible HTTP front of the gateway (docs/http.md), on its own port (`http.listen`).

schema: OpenAI JSON -> GenerateRequest; encode: responses, stream chunks, SSE; errors: typed
errors -> HTTP status + OpenAI's error shape; bridge: blocking core calls on worker threads;
telemetry: span, metrics, access log per request; app: the Starlette routes; serve: uvicorn.
"""
