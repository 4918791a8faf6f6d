"""What `specmesh ray up` asks for (plain data, no Ray import: the CLI builds it before connecting)."""

from __future__ import annotations

from dataclasses import dataclass, field

START_ORDER = ("target", "draft", "coordinator", "gateway")


@dataclass
class TierSpec:
    replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict = field(default_factory=dict)  # custom resources per replica, e.g. {"draft_gpu": 1}


@dataclass
class RayMeshSpec:
    redis_url: str
    config_text: str = ""  # the mesh YAML, written next to every service process
    env: dict = field(default_factory=dict)  # extra environment for every service (env.actor_env())
    host: str | None = None  # listen + advertise on this host; None: listen 0.0.0.0, advertise the node IP
    gateway_port: int = 50051
    coordinator_port: int = 50052  # coordinator i listens on coordinator_port + i (stable across restarts)
    start_timeout_s: float = 300.0
    tiers: dict = field(default_factory=lambda: {t: TierSpec() for t in START_ORDER})

    def tier(self, name: str) -> TierSpec:
        t = self.tiers[name]
        return t if isinstance(t, TierSpec) else TierSpec(**t)
