"""Worker discovery: workers register in Redis with a TTL heartbeat; coordinators watch it.

records.WorkerRecord (what is published), store.Registry (Redis keys), heartbeat.Registration
(worker side), watch.RegistryWatcher (coordinator side), worker.WorkerLifecycle (register +
drain on SIGTERM). Without registry.url nothing here runs: addresses are static.
"""

from specmesh.registry.records import TIERS, WorkerRecord, new_worker_id
from specmesh.registry.store import Registry, RegistryError

__all__ = ["TIERS", "WorkerRecord", "new_worker_id", "Registry", "RegistryError"]
