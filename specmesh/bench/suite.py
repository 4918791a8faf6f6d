"""`specmesh bench`: the whole benchmark — stack, schedule, runs, comparisons, report.

Modes: "spec" (one run per drafter in --drafters; a drafter may carry per-request options:
"block:tree=16" drafts a 16-node tree, "block:k=4" or "ngram:k=8" sets k, "block:tree=0" a chain),
and with --compare also "ar" (method "off"
through the same mesh) and the in-process peers "hf_generate" / "hf_prompt_lookup" (batch 1,
so only at concurrency 1).

Run order (machine drift): at each load level the prompts are split into two blocks (even and
odd prompt indices). Block A runs the modes in order M1..Mn, block B in reverse Mn..M1 (ABBA),
so a slow linear drift of the machine over a level's runs weighs on every mode alike. Every
mode still sees every prompt exactly once per level; its wall time is the sum of its blocks'.
With --passes N the mesh modes run that schedule N times per level, one pass after the other
(the peers, slow and in-process, in the first only): the tables pool the passes, and each pass's
own tokens/s gives each spec run's speed-up vs AR per pass (compare.add_speedups), so a ratio
comes with the spread this machine showed within the same run.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from specmesh.bench.datasets import Prompt
from specmesh.bench.metrics import RequestRecord, aggregate
from specmesh.bench.peers import PEER_MODES, peer_modes
from specmesh.bench.runner import Client, RequestOptions
from specmesh.netutil import free_ports


@dataclass(frozen=True)
class Mode:
    mode: str  # spec | ar | hf_generate | hf_prompt_lookup
    drafter: str | None = None

    @property
    def is_peer(self) -> bool:
        return self.mode in PEER_MODES

    @property
    def label(self) -> str:
        return f"{self.mode}/{self.drafter}" if self.drafter else self.mode


def parse_drafter(spec: str) -> tuple[str, int | None, int | None]:
    """'NAME[:k=N][:tree=N]' -> (method, k or None, tree budget or None)."""
    name, *opts = spec.split(":")
    k = tree = None
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in ("k", "tree") or not value.isdigit():
            raise ValueError(f"--drafters {spec!r}: options are k=N and tree=N")
        k, tree = (int(value), tree) if key == "k" else (k, int(value))
    return name, k, tree


@dataclass(frozen=True)
class Level:
    concurrency: int  # closed loop: clients; open loop: the in-flight cap
    request_rate: float | None = None  # open loop: Poisson arrivals per second

    @property
    def key(self) -> float:
        return self.request_rate if self.request_rate is not None else self.concurrency


@dataclass
class Acc:
    """One (mode, level)'s records and wall time, accumulated over its blocks."""

    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    passes: dict[int, list[float]] = field(default_factory=dict)  # pass -> [output tokens, wall seconds]

    def add(self, records: list[RequestRecord], wall_s: float, pass_: int) -> None:
        self.records += records
        self.wall_s += wall_s
        got = self.passes.setdefault(pass_, [0.0, 0.0])
        got[0] += sum(r.output_len for r in records if r.ok)
        got[1] += wall_s

    def pass_rates(self) -> list[float]:
        """Output tokens/s of each pass, in pass order."""
        return [tokens / wall if wall > 0 else 0.0 for _, (tokens, wall) in sorted(self.passes.items())]


def local_config(base_path: str | None, drafters: list[str], threads: int, out_dir: Path) -> Path:
    """The config YAML for a local stack: base config, four free loopback ports, only the
    drafters the run needs, torch threads."""
    from specmesh.config import DEFAULT_CONFIG

    data = yaml.safe_load(Path(base_path or DEFAULT_CONFIG).read_text()) or {}
    gw, co, dw, tw = (f"127.0.0.1:{p}" for p in free_ports(4))
    data.setdefault("gateway", {}).update(listen=gw, coordinator=co)
    data.setdefault("coordinator", {}).update(listen=co, draft_workers=[dw], target_workers=[tw])
    data.setdefault("draft_worker", {}).update(listen=dw, methods=list(drafters))
    data.setdefault("target_worker", {})["listen"] = tw
    if threads:
        data.setdefault("runtime", {})["torch_threads"] = threads
    path = out_dir / "bench-config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextlib.contextmanager
