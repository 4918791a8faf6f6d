"""Protobuf <-> core value types. Core code never sees protobuf; servicers call these."""

from __future__ import annotations

import numpy as np
import torch

from specmesh.core.types import DraftProposal, FeatureSpec, MatchBucket, NgramBurst, SamplingParams, SpecStats
from specmesh.errors import InvalidArgument
from specmesh.v1 import specmesh_pb2 as pb


def sampling_from_pb(opts: pb.SamplingOptions) -> SamplingParams:
    return SamplingParams(
        temperature=float(opts.temperature) if opts.HasField("temperature") else 0.0,
        top_p=float(opts.top_p) if opts.HasField("top_p") else 1.0,
        top_k=int(opts.top_k) if opts.HasField("top_k") else 0,
        seed=int(opts.seed) if opts.HasField("seed") else None,
    )


def checked_sampling_from_pb(opts: pb.SamplingOptions, field: str = "sampling") -> SamplingParams:
    """sampling_from_pb, validated (InvalidArgument naming e.g. sampling.top_p): an internal
    service never samples with a NaN temperature or a top_p outside (0, 1]."""
    params = sampling_from_pb(opts)
    try:
        params.validate()
    except InvalidArgument as exc:
        raise InvalidArgument(f"{field}.{exc.field}", str(exc).split(": ", 1)[1]) from None
    return params


