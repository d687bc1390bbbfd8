"""Stage 1D — cascaded teachers: every critical failure of 1C is answered by the cheapest teacher
tier first, and escalated to the next, pricier tier only when 1B's judge rejects the answer.

Tiers (the recipe's ordered ``tiers``; :mod:`methods.teachers`) are OpenAI-compatible endpoints,
``kind: reference`` (the dataset's gold answer at a flat price), or ``kind: self``: the student
itself (the ``student`` input, stage 1A's — or a later round's retrained — checkpoint), sampled
up to ``samples`` times at ``temperature`` and judged by the task's own judge; the first answer
that passes is the correction (STaR / rejection-sampling fine-tuning), priced as local compute at
the tier's per-1K-token prices, journaled, budgeted and never re-sampled by a rerun like any paid
request. A ``self`` tier with ``hint: answer`` (STaR's rationalization) asks the student again
with the reference's final number shown, for the rows a number answers; its answer passes only if
the judge passes it **and** its working derives that number (:func:`methods.judges.math.underived`),
and the pair holds the question without the hint. With ``hint: feedback`` (self-debugging) a code
failure is asked again with the student's own failing program and what it did on the test the task
shows (run in the judge's sandbox: "returned 35 where 1225 is expected"); the judge then runs every
test of the task, the unshown ones too. A tier with ``serve`` is a local model the stage
serves itself: its checkpoint (a GGUF file, or a transformers directory converted to GGUF in the
work directory) under llama-cpp-python's server on 127.0.0.1.

The budget is hard: a request leaves only if its worst-case cost fits what is left; once nothing
fits, the remaining rows are skipped and counted. Every paid request is journaled before it is
sent (``work_dir/journal.jsonl``): a killed run's rerun never sends a prompt to a tier twice — a
request that was in flight at the kill is charged its worst case and the row moves on. A journal
line cut by the kill (:mod:`methods.journal`) is never read as "not sent": a cut ``sent`` record is
a request in flight (charged, not resent); a cut ``reply``, or a cut line that does not say which
request it records, stops the stage with the file and line, until the rerun says
``--resend-unconfirmed`` (``KIBIDANGO_RESEND_UNCONFIRMED=1``): then every request whose fate is
unknown is charged its worst case **and** sent again.

A share of the critical failures (``holdout_share``, by a hash of the row id) is held out: never
sent to a teacher, never trained on; the retraining round measures its failure rate on them.

Outputs: ``pairs/`` (a ``datasets`` table of corrected pairs: the prompt and the first answer a
judge passed, with its tier), ``pairs.jsonl``, ``held_out.jsonl``, ``ledger.jsonl`` (one line per request: tier,
tokens, dollars, verdict, seconds), ``cost.json``, ``COST_CARD.md`` and ``cost_per_tier.png``. The
cost report sets the cascade's spend beside the counterfactual of sending every row to the top
tier, priced from the same token counts.
"""

from __future__ import annotations

import ast
import contextvars
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from fractions import Fraction
from pathlib import Path

from pydantic import Field, model_validator

from core.contract import KibidangoError, StageConfig, StageResult
from core.hashing import file_sha256, tree_sha256
from core.progress import Progress
from kibidango.paid.ledger import BudgetExceeded, Ledger, holds
from methods.failures import held_out, mined_judges, read_jsonl, task_of
from methods.journal import Journal
from methods.judges.base import Verdict
from methods.judges.code import judged_program
from methods.judges.math import final_number, through_mark, underived
from methods.measure.generate import Answerer, once
from methods.teachers import FEEDBACK_PROGRAM_CHARS, TeacherClient, TierConfig, TierDead, worst_case_usd
from methods.training.models import base_file

RESUMABLE = True
LIBRARIES = ("openai", "datasets", "sacrebleu", "llama-cpp-python")

log = logging.getLogger("kibidango.stage.1D")


class Config(StageConfig):
    tiers: list[TierConfig] = Field(min_length=1, description="Teacher tiers, cheapest first.")
    budget_usd: float = Field(gt=0, description="Hard limit on the run's spend, in dollars.")
    holdout_share: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="Share of the critical failures (by a hash of the row id) never sent to a teacher nor trained "
        "on: the retraining round measures its failure rate on them (held_out.jsonl).",
    )
    serve_n_ctx: int = Field(512, gt=0, description="Context of locally served tiers.")
    student_tier: str = Field("target", description="Tier directory of the `student` input a `self` tier samples.")
    serve_chat_format: str = Field(
        "alpaca",
        description="llama-cpp-python chat format of locally served tiers; `family`: the family's own training "
        "format (methods/training/chat.py), as llama-cpp-python's hf-tokenizer-config format; `gguf`: the GGUF's "
        "own template. A tier's `chat_format` overrides it.",
    )

    @model_validator(mode="after")
    def _names(self) -> Config:
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        return self

    def student_dir(self, inputs: dict[str, Path]) -> Path | None:
        """The checkpoint a `self` tier samples (None without one)."""
        if not any(t.kind == "self" for t in self.tiers):
            return None
        if "student" not in inputs:
            raise KibidangoError(
                "a `self` tier samples the student: wire stage 1A (or a round's 1R) as input 'student'"
            )
        path = inputs["student"] / self.student_tier
        if not (path / "config.json").is_file():
            raise KibidangoError(f"the student input has no transformers checkpoint at {path}")
        return path


