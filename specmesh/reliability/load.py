"""Steady load for the faults part: N clients, each with its own API key and its own connection to
every gateway, stream greedy (T=0) requests in a loop and record every call.

The client's retry (what a backend service calling the mesh does): a call that fails UNAVAILABLE
(a gateway or coordinator gone, a refusal) is sent again from scratch to the next gateway, up to
`attempts` times within the request's deadline; a partial stream of a failed attempt is dropped.
A call is `hung` when it waited out its whole deadline (DEADLINE_EXCEEDED) or never returned."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc

from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

PROMPTS = ("Count from 1 to 30, separated by commas.", "Write a haiku about the sea.",
           "Explain what a hash map is in two sentences.", "List five fruits and their colours.",
           "Write a Python function that reverses a string.", "Tell a very short story about a robot.",
           "Name the planets of the solar system.", "Give three tips for writing clear code.")
METHODS = ("ngram", "draft_model", "block")  # block: an 8-node tree from candidate tables (coordinator/tails.py)
BLOCK_TREE = 8
RETRYABLE = ("UNAVAILABLE",)


@dataclass
class Call:
    client: int
    prompt: int
    method: str
    start: float
    end: float = 0.0
    status: str = ""  # OK or the final status code's name
    attempts: int = 0
    errors: list = field(default_factory=list)  # status names of the failed attempts
    tokens: list | None = None

    @property
    def hung(self) -> bool:
        return self.status in ("DEADLINE_EXCEEDED", "NEVER_RETURNED")


def request(prompt: int, method: str, max_tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=PROMPTS[prompt], max_tokens=max_tokens)
    req.sampling.temperature = 0.0
    req.speculation.method = method
    if method == "block":
        req.speculation.tree_budget = BLOCK_TREE
    return req


def stream_once(stub, req, metadata, timeout: float) -> list[int]:
    tokens: list[int] = []
    last = None
    for chunk in stub.GenerateStream(req, timeout=timeout, metadata=metadata):
        tokens += chunk.token_ids
        last = chunk
    if last is None or not last.finish_reason:
        raise RuntimeError("stream ended without a finish_reason")
    return tokens


class Load:
    def __init__(self, mesh, gateways: list[str], clients: int = 16, max_tokens: int = 24,
                 deadline_s: float = 60.0, attempts: int = 4):
        self.mesh, self.gateways, self.clients = mesh, gateways, clients
        self.max_tokens, self.deadline_s, self.attempts = max_tokens, deadline_s, attempts
        self.keys = [mesh.add_key(f"faults-{i}") for i in range(clients)]
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []

    def reference(self) -> dict[int, list[int]]:
        """Each prompt once, alone, speculation off: what the target alone says (fault-free)."""
        with self.mesh.channel_to(self.gateways[0]) as ch:
            stub = pb_grpc.GatewayStub(ch)
            return {i: stream_once(stub, request(i, "off", self.max_tokens), self.mesh.metadata("user"),
                                   self.deadline_s) for i in range(len(PROMPTS))}

    def start(self) -> "Load":
        """Start the clients (again, after stop(): the calls recorded so far are kept)."""
        self.stop_event.clear()
        self.threads = []
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i,), name=f"load-{i}", daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def stop(self) -> int:
        """Stop after the calls in flight; the number of client threads that never came back."""
        self.stop_event.set()
        deadline = time.monotonic() + self.deadline_s + 30
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self.threads)

    def _client(self, i: int) -> None:
        channels = [self.mesh.channel_to(g, own_connection=True) for g in self.gateways]
        stubs = [pb_grpc.GatewayStub(ch) for ch in channels]
        n = 0
        try:
            while not self.stop_event.is_set():
                call = Call(i, (i + n) % len(PROMPTS), METHODS[(i + n) % len(METHODS)], time.monotonic())
                with self.lock:
                    self.calls.append(call)
                self._run(call, stubs, first=(i + n) % len(stubs))
                n += 1
        finally:
            for ch in channels:
                ch.close()

    def _run(self, call: Call, stubs, first: int) -> None:
        req = request(call.prompt, call.method, self.max_tokens)
        give_up = call.start + self.deadline_s
        for attempt in range(self.attempts):
            call.attempts = attempt + 1
            stub = stubs[(first + attempt) % len(stubs)]
            try:
                call.tokens = stream_once(stub, req, self.mesh.metadata(self.keys[call.client]),
                                          max(0.1, give_up - time.monotonic()))
                call.status = "OK"
                break
            except grpc.RpcError as err:
                call.status = err.code().name
                call.errors.append(call.status)
                if call.status not in RETRYABLE or time.monotonic() >= give_up - 1:
                    break
                time.sleep(0.2)
            except RuntimeError:
                call.status = "NO_FINISH"
                break
        call.end = time.monotonic()

    def snapshot(self) -> list[Call]:
        with self.lock:
            return list(self.calls)
