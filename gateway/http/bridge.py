"""Blocking core calls from the event loop: one worker thread owns a call from start to end.

The core (auth against Redis, the admission slot, the gRPC call to the coordinator) blocks, so
each request's work runs on the front's thread pool, inside the request's context (trace span,
request info), and hands its results to the loop through a queue. `cancel()` is the HTTP
client going away: it runs the cancel callbacks the core registered (the coordinator call's
cancel), so the blocked call fails at once, the core's own clean-up runs on its thread
(refund, release) and the coordinator stops generating and frees the sequence's KV.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from concurrent.futures import Executor
from typing import Callable, Iterator

_END = object()


class CancelHook:
    """Callbacks to run once when the client goes away; one registered after that runs at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], object]] = []
        self.fired = False

    def watch(self, cancel: Callable[[], object]) -> None:
        with self._lock:
            if not self.fired:
                self._callbacks.append(cancel)
                return
        cancel()

    def fire(self) -> None:
        with self._lock:
            if self.fired:
                return
            self.fired, callbacks = True, list(self._callbacks)
        for cancel in callbacks:
            cancel()


async def run_blocking(pool: Executor, ctx: contextvars.Context, fn, *args):
    """fn(*args) on the pool, inside ctx (a copy of the request's context)."""
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(ctx.run, fn, *args))


class ThreadStream:
    """Iterates make(watch) on one pool thread; `await next()` gets its items in order."""

    def __init__(self, make: Callable[[Callable], Iterator], pool: Executor, ctx: contextvars.Context):
        self.hook = CancelHook()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.done = pool.submit(ctx.run, self._pump, make)

    def _put(self, item, exc=None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (item, exc))
        except RuntimeError:  # the loop is closed (server stopped): nobody is listening
            pass

    def _pump(self, make) -> None:
        it = None
        try:
            it = make(self.hook.watch)
            for item in it:
                self._put(item)
                if self.hook.fired:
                    break
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, raised there
            self._put(_END, exc)
            return
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()  # a generator stopped early: its clean-up runs here, on its own thread
        self._put(_END)

    async def next(self):
        """The next item; raises StopAsyncIteration at the end, or what the iterator raised."""
        item, exc = await self._queue.get()
        if item is _END:
            if exc is not None:
                raise exc
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self.hook.fire()