def external_inputs(cfg: Config) -> dict[str, str]:
    """Digests of locally served checkpoints."""
    out = {}
    for t in cfg.tiers:
        if t.serve is not None:
            path = _served(t)
            if not path.exists():
                raise KibidangoError(f"tier {t.name!r}: `serve` checkpoint not found: {path}")
            out[f"serve:{t.name}"] = file_sha256(path) if path.is_file() else tree_sha256(path)
    return out


def run(cfg: Config, inputs: dict[str, Path], out_dir: Path, work_dir: Path) -> StageResult:
    critical = read_jsonl(inputs["critical"] / "critical.jsonl", "the critical input (stage 1C)")
    held = [r for r in critical if held_out(r["id"], cfg.holdout_share)]
    rows = [r for r in critical if not held_out(r["id"], cfg.holdout_share)]
    with open(out_dir / "held_out.jsonl", "w", encoding="utf-8") as f:
        for r in held:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    log.info(f"{len(rows):,} critical failures to the teachers, {len(held):,} held out for the retraining's evaluation")
    judges = mined_judges(inputs["mined"])
    journal = Journal(work_dir / "journal.jsonl", check=_check_event)
    resend = os.environ.get("KIBIDANGO_RESEND_UNCONFIRMED", "") not in ("", "0")
    state = _replay(journal.events, journal.path, resend)
    by_id, tiers = {r["id"]: r for r in rows}, {t.name: t for t in cfg.tiers}
    for (row, tier), reserved in state.lost.items():  # maybe served and billed: charged their worst case
        if reserved is None:  # a cut `sent` line that lost its amount: the worst case, priced again
            reserved = worst_case_usd(tiers[tier], by_id[row]["prompt"]) if row in by_id and tier in tiers else 0.0
        state.spent += reserved
        if resend:  # charged, and asked again
            journal.write({"event": "unconfirmed", "row": row, "tier": tier, "usd": reserved})
            continue
        event = {"event": "error", "row": row, "tier": tier, "usd": reserved, "attempts": 0, "retries": {}}
        event["reason"] = "in flight when an earlier attempt was killed: charged its worst case, not resent"
        journal.write(event)
        state.done[(row, tier)] = event
    budget_dir = work_dir / "budget"  # the run's ledger, seeded with what the journal says was spent
    shutil.rmtree(budget_dir, ignore_errors=True)
    ledger = Ledger(budget_dir, cfg.budget_usd, "total")
    ledger.charge(state.spent, note="spent by earlier attempts (journal)")
    if journal.resumed:
        log.info(
            f"resuming: {len(state.done):,} (row, tier) pairs settled, {len(state.lost)} in flight at the kill "
            f"(charged, {'sent again: --resend-unconfirmed' if resend else 'not resent'}), ${state.spent:.4f} spent"
        )
    cascade = _Cascade(cfg, rows, judges, journal, state, ledger, cfg.student_dir(inputs))
    try:
        with ExitStack() as stack:
            urls = _serve(cfg, inputs, work_dir, stack)
            # every client (and so every key) before the first request: a missing key fails the run
            # before anything is paid
            clients = {t.name: TeacherClient(t, ledger, urls.get(t.name)) for t in cfg.tiers if t.kind == "openai"}
            for tier in cfg.tiers:
                cascade.run_tier(tier, clients.get(tier.name))
    finally:
        cascade.close()
        journal.close()

    spent = ledger.state().settled_usd
    held = holds(budget_dir)  # a reply dearer than its reservation stopped the spending
    requests = _requests(journal.events)
    pairs, status = _outcomes(cfg, rows, requests, state)
    report = _report(cfg, rows, requests, pairs, status, spent, cascade.dead)
    report["holds"] = held
    _write(out_dir, pairs, requests, report)
    metrics = {
        "rows": len(rows),
        "held_out": len(held),
        "pairs": len(pairs),
        "unresolved": status["unresolved"],
        "skipped_budget": status["skipped_budget"],
        "held_judge_error": status["held_judge_error"],
        "spend_usd": report["spend_usd"],
        "budget_usd": cfg.budget_usd,
        "top_tier_only_usd": report["top_tier_only_usd"],
        "cost_cut": report["cost_cut"],
        "pairs_per_usd": report["pairs_per_usd"],
        "requests": len(requests),
        "journal_resumed_events": journal.resumed,
        **{f"spend_usd/{n}": v["usd"] for n, v in report["tiers"].items()},
        **{f"answered_by/{n}": v["passed"] for n, v in report["tiers"].items()},
        **{f"retries/{k}": v for k, v in report["retries"].items()},
    }
    summary = (
        f"{len(pairs):,} corrected pairs from {len(rows):,} critical failures; tier split "
        + ", ".join(f"{n} {v['passed']}" for n, v in report["tiers"].items())
        + f"; spent ${report['spend_usd']:.4f} of ${cfg.budget_usd:g} "
        f"(top tier only: ${report['top_tier_only_usd']:.4f}, cut {report['cost_cut']:.0%})"
        + (f"; {status['skipped_budget']} rows skipped at the budget" if status["skipped_budget"] else "")
        + (f"; {status['held_judge_error']} rows held (judge errors)" if status["held_judge_error"] else "")
        + (f"; DEAD tiers: {', '.join(cascade.dead)}" if cascade.dead else "")
        + (f"; SPENDING ON HOLD: {len(held)} repl(ies) cost more than reserved (rows after it skipped)" if held else "")
    )
    return StageResult(
        metrics, ["COST_CARD.md", "cost.json", "cost_per_tier.png"], summary, tables={"pairs.json": "pairs.jsonl"}
    )


