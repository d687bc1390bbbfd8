"""A bundle's chat template, rendered within bounds — in a process of its own.

The template is code that came with the bundle; a request's messages are data it runs on. The
server never renders it in its own process: :func:`render_chat` sends each render to a small pool
of worker processes (:mod:`kibidango.server.template_worker`: a bounded Jinja sandbox, and an
address-space cap no value check can match — a C-level ``join`` of 600 MB passes every bound on
items and cannot be interrupted by a clock). A render that outlives its time is answered here
and its worker killed; a worker that died is replaced. The server's memory never holds what a
template allocates.

Past any bound: :class:`TemplateBoundError`, which the server answers with a clear 400.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time

__all__ = ["TemplateBoundError", "render_chat"]

_WORKERS = 2
"""Renders at once (each a process); more wait for one."""
_MEMORY_MB = 256
"""What a render may allocate beyond the worker's own interpreter."""


class TemplateBoundError(ValueError):
    """The chat template went past a bound (time, size, memory) or failed on this conversation."""


class _Worker:
    def __init__(self, memory_mb: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-s", "-m", "kibidango.server.template_worker", "--memory-mb", str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        self._buf = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def render(self, request: dict, timeout: float) -> dict | None:
        """The worker's reply, or None when it gave none in ``timeout`` seconds (then killed) or died."""
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.kill()
            return None
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self.kill()
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class _Pool:
    def __init__(self, size: int, memory_mb: int):
        self.memory_mb = memory_mb
        self.idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(size):
            self.idle.put(None)  # started on first use
        self._all: list[_Worker] = []
        self._lock = threading.Lock()

    def render(self, request: dict, timeout: float) -> dict | None:
        worker = self.idle.get()
        try:
            if worker is None or not worker.alive():
                worker = _Worker(self.memory_mb)
                with self._lock:
                    self._all.append(worker)
            reply = worker.render(request, timeout)
            if reply is None or reply.get("bound"):
                worker.kill()  # out of time or memory: a fresh process for the next render
            return reply
        finally:
            self.idle.put(worker if worker is not None and worker.alive() else None)

    def close(self) -> None:
        with self._lock:
            for worker in self._all:
                worker.kill()


_POOL = _Pool(_WORKERS, _MEMORY_MB)
atexit.register(_POOL.close)


def render_chat(
    tokenizer,
    turns: list[dict[str, str]],
    seconds: float = 2.0,
    max_chars: int = 1 << 20,
    max_range: int = 10_000,
) -> str:
    """The prompt the tokenizer's chat template makes of ``turns`` (with the generation prompt),
    rendered by a worker process within the bounds of :mod:`kibidango.server.template_worker`;
    blocking (call it off the event loop)."""
    context = {**getattr(tokenizer, "special_tokens_map", {}), "messages": turns, "add_generation_prompt": True}
    context.update(tools=None, documents=None)
    request = {
        "template": tokenizer.chat_template,
        "context": context,
        "seconds": seconds,
        "max_chars": max_chars,
        "max_range": max_range,
    }
    reply = _POOL.render(request, timeout=seconds + 3.0)  # the worker's own clock first; then it is killed
    if reply is None:
        raise TemplateBoundError(
            f"the bundle's chat template took more than {seconds:g} s to render (or its renderer died): stopped"
        )
    if "error" in reply:
        raise TemplateBoundError(str(reply["error"]))
    return str(reply["text"])
