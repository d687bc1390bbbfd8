"""Shutdown that answers every request the server took: see :func:`uvicorn_server`."""

from __future__ import annotations

import asyncio
import logging
import time

from kibidango.server.scheduler import Scheduler

log = logging.getLogger("kibidango.server")


def uvicorn_server(config):
    """A uvicorn server for an app of :func:`create_app` that drains on SIGTERM/SIGINT, so that
    every request it took gets an HTTP answer. The first signal starts the drain while the server
    keeps accepting: new and queued requests are answered 503 + Retry-After, running ones get
    ``config.timeout_graceful_shutdown`` seconds to finish; then the rest stop after their decoding
    round and are answered 503 (a request still at the cloud too, after a few seconds more). Only
    then does the listening socket close: first no new connection may start on it
    (:func:`_stop_new_connections`), and those whose handshake began or that wait in its backlog
    are accepted and answered, so a client that connected is answered or, arriving after,
    refused — never reset after its request was sent. A second signal stops at once (uvicorn's way)."""
    import uvicorn

    scheduler = config.app.state.scheduler
    grace_s = config.timeout_graceful_shutdown if config.timeout_graceful_shutdown is not None else 10.0
    config.timeout_graceful_shutdown = 5.0  # uvicorn's own wait, after the drain: only answers being written

    class _Server(uvicorn.Server):
        drain: asyncio.Task | None = None

        def handle_exit(self, sig, frame):
            if not scheduler.draining.is_set():
                self._captured_signals.append(sig)  # re-raised once the server has stopped, as uvicorn does
                scheduler.draining.set()
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if scheduler.draining.is_set():
                if self.drain is None:
                    self.drain = asyncio.create_task(self._drain())
                return self.drain.done()
            return False

        async def _drain(self) -> None:
            await _idle(scheduler, grace_s)
            scheduler.closing.set()  # what still runs stops after its decoding round and is answered 503
            await _idle(scheduler, 5.0)
            if scheduler.abandon():  # still at the cloud: answered now, its work ends on its own
                log.warning("shutdown: requests still waiting for the cloud were answered 503")
            for server in self.servers:  # no new connection starts; those under way are taken
                for sock in server.sockets:
                    _stop_new_connections(sock)
            await asyncio.sleep(0.5)  # accepted and answered (503) before the socket closes

    return _Server(config)


async def _idle(scheduler: Scheduler, seconds: float) -> None:
    """Wait until no request is in flight, or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while scheduler.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


# A classic BPF socket filter for a listening TCP socket (the program sees the TCP header at offset 0):
# load the flags byte, keep every segment that carries ACK, drop the rest — a new client's SYN.
_BPF_LD_B_ABS, _BPF_JSET_K, _BPF_RET_K = 0x30, 0x45, 0x06
_TCP_FLAGS_OFFSET, _TCP_ACK = 13, 0x10
_DROP_SYNS = (
    (_BPF_LD_B_ABS, 0, 0, _TCP_FLAGS_OFFSET),
    (_BPF_JSET_K, 0, 1, _TCP_ACK),  # ACK set: next instruction (keep); else skip it (drop)
    (_BPF_RET_K, 0, 0, 0x40000),  # keep (up to 256 KiB of the segment: all of it)
    (_BPF_RET_K, 0, 0, 0),  # drop
)


def _stop_new_connections(sock) -> None:
    """Let no new connection start on a listening socket, while every one whose handshake began
    still completes and is accepted: on Linux a socket filter that drops a new client's SYN (it
    retries, then finds the socket closed: refused, nothing sent) and keeps every segment that
    carries ACK — the last step of a handshake already under way, so that a client which got its
    SYN-ACK before the filter (and whose ``connect`` therefore succeeded) reaches the backlog and is
    answered instead of being reset after sending its request. Elsewhere ``listen(0)``, which only
    shrinks the backlog."""
    import os
    import socket

    try:
        dup = socket.socket(fileno=os.dup(sock.fileno()))
    except OSError:
        return
    try:
        _attach_filter(dup, _DROP_SYNS)
    except OSError:
        try:
            dup.listen(0)
        except OSError:
            pass
    finally:
        dup.close()


def _attach_filter(sock, program) -> None:
    """Attach a classic BPF program (``(code, jt, jf, k)`` instructions) to ``sock``, replacing any
    filter it had (``SO_ATTACH_FILTER``; the kernel copies the program). OSError where unsupported."""
    import ctypes
    import socket
    import struct

    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in program))
    fprog = struct.pack("HL", len(program), ctypes.addressof(code))  # struct sock_fprog {len; *filter}
    sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_ATTACH_FILTER", 26), fprog)