_HARMLESS = ("verdict", "error", "skipped", "dead", "unconfirmed")  # a cut one of these pays nothing again

_NUMBER = (int, float)
_EVENTS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "sent": {"row": str, "tier": str, "reserved": _NUMBER},
    "reply": {"row": str, "tier": str, "usd": _NUMBER, "text": str},
    "error": {"row": str, "tier": str, "usd": _NUMBER},
    "skipped": {"row": str, "tier": str, "usd": _NUMBER},
    "dead": {"row": str, "tier": str, "usd": _NUMBER},
    "unconfirmed": {"row": str, "tier": str, "usd": _NUMBER},
    "verdict": {"row": str, "tier": str, "passed": bool, "outcome": str, "score": _NUMBER, "reason": str},
}
"""The fields each event of the journal has, as the stage writes them."""


def _check_event(e: dict) -> str | None:
    """Why ``e`` is not an event this stage wrote (a kind it does not write, a field missing or of
    another type), or None: such a line is damaged, never read (:class:`methods.journal.Journal`)."""
    fields = _EVENTS.get(e.get("event"))
    if fields is None:
        return f"event {e.get('event')!r} is not one this stage writes"
    for name, kind in fields.items():
        value = e.get(name)
        if not isinstance(value, kind) or (kind is _NUMBER and isinstance(value, bool)):
            return f"{name}: missing or not a {kind}"
    return None


class _State:
    """What the journal says: per (row, tier) the settled outcome, the requests lost in flight,
    and the money spent."""

    def __init__(self) -> None:
        self.done: dict[tuple[str, str], dict] = {}  # verdict or terminal event
        self.replies: dict[tuple[str, str], dict] = {}  # answered, maybe not yet judged
        self.lost: dict[tuple[str, str], float | None] = {}
        self.spent = 0.0


_FIELDS = {k: re.compile(rf'"{k}"\s*:\s*"((?:[^"\\]|\\.)*)"') for k in ("event", "row", "tier")}
_RESERVED = re.compile(r'"reserved"\s*:\s*([0-9][0-9.eE+-]*)[,}]')


def _fragment(text: str) -> dict:
    """What a cut journal line still says: its event, row, tier and reserved amount, where whole."""
    out: dict = {k: json.loads(f'"{m.group(1)}"') for k, rx in _FIELDS.items() if (m := rx.search(text))}
    if m := _RESERVED.search(text):
        out["reserved"] = float(m.group(1))
    return out


def _replay(events: list[dict], path: Path, resend: bool = False) -> _State:
    """The state the journal at ``path`` records. A cut ``sent`` line is a request in flight; a cut
    ``reply`` line, or a cut line whose request cannot be read, is an error unless ``resend``."""
    state = _State()
    sent: dict[tuple[str, str], float | None] = {}
    for e in events:
        kind = e["event"]
        if kind == "torn":
            cut = _fragment(e["text"])
            known = "row" in cut and "tier" in cut
            reply = cut.get("event") == "reply" and known
            if cut.get("event") == "sent" and known:
                sent[(cut["row"], cut["tier"])] = cut.get("reserved")
            elif reply or cut.get("event") not in _HARMLESS:
                if not resend:
                    what = (
                        f"the reply of row {cut['row']!r} from tier {cut['tier']!r} (paid, unreadable)"
                        if reply
                        else "a record that no longer says which request it was (it may be one sent and paid)"
                    )
                    raise KibidangoError(
                        f"{path}: line {e['line']} was cut by a kill and held {what}. Rerun with "
                        "--resend-unconfirmed (KIBIDANGO_RESEND_UNCONFIRMED=1) to charge every request whose fate is "
                        "unknown its worst case and send it again"
                    )
            continue
        key = (e["row"], e["tier"])
        if kind == "sent":
            sent[key] = e["reserved"]
        elif kind == "reply":
            sent.pop(key, None)
            state.replies[key] = e
            state.spent += e["usd"]
        elif kind in ("error", "skipped", "dead"):
            sent.pop(key, None)
            state.spent += e.get("usd", 0.0)
            state.done[key] = e
        elif kind == "unconfirmed":  # charged its worst case by an earlier attempt, to be asked again
            sent.pop(key, None)
            state.spent += e["usd"]
        elif kind == "verdict" and not e.get("retryable"):  # an answer the judge could not judge: again
            state.done[key] = e
    state.lost = sent  # in flight at the kill: maybe served and billed
    return state


