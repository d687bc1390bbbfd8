"""Up to ``parallel`` generations decode at a time — one by default (the models hold one KV cache
each); more with a :class:`kibidango.decode.batching.Batcher`, which merges their forward passes
(continuous batching: a request joins and leaves the running batch between forwards). Requests
wait in a FIFO queue of at most ``max_queue``, each runs on a worker thread and hands its output
to the event loop piece by piece; a request not finished ``request_timeout_s`` after it came is
cancelled, and ``/health`` reports a generation that made no progress for ``stall_seconds``."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from kibidango.backends.base import ContextLengthError
from kibidango.decode.batching import Batcher
from kibidango.pipeline import Pipeline

log = logging.getLogger("kibidango.server")


HEALTH_STALL_S = 120.0


class Generation:
    """One request's work, run on a worker thread and handed to the event loop piece by piece.
    Setting ``cancel`` stops it after the current decoding round (or before it starts, while it
    waits its turn); past ``deadline`` (monotonic seconds) it stops the same way and ends with
    ``timeout``."""

    def __init__(self, deadline: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancel = threading.Event()
        self.deadline = deadline
        self.timed_out = False

    def put(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass


class FifoLock:
    """A lock held by at most ``permits`` holders, granted in arrival order, so that under load
    every request waits about as long as the queue ahead of it (a plain lock polled by many
    threads lets some wait far longer). :meth:`enter` takes a ticket (an event set when the lock
    is granted); :meth:`withdraw` gives up a ticket (passing the lock on if it was granted
    meanwhile); :meth:`release` passes it on."""

    def __init__(self, permits: int = 1) -> None:
        self._mutex = threading.Lock()
        self._free = permits
        self._queue: collections.deque[threading.Event] = collections.deque()

    def enter(self) -> threading.Event:
        ticket = threading.Event()
        with self._mutex:
            if self._free > 0:
                self._free -= 1
                ticket.set()
            else:
                self._queue.append(ticket)
        return ticket

    def withdraw(self, ticket: threading.Event) -> None:
        with self._mutex:
            if ticket.is_set():
                self._pass_on()
            else:
                self._queue.remove(ticket)

    def release(self) -> None:
        with self._mutex:
            self._pass_on()

    def acquire(self, timeout: float = -1) -> bool:
        ticket = self.enter()
        if ticket.wait(None if timeout < 0 else timeout):
            return True
        with self._mutex:
            if ticket.is_set():  # granted at the last moment
                return True
            self._queue.remove(ticket)
        return False

    def _pass_on(self) -> None:  # the mutex is held
        if self._queue:
            self._queue.popleft().set()
        else:
            self._free += 1


class Scheduler:
    """``parallel`` generations at a time (one without a ``batcher``: the models hold one KV
    cache each), each request on its own daemon thread, in arrival order. A slot is held by that
    thread only while it decodes — never across a network write or a cloud call — so a client
    that disconnects, or a slow cloud, cannot keep it.

    At most ``max_queue`` admitted requests wait for the models; :meth:`admit` refuses the next
    (``queue_full``: the server answers 429 with Retry-After). A request that has not finished
    ``request_timeout_s`` after admission is cancelled (``timeout``: 504). ``draining`` (shutdown
    began) refuses new and queued requests (503) while running ones finish; ``closing`` (the
    grace period is over) cancels what still runs."""

    def __init__(
        self,
        pipe: Pipeline,
        stall_seconds: float,
        max_queue: int = 64,
        request_timeout_s: float = 600.0,
        batcher: Batcher | None = None,
    ):
        self.pipe = pipe
        self.stall_seconds = stall_seconds
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.batcher = batcher
        self.parallel = batcher.slots if batcher is not None else 1
        self.lock = FifoLock(self.parallel)
        self.decoding = 0
        self.closing = threading.Event()
        self.draining = threading.Event()
        self.counts = threading.Lock()
        self.waiting = 0  # admitted, waiting for the models
        self.in_flight = 0  # admitted, not finished (waiting, decoding, or asking the cloud)
        self.active_since: float | None = None
        self.last_progress: float | None = None
        self.cancelled = 0
        self.timed_out = 0
        self.refused: dict[str, int] = {"queue_full": 0, "shutting_down": 0}
        self.busy_seconds = 0.0  # the models' time, over `served` requests: Retry-After's estimate
        self.served = 0
        self.live: set[Generation] = set()  # started, not finished: answered 503 if a shutdown cannot wait

    def admit(self) -> str | None:
        """Take a request in (None) or say why not: ``queue_full`` or ``shutting_down``."""
        with self.counts:
            if self.draining.is_set() or self.closing.is_set():
                why = "shutting_down"
            elif self.waiting >= self.max_queue:
                why = "queue_full"
            else:
                self.waiting += 1
                self.in_flight += 1
                return None
            self.refused[why] += 1
            return why

    def retry_after(self) -> int:
        """Seconds until the queue has room, by the mean time a request held the models."""
        with self.counts:
            mean = self.busy_seconds / self.served if self.served else 1.0
            return max(1, min(60, math.ceil(mean * max(1, self.waiting - self.max_queue + 1) / self.parallel)))

    def start(self, locked: Callable[..., Any], unlocked: Callable[[Any], Any] | None = None) -> Generation:
        """Run ``locked(should_stop, emit)`` while holding the models (``emit(text)`` streams a
        piece), then ``unlocked(value)`` without them; the generation ends with ``("end", value)``.
        The caller has been admitted."""
        gen = Generation(time.monotonic() + self.request_timeout_s)
        with self.counts:
            self.live.add(gen)
        threading.Thread(
            target=self._work, args=(gen, locked, unlocked), name="kibidango-generate", daemon=True
        ).start()
        return gen

    def _stopped(self, gen: Generation) -> bool:
        self.last_progress = now = time.monotonic()  # asked once per decoding round
        if now > gen.deadline:
            gen.timed_out = True
        return gen.timed_out or gen.cancel.is_set() or self.closing.is_set()

    def _work(self, gen: Generation, locked, unlocked) -> None:
        try:
            self._run(gen, locked, unlocked)
        finally:
            with self.counts:
                self.in_flight -= 1
                self.live.discard(gen)

    def abandon(self) -> int:
        """Answer every request still running with 503 now (the end of a shutdown that cannot
        wait for it); its work ends on its own. Returns how many."""
        with self.counts:
            live = list(self.live)
        for gen in live:
            gen.put("shutting_down")
        return len(live)

    def _run(self, gen: Generation, locked, unlocked) -> None:
        ticket = self.lock.enter()
        try:
            while not ticket.wait(0.05):
                why = None
                if gen.cancel.is_set():
                    why = "cancelled"
                elif self.draining.is_set() or self.closing.is_set():
                    why = "shutting_down"
                elif time.monotonic() > gen.deadline:
                    why = "timeout"
                if why is not None:
                    self.lock.withdraw(ticket)
                    with self.counts:
                        if why == "cancelled":
                            self.cancelled += 1
                        elif why == "timeout":
                            self.timed_out += 1
                        else:
                            self.refused[why] += 1
                    gen.put(why)
                    return
        finally:
            with self.counts:
                self.waiting -= 1
        started = time.monotonic()
        try:
            with self.counts:
                self.decoding += 1
                if self.active_since is None:
                    self.active_since = started
            self.last_progress = started
            with self.batcher.member() if self.batcher is not None else contextlib.nullcontext():
                value = locked(lambda: self._stopped(gen), lambda piece: gen.put("text", piece))
        except (ContextLengthError, ValueError) as e:
            gen.put("error", e)
            return
        except Exception as e:  # a bug: logged here with its traceback, never sent to the client
            log.exception("generation failed")
            gen.put("crash", e)
            return
        finally:
            self.lock.release()
            with self.counts:
                self.decoding -= 1
                if self.decoding == 0:
                    self.active_since = None
                self.busy_seconds += time.monotonic() - started
                self.served += 1
        if gen.timed_out:
            with self.counts:
                self.timed_out += 1
            gen.put("timeout")
            return
        if self.closing.is_set() and not gen.cancel.is_set():  # cut by a shutdown: 503 + Retry-After
            with self.counts:
                self.refused["shutting_down"] += 1
            gen.put("shutting_down")
            return
        if gen.cancel.is_set():
            with self.counts:
                self.cancelled += 1
            gen.put("end", value)
            return
        if unlocked is not None:
            try:
                value = unlocked(value)
            except Exception as e:
                log.exception("the request's cloud phase failed")
                gen.put("crash", e)
                return
        gen.put("end", value)

    def health(self) -> tuple[int, dict[str, Any]]:
        now = time.monotonic()
        active, last = self.active_since, self.last_progress
        body: dict[str, Any] = {
            "status": "ok",
            "generating": active is not None,
            "waiting": self.waiting,
            "in_flight": self.in_flight,
        }
        if active is not None and last is not None:
            body["generating_for_s"] = round(now - active, 3)
            body["no_progress_for_s"] = round(now - last, 3)
            if now - last > self.stall_seconds:
                body["status"] = "wedged"
                return 503, body
        if self.closing.is_set() or self.draining.is_set():
            body["status"] = "shutting down"
            return 503, body
        return 200, body
