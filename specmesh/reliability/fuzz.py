"""The fuzz part: the known-good generation, the public and internal cases, the checks after."""

from __future__ import annotations

import time

from specmesh.reliability import runner
from specmesh.reliability.internal_cases import internal_case
from specmesh.reliability.public_cases import public_case
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc


def model_facts(mesh, cfg) -> dict:
    """vocab_size (the target's Status), context window and decoder layers of the served model."""
    from transformers import AutoConfig

    from specmesh.engine.loader import resolve_model_dir

    with mesh.channel("target_worker", own_connection=True) as ch:
        vocab = pb_grpc.TargetWorkerStub(ch).Status(pb.WorkerStatusRequest(), timeout=30).vocab_size
    text = AutoConfig.from_pretrained(resolve_model_dir(cfg.model.name, cfg.model.path)).get_text_config()
    return {"vocab_size": vocab, "context_window": int(getattr(text, "max_position_embeddings", 0) or 1 << 30),
            "num_layers": int(text.num_hidden_layers)}


def build_cases(seed: int, public_n: int, internal_n: int, model: dict, limits: dict, only=None) -> list:
    """only: ["public:12", "internal:3"] replays those cases alone."""
    if only:
        out = []
        for item in only:
            part, index = item.split(":")
            out.append(public_case(seed, int(index), limits) if part == "public"
                       else internal_case(seed, int(index), model, limits))
        return out
    return ([public_case(seed, i, limits) for i in range(public_n)]
            + [internal_case(seed, i, model, limits) for i in range(internal_n)])


def run_fuzz(mesh, cfg, seed: int, public_n: int, internal_n: int, concurrency: int = 4,
             deadline_s: float = 60.0, only=None, log=print, time_limit_s: float | None = None) -> runner.FuzzResult:
    t0 = time.monotonic()
    limits = vars_of(cfg.gateway)
    model = model_facts(mesh, cfg)
    baseline = runner.generate_tokens(mesh)
    cases = build_cases(seed, public_n, internal_n, model, limits, only)
    log(f"fuzz: seed {seed}, {len(cases)} cases ({public_n} public, {internal_n} internal), concurrency {concurrency}")

    def progress(outcome, done):
        if outcome.failure:
            log(f"  FAIL {outcome.case.part}:{outcome.case.index} [{outcome.case.kind}] {outcome.case.summary}: "
                f"{outcome.failure}")
        if done % 100 == 0:
            log(f"  {done}/{len(cases)} cases, {time.monotonic() - t0:.0f}s")

    result = runner.FuzzResult(seed, runner.run_cases(mesh, cases, concurrency, deadline_s, progress, time_limit_s))
    result.post = runner.post_checks(mesh, baseline)
    result.seconds = time.monotonic() - t0
    return result


def vars_of(section) -> dict:
    import dataclasses

    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


def to_json(result: runner.FuzzResult) -> dict:
    parts = sorted({o.case.part for o in result.outcomes})
    return {
        "seed": result.seed,
        "seconds": round(result.seconds, 1),
        "cases": {p: sum(1 for o in result.outcomes if o.case.part == p) for p in parts},
        "calls": {p: sum(result.histogram(p).values()) for p in parts},
        "statuses": {p: dict(sorted(result.histogram(p).items())) for p in parts},
        "kinds": _kinds(result),
        # DEADLINE_EXCEEDED from cases that set a tiny deadline on purpose (any other one is a hang)
        "deadline_asked": sum(1 for o in result.outcomes for st, s in zip(o.case.steps, o.statuses)
                              if s == "DEADLINE_EXCEEDED" and st.deadline_s is not None),
        "failures": [{"case": f"{o.case.part}:{o.case.index}", "kind": o.case.kind, "summary": o.case.summary,
                      "failure": o.failure} for o in result.failures()],
        "post": result.post,
        "passed": result.passed(),
    }


def _kinds(result: runner.FuzzResult) -> dict:
    out: dict = {}
    for o in result.outcomes:
        row = out.setdefault(f"{o.case.part}/{o.case.kind}", {"cases": 0, "failed": 0})
        row["cases"] += 1
        row["failed"] += bool(o.failure)
    return dict(sorted(out.items()))