class _Cascade:
    def __init__(self, cfg, rows, judges, journal, state, ledger: Ledger, student: Path | None = None):
        self.cfg = cfg
        self.rows = rows
        self.judges = judges
        self.journal = journal
        self.state = state
        self.ledger = ledger
        self.dead: list[str] = []
        self._dead_lock = threading.Lock()
        self._student = student
        self._samplers: dict[tuple[int, int], once] = {}  # the student, loaded when a row reaches a self tier

    def _resolved(self, row_id: str, upto: int) -> bool:
        """True once a tier before ``upto`` passed the row, or the budget skipped it, or its answer
        got no verdict in this run (the judge's sandbox failed: the row is held, never escalated to a
        dearer tier for the judge's fault; a rerun judges that answer again, without paying)."""
        for tier in self.cfg.tiers[:upto]:
            e = self.state.done.get((row_id, tier.name))
            if e is not None and (e.get("passed") or e["event"] == "skipped" or e.get("retryable")):
                return True
        return False

    def run_tier(self, tier: TierConfig, client: TeacherClient | None) -> None:
        index = self.cfg.tiers.index(tier)
        todo = [
            r
            for r in self.rows
            if not self._resolved(r["id"], index)
            and (r["id"], tier.name) not in self.state.done
            and (tier.hint is None or self._hintable(tier, r))
        ]
        if not todo:
            return
        progress = Progress(f"1D tier {tier.name}", len(todo), log)
        done = [0]
        lock = threading.Lock()

        def one(row: dict) -> None:
            self._ask(tier, client, row)
            with lock:
                done[0] += 1
                progress.update(done[0])

        # each call in a copy of this thread's context: the flow run's (Prefect sends the progress
        # lines to its run log; from a bare worker thread it warned there was no flow run)
        with ThreadPoolExecutor(max_workers=tier.concurrency) as pool:
            for future in [pool.submit(contextvars.copy_context().run, one, row) for row in todo]:
                future.result()
        progress.finish(done[0])

    def _ask(self, tier: TierConfig, client: TeacherClient | None, row: dict) -> None:
        key = (row["id"], tier.name)
        reply = self.state.replies.get(key)
        if reply is None:
            if tier.name in self.dead:
                self.journal.write({"event": "dead", "row": row["id"], "tier": tier.name, "usd": 0.0})
                self.state.done[key] = self.journal.events[-1]
                return
            reply = self._request(tier, client, row)
            if reply is None:
                return
        verdict = reply.get("_verdict") or self._judge(tier, row, reply["text"])  # a self tier judged it already
        event = {
            "event": "verdict",
            "row": row["id"],
            "tier": tier.name,
            "passed": bool(verdict.passed),
            "outcome": verdict.outcome,
            "score": float(verdict.score),
            "reason": verdict.reason,
        }
        if verdict.outcome == "judge_error" and verdict.details.get("retryable"):
            event["retryable"] = True
        self.journal.write(event)
        self.state.done[key] = event

    def _hintable(self, tier: TierConfig, row: dict) -> bool:
        """``hint: answer``: a number answers ``row`` (its judge is the math judge, its reference
        holds one). ``hint: feedback``: ``row`` is a code task the student answered, whose prompt
        shows one of its tests as ``assert <call> == <value>`` and not all of them (a program fitted
        to the tests it was shown must still fail one)."""
        kind = getattr(self.judges[row["domain"]], "kind", None)
        if tier.hint == "feedback":
            unshown = any(t not in str(row.get("prompt", "")) for t in row.get("tests") or ())
            answered = bool(str(row.get("answer") or "").strip())
            return kind == "code" and answered and unshown and _shown_test(row) is not None
        return kind == "math" and final_number(row["reference"]) is not None

    def _feedback(self, tier: TierConfig, row: dict) -> str:
        """The ``feedback`` hint of a code failure: the student's program (as the judge ran it) and
        what it did on the test the prompt shows, run in the judge's sandbox with the call's value
        as the assertion's message."""
        test = _shown_test(row)
        task = dataclasses.replace(task_of(row), tests=(_reporting(test),))
        program = judged_program(task, row["answer"])
        outcome = _outcome(self.judges[row["domain"]](task, row["answer"]), test)
        return tier.feedback_text.format(program=program[:FEEDBACK_PROGRAM_CHARS], test=test, outcome=outcome)

    def _judge(self, tier: TierConfig, row: dict, answer: str) -> Verdict:
        """The row's own judge (every test of the task, shown or not); for a tier shown the answer,
        a passing answer must also derive its number."""
        verdict = self.judges[row["domain"]](task_of(row), answer)
        if tier.hint != "answer" or not verdict.passed:
            return verdict
        why = underived(f"{row['instruction']}\n{row['input']}", answer)
        if why is None:
            return verdict
        return Verdict(False, 0.0, f"shown the answer, its working does not derive it: {why}", "failed", verdict.cost)

    def _request(self, tier: TierConfig, client: TeacherClient | None, row: dict) -> dict | None:
        """Send the row to the tier under the budget; the reply event, or None (journaled why).
        The ``sent`` record is written once the worst case is reserved, before the request leaves."""
        key = (row["id"], tier.name)

        def sent(reserved: float) -> None:
            self.journal.write({"event": "sent", "row": row["id"], "tier": tier.name, "reserved": reserved})

        if tier.kind == "self":
            return self._self_taught(tier, row, sent)
        if tier.kind == "reference":
            worst = worst_case_usd(tier, row["prompt"])
            try:
                rid = self.ledger.reserve(worst, note=f"teacher {tier.name}")
            except BudgetExceeded:
                return self._skipped(key)
            sent(worst)
            event = {"event": "reply", "row": row["id"], "tier": tier.name, "text": row["reference"]}
            event.update(usd=self.ledger.settle(rid, worst), prompt_tokens=0, completion_tokens=0, attempts=1)
            event.update(retries={}, seconds=0.0)
            self.journal.write(event)
            return event
        try:
            r = client.ask(row["prompt"], on_send=sent)
        except TierDead as e:
            with self._dead_lock:
                if tier.name not in self.dead:
                    self.dead.append(tier.name)
                    log.error(f"{e}; its rows escalate to the next tier")
            event = {"event": "dead", "row": row["id"], "tier": tier.name, "usd": e.usd, "reason": str(e)}
            self.journal.write(event)
            self.state.done[key] = event
            return None
        if r.status == "budget_exhausted":  # nothing was sent
            return self._skipped(key)
        # r.usd: unread attempts (timeouts, malformed replies) at their worst case, the answer at what
        # the endpoint reported when that is credible (the ledger's rule), else its worst case
        common = {"row": row["id"], "tier": tier.name, "usd": r.usd, "attempts": r.attempts}
        common.update(retries=dict(r.retries), seconds=round(r.seconds, 3))
        if r.text is None:
            event = {"event": "error", **common, "reason": r.error}
            self.journal.write(event)
            self.state.done[key] = event
            return None
        event = {"event": "reply", **common, "text": r.text}
        event.update(prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens)
        self.journal.write(event)
        return event

    def _self_taught(self, tier: TierConfig, row: dict, sent) -> dict | None:
        """The student's own answers to ``row``, sampled until the judge passes one (at most
        ``tier.samples``): the reply (with its verdict) is the first that passed, or the last sampled,
        at what the tokens cost. The worst case (every sample reading the prompt's own tokens and writing
        ``max_tokens``: exact, not a bound on bytes) is reserved and journaled before the first
        sample, so a killed run's rerun never samples the row again."""
        key = (row["id"], tier.name)
        shape = (tier.max_tokens, tier.concurrency)  # self tiers of one shape share the loaded student
        with self._dead_lock:
            sampler = self._samplers.setdefault(
                shape, once(lambda: Answerer(self._student, tier.max_tokens, parallel=tier.concurrency))
            )
        student = sampler()
        instruction, input_ = row["instruction"], row["input"]
        if tier.hint is not None:  # the pair keeps the question as it was (pairs come from the row)
            if tier.hint == "answer":
                shown = tier.hint_text.format(answer=_number(final_number(row["reference"])))
            else:
                shown = self._feedback(tier, row)
            input_ = f"{input_}\n\n{shown}" if input_ else shown
        # the worst case exactly: every sample reads the prompt's own tokens and writes max_tokens
        prompt_len = len(student.prompt_ids(instruction, input_))
        worst = tier.usd(tier.samples * prompt_len, tier.samples * tier.max_tokens)
        try:
            rid = self.ledger.reserve(worst, note=f"teacher {tier.name}")
        except BudgetExceeded:
            return self._skipped(key)
        sent(worst)
        prompt_tokens, completion_tokens, text, started = 0, 0, "", time.monotonic()
        drawn, verdict = 0, None
        salt = "" if tier.hint is None else f"hint={tier.hint}:"  # a hinted tier draws other samples
        for i in range(tier.samples):
            answer = student.sample(instruction, input_, tier.temperature, _sample_seed(salt + row["id"], i))
            drawn += 1
            prompt_tokens += prompt_len
            completion_tokens += answer.tokens
            text = answer.text
            verdict = self._judge(tier, row, text) if text.strip() else None
            if verdict is not None and verdict.passed:
                break
        usd = self.ledger.settle(rid, tier.usd(prompt_tokens, completion_tokens))
        event = {"event": "reply", "row": row["id"], "tier": tier.name, "usd": usd, "attempts": drawn, "retries": {}}
        event.update(seconds=round(time.monotonic() - started, 3), text=text, prompt_tokens=prompt_tokens)
        event.update(completion_tokens=completion_tokens)
        self.journal.write(event)
        return {**event, "_verdict": verdict}  # the last sample's verdict: `_ask` journals it, not judging again

    def close(self) -> None:
        for sampler in self._samplers.values():
            sampler.close()

    def _skipped(self, key: tuple[str, str]) -> None:
        event = {"event": "skipped", "row": key[0], "tier": key[1], "reason": "budget", "usd": 0.0}
        self.journal.write(event)
        self.state.done[key] = event