def mesh_target(args, drafters: list[str]):
    """Yields (gateway address, a target worker's address or None): --target as given (its
    workers unknown), else a local stack started for the run."""
    if args.target:
        yield args.target, None
        return
    from specmesh.config import load_config
    from specmesh.launcher import Mesh, Scale

    with tempfile.TemporaryDirectory(prefix="specmesh-bench-") as tmp:
        path = local_config(args.config, drafters, args.threads, Path(tmp))
        cfg = load_config(path)
        log_dir = args.log_dir or str(Path(tmp) / "logs")
        scale = Scale(target_workers=getattr(args, "target_workers", 1), draft_workers=getattr(args, "draft_workers", 1))
        mesh = Mesh(cfg, str(path), log_dir, scale=scale, free_ports=True)  # extra replicas on free ports
        print(f"bench: starting a local mesh (logs in {log_dir})", file=sys.stderr)
        mesh.start(timeout_s=args.start_timeout)
        try:
            yield cfg.gateway.listen, cfg.coordinator.target_workers[0]
        finally:
            mesh.stop()


def plan(args, peer_modes=PEER_MODES[:2]) -> tuple[list[Mode], list[Level]]:
    drafters = [d for d in args.drafters.split(",") if d]
    for d in drafters:
        parse_drafter(d)  # a bad option fails before anything starts
    modes = [Mode("spec", d) for d in drafters]
    if args.compare:
        modes.append(Mode("ar"))
        if not args.no_peers:
            modes += [Mode(m) for m in peer_modes]
    if args.request_rate:
        levels = [Level(args.max_concurrency, float(r)) for r in args.request_rate.split(",") if r]
    else:
        levels = [Level(int(c)) for c in args.concurrency.split(",") if c]
    return modes, levels


def schedule(modes: list[Mode], levels: list[Level], prompts: list[Prompt], passes: int = 1):
    """Yields (level, mode, [(index, prompt)], pass) in ABBA order per level and pass (see the
    module doc). Peers run once, in the first pass, at concurrency 1 (batch 1): with the
    closed-loop level 1 if there is one, else in a level of their own."""
    indexed = list(enumerate(prompts))
    blocks = [b for b in (indexed[0::2], indexed[1::2]) if b]
    mesh_modes = [m for m in modes if not m.is_peer]
    peers = [m for m in modes if m.is_peer]
    has_c1 = any(lv.concurrency == 1 and lv.request_rate is None for lv in levels)
    runs = [(lv, mesh_modes + (peers if lv.concurrency == 1 and lv.request_rate is None else [])) for lv in levels]
    if peers and not has_c1:
        runs.insert(0, (Level(1), peers))
    for level, level_modes in runs:
        for p in range(passes if any(not m.is_peer for m in level_modes) else 1):
            this = level_modes if p == 0 else [m for m in level_modes if not m.is_peer]
            for b, block in enumerate(blocks):
                for mode in (this if b % 2 == 0 else list(reversed(this))):
                    yield level, mode, block, p


def request_options(args, mode: Mode, k: int) -> RequestOptions:
    if mode.mode == "ar":
        method, k, tree = "off", None, None
    else:
        method, own_k, tree = parse_drafter(mode.drafter) if mode.drafter else ("", None, None)
        k = own_k if own_k is not None else (k if getattr(args, "k_given", True) else None)
    return RequestOptions(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                          method=method, k=k, timeout_s=args.timeout, tree_budget=tree)


