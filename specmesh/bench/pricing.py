"""Cost per million output tokens (`specmesh bench --price draft=0.9,target=3.5`). Pure: no grpc.

Prices are per instance-hour per tier (draft, target, gateway, coordinator; a tier left out costs
nothing). For each run (mode, level):

    $/hour      = sum over tiers of price[tier] * instances the mode used of that tier
    $/1M tokens = $/hour / (output tokens/s * 3600) * 1e6

output tokens/s is the run's measured throughput (all its clients together), so the figure is
what the fleet costs per million tokens at that load. Instances the mode used (`Fleet` is the
mesh the bench ran: its draft and target workers, one gateway, one coordinator):

    ar                       target workers (+ gateway, coordinator)
    spec, remote drafter     draft workers + target workers (+ gateway, coordinator)
    spec, local n-gram       target workers (+ gateway, coordinator): drafted in the coordinator
    hf_* peers (in-process)  one target instance
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from specmesh.bench.compare import _key as level_key

TIERS = ("draft", "target", "gateway", "coordinator")
PEER_PREFIX = "hf_"
FORMULA = ("usd_per_million_output_tokens = sum(price[tier] * instances[tier]) / (output_tokens_per_s * 3600) * 1e6; "
           "ar: target (+gateway, coordinator); spec: draft + target (+gateway, coordinator), no draft tier for "
           "n-gram drafted in the coordinator; in-process peers: one target instance")


def parse_prices(text: str) -> dict[str, float]:
    """'draft=0.9,target=3.5' -> {'draft': 0.9, 'target': 3.5} ($ per instance-hour).
    ValueError with a message naming the problem: bad syntax, not a number, negative, unknown or
    repeated tier."""
    prices: dict[str, float] = {}
    items = [item.strip() for item in (text or "").split(",")]
    if not any(items):
        raise ValueError(f"give TIER=USD_PER_HOUR pairs, e.g. draft=0.9,target=3.5 (tiers: {', '.join(TIERS)})")
    for item in items:
        tier, eq, value = item.partition("=")
        tier, value = tier.strip(), value.strip()
        if not eq or not tier or not value:
            raise ValueError(f"{item!r}: expected TIER=USD_PER_HOUR, e.g. target=3.5")
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r} (tiers: {', '.join(TIERS)})")
        if tier in prices:
            raise ValueError(f"tier {tier!r} priced twice")
        try:
            price = float(value)
        except ValueError:
            raise ValueError(f"{tier}={value!r}: not a number") from None
        if not math.isfinite(price) or price < 0:
            raise ValueError(f"{tier}={value}: a price must be a finite number >= 0")
        prices[tier] = price
    return prices


@dataclass(frozen=True)
class Fleet:
    """The instances of the mesh a bench ran against."""

    draft: int = 1
    target: int = 1
    gateway: int = 1
    coordinator: int = 1


def fleet_of(args, cfg) -> tuple[Fleet, frozenset, str]:
    """(the fleet, drafters run in the coordinator, where the counts come from) for a bench run:
    the local stack's workers, or for --target the --draft-workers / --target-workers given (the
    bench cannot see a remote mesh; there the local n-gram setting is --config's too)."""
    fleet = Fleet(draft=args.draft_workers, target=args.target_workers)
    local = frozenset({"ngram"}) if cfg.coordinator.local_ngram else frozenset()
    source = ("declared with --draft-workers / --target-workers for the --target mesh" if args.target
              else "the local stack this bench started")
    return fleet, local, source


def instances(mode: str, drafter_method: str | None, fleet: Fleet, local_drafters: frozenset = frozenset()) -> dict:
    """{tier: count} a run of `mode` used (see the module doc)."""
    if mode.startswith(PEER_PREFIX):
        return {"draft": 0, "target": 1, "gateway": 0, "coordinator": 0}
    remote_draft = mode == "spec" and drafter_method is not None and drafter_method not in local_drafters
    return {"draft": fleet.draft if remote_draft else 0, "target": fleet.target,
            "gateway": fleet.gateway, "coordinator": fleet.coordinator}