def _shown_test(row: dict) -> str | None:
    """The first of ``row``'s tests its prompt shows, when it reads ``assert <expression> == <value>``."""
    for test in row.get("tests") or ():
        if test in str(row.get("prompt", "")):
            try:
                node = ast.parse(test).body
            except SyntaxError:
                continue
            if len(node) == 1 and isinstance(node[0], ast.Assert) and node[0].msg is None:
                compare = node[0].test
                if isinstance(compare, ast.Compare) and len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq):
                    return test
    return None


def _reporting(test: str) -> str:
    """``assert f(x) == v`` as ``assert f(x) == v, repr(f(x))``: a failure's message is the value."""
    compare = ast.parse(test).body[0].test
    return f"assert {ast.unparse(compare)}, repr({ast.unparse(compare.left)})"


def _outcome(verdict: Verdict, test: str) -> str:
    """What a program did on ``test`` (run as :func:`_reporting` made it), in words."""
    if verdict.passed:
        return "passes it, but other tests of the task fail"
    if why := verdict.details.get("format_failure"):  # nothing ran: the judge said why
        return f"could not run ({why})"
    if verdict.outcome == "timeout":
        return "ran past the time limit"
    if verdict.outcome == "judge_error":
        return "could not be checked"
    detail = verdict.reason.split("test 0: ", 1)[1] if "test 0: " in verdict.reason else verdict.reason
    if detail.startswith("AssertionError: "):
        expected = ast.unparse(ast.parse(test).body[0].test.comparators[0])
        return f"returned {detail[len('AssertionError: ') :][:200]} where {expected} is expected"
    return f"raised {detail.removeprefix('error: ')[:300]}"