class Executor:
    """Runs one scheduled (level, mode, block) against the mesh or a peer."""

    def __init__(self, args, client: Client | None, peer, k: int, progress):
        self.args, self.client, self.peer, self.k, self.progress = args, client, peer, k, progress

    def _tick(self) -> None:
        self.progress.update(1)

    def run(self, level: Level, mode: Mode, block: list[tuple[int, Prompt]]) -> tuple[list[RequestRecord], float]:
        self.progress.set_description(f"{mode.label} c={level.concurrency}"
                                      + (f" rate={level.request_rate}" if level.request_rate else ""), refresh=False)
        a = self.args
        if mode.is_peer:
            return self.peer.run(mode.mode, block, a.max_tokens, a.temperature, a.seed, self.k, self._tick)
        opts = request_options(a, mode, self.k)
        if level.request_rate is not None:
            return self.client.run_open(block, level.request_rate, opts, a.seed, level.concurrency, self._tick)
        return self.client.run_closed(block, level.concurrency, opts, self._tick)

    def warmup(self, modes: list[Mode], prompt: Prompt) -> None:
        """One unrecorded short request per mode (lazy initialisation, caches, first-call costs)."""
        for mode in modes:
            for _ in range(self.args.warmup):
                if mode.is_peer:
                    self.peer.run_one(mode.mode, prompt, 0, min(8, self.args.max_tokens), self.args.temperature,
                                      self.args.seed, self.k)
                else:
                    opts = replace(request_options(self.args, mode, self.k), max_tokens=min(8, self.args.max_tokens))
                    self.client.run_closed([(0, prompt)], 1, opts)


def execute(args, modes: list[Mode], levels: list[Level], prompts: list[Prompt], cfg) -> tuple[dict, dict | None]:
    """Runs the whole schedule; returns ({(mode, level): Acc}, the target's cost model or None)."""
    from tqdm import tqdm

    from specmesh.bench.peers import HFPeer

    k = args.k
    steps = list(schedule(modes, levels, prompts, getattr(args, "passes", 1)))
    peer = HFPeer(cfg.model, cfg.draft_worker.ngram.max_n, args.threads, cfg.draft_worker.draft_model) \
        if any(m.is_peer for m in modes) else None
    drafters = sorted({parse_drafter(m.drafter)[0] for m in modes if m.drafter})
    results: dict = {}
    cost = None
    with tqdm(total=sum(len(b) for _, _, b, _ in steps), file=sys.stderr, unit="req", disable=args.no_progress,
              mininterval=1.0) as bar:
        if getattr(args, "peers_apart", False) and peer is not None:  # peers first, then their memory is freed
            _run_steps(Executor(args, None, peer, k, bar), [m for m in modes if m.is_peer],
                       [s for s in steps if s[1].is_peer], results)
            steps, modes, peer = [s for s in steps if not s[1].is_peer], [m for m in modes if not m.is_peer], None
            gc.collect()
        if not steps:
            return results, cost
        with mesh_target(args, drafters) as (target, worker):
            client = Client(target)
            try:
                _run_steps(Executor(args, client, peer, k, bar), modes, steps, results)
                cost = target_cost(worker)
            finally:
                client.close()
    return results, cost


def _run_steps(ex: Executor, modes: list[Mode], steps: list, results: dict) -> None:
    ex.warmup(modes, steps[0][2][0][1])
    for level, mode, block, pass_ in steps:
        records, wall = ex.run(level, mode, block)
        results.setdefault((mode, level), Acc()).add(records, wall, pass_)


def target_cost(address: str | None) -> dict | None:
    """The target worker's verify cost model (its Status RPC), or None when unknown/unreachable."""
    if address is None:
        return None
    from coordinator.clients import GrpcTargetClient
    from specmesh.errors import SpecmeshError
    from specmesh.rpc.convert import cost_from_pb

    client = GrpcTargetClient(address)
    try:
        cost = client.status().verify_cost
    except (SpecmeshError, OSError) as exc:
        print(f"bench: no cost model from {address}: {exc}", file=sys.stderr)
        return None
    finally:
        client.close()
    return cost_from_pb(cost)


def request_row(rec: RequestRecord) -> dict:
    first = rec.chunk_times[0] if rec.chunk_times else None
    return {"prompt_id": rec.prompt_id, "category": rec.category, "output_tokens": rec.output_len,
            "ttft_ms": None if first is None else first * 1e3,
            "e2e_ms": None if rec.latency is None else rec.latency * 1e3,
            "finish_reason": rec.finish_reason, "error": rec.error}


