"""Load generators against a gateway: closed-loop clients or open-loop Poisson arrivals.

Every request goes through Gateway.GenerateStream so the client can time each stream message
(TTFT, ITL); the final message's SpecStats are kept on the record. Errors are recorded on the
request, never raised: a run always completes and counts them.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import grpc

from specmesh.bench.datasets import Prompt
from specmesh.bench.metrics import RequestRecord
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class RequestOptions:
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    method: str = ""  # "" = the mesh's default drafter; "off" = AR; else a drafter name
    k: int | None = None  # speculative tokens per round (None = the mesh's default)
    timeout_s: float = 600.0
    tree_budget: int | None = None  # block drafter: draft-tree nodes per round (0 = chain, None = default)


def build_request(prompt: Prompt, index: int, opts: RequestOptions) -> pb.GenerateRequest:
    """The request for prompt #index; its sampling seed is opts.seed + index in every mode."""
    req = pb.GenerateRequest(max_tokens=opts.max_tokens, request_id=f"bench-{prompt.prompt_id}")
    if prompt.messages:
        req.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in prompt.messages)
    else:
        req.prompt = prompt.prompt or ""
    req.sampling.temperature = opts.temperature
    req.sampling.seed = opts.seed + index
    if opts.method:
        req.speculation.method = opts.method
    if opts.k is not None:
        req.speculation.num_speculative_tokens = opts.k
    if opts.tree_budget is not None:
        req.speculation.tree_budget = opts.tree_budget
    return req


def spec_to_dict(spec: pb.SpecStats) -> dict:
    return {
        "method": spec.method,
        "rounds": spec.rounds,
        "drafted_tokens": spec.drafted_tokens,
        "accepted_tokens": spec.accepted_tokens,
        "mean_acceptance_length": spec.mean_acceptance_length,
        "accepted_per_position": list(spec.accepted_per_position),
        "drafted_per_position": list(spec.drafted_per_position),
        "draft_failures": spec.draft_failures,
        "tier_down_rounds": spec.tier_down_rounds,
        "draft_time_s": spec.draft_time_s,
        "verify_time_s": spec.verify_time_s,
        "chosen_k": {int(k): int(v) for k, v in spec.chosen_k.items()},
        "predraft_hits": spec.predraft_hits,
        "predraft_misses": spec.predraft_misses,
        "draft_wait_s": spec.draft_wait_s,
        "draft_waits": spec.draft_waits,
        "trimmed_tokens": spec.trimmed_tokens,
        "graft_rounds": spec.graft_rounds,
        "graft_tokens": spec.graft_tokens,
    }


def stream_one(stub, prompt: Prompt, index: int, opts: RequestOptions) -> RequestRecord:
    """Send one streaming request and time every message that carries tokens."""
    rec = RequestRecord(prompt_id=prompt.prompt_id, category=prompt.category)
    req = build_request(prompt, index, opts)
    start = time.perf_counter()
    try:
        for chunk in stub.GenerateStream(req, timeout=opts.timeout_s):
            now = time.perf_counter() - start
            if chunk.token_ids:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(len(chunk.token_ids))
                rec.token_ids.extend(chunk.token_ids)
            if chunk.finish_reason:
                rec.finish_reason = chunk.finish_reason
                rec.spec = spec_to_dict(chunk.spec) if chunk.spec.method not in ("", "off") else None
        rec.latency = time.perf_counter() - start
        if not rec.finish_reason:
            rec.error, rec.latency = "stream ended without a final message", None
    except grpc.RpcError as err:
        rec.error = f"{err.code().name}: {err.details()}"
    return rec


class Client:
    """A channel to one gateway, shared by all client threads."""

    def __init__(self, target: str):
        self.target = target
        self.channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)])
        self.stub = pb_grpc.GatewayStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def run_closed(self, prompts: list[tuple[int, Prompt]], concurrency: int, opts: RequestOptions,
                   on_done: Callable[[], None] = lambda: None) -> tuple[list[RequestRecord], float]:
        """`concurrency` clients, each sending its next prompt when its last one finished.
        Returns (records in prompt order, wall seconds from the first send to the last finish)."""
        records: list[RequestRecord | None] = [None] * len(prompts)
        work = iter(range(len(prompts)))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    slot = next(work, None)
                if slot is None:
                    return
                index, prompt = prompts[slot]
                records[slot] = stream_one(self.stub, prompt, index, opts)
                on_done()

        start = time.perf_counter()
        threads = [threading.Thread(target=client, daemon=True) for _ in range(max(1, concurrency))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [r for r in records if r is not None], time.perf_counter() - start

    def run_open(self, prompts: list[tuple[int, Prompt]], rate: float, opts: RequestOptions, seed: int,
                 max_concurrency: int, on_done: Callable[[], None] = lambda: None
                 ) -> tuple[list[RequestRecord], float]:
        """Poisson arrivals at `rate` requests/s (exponential gaps from a seeded RNG); at most
        max_concurrency in flight (later arrivals wait for a free slot)."""
        rng = random.Random(seed)
        arrivals, t = [], 0.0
        for _ in prompts:
            t += rng.expovariate(rate)
            arrivals.append(t)

        def one(slot: int) -> RequestRecord:
            index, prompt = prompts[slot]
            rec = stream_one(self.stub, prompt, index, opts)
            on_done()
            return rec

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, max_concurrency)) as pool:
            futures = []
            for slot, due in enumerate(arrivals):
                delay = start + due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(one, slot))
            records = [f.result() for f in futures]
        return records, time.perf_counter() - start
