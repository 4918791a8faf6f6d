"""`specmesh bench --context`: what a long context and a long neighbour cost, through the public API.

Against a local stack (or --target), all requests AR (`method off`), T=0, streamed:
1. decode cost per token (TPOT) of one request at a ~60-token context vs a ~2,200-token one,
   each alone (median of --context-repeats requests);
2. 7 short requests decoding together, alone, vs the same 7 beside one ~2,200-token request that
   is already decoding (started first, its first token awaited) and keeps decoding throughout:
   the short ones' median TPOT in each case;
3. the target worker's RSS: after 16 concurrent ~2,000-token sequences, compared with weights +
   KV pool, and its growth over --context-soak short requests (16 concurrent) after a warm-up.
Prompts are raw text (no chat template), cut to a token count with the model's own tokenizer.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

from specmesh.bench.datasets import Prompt
from specmesh.bench.runner import Client, RequestOptions, stream_one

FILLER = ("The committee reviewed the quarterly figures line by line, asked where each number came from, "
          "and wrote down every question that nobody in the room could answer on the spot. ")


def _text(tokenizer, n_tokens: int, salt: int) -> str:
    ids = tokenizer(f"Note {salt}. " + FILLER * (n_tokens // 20 + 2), add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids) + "\nSummarise the notes above."


def _prompt(tokenizer, n_tokens: int, salt: int) -> Prompt:
    return Prompt(prompt_id=f"ctx{n_tokens}-{salt}", prompt=_text(tokenizer, n_tokens, salt))


def _raw(opts: RequestOptions):
    def run(stub, prompt, index):
        req_prompt = Prompt(prompt.prompt_id, prompt.prompt)
        return stream_one(stub, req_prompt, index, opts)
    return run


def _tpot(rec) -> float:
    toks = len(rec.token_ids)
    if rec.error or toks < 2:
        raise RuntimeError(f"request {rec.prompt_id} failed: {rec.error or 'too few tokens'}")
    return (rec.latency - rec.chunk_times[0]) / (toks - 1)


def _parallel(stub, prompts: list[Prompt], opts: RequestOptions) -> list:
    out = [None] * len(prompts)

    def one(i):
        out[i] = stream_one(stub, prompts[i], i, opts)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def alone(stub, tok, n: int, repeats: int, max_tokens: int) -> float:
    opts = RequestOptions(max_tokens=max_tokens, method="off")
    return statistics.median(_tpot(stream_one(stub, _prompt(tok, n, i), i, opts)) for i in range(repeats))


def beside_long(stub, tok, short: int, long: int, max_tokens: int) -> dict:
    """Short requests' TPOT: 7 together, then 7 beside one long request already decoding."""
    opts = RequestOptions(max_tokens=max_tokens, method="off")
    shorts = [_prompt(tok, short, 100 + i) for i in range(7)]
    base = statistics.median(_tpot(r) for r in _parallel(stub, shorts, opts))
    first = threading.Event()
    long_opts = RequestOptions(max_tokens=max_tokens * 6, method="off")
    holder = {}

    def run_long():
        from specmesh.bench.runner import build_request

        req = build_request(_prompt(tok, long, 999), 0, long_opts)
        n = 0
        for chunk in stub.GenerateStream(req, timeout=600):
            n += len(chunk.token_ids)
            first.set()
        holder["tokens"] = n

    t = threading.Thread(target=run_long)
    t.start()
    first.wait(600)
    mixed = _parallel(stub, shorts, opts)
    t.join()
    beside = statistics.median(_tpot(r) for r in mixed)
    return {"short_tpot_ms_alone": base * 1e3, "short_tpot_ms_beside_long": beside * 1e3,
            "ratio": beside / base, "long_tokens": holder.get("tokens")}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss(stub, tok, pid: int, soak: int, weights_mb: float, pool_mb: float) -> dict:
    opts = RequestOptions(max_tokens=8, method="off")
    _parallel(stub, [_prompt(tok, 2000, 200 + i) for i in range(16)], opts)
    after_16 = _rss_mb(pid)
    client_prompts = [_prompt(tok, 40 + (i % 7) * 30, 300 + i) for i in range(soak)]
    warm = max(16, soak // 10)
    for start in range(0, warm, 16):
        _parallel(stub, client_prompts[start:start + 16], opts)
    after_warm = _rss_mb(pid)
    for start in range(warm, soak, 16):
        _parallel(stub, client_prompts[start:start + 16], opts)
    end = _rss_mb(pid)
    return {"rss_mb_after_16x2000": after_16, "weights_mb": weights_mb, "pool_mb": pool_mb,
            "rss_over_weights_plus_pool": after_16 / (weights_mb + pool_mb),
            "rss_mb_after_warmup": after_warm, "rss_mb_end": end, "soak_requests": soak,
            "growth_after_warmup": end / after_warm - 1}


def main(args) -> int:
    from specmesh.bench.compare import command_line, machine_info
    from specmesh.bench.suite import mesh_target
    from specmesh.config import load_config
    from specmesh.engine.loader import load_tokenizer, resolve_model_dir

    cfg = load_config(args.config)
    model_dir = resolve_model_dir(cfg.model.name, cfg.model.path)
    tok = load_tokenizer(model_dir)
    weights_mb = _weights_mb(cfg, model_dir)
    with mesh_target(args, ["ngram"]) as (target, _):
        client = Client(target)
        pid = _target_pid(args)
        doc = {"command": command_line(), "machine": machine_info(), "model": str(model_dir)}
        short = alone(client.stub, tok, 60, args.context_repeats, args.max_tokens)
        long = alone(client.stub, tok, 2200, args.context_repeats, args.max_tokens)
        doc["decode"] = {"tpot_ms_60": short * 1e3, "tpot_ms_2200": long * 1e3, "ratio": long / short}
        print(json.dumps(doc["decode"]), file=sys.stderr)
        doc["mixed"] = beside_long(client.stub, tok, 60, 2200, args.max_tokens)
        print(json.dumps(doc["mixed"]), file=sys.stderr)
        if pid:
            pool_mb = _pool_mb(cfg, model_dir)
            doc["rss"] = rss(client.stub, tok, pid, args.context_soak, weights_mb, pool_mb)
            print(json.dumps(doc["rss"]), file=sys.stderr)
        client.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k not in ("machine",)}, indent=2))
    return 0


def _target_pid(args) -> int | None:
    """The local stack's target worker (by its command line); None with --target."""
    if args.target:
        return None
    time.sleep(0.5)
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "target_worker" in cmd and "python" in cmd:
                return int(proc.name)
    return None


def _weights_mb(cfg, model_dir) -> float:
    """The weights as the worker holds them: parameters x bytes per element of the resolved dtype
    (the CPU kernel's packed copy, when it runs, is on top: the worker logs its size)."""
    from specmesh.capacity import BYTES, model_shape
    from specmesh.engine.loader import dtype_name, resolve_dtype

    return model_shape(str(model_dir)).params * BYTES[dtype_name(resolve_dtype(cfg.model.dtype))] / 2**20


def _pool_mb(cfg, model_dir) -> float:
    from specmesh.capacity import BYTES, model_shape
    from specmesh.engine.loader import dtype_name, resolve_dtype

    shape = model_shape(str(model_dir))
    bpe = BYTES[dtype_name(resolve_dtype(cfg.model.dtype))]
    return shape.kv_bytes_per_token(bpe) * cfg.target_worker.cache.max_tokens / 2**20
