"""Sliding windows of target feature rows for the block drafter. Pure torch, no I/O.

A sequence's committed positions are 0..end-1 (every context token except the last one, which
the target has not forwarded yet). Feature row j is the target's hidden-state features of
position j. Both the coordinator and a draft worker keep only the newest `window` rows: the
drafter reads features of positions end-window..end-1.

Transfer (coordinator -> draft worker, ProposeRequest.features): rows always END at the
committed end, so their positions are implied: r rows sent with end e cover [e - r, e).
  - delta: the rows committed since the last successful send; the worker appends them to its
    window if they touch or overlap it (e - r <= its end), else it reports a miss;
  - complete: the coordinator's whole window (after a miss, a failover, or the first round);
    the worker replaces what it holds.
"""

from __future__ import annotations

import torch


class FeatureWindow:
    """The newest <= `window` feature rows of one sequence: rows[i] is position end - n + i."""

    def __init__(self, window: int, rows: torch.Tensor | None = None, end: int = 0):
        self.window = window
        self.rows: torch.Tensor | None = None  # [n, F], n <= window
        self.end = 0
        if rows is not None:
            self.replace(rows, end)

    @property
    def start(self) -> int:
        return self.end - (0 if self.rows is None else self.rows.shape[0])

    def __len__(self) -> int:
        return 0 if self.rows is None else self.rows.shape[0]

    def replace(self, rows: torch.Tensor, end: int) -> None:
        """rows: [r, F] for positions [end - r, end); keeps the last `window`."""
        if rows.dim() != 2 or rows.shape[0] > end:
            raise ValueError(f"{tuple(rows.shape)} rows cannot end at position {end}")
        self.rows, self.end = rows[-self.window:], end

    def extend(self, rows: torch.Tensor, end: int) -> bool:
        """Merge rows [r, F] covering [end - r, end). Held rows at positions >= end - r are
        replaced by the new ones. False (nothing changed) if they leave a gap after the held rows
        or the feature width differs."""
        if self.rows is None:
            return False
        first = end - rows.shape[0]  # position of rows[0]
        if first > self.end or rows.shape[1] != self.rows.shape[1]:
            return False
        keep = self.rows[: max(0, first - self.start)]  # held rows before the new ones
        self.replace(torch.cat([keep, rows.to(keep.dtype)], dim=0), end)
        return True

    def since(self, position: int) -> torch.Tensor:
        """Rows of positions [max(position, start), end): [m, F]."""
        return self.rows[max(0, position - self.start):]

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded to the window, as the drafter takes it: feats [window, F], valid [window] bool."""
        n, f = self.rows.shape
        feats = self.rows.new_zeros((self.window, f))
        valid = torch.zeros(self.window, dtype=torch.bool)
        feats[self.window - n:] = self.rows
        valid[self.window - n:] = True
        return feats, valid


class FeatureFeed:
    """Coordinator side: the window it holds for one sequence and what the draft tier has."""

    def __init__(self, window: int):
        self.window = FeatureWindow(window)
        self.sent_end: int | None = None  # the draft tier holds rows up to here (None: nothing sent)

    def reset(self, rows: torch.Tensor, end: int) -> None:
        """After a prefill (or a failover re-prefill): rows [r, F] end at `end`."""
        self.window.replace(rows, end)
        self.sent_end = None

    def extend(self, rows: torch.Tensor, end: int) -> None:
        """After a verify round: rows [n+1, F] of the slots it committed, now ending at `end`."""
        if not self.window.extend(rows, end):  # none held yet (a request switched to the block drafter)
            self.reset(rows, end)

    def outgoing(self, complete: bool = False) -> tuple[torch.Tensor | None, bool]:
        """(rows to send, complete). Complete = the whole window (replace); else the delta."""
        w = self.window
        if w.rows is None:
            return None, False
        if complete or self.sent_end is None or self.sent_end < w.start:
            return w.rows, True
        return w.since(self.sent_end), False

    def sent(self) -> None:
        self.sent_end = self.window.end
