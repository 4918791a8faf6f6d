"""Shared fixtures for every test tier.

- model_dir / target_model / target_tokenizer: the default model, fetched and loaded once per
  session (marked tests only; unit tests never touch them).
- free_port() / free_ports(n): free TCP ports on 127.0.0.1 (also as the `free_port` fixture).
- services: a factory, services(overrides=None, components=ALL_SERVICES, draft_model=None)
  -> ServiceStack, that starts REAL in-process gRPC servers (target worker, draft worker,
  coordinator, gateway) on free ports with the real servicers, and stops them at teardown.
- hf_reference: Hugging Face `generate` (greedy) on the same model and chat template, with the
  LM head in float32 like our engine — the ground truth for token-identity tests.

Torch threads: on a small shared box, torch's default (one OpenMP thread per core) spins
against other processes and one forward of the 135M model goes from ~0.1 s to ~1.7 s. The
suite therefore runs torch with $SPECMESH_TEST_TORCH_THREADS threads (default 1; 0 keeps
torch's default). Servers run in-process, so their batcher threads use the same setting.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from specmesh.netutil import free_ports


def pytest_configure(config: pytest.Config) -> None:
    # the start-up probes run in every test, unless a tier asks otherwise: a cached result would
    # hide a probe a test tampers with (tests/e2e keeps one cache for its processes' starts)
    os.environ["SPECMESH_PROBE_CACHE"] = "off"
    threads = int(os.environ.get("SPECMESH_TEST_TORCH_THREADS", "1"))
    if threads > 0:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- model fixtures

MODEL_TEST_DTYPE = os.environ.get("SPECMESH_TEST_DTYPE", "float32")
# where the model tier runs (cpu | cuda | cuda:N): the target, its bf16 twin, the services' drafters
# and the block drafter all go there; cpu unless asked, so a GPU box runs the CI's tier unless told
MODEL_TEST_DEVICE = os.environ.get("SPECMESH_TEST_DEVICE", "cpu")


def on_cpu() -> bool:
    """Whether the model tier runs on the CPU (where the CPU kernels can take a step)."""
    return MODEL_TEST_DEVICE == "cpu"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model's verified cache dir (downloads and converts it on first use), or the HF
    causal-LM dir in $SPECMESH_TEST_MODEL_DIR (any model the engine takes: the bitwise tests then
    run on it; an offline GPU box with a random-weight model of the default's shapes, say)."""
    from specmesh.engine.fetch import fetch_model

    other = os.environ.get("SPECMESH_TEST_MODEL_DIR")
    return Path(other) if other else fetch_model(progress=False)


@pytest.fixture(scope="session")
def target_model(model_dir: Path):
    """The default model (eval, no grad) in MODEL_TEST_DTYPE, loaded once per session and shared
    by every test and every in-process server. Never mutate it (wrap or copy instead).

    Why float32 here, while the services default to bf16: token identity must be a statement
    about the algorithm, so the paths being compared have to compute the same numbers. In
    float32 they do, to ~1e-4 in the logits: a (k+1)-position verify vs k one-position AR steps,
    and a padded batched verify vs the same sequence alone. In bf16 they do not: oneDNN rounds an
    M=1 and an M=5 GEMM differently and the shorter sequence of a padded batch shifts by
    0.3-0.6 logits (measured), so near-ties (gaps 0.005-0.16 seen) can flip. The bf16 identity
    rate is measured and reported (docs/numerics.md, `specmesh bench` mismatches), never hidden
    by a looser assertion; tests/model/test_identity.py also asserts bf16 identity where the
    paths are bitwise aligned (one request, speculation off).
    """
    from specmesh.engine.loader import load_model

    return load_model(model_dir, MODEL_TEST_DTYPE, MODEL_TEST_DEVICE)


@pytest.fixture(scope="session")
def target_model_bf16(model_dir: Path):
    """The default model in bf16, the services' default dtype (see target_model)."""
    from specmesh.engine.loader import load_model

    return load_model(model_dir, "bfloat16", MODEL_TEST_DEVICE)


@pytest.fixture(scope="session")
def target_tokenizer(model_dir: Path):
    from specmesh.engine.loader import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def prompt_encoder(model_dir: Path):
    """specmesh's PromptEncoder for the default model (chat template, eos ids, context window)."""
    from specmesh.tokenization import PromptEncoder

    return PromptEncoder.from_model_dir(model_dir)