def _number(x: Fraction) -> str:
    """A reference's final number as a hint shows it (``37``, ``2.5``, ``1/3``)."""
    if x.denominator == 1:
        return str(x.numerator)
    decimal = f"{float(x):g}"
    return decimal if Fraction(decimal) == x else f"{x.numerator}/{x.denominator}"


def _sample_seed(row_id: str, i: int) -> int:
    """The seed of a row's ``i``-th sample: the same answers on every run."""
    return int.from_bytes(hashlib.sha256(f"kibidango/self-tier/v1:{row_id}:{i}".encode()).digest()[:4], "big")


def _serve(cfg: Config, inputs: dict[str, Path], work_dir: Path, stack: ExitStack) -> dict[str, str]:
    """Start one llama-cpp-python server for the tiers with ``serve`` or ``serve_input``; their base
    URLs by name."""
    local = [t for t in cfg.tiers if t.serve is not None or t.serve_input is not None]
    if not local:
        return {}
    from methods.llama_cpp_tools import convert_hf_to_gguf
    from methods.local_server import chat_settings, llama_cpp_server

    models = {}
    for t in local:
        path = _served(t) if t.serve is not None else _upstream_model(t, inputs)
        try:
            chat = chat_settings(
                t.chat_format or cfg.serve_chat_format, path, work_dir / f"chat_template_{t.name}.json"
            )
        except KibidangoError as e:
            raise KibidangoError(f"tier {t.name!r}: {e}") from None
        if path.is_dir():
            gguf = work_dir / "gguf" / f"{t.name}.gguf"
            if not gguf.is_file():
                gguf.parent.mkdir(parents=True, exist_ok=True)
                log.info(f"tier {t.name}: converting {path} to GGUF (f16) for the local server")
                convert_hf_to_gguf(path, gguf, "f16")
            path = gguf
        models[t.model or t.name] = {"model": path, **chat}
    base = stack.enter_context(llama_cpp_server(models, n_ctx=cfg.serve_n_ctx, log_path=work_dir / "server.log"))
    log.info(f"serving {', '.join(models)} on {base}")
    return {t.name: base for t in local}


