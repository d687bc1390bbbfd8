"""A cloud stand-in that answers with the gold solution: an OpenAI-compatible server on 127.0.0.1.

In the task ladder's world (and on the benchmarks' tasks) the strongest answerer there is, is the
task's own gold solution: stage 6C's frontier assumes exactly that cloud (it scores every
escalated query as the gold answer would). ``make eval-cascade`` measures the runtime's cascade
against the same cloud, so that 6C's predicted escalation share and quality can be checked on
fresh queries — through the runtime's real paid client (HTTP, the API key, the ledger), never a
mock. It is labelled for what it is, an oracle, everywhere it is reported.

The server knows a map of questions to gold answers. A chat request is answered with the gold
answer of its last user message; the cascade's validation request (the question and a local
answer, :data:`kibidango.cascade.pipeline.VALIDATION_PROMPT`) is answered with the gold answer of
the question it quotes (a correction: the oracle never approves). A question it does not know gets
an empty answer. ``usage`` reports a token per four UTF-8 bytes of the request's messages and of
the answer (an honest server: within the client's reservation).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["GOLD_MODEL", "gold_server"]

GOLD_MODEL = "gold-oracle"


def _answer(gold: dict[str, str], content: str) -> str:
    """The gold answer of ``content``: a question, or a validation request quoting one."""
    if content in gold:
        return gold[content]
    head, found, rest = content.partition("\n\nQuestion:\n")  # VALIDATION_PROMPT's layout
    question = rest.partition("\n\nAnswer:\n")[0] if found else ""
    return gold.get(question, "")


@contextlib.contextmanager
def gold_server(gold: dict[str, str], api_key: str) -> Iterator[str]:
    """Serve ``gold`` (question -> gold answer) on 127.0.0.1; yields the base URL (``.../v1``)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return True
            self._reply(401, {"error": {"message": "invalid API key", "type": "invalid_request_error"}})
            return False

        def do_GET(self):
            if self._authorised():
                self._reply(200, {"object": "list", "data": [{"id": GOLD_MODEL, "object": "model"}]})

        def do_POST(self):
            if not self._authorised():
                return
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                messages = request["messages"]
                content = next(m["content"] for m in reversed(messages) if m.get("role") == "user")
            except (ValueError, KeyError, TypeError, StopIteration):
                return self._reply(400, {"error": {"message": "not a chat completion request"}})
            answer, finish = _answer(gold, str(content)), "stop"
            limit = request.get("max_tokens")
            if isinstance(limit, int) and len(answer.encode()) > 4 * limit:  # honest: never past max_tokens
                answer, finish = answer.encode()[: 4 * limit].decode("utf-8", "ignore"), "length"
            prompt = sum(len(json.dumps(m).encode()) for m in messages) // 4 + 1
            completion = min(len(answer.encode()) // 4 + 1, limit) if isinstance(limit, int) else len(answer) // 4 + 1
            self._reply(
                200,
                {
                    "id": "chatcmpl-gold",
                    "object": "chat.completion",
                    "model": GOLD_MODEL,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": finish}
                    ],
                    "usage": {
                        "prompt_tokens": prompt,
                        "completion_tokens": completion,
                        "total_tokens": prompt + completion,
                    },
                },
            )

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
