"""Deployment configuration: one YAML file, one frozen dataclass per section, env overrides.

Load order: dataclass defaults <- YAML file <- environment. An environment variable
SPECMESH_<SECTION>__<FIELD>[__<FIELD>...] overrides one field, its value parsed as YAML
(e.g. SPECMESH_TARGET_WORKER__CACHE__IDLE_TIMEOUT_S=30, SPECMESH_SPECULATIVE__METHOD=off,
SPECMESH_COORDINATOR__DRAFT_WORKERS="[127.0.0.1:6000, 127.0.0.1:6001]").
Everything is validated at load; a bad value raises ConfigError naming its key path.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specmesh.config_load import ConfigError, _build, _check, _merge, _set_path, parse_yaml
from specmesh.config_ops import (  # noqa: E402  (sections of the production gateway / observability)
    AdmissionConfig,
    AuthConfig,
    BackpressureConfig,
    CanaryConfig,
    HealthConfig,
    HttpConfig,
    LoggingConfig,
    MeshTlsConfig,
    MetricsConfig,
    PublicTlsConfig,
    RateLimitConfig,
    ShutdownConfig,
    TlsConfig,
    auth_env_override,
)

ENV_PREFIX = "SPECMESH_"
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"
DRAFTERS = ("ngram", "draft_model", "block")
METHODS = ("off",) + DRAFTERS
FEATURE_DRAFTERS = ("block",)  # drafters that read the target's hidden-state features
AUTOREGRESSIVE_DRAFTERS = ("draft_model",)  # one draft forward per drafted token: the wait grows with k
VERIFY_MODES = ("chain", "tree")
# auto: bfloat16 on a GPU or a CPU with native bf16 (avx512_bf16 / amx_bf16), else float32
DTYPES = ("auto", "bfloat16", "float16", "float32")
MAX_TREE_BUDGET = 64  # draft-tree nodes per round, at most
MAX_DRAFT_TOKENS = 64  # draft tokens (chain or tree nodes) one Verify may carry: >= max_speculative_tokens, tree_budget
MAX_SEQ_ID_CHARS = 256  # internal sequence ids (Prefill, Propose): the coordinator's are ~45


def _check_address(value: str, key: str) -> None:
    host, sep, port = value.rpartition(":")
    _check(bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65536, key,
           f"{value!r} is not host:port")


def literal_host(address: str) -> bool:
    """Whether host:port names its host as an IPv4 literal or localhost: several such coordinators
    can share one gRPC channel (round-robin over a static list), other names cannot."""
    return re.fullmatch(r"(\d+\.){3}\d+|localhost", address.rpartition(":")[0]) is not None


def _check_coordinators(value: str, key: str) -> None:
    """host:port, a dns:/// target, or several ip:port separated by commas (see coordinator_target)."""
    if value.startswith("dns:///"):
        _check_address(value[len("dns:///"):], key)
        return
    addresses = value.split(",")
    for address in addresses:
        _check_address(address.strip(), key)
    if len(addresses) > 1:
        _check(all(literal_host(a.strip()) for a in addresses), key,
               "several coordinators must be IPv4 ip:port (or one dns:///name:port that resolves to them)")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # a model pinned in specmesh/manifests (fetched by fetch-model)
    path: str | None = None  # or any local HF causal-LM directory (overrides name)
    dtype: str = "auto"
    require_manifest: bool = True  # refuse to start without a verified MANIFEST.sha256 (named models)
    device: str = "auto"  # auto (cuda when torch sees a GPU, else cpu) | cpu | cuda | cuda:N

    def validate(self, key: str) -> None:
        _check(self.dtype in DTYPES, f"{key}.dtype", "|".join(DTYPES))
        _check(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, f"{key}.device",
               "auto | cpu | cuda | cuda:N")
        _check(bool(self.name) or bool(self.path), key, "needs a name or a path")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"  # default drafter for requests that do not choose: off | ngram | draft_model
    num_speculative_tokens: int = 4  # k drafted tokens per round
    max_speculative_tokens: int = 16  # upper bound a request may ask for
    verify_mode: str = "chain"  # chain: one drafted sequence per round | tree: a draft tree (block drafter)
    tree_budget: int = 16  # draft-tree nodes per round with verify_mode tree
    feature_layers: tuple[int, ...] = (1, 14, 27)  # block drafter: target decoder layers it reads
    feature_window: int = 64  # block drafter: newest committed positions it reads
    # goodput: k per round in 0..goodput_k_max maximising expected tokens / verify time (the target's
    # cost model, core/goodput.py); fixed: num_speculative_tokens every round. A request that sets
    # its own num_speculative_tokens is always fixed; a tree's node budget is chosen the same way.
    k_policy: str = "goodput"
    goodput_k_max: int = 8  # capped at max_speculative_tokens
    # goodput only: a round that would draft runs with k = 0 where the drafter's measured wall time
    # per emitted token exceeds the target alone's (core/pace.py)
    pace_gate: bool = True

    def validate(self, key: str) -> None:
        _check(self.method in METHODS, f"{key}.method", f"one of {', '.join(METHODS)}")
        _check(0 <= self.num_speculative_tokens <= self.max_speculative_tokens,
               f"{key}.num_speculative_tokens", "must be in [0, max_speculative_tokens]")
        _check(1 <= self.max_speculative_tokens <= 64, f"{key}.max_speculative_tokens", "must be in [1, 64]")
        _check(self.verify_mode in VERIFY_MODES, f"{key}.verify_mode", f"one of {', '.join(VERIFY_MODES)}")
        _check(1 <= self.tree_budget <= MAX_TREE_BUDGET, f"{key}.tree_budget", f"must be in [1, {MAX_TREE_BUDGET}]")
        _check(bool(self.feature_layers) and all(x >= 0 for x in self.feature_layers), f"{key}.feature_layers",
               "needs at least one decoder layer index >= 0")
        _check(self.feature_window >= 1, f"{key}.feature_window", "must be >= 1")
        _check(self.k_policy in ("goodput", "fixed"), f"{key}.k_policy", "goodput | fixed")
        _check(self.goodput_k_max >= 0, f"{key}.goodput_k_max", "must be >= 0 (capped at max_speculative_tokens)")

    def default_tree_budget(self) -> int:
        """Draft-tree nodes per round for a request that does not choose (0 = chain)."""
        return self.tree_budget if self.verify_mode == "tree" else 0