def _served(tier: TierConfig) -> Path:
    """The checkpoint ``serve`` names: a directory, a GGUF file, or ``package:<dist>/<file>`` (a file an
    installed package ships: the small preset's SmolLM2)."""
    return base_file(tier.serve) or Path(tier.serve)


def _upstream_model(tier: TierConfig, inputs: dict[str, Path]) -> Path:
    """The model directory ``serve_input`` names among the stage's inputs (an error naming it)."""
    name, _, sub = tier.serve_input.strip("/").partition("/")
    if name not in inputs:
        raise KibidangoError(
            f"tier {tier.name!r}: serve_input {tier.serve_input!r} names input {name!r}; the stage has "
            f"{', '.join(sorted(inputs)) or 'none'} (wire it in the preset's graph)"
        )
    path = inputs[name] / sub
    if not (path / "config.json").is_file():
        raise KibidangoError(f"tier {tier.name!r}: {path} (serve_input {tier.serve_input!r}) is no transformers model")
    return path


def _requests(events: list[dict]) -> list[dict]:
    """One line per request (row, tier): its reply or error, verdict, dollars and seconds."""
    by_key: dict[tuple[str, str], dict] = {}
    unconfirmed: Counter = Counter()  # worst cases charged for requests sent again (--resend-unconfirmed)
    for e in events:
        if e["event"] == "torn":
            continue
        key = (e["row"], e["tier"])
        if e["event"] == "unconfirmed":
            unconfirmed[key] += e["usd"]
            by_key.setdefault(key, {"row": e["row"], "tier": e["tier"]})
        elif e["event"] in ("reply", "error"):
            entry = {k: v for k, v in e.items() if k not in ("event", "text")}
            entry["answer"] = e.get("text")
            by_key[key] = {**by_key.get(key, {}), **entry}
        elif e["event"] == "verdict":
            by_key.setdefault(key, {"row": e["row"], "tier": e["tier"]})
            by_key[key].update({k: e[k] for k in ("passed", "outcome", "score", "reason")})
    for key, entry in by_key.items():
        entry.setdefault("passed", False)
        entry["usd"] = entry.get("usd", 0.0) + unconfirmed[key]
    return list(by_key.values())


def _outcomes(cfg: Config, rows: list[dict], ledger: list[dict], state: _State) -> tuple[list[dict], Counter]:
    first_pass = {}
    order = {t.name: i for i, t in enumerate(cfg.tiers)}
    for entry in sorted(ledger, key=lambda e: order[e["tier"]]):
        if entry["passed"] and entry["row"] not in first_pass:
            first_pass[entry["row"]] = entry
    spent_by_row = Counter()
    for entry in ledger:
        spent_by_row[entry["row"]] += entry["usd"]
    skipped = {k[0] for k, e in state.done.items() if e["event"] == "skipped"}
    unjudged = {k[0] for k, e in state.done.items() if e.get("retryable")}
    status: Counter[str] = Counter()
    pairs = []
    for r in rows:
        hit = first_pass.get(r["id"])
        if hit is not None:
            pairs.append(
                {
                    "id": r["id"],
                    "domain": r["domain"],
                    "instruction": r["instruction"],
                    "input": r["input"],
                    "output": _pair_output(r, hit["answer"]),
                    "tier": hit["tier"],
                    "score": hit["score"],
                    "teacher_usd": spent_by_row[r["id"]],
                }
            )
            status["paired"] += 1
        elif r["id"] in skipped:
            status["skipped_budget"] += 1
        elif r["id"] in unjudged:
            status["held_judge_error"] += 1
        else:
            status["unresolved"] += 1
    return pairs, status


def _pair_output(row: dict, answer: str) -> str:
    """A passing answer as its pair teaches it: a math answer ends at its ``#### n`` mark; a code
    answer is the program the judge ran (its fences, prose and self-checks left out, as the gold
    programs are written)."""
    if row["domain"] == "math":
        return through_mark(answer.strip())
    if row["domain"] == "code":
        return judged_program(task_of(row), answer).strip()
    return answer.strip()


