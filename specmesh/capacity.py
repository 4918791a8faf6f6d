"""`specmesh plan`: memory per tier from a model's config.json (docs/capacity.md explains it).

    KV bytes = 2 (K and V) x layers x KV heads x head_dim x tokens x concurrency x bytes/element

Target worker: weights + KV for `concurrency` sequences of `context` tokens + the transient of a
verify round (k+1 new positions per sequence: their KV, and their float32 logits, since the LM
head runs in fp32). Draft worker: nothing model-sized for n-gram; with a draft model its weights,
its own per-sequence KV (cached across rounds) and k positions per proposal.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ROUND_SLOTS = 65  # KV slots one verify round may write past a sequence: pending + the largest tree / chain


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    params: int
    params_source: str  # "safetensors" (counted) or "config" (estimated)

    def kv_bytes_per_token(self, bpe: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * bpe


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def _estimate_params(c: dict, head_dim: int, kv_heads: int) -> int:
    h, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    heads = c.get("num_attention_heads", h // head_dim)
    inter = c.get("intermediate_size", 4 * h)
    attn = h * heads * head_dim * 2 + 2 * h * kv_heads * head_dim  # q, o + k, v
    mlp = 3 * h * inter  # gate, up, down
    embed = v * h * (1 if c.get("tie_word_embeddings", False) else 2)
    return n * (attn + mlp + 2 * h) + embed + h


def _count_safetensors(model_dir: Path) -> int | None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    total = 0
    for f in files:
        with safe_open(str(f), framework="np") as st:
            for key in st.keys():
                shape = st.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= d
                total += n
    return total


def resolve_config(model: str) -> Path:
    """A dir with config.json, a config.json path, or a pinned model name (its cache dir)."""
    p = Path(model).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if (p / "config.json").is_file():
            return p / "config.json"
        raise FileNotFoundError(f"{p} has no config.json")
    from specmesh.engine.fetch import model_cache_dir

    cached = model_cache_dir(model) / "config.json"
    if cached.is_file():
        return cached
    raise FileNotFoundError(f"{model!r}: not a directory, a config.json, or a fetched model "
                            f"(run `specmesh fetch-model --name {model}`)")


def model_shape(model: str) -> ModelShape:
    path = resolve_config(model)
    c = _text_config(json.loads(path.read_text()))
    heads = c.get("num_attention_heads")
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    kv_heads = c.get("num_key_value_heads") or heads
    counted = _count_safetensors(path.parent)
    params = counted if counted is not None else _estimate_params(c, head_dim, kv_heads)
    return ModelShape(model, c["num_hidden_layers"], kv_heads, head_dim, c["hidden_size"], c["vocab_size"], params,
                      "safetensors" if counted is not None else "config")


@dataclass(frozen=True)
class Plan:
    target: ModelShape
    draft: ModelShape | None
    concurrency: int
    context: int
    k: int
    dtype: str
    draft_weights: str = "model"  # int8: the draft worker also holds an int8 copy (engine/quant.py)

    @property
    def bpe(self) -> int:
        return BYTES[self.dtype]

    @property
    def pool_tokens(self) -> int:
        """target_worker.cache.max_tokens for this load: each sequence reserves its context plus the
        slots of one round's drafts (target_worker/engine.py ROUND_SLOTS) in the KV pool."""
        return self.concurrency * (self.context + ROUND_SLOTS)

    def tiers(self) -> dict:
        t, n, T, k, b = self.target, self.concurrency, self.context, self.k, self.bpe
        target = {"weights": t.params * b,
                  "kv_cache": t.kv_bytes_per_token(b) * self.pool_tokens,  # the pool, allocated at start
                  "verify_logits_fp32": (k + 1) * t.vocab * 4 * n}
        draft = {"weights": 0, "int8_copy": 0, "kv_cache": 0, "propose_kv": 0, "propose_logits_fp32": 0}
        if self.draft is not None:
            d = self.draft
            draft = {"weights": d.params * b, "int8_copy": d.params if self.draft_weights == "int8" else 0,
                     "kv_cache": d.kv_bytes_per_token(b) * T * n,
                     "propose_kv": d.kv_bytes_per_token(b) * k * n, "propose_logits_fp32": k * d.vocab * 4 * n}
        return {"target_worker": dict(target, total=sum(target.values())),
                "draft_worker": dict(draft, total=sum(draft.values()))}

    def as_dict(self) -> dict:
        return {"target_model": asdict(self.target), "draft_model": self.draft and asdict(self.draft),
                "concurrency": self.concurrency, "context": self.context, "k": self.k, "dtype": self.dtype,
                "bytes_per_element": self.bpe, "kv_bytes_per_token": self.target.kv_bytes_per_token(self.bpe),
                "bytes": self.tiers(),
                "config": {"target_worker.cache.max_sequences": self.concurrency,
                           "target_worker.cache.max_tokens": self.pool_tokens}}

    def text(self) -> str:
        t, b, n, T, k = self.target, self.bpe, self.concurrency, self.context, self.k
        tiers = self.tiers()
        tw, dw = tiers["target_worker"], tiers["draft_worker"]
        lines = [
            f"target model {t.name}: {t.layers} layers, {t.kv_heads} KV heads x head_dim {t.head_dim}, "
            f"vocab {t.vocab}, {t.params / 1e6:.1f}M params ({t.params_source}); {self.dtype} = {b} B/element",
            f"KV per token = 2 x {t.layers} layers x {t.kv_heads} KV heads x {t.head_dim} head_dim x {b} B"
            f" = {t.kv_bytes_per_token(b):,} B",
            "",
            f"target worker ({n} concurrent sequences x {T} tokens, k = {k})",
            _row("weights", f"{t.params:,} params x {b} B", tw["weights"]),
            _row("KV pool", f"2 x {t.layers} x {t.kv_heads} x {t.head_dim} x {self.pool_tokens} slots x {b} B",
                 tw["kv_cache"]),
            _row("verify logits", f"{k + 1} x {t.vocab} vocab x 4 B (fp32) x {n} seqs", tw["verify_logits_fp32"]),
            _row("total", "", tw["total"]),
            "",
        ]
        if self.draft is None:
            lines.append("draft worker: n-gram needs no model memory (draft_model with no draft model configured "
                         "loads the target: plan it with --draft-model <the target>)")
        else:
            d = self.draft
            lines += [
                f"draft worker (draft model {d.name}: {d.params / 1e6:.1f}M params, {d.layers} layers, "
                f"{d.kv_heads} KV heads x head_dim {d.head_dim})",
                _row("weights", f"{d.params:,} params x {b} B", dw["weights"]),
                *([_row("int8 copy", f"{d.params:,} params x 1 B (draft_model.weights: int8)", dw["int8_copy"])]
                  if dw["int8_copy"] else []),
                _row("KV cache", f"2 x {d.layers} x {d.kv_heads} x {d.head_dim} x {T} tokens x {n} seqs x {b} B",
                     dw["kv_cache"]),
                _row("propose", f"k = {k} positions: KV + fp32 probs x {n} seqs",
                     dw["propose_kv"] + dw["propose_logits_fp32"]),
                _row("total", "", dw["total"]),
            ]
        lines += ["", "add per process: the Python/torch runtime (~0.5-1 GiB on CPU; the CUDA context on a GPU);",
                  f"the KV pool holds {n} x ({T} context + one round's draft slots) and is allocated once at start",
                  "(drafts are verified in place inside it; a CPU commits its pages as they are first written).",
                  "on a CPU with target_worker.cpu_kernel on: + the weights again (float32 on an x86 CPU: the verify "
                  "kernel's packed copy, half that for a bf16 checkpoint; bf16: oneDNN's prepacked copy, "
                  "where its probe keeps it), and on a bf16 CPU "
                  "with AVX512-BF16 + the decoder's linears once more where target_worker.bf16_rows' probe keeps them.",
                  f"config: target_worker.cache.max_sequences: {n}, target_worker.cache.max_tokens: {self.pool_tokens}"]
        return "\n".join(lines)


def _row(label: str, formula: str, n: int) -> str:
    return f"  {label:<14}{formula:<60}{_fmt(n)}"


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:>10.2f} {unit}"
    return f"{n:>10d} B"


def plan_from_args(args) -> Plan:
    if args.concurrency < 1 or args.context < 1 or args.k < 0:
        raise ValueError("--concurrency and --context must be >= 1, --k >= 0")
    draft = model_shape(args.draft_model) if args.draft_model else None
    return Plan(model_shape(args.model), draft, args.concurrency, args.context, args.k, args.dtype,
                getattr(args, "draft_weights", "model"))