@dataclass(frozen=True)
class AffinityConfig:
    """CPU indices each service's processes are pinned to (empty: not pinned)."""

    gateway: tuple[int, ...] = ()
    coordinator: tuple[int, ...] = ()
    draft_worker: tuple[int, ...] = ()
    target_worker: tuple[int, ...] = ()

    def validate(self, key: str) -> None:
        for name in ("gateway", "coordinator", "draft_worker", "target_worker"):
            _check(all(int(c) >= 0 for c in getattr(self, name)), f"{key}.{name}", "CPU indices >= 0")


@dataclass(frozen=True)
class RuntimeConfig:
    torch_threads: int = 1  # per process (0 = torch's default: all cores)
    log_level: str = "INFO"
    cpu_affinity: AffinityConfig = field(default_factory=AffinityConfig)

    def validate(self, key: str) -> None:
        _check(self.torch_threads >= 0, f"{key}.torch_threads", "must be >= 0")
        self.cpu_affinity.validate(f"{key}.cpu_affinity")
        _check(self.log_level in ("DEBUG", "INFO", "WARNING", "ERROR"), f"{key}.log_level",
               "DEBUG|INFO|WARNING|ERROR")


@dataclass(frozen=True)
class GatewayConfig:
    listen: str = "127.0.0.1:50051"
    # host:port; several coordinators: "ip:port,ip:port" (IP literals) or a dns:///name:port target
    # resolving to them; calls go round-robin, skip a replica that is down and retry a refused one
    coordinator: str = "127.0.0.1:50052"
    max_tokens_limit: int = 2048  # largest max_tokens a request may ask for
    max_stop_strings: int = 16
    max_deadline_s: float = 600.0  # a client's deadline is clamped to this
    max_workers: int = 64  # gRPC handler threads
    # sizes the public API accepts (docs/reliability.md: each limit and its status code)
    max_message_bytes: int = 1 << 20  # one request on the public port; larger: RESOURCE_EXHAUSTED (gRPC)
    max_prompt_bytes: int = 262144  # UTF-8 bytes of the prompt (or all message contents), checked before tokenizing
    max_prompt_tokens: int = 0  # prompt tokens after the chat template (0: the model's context window)
    max_messages: int = 128  # entries in `messages`
    max_stop_chars: int = 128  # characters of one stop string
    max_request_id_chars: int = 128  # request_id: printable ASCII without spaces, at most this long
    max_streams_per_connection: int = 64  # concurrent requests on one client connection; more: RESOURCE_EXHAUSTED
    max_streams_per_key: int = 64  # concurrent requests per API key (auth on; 0: no limit); more: RESOURCE_EXHAUSTED

    def validate(self, key: str) -> None:
        _check_address(self.listen, f"{key}.listen")
        _check_coordinators(self.coordinator, f"{key}.coordinator")
        _check(self.max_tokens_limit >= 1, f"{key}.max_tokens_limit", "must be >= 1")
        for name in ("max_stop_strings", "max_prompt_tokens", "max_streams_per_key"):
            _check(getattr(self, name) >= 0, f"{key}.{name}", "must be >= 0")
        for name in ("max_message_bytes", "max_prompt_bytes", "max_messages", "max_stop_chars",
                     "max_request_id_chars", "max_streams_per_connection"):
            _check(getattr(self, name) >= 1, f"{key}.{name}", "must be >= 1")
        _check(self.max_deadline_s > 0, f"{key}.max_deadline_s", "must be > 0")
        _check(self.max_workers >= 1, f"{key}.max_workers", "must be >= 1")