def _report(cfg, rows, ledger, pairs, status, spent: float, dead) -> dict:
    tiers = {}
    for t in cfg.tiers:
        mine = [e for e in ledger if e["tier"] == t.name]
        tiers[t.name] = {
            "kind": t.kind,
            "hint": t.hint,
            "requests": len(mine),
            "passed": sum(1 for p in pairs if p["tier"] == t.name),
            "usd": sum(e["usd"] for e in mine),
            "prompt_tokens": sum(e.get("prompt_tokens", 0) for e in mine),
            "completion_tokens": sum(e.get("completion_tokens", 0) for e in mine),
            "dead": t.name in dead,
        }
    retries: Counter[str] = Counter()
    for e in ledger:
        retries.update(e.get("retries") or {})
    # Every row sent to the top tier, priced from the same token counts: the most tokens any tier
    # saw for the row (0 for a row no tier answered), at the top tier's prices.
    top = cfg.tiers[-1]
    tokens: dict[str, tuple[int, int]] = {}
    for e in ledger:
        p, c = tokens.get(e["row"], (0, 0))
        tokens[e["row"]] = (max(p, e.get("prompt_tokens", 0)), max(c, e.get("completion_tokens", 0)))
    handled = {e["row"] for e in ledger}
    top_only = sum(top.usd(*tokens.get(r["id"], (0, 0))) for r in rows if r["id"] in handled)
    return {
        "command": "make stage-1d",
        "rows": len(rows),
        "pairs": len(pairs),
        "status": dict(status),
        "tiers": tiers,
        "retries": dict(retries),
        "spend_usd": spent,
        "ledger_usd": sum(e["usd"] for e in ledger),
        "budget_usd": cfg.budget_usd,
        "top_tier": top.name,
        "top_tier_only_usd": top_only,
        "cost_cut": 1 - spent / top_only if top_only else 0.0,
        "pairs_per_usd": len(pairs) / spent if spent else 0.0,
        "dead_tiers": list(dead),
        "domains": dict(Counter(p["domain"] for p in pairs)),
    }


def _write(out_dir: Path, pairs: list[dict], ledger: list[dict], report: dict) -> None:
    from datasets import Dataset

    for name, rows in (("pairs.jsonl", pairs), ("ledger.jsonl", ledger)):
        with open(out_dir / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    if pairs:
        Dataset.from_list(pairs).save_to_disk(str(out_dir / "pairs"))
    (out_dir / "cost.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    (out_dir / "COST_CARD.md").write_text(_card(report))
    _plot(report, out_dir / "cost_per_tier.png")


def _card(r: dict) -> str:
    lines = [
        "# Cascaded teachers (stage 1D)",
        "",
        f"Every figure below was computed by the stage that wrote this card (`{r['command']}`).",
        "",
        "| tier | requests | answers passed (pairs) | prompt tokens | completion tokens | spend ($) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t in r["tiers"].items():
        dead = " (DEAD)" if t["dead"] else ""
        lines.append(
            f"| {name}{dead} | {t['requests']:,} | {t['passed']:,} | {t['prompt_tokens']:,} "
            f"| {t['completion_tokens']:,} | {t['usd']:.4f} |"
        )
    s = r["status"]
    lines += [
        "",
        f"- critical failures in: {r['rows']:,}; corrected pairs: **{r['pairs']:,}**; unresolved (every tier "
        f"failed): {s.get('unresolved', 0):,}; skipped at the budget: {s.get('skipped_budget', 0):,}; held "
        f"because the judge gave no verdict (not escalated; a rerun judges them again, unpaid): "
        f"{s.get('held_judge_error', 0):,}",
        f"- spend: **${r['spend_usd']:.4f}** of a ${r['budget_usd']:g} budget; pairs per dollar: "
        f"{r['pairs_per_usd']:.1f}",
        f"- every row sent to the top tier ({r['top_tier']}) instead, from the same token counts: "
        f"${r['top_tier_only_usd']:.4f}; the cascade's cost cut: **{r['cost_cut']:.1%}**",
        f"- retries by cause: {', '.join(f'{k} {v}' for k, v in sorted(r['retries'].items())) or 'none'}",
        "",
    ]
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["tiers"])
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    ax[0].bar(names, [r["tiers"][n]["passed"] for n in names], color="#4a7")
    ax[0].set_title("corrected pairs by tier")
    ax[1].bar(["cascade", f"{r['top_tier']} only"], [r["spend_usd"], r["top_tier_only_usd"]], color=["#47a", "#a74"])
    ax[1].set_title("spend ($)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report_loop(artifact: Path) -> list[str]:
    """This stage's part of the report's "Does the loop work?" section: the first passing tier of
    every pair, and the spend against the top tier alone."""
    manifest = artifact / "manifest.json"
    teach = json.loads(manifest.read_text()).get("metrics", {}) if manifest.is_file() else {}
    if not teach:
        return []
    tiers = {k.split("/", 1)[1]: int(v) for k, v in teach.items() if k.startswith("answered_by/")}
    return [
        "### The teachers' tier split and cost cut",
        "",
        f"{int(teach.get('pairs', 0))} corrected pairs from {int(teach.get('rows', 0))} critical failures; first "
        "passing tier: " + ", ".join(f"{t} {n}" for t, n in tiers.items()) + f"; spent ${teach['spend_usd']:.4f} "
        f"against ${teach['top_tier_only_usd']:.4f} for the top tier alone (cut {teach['cost_cut']:.0%}).",
    ]