@pytest.fixture(scope="session")
def eos_token_id(model_dir: Path) -> int:
    """The model's generation_config eos (2 for SmolLM2)."""
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    return eos[0] if isinstance(eos, (list, tuple)) else int(eos)


# ---------------------------------------------------------------------------- ports

def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    return free_ports(1)[0]


@pytest.fixture(name="free_port")
def free_port_fixture():
    """The free_port() helper, for tests that prefer a fixture to an import."""
    return free_port


# ---------------------------------------------------------------------------- in-process mesh

def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class ServiceStack:
    """Real gRPC servers started in this process. Attributes are None for parts not started.

    cfg: the MeshConfig (load_config with the free-port addresses and the caller's overrides).
    engine: the TargetEngine; drafters: {method: drafter} served by the draft worker.
    *_stub: stubs over TCP on 127.0.0.1 (the same channels a client would use)."""

    cfg: object
    engine: object = None
    drafters: dict = field(default_factory=dict)
    servers: dict = field(default_factory=dict)  # name -> specmesh.rpc.server.Service
    channels: list = field(default_factory=list)
    target_stub: object = None
    draft_stub: object = None
    coordinator_stub: object = None
    gateway_stub: object = None

    def address(self, name: str) -> str:
        return self.servers[name].listen

    def request(self, prompt: str | None = None, *, messages=None, raw: bool = False, max_tokens: int = 32,
                method: str | None = None, k: int | None = None, temperature: float | None = None,
                top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                stop=(), request_id: str = ""):
        """A public GenerateRequest. messages: [(role, content), ...]."""
        from specmesh.v1 import specmesh_pb2 as pb

        req = pb.GenerateRequest(max_tokens=max_tokens, raw=raw, stop=list(stop), request_id=request_id)
        if messages is not None:
            req.messages.CopyFrom(pb.MessageList(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]))
        else:
            req.prompt = prompt
        for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
            if value is not None:
                setattr(req.sampling, name, value)
        if method is not None:
            req.speculation.method = method
        if k is not None:
            req.speculation.num_speculative_tokens = k
        return req

    def generate(self, prompt: str | None = None, *, timeout: float = 300.0, **kwargs):
        """Gateway.Generate over TCP; kwargs as request()."""
        return self.gateway_stub.Generate(self.request(prompt, **kwargs), timeout=timeout)

    def stop(self) -> None:
        for name in ("gateway", "coordinator", "draft_worker", "target_worker"):
            server = self.servers.get(name)
            if server is not None:
                server.stop(grace_s=1.0)
        for ch in self.channels:
            ch.close()
        for drafter in self.drafters.values():
            drafter.close()
        if self.engine is not None:
            self.engine.close()


ALL_SERVICES = ("target_worker", "draft_worker", "coordinator", "gateway")


