"""External peers run in-process on the same model and machine, batch 1 (concurrency 1) only:

    hf_generate        Hugging Face transformers `generate` (plain autoregressive decoding)
    hf_prompt_lookup   HF assisted generation with prompt lookup (`prompt_lookup_num_tokens`,
                       an n-gram drafter; max_matching_ngram_size = the mesh's ngram max_n)
    hf_assisted        HF assisted generation with the configured draft model in the same process
                       (`assistant_model=`, HF's own draft-length schedule); only when
                       draft_worker.draft_model names a model of its own

Prompts are tokenized exactly as the gateway does (specmesh.tokenization.PromptEncoder), the
model is loaded by specmesh.engine.loader as a worker does (same dtype, SDPA), and EOS ids are
the mesh's. Timing uses a streamer: HF hands it the tokens of each target forward (one for AR,
the accepted drafts + one for assisted decoding), which plays the role of a stream message.
"""

from __future__ import annotations

import time

import torch

from specmesh.bench.datasets import Prompt
from specmesh.bench.metrics import RequestRecord

PEER_MODES = ("hf_generate", "hf_prompt_lookup", "hf_assisted")


def peer_modes(cfg) -> tuple[str, ...]:
    """The peers this config can run: hf_assisted needs a draft model of its own."""
    dm = cfg.draft_worker.draft_model
    return PEER_MODES if (dm.name or dm.path) else PEER_MODES[:2]


class _TimingStreamer:
    """A transformers streamer recording (seconds since start, tokens) per put after the prompt."""

    def __init__(self, start: float):
        self.start = start
        self.seen_prompt = False
        self.times: list[float] = []
        self.counts: list[int] = []
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:  # generate() first puts the prompt itself
            self.seen_prompt = True
            return
        ids = value.reshape(-1).tolist()
        if ids:
            self.times.append(time.perf_counter() - self.start)
            self.counts.append(len(ids))
            self.tokens.extend(int(t) for t in ids)

    def end(self) -> None:
        pass


class HFPeer:
    """The configured model loaded in this process, driven by HF `generate`."""

    def __init__(self, model_cfg, ngram_max_n: int = 4, num_threads: int = 0, draft_cfg=None):
        from specmesh.engine.loader import load_configured_model
        from specmesh.tokenization import PromptEncoder

        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_dir, self.model = load_configured_model(model_cfg.name, model_cfg.path, model_cfg.dtype,
                                                           model_cfg.require_manifest)
        self.encoder = PromptEncoder.from_model_dir(self.model_dir)
        self.eos = sorted(self.encoder.eos_token_ids)
        self.ngram_max_n = ngram_max_n
        self.draft_cfg, self.require_manifest, self._draft = draft_cfg, model_cfg.require_manifest, None

    def draft(self):
        """The assistant model (draft_worker.draft_model), loaded on first use like the draft worker."""
        if self._draft is None:
            from specmesh.engine.loader import load_configured_model

            dm = self.draft_cfg
            self._draft = load_configured_model(dm.name, dm.path, dm.dtype, self.require_manifest)[1]
        return self._draft

    def encode(self, prompt: Prompt) -> list[int]:
        if prompt.messages:
            return self.encoder.encode(None, list(prompt.messages))
        return self.encoder.encode(prompt.prompt, None)

    def _kwargs(self, mode: str, max_tokens: int, temperature: float, k: int) -> dict:
        kw = {"max_new_tokens": max_tokens, "eos_token_id": self.eos, "pad_token_id": self.eos[0] if self.eos else 0}
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if mode == "hf_prompt_lookup":
            kw.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=self.ngram_max_n)
        elif mode == "hf_assisted":
            kw.update(assistant_model=self.draft())
        elif mode != "hf_generate":
            raise ValueError(f"unknown peer mode {mode!r}")
        return kw

    @torch.inference_mode()
    def run_one(self, mode: str, prompt: Prompt, index: int, max_tokens: int, temperature: float,
                seed: int, k: int) -> RequestRecord:
        rec = RequestRecord(prompt_id=prompt.prompt_id, category=prompt.category)
        try:
            ids = torch.tensor([self.encode(prompt)], dtype=torch.long)
            kw = self._kwargs(mode, max_tokens, temperature, k)
            torch.manual_seed(seed + index)
            start = time.perf_counter()
            streamer = _TimingStreamer(start)
            self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=streamer, **kw)
            rec.latency = time.perf_counter() - start
        except Exception as exc:  # a peer failure is counted like a mesh error, not fatal
            rec.error = f"{type(exc).__name__}: {exc}"
            return rec
        rec.chunk_times, rec.chunk_tokens, rec.token_ids = streamer.times, streamer.counts, streamer.tokens
        rec.finish_reason = "eos" if rec.token_ids and rec.token_ids[-1] in self.eos else "length"
        if mode in ("hf_prompt_lookup", "hf_assisted"):
            rec.round_tokens = list(streamer.counts)
        return rec

    def run(self, mode: str, prompts: list[tuple[int, Prompt]], max_tokens: int, temperature: float,
            seed: int, k: int, on_done=lambda: None) -> tuple[list[RequestRecord], float]:
        """Sequentially (batch 1); wall = the sum of the requests' latencies."""
        records = []
        for index, prompt in prompts:
            records.append(self.run_one(mode, prompt, index, max_tokens, temperature, seed, k))
            on_done()
        return records, sum(r.latency or 0.0 for r in records)