@dataclass(frozen=True)
class CoordinatorConfig:
    listen: str = "127.0.0.1:50052"
    draft_workers: tuple[str, ...] = ("127.0.0.1:50053",)
    target_workers: tuple[str, ...] = ("127.0.0.1:50054",)
    draft_timeout_s: float = 5.0  # a slower proposal counts as a draft failure (round runs with k=0)
    draft_retry_after_s: float = 2.0  # after a failure, skip that draft worker this long
    max_workers: int = 64
    # AR rounds (speculation off) decode up to this many tokens per Verify call, one-token steps
    # back to back in the target (VerifyRequest.decode_steps): one hop for several tokens; 1: off
    decode_steps: int = 4
    target_call_timeout_s: float = 120.0  # cap on one Prefill/Verify call: a hung target never hangs a request
    max_target_failovers: int = 2  # a sequence whose target dies is re-prefilled elsewhere this often
    # n-gram drafts in the coordinator, where the context is (draft_worker.ngram's sizes): no
    # Propose hop; false: the draft tier serves n-gram like the model drafters
    local_ngram: bool = True
    # with local_ngram and decode_steps > 1: an n-gram round is a burst of decode_steps target
    # steps, each after the first drafting by prompt lookup in the target (VerifyRequest.ngram_burst,
    # the same sizes): one hop for several rounds; false: one hop per drafting round
    ngram_bursts: bool = True
    # draft round r+1 while the target verifies round r, on the guess that r is accepted in full
    # (coordinator/predraft.py; remote chain drafters); opt-in until its benchmarks land
    overlap_drafting: bool = False
    # the block drafter's draft trees from the candidate table drafted while the target verified the
    # round before (coordinator/tails.py): no round waits for a Propose but the first
    block_tables: bool = True
    # with block_tables, alone: a round may pass an older table's tail over and wait for a table at
    # its own anchor, where the goodput rule predicts that emits faster (RoundPolicy.fresh_beats_tail)
    fresh_tables: bool = True
    # the block drafter's trees also carry the coordinator's n-gram draft (draft_worker.ngram's
    # max_n) as a root path where the context's suffix matched at least this many tokens earlier:
    # one forward verifies both (coordinator/drafting.py Drafting._graft); 0: off
    ngram_graft: int = 2
    canary: CanaryConfig = field(default_factory=CanaryConfig)  # the speculation canary (docs/rollout.md)

    def validate(self, key: str) -> None:
        _check_address(self.listen, f"{key}.listen")
        self.canary.validate(f"{key}.canary")
        _check(len(self.target_workers) >= 1, f"{key}.target_workers", "needs at least one address")
        for i, addr in enumerate(self.draft_workers):
            _check_address(addr, f"{key}.draft_workers[{i}]")
        for i, addr in enumerate(self.target_workers):
            _check_address(addr, f"{key}.target_workers[{i}]")
        _check(self.draft_timeout_s > 0, f"{key}.draft_timeout_s", "must be > 0")
        _check(self.max_workers >= 1, f"{key}.max_workers", "must be >= 1")
        _check(self.target_call_timeout_s > 0, f"{key}.target_call_timeout_s", "must be > 0")
        _check(1 <= self.decode_steps <= 64, f"{key}.decode_steps", "1..64")
        _check(self.max_target_failovers >= 0, f"{key}.max_target_failovers", "must be >= 0")
        _check(0 <= self.ngram_graft <= 64, f"{key}.ngram_graft", "0 (off) or a match length in 1..64")