def usd_per_hour(prices: dict[str, float], used: dict[str, int]) -> float:
    return sum(prices.get(tier, 0.0) * n for tier, n in used.items())


def usd_per_million(hourly: float, tokens_per_s: float | None) -> float | None:
    """None when nothing was produced (no throughput to spread the cost over)."""
    if not tokens_per_s or tokens_per_s <= 0:
        return None
    return hourly / (tokens_per_s * 3600.0) * 1e6


def add_costs(doc: dict, prices: dict[str, float], fleet: Fleet, local_drafters: frozenset,
              fleet_source: str) -> None:
    """Annotate a result document in place: doc['price'] and each run's 'cost'."""
    ar = {}
    for run in doc["runs"]:
        method = run["drafter"].split(":", 1)[0] if run.get("drafter") else None
        used = instances(run["mode"], method, fleet, local_drafters)
        hourly = usd_per_hour(prices, used)
        run["cost"] = {"instances": used, "usd_per_hour": hourly,
                       "usd_per_million_output_tokens": usd_per_million(hourly, run["output_tokens_per_s"])}
        if run["mode"] == "ar":
            ar[level_key(run)] = run["cost"]["usd_per_million_output_tokens"]
    for run in doc["runs"]:
        mine, base = run["cost"]["usd_per_million_output_tokens"], ar.get(level_key(run))
        run["cost"]["vs_ar"] = mine / base if mine is not None and base else None
    doc["price"] = {"usd_per_instance_hour": dict(prices), "fleet": asdict(fleet), "fleet_source": fleet_source,
                    "local_drafters": sorted(local_drafters), "formula": FORMULA}


def cost_errors(doc: dict) -> list[str]:
    """Schema problems of the price annotations ([] when there are none or they are fine)."""
    if "price" not in doc:
        return []
    errs = []
    price = doc["price"]
    if not isinstance(price, dict) or not isinstance(price.get("usd_per_instance_hour"), dict):
        return ["price.usd_per_instance_hour: missing"]
    for i, run in enumerate(doc.get("runs") or []):
        c = run.get("cost") if isinstance(run, dict) else None
        v = c.get("usd_per_million_output_tokens", "missing") if isinstance(c, dict) else "missing"
        if not isinstance(c, dict) or not isinstance(c.get("instances"), dict) or \
                not (v is None or isinstance(v, (int, float))):
            errs.append(f"runs[{i}].cost: needs instances and usd_per_million_output_tokens (number or null)")
    return errs


def _money(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}" if v >= 1 else f"{v:.4f}"


def markdown_section(doc: dict) -> list[str]:
    """The cost table of a priced result ([] when the run was not priced)."""
    price = doc.get("price")
    if not price:
        return []
    prices = ", ".join(f"{t} {p:g}" for t, p in price["usd_per_instance_hour"].items())
    fleet = ", ".join(f"{n} {t}" for t, n in price["fleet"].items())
    local = price.get("local_drafters") or []
    local = f"; drafted in the coordinator, no draft tier: {', '.join(local)}" if local else ""
    lines = ["", f"### Cost per million output tokens (USD per instance-hour: {prices})",
             f"- fleet: {fleet} ({price['fleet_source']}){local}; a tier without a price costs 0",
             f"- {price['formula']}", "",
             "| mode | drafter | conc (or rate) | instances draft/target/gateway/coordinator | USD/hour | out tok/s "
             "| USD per 1M out tokens | cost vs AR |", "|" + "---|" * 8]
    for r in doc["runs"]:
        c = r["cost"]
        used = "/".join(str(c["instances"][t]) for t in TIERS)
        level = f"{r['request_rate']}/s" if r.get("request_rate") is not None else str(r["concurrency"])
        vs = "-" if c.get("vs_ar") is None else f"{c['vs_ar']:.2f}x"
        lines.append(f"| {r['mode']} | {r['drafter'] or '-'} | {level} | {used} | {c['usd_per_hour']:.2f} "
                     f"| {r['output_tokens_per_s']:.2f} | {_money(c['usd_per_million_output_tokens'])} | {vs} |")
    return lines

