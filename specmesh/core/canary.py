"""The speculation canary's arm choice. Pure: no grpc, no metrics.

Each request is put in one of two arms, once, when the coordinator receives it:

    spec     it speculates (its own drafter and k, through the admin hot switch)
    control  it runs with speculation off (the target alone), whatever it asked for

A request is in `spec` when all three hold:
  * it would speculate at all (its method, or the deployment's default, is not "off" and k > 0):
    a request that asks for no speculation is never made to speculate, and is counted in
    `control`, the arm whose treatment it gets;
  * the canary's key list is empty, or the request's API key name is in it (other keys' requests
    stay on the control treatment);
  * the stable hash of its request id falls below the share: sha256(request_id) read as a
    fraction in [0, 1). The same id always lands in the same arm, on every coordinator, and
    raising the share only moves requests from `control` to `spec`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from specmesh.errors import InvalidArgument

SPEC = "spec"
CONTROL = "control"
ARMS = (SPEC, CONTROL)
_SCALE = float(1 << 64)


def hash_fraction(request_id: str) -> float:
    """The first 8 bytes of sha256(request_id) as a fraction in [0, 1)."""
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE


def choose_arm(request_id: str, share: float, keys: tuple[str, ...] = (), key_name: str = "",
               speculates: bool = True) -> str:
    if not speculates:
        return CONTROL
    if keys and key_name not in keys:
        return CONTROL
    return SPEC if hash_fraction(request_id) < share else CONTROL


def check_share(share: float) -> float:
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not math.isfinite(share) \
            or not 0.0 <= share <= 1.0:
        raise InvalidArgument("share", f"must be a number in [0, 1], got {share!r}")
    return float(share)


def parse_keys(text: str | None) -> tuple[str, ...]:
    """"team-a, team-b" -> ("team-a", "team-b"); "" or None -> () (every key). Sorted, no repeats."""
    if not text:
        return ()
    names = {n.strip() for n in text.split(",")}
    return tuple(sorted(n for n in names if n))


@dataclass(frozen=True)
class Canary:
    """The canary's settings: share of eligible requests in `spec`, the API key names it is
    limited to (() = every request), and why the guard last turned it to 0 ("" = it did not)."""

    share: float = 1.0
    keys: tuple[str, ...] = ()
    tripped: str = ""

    def arm(self, request_id: str, key_name: str = "", speculates: bool = True) -> str:
        return choose_arm(request_id, self.share, self.keys, key_name, speculates)