def runs_from_results(results: dict) -> list[dict]:
    runs = []
    for (mode, level), acc in results.items():
        run = {"mode": mode.mode, "drafter": mode.drafter, "concurrency": level.concurrency,
               "request_rate": level.request_rate, "batch_1_only": mode.is_peer}
        run.update(aggregate(acc.records, acc.wall_s))
        run["pass_tokens_per_s"] = acc.pass_rates()
        run["errors_sample"] = [r.error for r in acc.records if r.error][:3]
        run["requests"] = [request_row(r) for r in acc.records]
        run["_records"] = acc.records
        runs.append(run)
    return runs


def warn_underfilled(levels: list[Level], prompts: list[Prompt]) -> None:
    block = (len(prompts) + 1) // 2
    for lv in levels:
        if lv.request_rate is None and lv.concurrency > block:
            print(f"bench: warning: concurrency {lv.concurrency} > {block} prompts per ABBA block; "
                  "the level never has all clients busy (raise --limit)", file=sys.stderr)


def check_plan(modes: list[Mode], levels: list[Level], passes: int = 1) -> str | None:
    """A usage error, or None."""
    from specmesh.config import DRAFTERS

    unknown = [m.drafter for m in modes if m.drafter and parse_drafter(m.drafter)[0] not in DRAFTERS]
    if unknown:
        return f"unknown drafter(s) {', '.join(unknown)} (known: {', '.join(DRAFTERS)})"
    if not levels or any(lv.concurrency < 1 or (lv.request_rate is not None and lv.request_rate <= 0)
                         for lv in levels):
        return "--concurrency levels must be >= 1 and --request-rate values > 0"
    if not modes:
        return "nothing to run: give --drafters and/or --compare"
    if passes < 1:
        return "--passes must be >= 1"
    return None


def mesh_settings(cfg) -> dict:
    """The local config's numerics (what a stack this bench starts runs with)."""
    from specmesh.engine.loader import dtype_name, resolve_device, resolve_dtype

    return {"dtype": dtype_name(resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))), "batch_invariant": cfg.target_worker.batch_invariant,
            "default_method": cfg.speculative.method, "k_policy": cfg.speculative.k_policy,
            "local_ngram": cfg.coordinator.local_ngram, "overlap_drafting": cfg.coordinator.overlap_drafting}


def main(args) -> int:
    from specmesh.bench import report
    from specmesh.bench.compare import summarize_runs
    from specmesh.bench.datasets import load_dataset
    from specmesh.config import load_config

    started = time.monotonic()
    cfg = load_config(args.config)
    args.k_given = args.k is not None  # else the mesh's own k policy decides (the peers use the default k)
    if args.k is None:
        args.k = cfg.speculative.num_speculative_tokens
    if not args.threads:
        args.threads = cfg.runtime.torch_threads
    try:
        asked = [m for m in getattr(args, "peers", "").split(",") if m]
        unknown = [m for m in asked if m not in peer_modes(cfg)]
        if unknown:
            raise ValueError(f"--peers: {unknown} not among {list(peer_modes(cfg))}")
        modes, levels = plan(args, asked or peer_modes(cfg))
    except ValueError as exc:
        print(f"specmesh bench: bad --concurrency / --request-rate / --peers: {exc}", file=sys.stderr)
        return 2
    problem = check_plan(modes, levels, getattr(args, "passes", 1))
    if problem:
        print(f"specmesh bench: {problem}", file=sys.stderr)
        return 2
    prompts = load_dataset(args.dataset, args.dataset_cache, args.limit, args.seed)
    if not prompts:
        print("specmesh bench: the dataset has no prompts", file=sys.stderr)
        return 2
    warn_underfilled(levels, prompts)
    try:
        results, cost = execute(args, modes, levels, prompts, cfg)
        runs = runs_from_results(results)
    except RuntimeError as exc:  # the local stack did not start
        print(f"specmesh bench: {exc}", file=sys.stderr)
        return 1
    result = summarize_runs(runs, args, len(prompts))
    result["target_cost"] = cost
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["mesh_config"] = mesh_settings(cfg)
    if getattr(args, "price", None):
        from specmesh.bench.pricing import add_costs, fleet_of

        add_costs(result, args.price, *fleet_of(args, cfg))
    report.write_all(result, args.out, plots=not args.no_plots)
    print(report.to_markdown(result))
    return 0
