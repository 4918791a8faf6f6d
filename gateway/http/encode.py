"""GenerateResponse / GenerateChunk -> OpenAI JSON: completions, stream chunks, SSE frames. Pure.

Shapes: chat.completion / chat.completion.chunk and text_completion, one choice (index 0),
`usage` {prompt_tokens, completion_tokens, total_tokens}; the speculation stats ride in the
extension field `speculation` (the response, or the stream's finish chunk). finish_reason:
the mesh's eos and stop are OpenAI's "stop", length is "length".
"""

from __future__ import annotations

import json
import time

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage_json(usage) -> dict:
    p, c = int(usage.prompt_tokens), int(usage.completion_tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def spec_json(spec) -> dict:
    """The `speculation` extension: what the drafter did for this request."""
    return {
        "method": spec.method,
        "rounds": spec.rounds,
        "drafted_tokens": spec.drafted_tokens,
        "accepted_tokens": spec.accepted_tokens,
        "mean_acceptance_length": round(spec.mean_acceptance_length, 4),
        "accepted_per_position": list(spec.accepted_per_position),
        "draft_failures": spec.draft_failures,
        "tier_down_rounds": spec.tier_down_rounds,
    }


def response_id(chat: bool, request_id: str) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + request_id


class Encoder:
    """One request's response objects (id, created and model fixed for all its chunks)."""

    def __init__(self, chat: bool, model: str, request_id: str, include_usage: bool = False):
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = response_id(chat, request_id)
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, resp) -> dict:
        """A non-streamed completion from a GenerateResponse."""
        finish = FINISH.get(resp.finish_reason, resp.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": resp.text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": resp.text, "logprobs": None, "finish_reason": finish}
        out = self._head("chat.completion" if self.chat else "text_completion")
        out.update(choices=[choice], usage=usage_json(resp.usage), speculation=spec_json(resp.spec))
        return out

    def _chunk(self, delta: dict | None, text: str | None, finish: str | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the last
        return out

    def role(self) -> dict | None:
        """Chat streams open with the assistant role (an empty content delta)."""
        return self._chunk({"role": "assistant", "content": ""}, None, None) if self.chat else None

    def frames(self, chunk) -> list[bytes]:
        """SSE frames for one GenerateChunk: its text delta, then (last chunk) the finish chunk with
        the speculation stats, then (stream_options.include_usage) the usage chunk."""
        out = []
        if chunk.text:
            out.append(sse(self._chunk({"content": chunk.text}, chunk.text, None)))
        if chunk.finish_reason:
            final = self._chunk({}, "", FINISH.get(chunk.finish_reason, chunk.finish_reason))
            final["speculation"] = spec_json(chunk.spec)
            out.append(sse(final))
            if self.include_usage:
                tail = self._head("chat.completion.chunk" if self.chat else "text_completion")
                tail.update(choices=[], usage=usage_json(chunk.usage))
                out.append(sse(tail))
        return out


def models_json(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_json(model, created)]}


def model_json(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "specmesh"}