def start_services(target_model, prompt_encoder, overrides: dict | None = None,
                   components: tuple[str, ...] = ALL_SERVICES, draft_model=None) -> ServiceStack:
    """Start the requested services on free ports; see the `services` fixture."""
    from coordinator.clients import TargetPool
    from coordinator.draftpool import GrpcDraftPool
    from coordinator.server import CoordinatorServicer
    from draft_worker.block_loader import load_block_model
    from draft_worker.drafters import BlockDrafter, NgramDrafter
    from draft_worker.model_drafter import ModelDrafter
    from draft_worker.server import DraftWorkerServicer
    from gateway.server import GatewayServicer
    from specmesh.config import load_config
    from specmesh.engine.loader import load_configured_model
    from specmesh.rpc.server import Service, make_channel
    from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
    from target_worker.engine import TargetEngine
    from target_worker.server import TargetWorkerServicer

    addr = {name: f"127.0.0.1:{port}" for name, port in zip(ALL_SERVICES, free_ports(len(ALL_SERVICES)))}
    base = {
        "runtime": {"log_level": "WARNING"},
        "model": {"device": MODEL_TEST_DEVICE},
        "gateway": {"listen": addr["gateway"], "coordinator": addr["coordinator"], "max_workers": 16},
        # local_ngram false: n-gram stands in for a model drafter here, so its rounds cross the draft tier
        "coordinator": {"listen": addr["coordinator"], "draft_workers": [addr["draft_worker"]],
                        "target_workers": [addr["target_worker"]], "max_workers": 16, "local_ngram": False},
        "draft_worker": {"listen": addr["draft_worker"], "max_workers": 16},
        "target_worker": {"listen": addr["target_worker"], "max_workers": 16},
    }
    # environ={}: hermetic, the developer's SPECMESH_* variables do not leak into tests
    cfg = load_config(environ={}, overrides=_merge(base, overrides or {}))
    stack = ServiceStack(cfg)
    try:
        if "target_worker" in components:
            w = cfg.target_worker
            stack.engine = TargetEngine(target_model, w.max_batch_size, w.cache.max_sequences, w.cache.max_tokens,
                                        w.cache.idle_timeout_s, batch_invariant=w.batch_invariant)
            servicer = TargetWorkerServicer(stack.engine, "test-target")
            stack.servers["target_worker"] = Service(
                "specmesh.v1.TargetWorker", w.listen,
                lambda s: pb_grpc.add_TargetWorkerServicer_to_server(servicer, s), w.max_workers).start()
        if "draft_worker" in components:
            w = cfg.draft_worker
            if "ngram" in w.methods:
                stack.drafters["ngram"] = NgramDrafter(w.ngram.min_n, w.ngram.max_n)
            if "draft_model" in w.methods:
                dm = w.draft_model
                if draft_model is None and (dm.name or dm.path):  # as build_drafters does
                    _, draft_model = load_configured_model(dm.name, dm.path, dm.dtype, cfg.model.require_manifest,
                                                            cfg.model.device)
                stack.drafters["draft_model"] = ModelDrafter(draft_model if draft_model is not None else target_model,
                                                             w.max_batch_size, w.cache_max_sequences,
                                                             proposal_top_k=dm.proposal_top_k)
            if "block" in w.methods:  # the trained block drafter, around the session model's embedding / head
                block = load_block_model(cfg, target_model.get_input_embeddings(), target_model.get_output_embeddings())
                if block is not None:  # None: no artefact in this checkout
                    stack.drafters["block"] = BlockDrafter(block, w.max_batch_size, w.cache_max_sequences)
            dservicer = DraftWorkerServicer(stack.drafters, cfg.speculative.max_speculative_tokens)
            stack.servers["draft_worker"] = Service(
                "specmesh.v1.DraftWorker", w.listen,
                lambda s: pb_grpc.add_DraftWorkerServicer_to_server(dservicer, s), w.max_workers).start()
        if "coordinator" in components:
            c = cfg.coordinator
            cservicer = CoordinatorServicer(cfg, prompt_encoder, TargetPool(c.target_workers),
                                            GrpcDraftPool(c.draft_workers, c.draft_retry_after_s))
            stack.servers["coordinator"] = Service(
                "specmesh.v1.Coordinator", c.listen,
                lambda s: pb_grpc.add_CoordinatorServicer_to_server(cservicer, s), c.max_workers).start()
        if "gateway" in components:
            gservicer = GatewayServicer(cfg, prompt_encoder)
            stack.servers["gateway"] = Service(
                "specmesh.v1.Gateway", cfg.gateway.listen,
                lambda s: pb_grpc.add_GatewayServicer_to_server(gservicer, s), cfg.gateway.max_workers).start()
        for name, stub_attr, stub_cls in (("target_worker", "target_stub", pb_grpc.TargetWorkerStub),
                                          ("draft_worker", "draft_stub", pb_grpc.DraftWorkerStub),
                                          ("coordinator", "coordinator_stub", pb_grpc.CoordinatorStub),
                                          ("gateway", "gateway_stub", pb_grpc.GatewayStub)):
            if name in stack.servers:
                channel = make_channel(stack.servers[name].listen)
                stack.channels.append(channel)
                setattr(stack, stub_attr, stub_cls(channel))
    except BaseException:
        stack.stop()
        raise
    return stack


@pytest.fixture
def services(target_model, prompt_encoder):
    """Factory: services(overrides=None, components=ALL_SERVICES, draft_model=None) -> ServiceStack.

    Starts REAL gRPC servers in this process on free 127.0.0.1 ports, with the real servicers:
    TargetWorkerServicer + TargetEngine, DraftWorkerServicer (NgramDrafter, ModelDrafter, BlockDrafter
    when the artefact is present),
    CoordinatorServicer, GatewayServicer. The config comes from specmesh.config.load_config with
    the free-port addresses merged under `overrides` (a nested dict shaped like the YAML, e.g.
    {"target_worker": {"cache": {"max_sequences": 1}}}). The target engine and, unless the config
    names a draft model (draft_worker.draft_model.name/path, loaded as the draft worker would,
    honouring model.require_manifest) or `draft_model` passes a loaded one, the draft_model
    drafter share the session's one loaded target model. Everything started is stopped at
    teardown, in reverse dependency order.
    """
    stacks: list[ServiceStack] = []

    def start(overrides: dict | None = None, components: tuple[str, ...] = ALL_SERVICES, draft_model=None,
              model=None):
        """model: serve this loaded target instead of the session's (e.g. target_model_bf16)."""
        stack = start_services(model if model is not None else target_model, prompt_encoder, overrides,
                               components, draft_model)
        stacks.append(stack)
        return stack

    yield start
    for stack in reversed(stacks):
        stack.stop()