@dataclass(frozen=True)
class NgramConfig:
    min_n: int = 1
    max_n: int = 8

    def validate(self, key: str) -> None:
        _check(1 <= self.min_n <= self.max_n, key, "needs 1 <= min_n <= max_n")


@dataclass(frozen=True)
class DraftModelConfig:
    name: str | None = None  # a pinned model name; with neither name nor path: the target model
    path: str | None = None  # any HF causal LM sharing the target's tokenizer
    dtype: str = "auto"
    cpu_kernel: bool | str = "auto"  # float32 draft steps from packed weights (as target_worker.cpu_kernel)
    proposal_top_k: int = 64  # T > 0: drafts sampled from (and sent as) their 64 likeliest tokens; 0: dense
    weights: str = "model"  # int8: drafting steps read int8 copies of the linears (specmesh/engine/quant.py)

    def validate(self, key: str) -> None:
        _check(self.dtype in DTYPES, f"{key}.dtype", "|".join(DTYPES))
        _check(self.weights in ("model", "int8"), f"{key}.weights", "model|int8")
        _check(self.cpu_kernel in (True, False, "auto"), f"{key}.cpu_kernel", "must be true, false or auto")
        _check(self.proposal_top_k >= 0, f"{key}.proposal_top_k", "must be >= 0 (0: the whole vocabulary)")


@dataclass(frozen=True)
class BlockWorkerConfig:
    """The block drafter's artefact (specmesh/drafters): weights + config + MANIFEST.sha256."""

    path: str | None = None  # null: artifacts/drafters/<model.name>-block in the source tree, if present
    dtype: str = "auto"
    cpu_kernel: bool | str = "auto"  # a float32 LM head (the target's, shared) from packed weights
    # the head scores only the N most frequent tokens (the artefact's token_rank.safetensors; 0: all)
    head_vocab: int = 8192

    def validate(self, key: str) -> None:
        _check(self.dtype in DTYPES, f"{key}.dtype", "|".join(DTYPES))
        _check(isinstance(self.head_vocab, int) and self.head_vocab >= 0, f"{key}.head_vocab",
               "must be an integer >= 0 (0: every token)")
        _check(self.cpu_kernel in (True, False, "auto"), f"{key}.cpu_kernel", "must be true, false or auto")


@dataclass(frozen=True)
class DraftWorkerConfig:
    listen: str = "127.0.0.1:50053"
    methods: tuple[str, ...] = ("ngram", "draft_model", "block")  # drafters this worker loads
    ngram: NgramConfig = field(default_factory=NgramConfig)
    draft_model: DraftModelConfig = field(default_factory=DraftModelConfig)
    block: BlockWorkerConfig = field(default_factory=BlockWorkerConfig)
    max_batch_size: int = 16
    cache_max_sequences: int = 256  # per-sequence draft KV kept (LRU) for reuse across rounds
    cache_max_tokens: int = 65536  # ... and KV slots kept in all (draft_model): least recent sequences go first
    max_workers: int = 64

    def validate(self, key: str) -> None:
        _check_address(self.listen, f"{key}.listen")
        for m in self.methods:
            _check(m in DRAFTERS, f"{key}.methods", f"unknown drafter {m!r} (known: {', '.join(DRAFTERS)})")
        self.ngram.validate(f"{key}.ngram")
        self.draft_model.validate(f"{key}.draft_model")
        self.block.validate(f"{key}.block")
        _check(self.max_batch_size >= 1, f"{key}.max_batch_size", "must be >= 1")
        _check(self.cache_max_sequences >= 1, f"{key}.cache_max_sequences", "must be >= 1")
        _check(self.cache_max_tokens >= 0, f"{key}.cache_max_tokens", "must be >= 0 (0: no token bound)")


