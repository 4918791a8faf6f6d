"""Continuous request batching: one model thread serves every RPC thread.

RPC threads submit jobs and block on a future. The model thread takes the first waiting job,
then everything else already queued of the same kind (up to max_batch), and runs them as one
batch. While a batch runs, new jobs queue up and form the next batch — so batch size follows
load without any fixed wait.

Optionally (`gather`) the model thread waits a little for jobs it knows are coming: a target
worker's sequences between two rounds come back within a few ms of each other (each caller
turns its result into the next request), and a batch started on the first of them leaves the
rest for another whole forward. gather(kind, n) -> (jobs expected in all, longest wait in s).

Optionally (`streaming`) a batch runs step by step: run_batch(kind, payloads, stream) may answer a
job as soon as its own steps are done (stream.deliver) and take jobs of its kind queued meanwhile
into its next step (stream.take_more), as vLLM's scheduler does per iteration; jobs of another
kind waiting (stream.others_waiting) run between two of its steps (stream.run_others).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from specmesh.errors import Unavailable

log = logging.getLogger(__name__)


@dataclass
class Job:
    kind: str
    payload: Any
    future: Future = field(default_factory=Future)


class Stream:
    """The running batch of a streaming Batcher, seen from run_batch (the model thread only)."""

    def __init__(self, batcher: "Batcher", jobs: list[Job]):
        self._batcher, self.jobs, self._done = batcher, jobs, set()

    def delivered(self, i: int) -> bool:
        return i in self._done

    def deliver(self, i: int, result: Any) -> None:
        """Answer job i now (a result, or an exception to raise in its caller)."""
        self._done.add(i)
        _settle(self.jobs[i].future, result)

    def take_more(self, running: int) -> list:
        """Payloads of queued jobs of this batch's kind, now part of it, as many as the batcher's
        max_batch leaves room for beside `running` jobs still in the batch; jobs of another kind
        met on the way are held for the next batch. With a gather, the next step waits (bounded)
        for the jobs it says are coming, as a new batch does: else the jobs queued during a step
        start the next one alone while those just answered come back a few ms later, and the
        sequences settle into groups that alternate forwards (half the batch per forward)."""
        b, kind = self._batcher, self.jobs[0].kind
        new = b._take_held(kind, b._max_batch - running)  # first come
        while len(new) < b._max_batch - running:
            try:
                job = b._queue.get_nowait()
            except queue.Empty:
                break
            (new if job.kind == kind else b._held).append(job)
        if b._gather is not None and not b._held and running + len(new) > 0:
            b._wait_for_more(kind, new, b._held, running)
        live = [job for job in new if job.future.set_running_or_notify_cancel()]
        self.jobs.extend(live)
        return [job.payload for job in live]

    def others_waiting(self) -> bool:
        """A job of another kind waits, or the batcher is closing."""
        return bool(self._batcher._held) or self._batcher._stop.is_set()

    def closing(self) -> bool:
        """The batcher is closing: finish the batch now."""
        return self._batcher._stop.is_set()

    def run_others(self) -> None:
        """Run the jobs of another kind waiting (a prefill beside running decode bursts) now, as
        batches of their own between two steps of this one, which then goes on: its jobs keep
        their places, as vLLM's scheduler keeps running sequences while a new one prefills."""
        b, mine = self._batcher, self.jobs[0].kind
        while not b._stop.is_set():
            kind = next((j.kind for j in b._held if j.kind != mine), None)
            if kind is None:
                return
            batch = b._take_held(kind, b._max_batch)
            live = [j for j in batch if j.future.set_running_or_notify_cancel()]
            if live:
                b._run(live)


def _settle(future: Future, result: Any) -> None:
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _fail_unanswered(jobs: list[Job], exc: BaseException) -> None:
    """The error to every job not answered yet (a streaming batch may have answered some)."""
    for j in jobs:
        if not j.future.done():
            j.future.set_exception(exc)


class Batcher:
    """run_batch(kind, payloads) -> results (same order), or raises: the error goes to each job."""

    def __init__(self, run_batch: Callable[[str, list], list], max_batch: int, max_queue: int = 1024, name: str = "batcher",
                 gather: Callable[[str, int], tuple[int, float]] | None = None, streaming: bool = False):
        self._run_batch = run_batch
        self._gather = gather
        self._streaming = streaming
        self._max_batch = max_batch
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._held: list[Job] = []  # jobs taken off the queue but of another kind than the batch
        self._stop = threading.Event()
        self.batches_run = 0
        self.jobs_run = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def qsize(self) -> int:
        return self._queue.qsize() + len(self._held)

    def submit(self, kind: str, payload: Any) -> Future:
        if self._stop.is_set():
            raise Unavailable("worker is shutting down")
        if len(self._held) >= self._queue.maxsize:
            raise Unavailable("worker queue is full; retry later")
        job = Job(kind, payload)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Unavailable("worker queue is full; retry later") from None
        return job.future

    def close(self) -> None:
        """Stop the model thread; jobs still queued fail with UNAVAILABLE (nothing hangs)."""
        self._stop.set()
        self._thread.join(timeout=5)
        leftover = self._held + [self._queue.get_nowait() for _ in range(self._queue.qsize())]
        self._held = []
        for job in leftover:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(Unavailable("worker is shutting down"))

    def _take_held(self, kind: str, n: int) -> list[Job]:
        """Up to n held jobs of `kind`, oldest first, no longer held."""
        taken = [j for j in self._held if j.kind == kind][: max(0, n)]
        self._held = [j for j in self._held if all(j is not t for t in taken)]
        return taken

    def _next_batch(self) -> list[Job]:
        first = self._held.pop(0) if self._held else self._queue.get(timeout=0.1)
        batch = [first] + self._take_held(first.kind, self._max_batch - 1)
        rest = self._held  # the other held jobs, and those of other kinds queued below
        while len(batch) < self._max_batch:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            (batch if job.kind == first.kind else rest).append(job)
        if self._gather is not None and not rest:
            self._wait_for_more(first.kind, batch, rest)
        self._held = rest
        return batch

    def _wait_for_more(self, kind: str, batch: list[Job], rest: list[Job], running: int = 0) -> None:
        """Wait (bounded) for jobs of `kind` that gather says are coming, beside `running` jobs
        already in a streaming batch; another kind ends it."""
        want, wait_s = self._gather(kind, running + len(batch))
        deadline = time.monotonic() + wait_s
        while running + len(batch) < min(want, self._max_batch) and not rest:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                job = self._queue.get(timeout=left)
            except queue.Empty:
                return
            (batch if job.kind == kind else rest).append(job)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                batch = self._next_batch()
            except queue.Empty:
                continue
            live = [j for j in batch if j.future.set_running_or_notify_cancel()]
            if live:
                self._run(live)

    def _run(self, live: list[Job]) -> None:
        stream = Stream(self, live) if self._streaming else None
        try:
            payloads = [j.payload for j in live]
            results = self._run_batch(live[0].kind, payloads, stream) if stream else self._run_batch(live[0].kind, payloads)
        except BaseException as exc:  # noqa: BLE001 - delivered to every waiting caller
            log.exception("batch of %d %s jobs failed", len(live), live[0].kind)
            _fail_unanswered(live, exc)
            return
        if len(results) != len(live):
            _fail_unanswered(live, RuntimeError(f"batch returned {len(results)} results for {len(live)} jobs"))
            return
        self.batches_run += 1
        self.jobs_run += len(live)
        for i, (j, r) in enumerate(zip(live, results)):
            if stream is None or not stream.delivered(i):
                _settle(j.future, r)
