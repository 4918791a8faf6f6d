"""What a worker publishes about itself: one JSON record per worker, under a TTL key.

    key:   <namespace>:workers:<tier>:<worker_id>      (expires ttl_s after the last heartbeat)
    value: {"worker_id", "tier", "address", "model", "fingerprint", "methods", "capacity", "load", "draining",
            "host", "pid", "started_at", "updated_at"}

capacity / load per tier:
    target:      capacity {max_sequences, max_tokens, max_batch_size}
                 load     {live_sequences, held_tokens, queue}
    draft:       capacity {max_batch_size}        load {inflight, served, queue}
    coordinator: capacity {}                      load {active}
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field

TIERS = ("draft", "target", "coordinator", "gateway")


def new_worker_id(tier: str) -> str:
    return f"{tier}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class WorkerRecord:
    worker_id: str
    tier: str
    address: str
    model: str = ""
    fingerprint: str = ""  # target: engine.manifest.model_fingerprint of its model ("" = unknown)
    methods: tuple[str, ...] = ()
    capacity: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)
    draining: bool = False
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    started_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    def __post_init__(self):
        if self.tier not in TIERS:
            raise ValueError(f"unknown tier {self.tier!r} (known: {', '.join(TIERS)})")
        self.methods = tuple(self.methods)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "WorkerRecord":
        data = json.loads(text)
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)

    # ---------------------------------------------------------------- routing helpers (target)
    def free_sequences(self) -> int | None:
        cap = self.capacity.get("max_sequences")
        return None if cap is None else int(cap) - int(self.load.get("live_sequences", 0))

    def free_tokens(self) -> int | None:
        cap = self.capacity.get("max_tokens")
        return None if cap is None else int(cap) - int(self.load.get("held_tokens", 0))

    def serves(self, method: str) -> bool:
        """Draft workers: whether this worker loaded that drafter (no list published: assume yes)."""
        return not self.methods or method in self.methods