@dataclass(frozen=True)
class CacheConfig:
    max_sequences: int = 64  # live sequences (KV caches) held at once
    # KV pool slots, allocated at start (specmesh/engine/pool.py): every held token plus each live
    # sequence's reserved headroom; `specmesh plan` gives the bytes
    max_tokens: int = 65536
    idle_timeout_s: float = 300.0  # a sequence nobody touches this long is reclaimed
    reclaim_interval_s: float = 5.0

    def validate(self, key: str) -> None:
        _check(self.max_sequences >= 1, f"{key}.max_sequences", "must be >= 1")
        _check(self.max_tokens >= 1, f"{key}.max_tokens", "must be >= 1")
        _check(self.idle_timeout_s > 0, f"{key}.idle_timeout_s", "must be > 0")
        _check(self.reclaim_interval_s > 0, f"{key}.reclaim_interval_s", "must be > 0")


@dataclass(frozen=True)
class TargetWorkerConfig:
    listen: str = "127.0.0.1:50054"
    max_batch_size: int = 16  # sequences verified in one forward
    cache: CacheConfig = field(default_factory=CacheConfig)
    max_workers: int = 64
    drain_timeout_s: float = 30.0  # SIGTERM: take no new sequence, finish live ones up to this long
    # deterministic verification: one-token kernels per row (in chunks the start-up probe proves
    # bitwise) and prefills unpacked, so output is bitwise the target alone's in any dtype and batch;
    # false: one GEMM over the batch, near-tie flips possible; own: deterministic on the mesh's own
    # kernels (products padded to 2+ rows where the probe finds that row-invariant, bf16 attention
    # rows on the row kernel): bitwise the mesh's own decode, which rounds apart from HF's one-row
    # calls; auto: true where the probe finds it nearly free on this machine, else own where that
    # is, else false (specmesh/engine/rowexact.py), logged at start
    batch_invariant: bool | str = "auto"
    # float32 linears of a verify / decode step from packed weights (specmesh/engine/cpu_gemm.py):
    # auto: where it builds and runs (x86-64 AVX2+FMA, float32 on the CPU); false: torch's own
    cpu_kernel: bool | str = "auto"
    # a one-token row's attention with each kv head's query heads as rows (specmesh/engine/attention.py):
    # auto: where a start-up probe finds it bitwise HF's SDPA call and not slower; true: where the
    # probe finds it 1.5x faster, bitwise or not (bf16 on CPUs without AMX: ~5x; the AR then differs
    # from HF generate in near-ties, still bitwise the target alone for speculation); false: never
    attention_fold: bool | str = "auto"
    # bf16 batched steps' decoder linears of 2-32 rows from a kernel reading each weight once for
    # every row (specmesh/engine/bf16rows.py; AVX512-BF16): auto where a start-up probe finds it
    # faster than oneDNN's prepacked calls, true wherever it builds, false never. A lone row (AR),
    # prefills and deterministic steps always keep oneDNN's (HF's) arithmetic
    bf16_rows: bool | str = "auto"
    # a verify batch waits up to this fraction of the last verify forward for the sequences between
    # two rounds, so concurrent requests share one forward instead of trailing into the next; 0: off
    batch_gather: float = 0.8
    # beside other sequences, verify of each chain draft only the prefix the whole forward does
    # best with, from the p_i its coordinator sends (specmesh/core/trim.py); false (default):
    # as drafted (measured: docs/bench/round_policy.md#session-34)
    draft_trim: bool = False

    def validate(self, key: str) -> None:
        _check_address(self.listen, f"{key}.listen")
        _check(self.max_batch_size >= 1, f"{key}.max_batch_size", "must be >= 1")
        _check(0 <= self.batch_gather <= 2, f"{key}.batch_gather", "must be in [0, 2]")
        _check(isinstance(self.draft_trim, bool), f"{key}.draft_trim", "must be true or false")
        self.cache.validate(f"{key}.cache")
        _check(self.batch_invariant in (True, False, "auto", "own"), f"{key}.batch_invariant",
               "must be true, false, own or auto")
        _check(self.cpu_kernel in (True, False, "auto"), f"{key}.cpu_kernel", "must be true, false or auto")
        _check(self.attention_fold in (True, False, "auto"), f"{key}.attention_fold", "must be true, false or auto")
        _check(self.bf16_rows in (True, False, "auto"), f"{key}.bf16_rows", "must be true, false or auto")
        _check(self.drain_timeout_s >= 0, f"{key}.drain_timeout_s", "must be >= 0")