# ---------------------------------------------------------------------------- HF reference

@dataclass(frozen=True)
class Reference:
    """One greedy reference run. logits[i]: float32 [V] raw logits that chose token_ids[i]."""

    prompt_ids: list[int]
    token_ids: list[int]
    logits: list  # list of torch.Tensor [V]

    def gap(self, position: int, token_a: int, token_b: int) -> float | None:
        """Reference logit(token_a) - logit(token_b) at an output position (None past the end)."""
        if position >= len(self.logits):
            return None
        row = self.logits[position]
        return float(row[token_a] - row[token_b])

    def explain_mismatch(self, got: list[int], tokenizer=None, label: str = "") -> str:
        """'' if got == token_ids, else where they first differ, both tokens, and the gap."""
        want = self.token_ids
        if got == want:
            return ""
        pos = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        g = got[pos] if pos < len(got) else None
        w = want[pos] if pos < len(want) else None

        def show(t):
            if t is None:
                return "<end>"
            return f"{t} {tokenizer.decode([t])!r}" if tokenizer is not None else str(t)

        msg = (f"{label}: token mismatch at output position {pos} (len got {len(got)}, want {len(want)}): "
               f"mesh={show(g)} reference={show(w)}")
        if g is not None and w is not None:
            row = self.logits[pos]
            top2 = row.topk(2)
            msg += (f"; reference fp32 logit gap (ref - mesh) = {self.gap(pos, w, g):.6g}"
                    f" [ref logit {float(row[w]):.6g}, mesh-token logit {float(row[g]):.6g},"
                    f" top-2 gap {float(top2.values[0] - top2.values[1]):.6g}]")
        if tokenizer is not None:
            msg += f"\n  mesh: {tokenizer.decode(got)!r}\n  ref:  {tokenizer.decode(want)!r}"
        return msg


def bf16_hf_mismatch(ref, got: list[int], tokenizer=None, label: str = "", own_kernels: bool = False) -> str:
    """'' when `got` is HF bf16 greedy's `ref` - strictly on a CPU that multiplies bf16 natively,
    unless the mesh ran its own kernels (own_kernels: batch_invariant's mode 2, rowexact.py).
    Elsewhere HF's bf16 arithmetic is emulated by other kernels and its logits come out on the bf16
    grid while the mesh's are float32, so a first difference is allowed where HF's own logits of the
    two tokens are within one bf16 step (on an Ice Lake Xeon: ties at 26.125, gaps of 0.125 at 23-25);
    it is printed; with the mesh's own kernels on such a CPU any flip is printed, not asserted (the
    callers that speculate hold `own` strictly to its own AR). Otherwise the mismatch, explained."""
    import math

    from specmesh.engine.loader import cpu_has_native_bf16

    why, native = ref.explain_mismatch(got, tokenizer, label), cpu_has_native_bf16()
    if not why or (native and not own_kernels):
        return why
    if own_kernels and not native:
        # neither side is the other's arithmetic: HF's bf16 is emulated here, the mesh's own kernels
        # round apart from HF by design (docs/numerics.md); the strict check of `own` is against the
        # mesh's own AR where they speculate. The flip and its gap are printed, not hidden.
        print(f"the mesh's own kernels against HF's emulated bf16 (no native bf16 here): {why}")
        return ""
    pos = next((i for i, (a, b) in enumerate(zip(got, ref.token_ids)) if a != b), None)
    if pos is None:  # one is a prefix of the other: a length difference, never a rounding
        return why
    want = ref.token_ids[pos]
    step = 2.0 ** (math.floor(math.log2(max(abs(float(ref.logits[pos][want])), 1e-30))) - 7)  # one bf16 step
    if ref.gap(pos, want, got[pos]) <= step:
        print(f"within HF's bf16 rounding ({'the mesh own kernels' if own_kernels else 'no native bf16 here'}): {why}")
        return ""
    return why


