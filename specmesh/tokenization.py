"""Prompt encoding (chat template) and output assembly (incremental text, EOS, stop strings)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from specmesh.errors import InvalidArgument

ROLES = ("system", "user", "assistant", "tool")


class PromptEncoder:
    """Turns a prompt / message list into token ids exactly as HF `apply_chat_template` does."""

    def __init__(self, tokenizer, context_window: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.context_window = context_window
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_model_dir(cls, model_dir) -> "PromptEncoder":
        from transformers import AutoConfig, GenerationConfig

        from specmesh.engine.loader import load_tokenizer

        tok = load_tokenizer(model_dir)
        cfg = AutoConfig.from_pretrained(model_dir).get_text_config()
        window = getattr(cfg, "max_position_embeddings", None) or tok.model_max_length
        try:
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        except OSError:
            eos = None
        eos = eos if eos is not None else tok.eos_token_id
        eos_ids = set(eos) if isinstance(eos, (list, tuple)) else ({eos} if eos is not None else set())
        return cls(tok, int(window), eos_ids)

    @cached_property
    def _control(self) -> re.Pattern | None:
        """The tokenizer's special tokens that plain text turns into (<|im_start|>, <|im_end|>, ...)."""
        decoder = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
        names = {t.content for t in decoder.values() if getattr(t, "special", False)}
        names |= set(getattr(self.tokenizer, "all_special_tokens", ()) or ())
        names = sorted((n for n in names if n), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, names))) if names else None

    def _check_text(self, field: str, text: str) -> None:
        """Templated text must not carry the template's own control tokens: a message could
        otherwise close its turn and open a forged one (a `system` turn from a user)."""
        found = self._control.search(text) if self._control is not None else None
        if found:
            raise InvalidArgument(field, f"must not contain the chat template's control token {found.group()!r} "
                                         "(send raw=true with prompt to write the template yourself)")

    def encode(self, prompt: str | None, messages: list[tuple[str, str]] | None, raw: bool = False) -> list[int]:
        if messages:
            for i, (role, content) in enumerate(messages):
                if role not in ROLES:
                    raise InvalidArgument(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
                if not content:
                    raise InvalidArgument(f"messages[{i}].content", "must not be empty")
                self._check_text(f"messages[{i}].content", content)
            return self._template([{"role": r, "content": c} for r, c in messages])
        if not prompt:
            raise InvalidArgument("prompt", "must not be empty (send prompt or messages)")
        if raw or not self.tokenizer.chat_template:
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        self._check_text("prompt", prompt)
        return self._template([{"role": "user", "content": prompt}])

    def _template(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)


def model_encoder(model_cfg) -> PromptEncoder:
    """The encoder for the configured model (tokenizer files only, integrity-checked)."""
    from specmesh.engine.loader import check_model_dir, resolve_model_dir

    model_dir = resolve_model_dir(model_cfg.name, model_cfg.path)
    check_model_dir(model_dir, require_manifest=model_cfg.require_manifest and model_cfg.path is None)
    return PromptEncoder.from_model_dir(model_dir)


@dataclass
class OutputAssembler:
    """Accumulates emitted tokens; decides finish (eos / length / stop) and the text to stream.

    Text is decoded from all tokens each time (skip special tokens) and diffed, so multi-token
    characters never split. While unfinished, text that could still grow into a stop string, or
    ends in an incomplete character, is held back. On a stop string the text is cut before it
    and token_ids keep the tokens up to the one that completed it.
    """

    tokenizer: object
    max_tokens: int
    eos_token_ids: set[int]
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    text_sent: int = 0  # characters of text already streamed
    finish_reason: str | None = None
    text: str = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> tuple[list[int], str]:
        """Append one round's tokens; returns (new token ids kept, new text to stream)."""
        start = len(self.token_ids)
        for t in tokens:
            if self.finish_reason:
                break
            self.token_ids.append(t)
            if t in self.eos_token_ids:
                self.finish_reason = "eos"
            elif len(self.token_ids) >= self.max_tokens:
                self.finish_reason = "length"
        self.text = self._decode(self.token_ids)
        if self.stop:
            self._apply_stop(start)
        return self.token_ids[start:], self._release_text()

    def _apply_stop(self, start: int) -> None:
        hits = [self.text.find(s) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if not hits:
            return
        cut = min(hits)
        # keep tokens up to the first one whose text completes a stop string
        for n in range(start + 1, len(self.token_ids) + 1):
            partial = self._decode(self.token_ids[:n])
            if any(s in partial for s in self.stop):
                del self.token_ids[n:]
                break
        self.text = self.text[:cut]
        self.finish_reason = "stop"

    def _release_text(self) -> str:
        end = len(self.text)
        if not self.finish_reason:
            if self.text.endswith("\ufffd"):
                end -= 1
            hold = max((len(s) - 1 for s in self.stop), default=0)
            end = max(self.text_sent, end - hold)
        delta = self.text[self.text_sent:end]
        self.text_sent = max(self.text_sent, end)
        return delta