@dataclass(frozen=True)
class RegistryConfig:
    """Worker discovery. url null: static addresses (coordinator.*_workers). With a Redis url,
    workers register themselves with a TTL heartbeat and coordinators watch the registry."""

    url: str | None = None  # redis://host:port[/db]
    namespace: str = "specmesh"  # key prefix: several meshes can share one Redis
    heartbeat_interval_s: float = 1.0  # a worker refreshes its record (and its load) this often
    ttl_s: float = 5.0  # a worker that stops heartbeating is dropped after this long
    poll_interval_s: float = 0.5  # coordinators re-read the registry this often
    advertise_host: str | None = None  # host others dial; null: the listen host (wildcard: hostname); "ip": this host's IP

    def validate(self, key: str) -> None:
        if self.url is not None:
            _check(self.url.startswith(("redis://", "rediss://", "unix://")), f"{key}.url",
                   "must be redis://host:port[/db] (or rediss://, unix://)")
        _check(bool(self.namespace) and ":" not in self.namespace, f"{key}.namespace", "non-empty, no ':'")
        _check(self.heartbeat_interval_s > 0, f"{key}.heartbeat_interval_s", "must be > 0")
        _check(self.ttl_s > self.heartbeat_interval_s, f"{key}.ttl_s", "must be > heartbeat_interval_s")
        _check(self.poll_interval_s > 0, f"{key}.poll_interval_s", "must be > 0")


@dataclass(frozen=True)
class MeshConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    draft_worker: DraftWorkerConfig = field(default_factory=DraftWorkerConfig)
    target_worker: TargetWorkerConfig = field(default_factory=TargetWorkerConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    ratelimit: RateLimitConfig = field(default_factory=RateLimitConfig)
    backpressure: BackpressureConfig = field(default_factory=BackpressureConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)

    def replace(self, **sections) -> "MeshConfig":
        return dataclasses.replace(self, **sections)


def env_overrides(environ=None) -> dict:
    """SPECMESH_A__B=v -> {"a": {"b": parsed v}} for the sections MeshConfig knows."""
    environ = os.environ if environ is None else environ
    sections = {f.name for f in dataclasses.fields(MeshConfig)}
    out: dict = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = name[len(ENV_PREFIX):].lower().split("__")
        if path[0] not in sections:
            continue
        try:
            value = parse_yaml(raw) if raw != "" else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{name}: not parseable ({exc})") from exc
        _set_path(out, path, value)
    return out


def load_config(path: str | os.PathLike | None = None, environ=None, overrides: dict | None = None) -> MeshConfig:
    """Load YAML (path, else $SPECMESH_CONFIG, else the shipped default), apply env, validate."""
    environ = os.environ if environ is None else environ
    path = path or environ.get("SPECMESH_CONFIG") or DEFAULT_CONFIG
    try:
        data = parse_yaml(Path(path).read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} not found") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc
    data = _merge(_merge(_merge(data, env_overrides(environ)), auth_env_override(environ)), overrides or {})
    cfg = _build(MeshConfig, data, "")
    cfg.validate()
    return cfg