@pytest.fixture(scope="session")
def hf_reference(target_model, target_tokenizer, eos_token_id):
    """HF greedy reference on the session model (MODEL_TEST_DTYPE); see hf_reference_runner."""
    return hf_reference_runner(target_model, target_tokenizer, eos_token_id)


@pytest.fixture(scope="session")
def hf_reference_bf16(target_model_bf16, target_tokenizer, eos_token_id):
    """HF greedy reference on the bf16 model; see hf_reference_runner."""
    return hf_reference_runner(target_model_bf16, target_tokenizer, eos_token_id)


def hf_reference_runner(target_model, target_tokenizer, eos_token_id):
    """hf_reference(prompt=None, *, messages=None, raw=False, prompt_ids=None, max_tokens) -> Reference.

    Hugging Face transformers greedy `generate` on the SAME loaded model (its weights are
    shared, nothing is mutated), the prompt encoded with the tokenizer's own chat template
    (`apply_chat_template(..., add_generation_prompt=True)`; raw=True: plain tokenization with
    special tokens; or explicit prompt_ids), eos = generation_config eos (id 2), stopping after
    max_tokens new tokens or after EOS (which is included).

    The model's own LM head, in its dtype, as specmesh runs it (engine/kv.lm_head): the reference
    is what users run. (In bf16 the logits are bf16 and at |logit| ~ 20 their ulp is 0.125, so
    the top two tie now and then; both sides take the lower token index.)

    Runs are memoised per (prompt ids, max_tokens); Reference.logits holds the fp32 logits of
    every step so a failing identity test can report the reference gap between the two tokens.
    """
    ref_model = target_model
    cache: dict = {}
    lock = threading.Lock()

    def encode(prompt, messages, raw):
        if messages is not None:
            msgs = [{"role": r, "content": c} for r, c in messages]
        elif raw:
            return list(target_tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            msgs = [{"role": "user", "content": prompt}]
        out = target_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])

    def run(prompt: str | None = None, *, messages=None, raw: bool = False, prompt_ids=None,
            max_tokens: int) -> Reference:
        ids = list(prompt_ids) if prompt_ids is not None else encode(prompt, messages, raw)
        key = (tuple(ids), max_tokens)
        with lock:
            if key not in cache:
                inp = torch.tensor([ids], dtype=torch.long)
                with torch.inference_mode():
                    out = ref_model.generate(
                        inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_tokens, do_sample=False,
                        temperature=None, top_p=None, top_k=None, eos_token_id=eos_token_id,
                        pad_token_id=eos_token_id, output_logits=True, return_dict_in_generate=True)
                tokens = out.sequences[0, len(ids):].tolist()
                logits = [row[0].float().clone() for row in out.logits]
                assert len(logits) == len(tokens)
                cache[key] = Reference(ids, tokens, logits)
            return cache[key]

    return run


# ---------------------------------------------------------------- the target alone, step by step

def _prefill(model, prompt: list[int]):
    from specmesh.engine.kv import batched_step, new_sequence_kv

    kv = new_sequence_kv(model, len(prompt) + 80)
    batched_step(model, [kv], [prompt], logits_rows=[[len(prompt) - 1]])
    kv.commit(len(prompt))
    return kv


def _one_token_steps(model, prompt: list[int], tokens: list[int], row_exact: int = 0):
    """The target alone: prefill, then one forward per token -> [len(tokens), V] logits (row_exact:
    the mesh's decode in that row-exact mode, rowexact.rows; 0: HF's own one-row calls)."""
    from specmesh.engine.kv import batched_step

    kv = _prefill(model, prompt)
    rows = []
    for t in tokens:
        out = batched_step(model, [kv], [[t]], row_exact=row_exact)[0]
        kv.commit(1)
        rows.append(out.logits[0])
    return torch.stack(rows)


@pytest.fixture(scope="session")
def prefilled():
    """prefilled(model, prompt) -> a SequenceKV holding the prompt's KV (one unpadded prefill)."""
    return _prefill


@pytest.fixture(scope="session")
def one_token_steps():
    """one_token_steps(model, prompt, tokens) -> [len(tokens), V] float32 logits of the target alone
    (prefill, then one one-token forward per token): the reference of every row-exact test."""
    return _one_token_steps