def sampling_to_pb(params: SamplingParams) -> pb.SamplingOptions:
    opts = pb.SamplingOptions(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.seed is not None:
        opts.seed = params.seed
    return opts


def probs_to_bytes(probs: torch.Tensor | None) -> bytes:
    """probs: [k, V] float32 -> row-major little-endian bytes (empty for a point mass)."""
    if probs is None:
        return b""
    return probs.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()


def probs_from_bytes(data: bytes, k: int, vocab_size: int) -> torch.Tensor | None:
    """Inverse of probs_to_bytes -> [k, V] float32, or None for an empty field."""
    if not data:
        return None
    if vocab_size <= 0 or len(data) != 4 * k * vocab_size:
        raise InvalidArgument("draft_probs", f"{len(data)} bytes is not float32 [{k}, {vocab_size}]")
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").reshape(k, vocab_size).copy())


def probs_to_wire(probs: torch.Tensor | None) -> tuple[bytes, pb.SparseProbs | None]:
    """probs: [k, V] -> (dense bytes, None), or (b"", SparseProbs) when the rows' supports are
    small enough that 8 bytes per kept entry beat 4 per vocabulary entry (a truncated proposal)."""
    if probs is None:
        return b"", None
    p = probs.detach().to(torch.float32)
    nnz = (p > 0).sum(dim=1)  # [k]
    if int(nnz.sum()) * 8 >= p.numel() * 4:
        return probs_to_bytes(p), None
    rows, cols = (p > 0).nonzero(as_tuple=True)  # row-major: each row's support in index order
    sparse = pb.SparseProbs(row_lengths=nnz.tolist(),
                            token_ids=cols.numpy().astype("<u4").tobytes(),
                            probs=p[rows, cols].numpy().astype("<f4").tobytes())
    return b"", sparse


def sparse_from_pb(sparse: pb.SparseProbs, tokens: list[int], vocab_size: int) -> torch.Tensor:
    """SparseProbs -> dense [k, V] float32, validated: one row per drafted token, ids in range,
    non-negative finite values summing to 1 per row, and each drafted token inside its row."""
    lengths = list(sparse.row_lengths)
    ids = np.frombuffer(sparse.token_ids, dtype="<u4").astype(np.int64)
    vals = np.frombuffer(sparse.probs, dtype="<f4")
    if vocab_size <= 0 or len(lengths) != len(tokens) or len(ids) != sum(lengths) or len(vals) != len(ids):
        raise InvalidArgument("sparse_probs", f"{len(lengths)} rows, {len(ids)} ids and {len(vals)} values "
                                              f"for {len(tokens)} drafted tokens")
    if len(ids) and (ids.max() >= vocab_size or not np.isfinite(vals).all() or (vals < 0).any()):
        raise InvalidArgument("sparse_probs", f"ids must be in [0, {vocab_size}) and values finite, >= 0")
    out = torch.zeros(len(tokens), vocab_size)
    rows = np.repeat(np.arange(len(tokens)), lengths)
    out[torch.from_numpy(rows), torch.from_numpy(ids)] = torch.from_numpy(vals.copy())
    return check_rows(out, tokens, "sparse_probs")


def check_rows(probs: torch.Tensor, tokens: list[int], field: str) -> torch.Tensor:
    """probs [k, V] must be distributions (finite, >= 0, each row summing to 1) in which each drafted
    token has mass: rejection sampling divides by them, so a NaN or a negative row breaks it."""
    if len(tokens) and (not torch.isfinite(probs).all() or (probs < 0).any()):
        raise InvalidArgument(field, "values must be finite and >= 0")
    if len(tokens) and ((probs.sum(dim=1) - 1).abs() > 1e-3).any():
        raise InvalidArgument(field, "each row must sum to 1")
    if any(probs[i, t] <= 0 for i, t in enumerate(tokens) if 0 <= t < probs.shape[1]):
        raise InvalidArgument(field, "a drafted token lies outside the distribution it was drawn from")
    return probs


def proposal_from_pb(token_ids, probs: bytes, vocab_size: int, parents=(), missing_features: bool = False,
                     sparse: pb.SparseProbs | None = None, candidates: pb.Candidates | None = None,
                     accept=()) -> DraftProposal:
    """parents: a draft tree's parent list (empty = a chain); sparse: the rows in sparse form;
    candidates: a block drafter's candidate table (ProposeRequest.candidates); accept: a chain's
    p_i (VerifyRequest.draft_accept; empty: none)."""
    tokens = list(token_ids)
    tree = list(parents) or None
    if tree is not None and len(tree) != len(tokens):
        raise InvalidArgument("draft_parents", f"{len(tree)} parents for {len(tokens)} draft tokens")
    odds = checked_rates(accept, "draft_accept") or None
    if odds is not None and (tree is not None or len(odds) != len(tokens)):
        raise InvalidArgument("draft_accept", f"one value per chain draft token ({len(odds)} for {len(tokens)}"
                              f"{', a tree' if tree is not None else ''})")
    if sparse is not None and sparse.row_lengths:
        dist = sparse_from_pb(sparse, tokens, vocab_size)
    else:
        dist = probs_from_bytes(probs, len(tokens), vocab_size)
        if dist is not None:
            check_rows(dist, tokens, "draft_probs")
    table = candidates_from_pb(candidates) if candidates is not None else None
    return DraftProposal(tokens, dist, tree, missing_features, table, accept=odds)


def checked_rates(values, field: str) -> list[float]:
    """Probabilities off the wire: each finite and in [0, 1], at most 64 (INVALID_ARGUMENT)."""
    out = [float(v) for v in values]
    if len(out) > 64 or not all(0.0 <= v <= 1.0 for v in out):  # NaN fails both comparisons
        raise InvalidArgument(field, "at most 64 values, each in [0, 1]")
    return out


def candidates_to_pb(table: tuple[torch.Tensor, torch.Tensor] | None) -> pb.Candidates | None:
    """(log q [D, W], tokens [D, W]) -> Candidates (None -> None)."""
    if table is None:
        return None
    logq, tokens = table
    return pb.Candidates(depth=logq.shape[0], width=logq.shape[1], logprobs=logq.float().flatten().tolist(),
                         token_ids=tokens.flatten().tolist())


def candidates_from_pb(msg: pb.Candidates, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Candidates -> (log q [D, W] float32, tokens [D, W] int64), checked; None when empty."""
    if msg.depth == 0:
        return None
    shape = (msg.depth, msg.width)
    if msg.depth < 0 or msg.width <= 0 or len(msg.logprobs) != shape[0] * shape[1] \
            or len(msg.token_ids) != shape[0] * shape[1]:
        raise InvalidArgument("candidates", f"want {shape[0]} x {shape[1]} log-probabilities and tokens, got "
                                            f"{len(msg.logprobs)} and {len(msg.token_ids)}")
    logq = torch.tensor(list(msg.logprobs), dtype=torch.float32).view(shape)
    tokens = torch.tensor(list(msg.token_ids), dtype=torch.long).view(shape)
    if (tokens < 0).any() or (vocab_size and (tokens >= vocab_size).any()):
        raise InvalidArgument("candidates", "token ids outside the vocabulary")
    if torch.isnan(logq).any() or (logq > 0).any() or (logq[:, 1:] > logq[:, :-1]).any():
        raise InvalidArgument("candidates", "log-probabilities must be <= 0 and descending in each row")
    return logq, tokens


def features_to_pb(rows: torch.Tensor | None) -> pb.FeatureRows | None:
    """rows: [n, F] -> FeatureRows with bfloat16 little-endian bytes (None -> None)."""
    if rows is None:
        return None
    bf16 = rows.detach().to(torch.bfloat16).contiguous()
    data = bf16.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()  # bf16 bits as int16
    return pb.FeatureRows(data=data, rows=bf16.shape[0], dim=bf16.shape[1])


def features_from_pb(msg: pb.FeatureRows, field: str = "features") -> torch.Tensor | None:
    """Inverse of features_to_pb -> [rows, dim] bfloat16, or None for an empty message."""
    if msg.rows == 0 and not msg.data:
        return None
    if msg.rows < 0 or msg.dim <= 0 or len(msg.data) != 2 * msg.rows * msg.dim:
        raise InvalidArgument(field, f"{len(msg.data)} bytes is not bfloat16 [{msg.rows}, {msg.dim}]")
    bits = np.frombuffer(msg.data, dtype="<i2").reshape(msg.rows, msg.dim).copy()
    return torch.from_numpy(bits).view(torch.bfloat16)


def feature_request_to_pb(spec: FeatureSpec) -> pb.FeatureRequest:
    return pb.FeatureRequest(layers=list(spec.layers), max_rows=spec.max_rows)


def feature_request_from_pb(request, field: str = "return_features") -> FeatureSpec | None:
    """The FeatureSpec of a Prefill/Verify request, None when it asks for no features."""
    if not request.HasField(field):
        return None
    msg = getattr(request, field)
    if not msg.layers or msg.max_rows < 0:
        raise InvalidArgument(field, "needs at least one layer and max_rows >= 0")
    return FeatureSpec(tuple(msg.layers), msg.max_rows)


def stats_to_pb(stats: SpecStats, method: str) -> pb.SpecStats:
    return pb.SpecStats(
        rounds=stats.rounds,
        drafted_tokens=stats.drafted_tokens,
        accepted_tokens=stats.accepted_tokens,
        mean_acceptance_length=stats.mean_acceptance_length,
        accepted_per_position=stats.accepted_per_position,
        drafted_per_position=stats.drafted_per_position,
        draft_failures=stats.draft_failures,
        tier_down_rounds=stats.tier_down_rounds,
        method=method,
        draft_time_s=stats.draft_time_s,
        verify_time_s=stats.verify_time_s,
        feature_bytes=stats.feature_bytes,
        draft_feature_bytes=stats.draft_feature_bytes,
        chosen_k=stats.chosen_k,
        predraft_hits=stats.predraft_hits,
        predraft_misses=stats.predraft_misses,
        draft_wait_s=stats.draft_wait_s,
        draft_waits=stats.draft_waits,
        trimmed_tokens=stats.trimmed_tokens,
        graft_rounds=stats.graft_rounds,
        graft_tokens=stats.graft_tokens,
    )


def cost_to_pb(cost: dict | None) -> pb.VerifyCostTable | None:
    """A VerifyCost.as_dict() -> VerifyCostTable (None -> None)."""
    if cost is None:
        return None
    return pb.VerifyCostTable(rows=cost["rows"], seconds=cost["seconds"], mean_batch=cost["mean_batch"],
                              live=int(cost.get("live", 0)), mean_rows=cost.get("mean_rows", 1.0),
                              mean_tokens=cost.get("mean_tokens", 1.0), batches=cost.get("batches", ()),
                              batch_seconds=cost.get("batch_seconds", ()), batch_slopes=cost.get("batch_slopes", ()))


def cost_from_pb(msg: pb.VerifyCostTable) -> dict | None:
    """Inverse of cost_to_pb; None for an empty table (a worker that sent none)."""
    if not msg.rows or len(msg.rows) != len(msg.seconds):
        return None
    return {"rows": list(msg.rows), "seconds": list(msg.seconds), "mean_batch": msg.mean_batch or 1.0,
            "live": msg.live, "mean_rows": msg.mean_rows or 1.0, "mean_tokens": msg.mean_tokens or 1.0,
            **({"batches": list(msg.batches), "batch_seconds": list(msg.batch_seconds),
                "batch_slopes": list(msg.batch_slopes)}
               if len(msg.batches) == len(msg.batch_seconds) == len(msg.batch_slopes) else {})}


def ngram_burst_to_pb(spec: NgramBurst | None) -> pb.NgramBurst | None:
    if spec is None:
        return None
    return pb.NgramBurst(k=spec.k, min_n=spec.min_n, max_n=spec.max_n, max_tokens=spec.max_tokens, rates=spec.rates,
                         by_match=[pb.NgramMatchBucket(min_match=b.min_match, k=b.k, rates=b.rates)
                                   for b in spec.by_match])


def ngram_burst_from_pb(request) -> NgramBurst | None:
    """VerifyRequest.ngram_burst, or None when not set (the engine checks the values)."""
    if not request.HasField("ngram_burst"):
        return None
    m = request.ngram_burst
    by_match = tuple(MatchBucket(b.min_match, b.k, tuple(checked_rates(b.rates, "ngram_burst.by_match.rates")))
                     for b in m.by_match)
    return NgramBurst(m.k, m.min_n, m.max_n, m.max_tokens, tuple(checked_rates(m.rates, "ngram_burst.rates")),
                      by_match)


def burst_steps_from_pb(resp) -> list[tuple[int, int]] | None:
    """VerifyResponse.step_drafted / step_accepted as [(drafted, accepted)] (None: not sent)."""
    if len(resp.step_drafted) != len(resp.step_accepted) or not resp.step_drafted:
        return None
    return list(zip(resp.step_drafted, resp.step_accepted))
