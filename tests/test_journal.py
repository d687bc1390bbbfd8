"""The resumable stages' journal: a torn last line is kept in its place (and stays there across
attempts, even when its acknowledgement is itself cut); a damaged line anywhere else is refused
with the file and the line."""

from __future__ import annotations

import json

import pytest

from methods.journal import Journal, JournalDamaged


def _reopen(path):
    j = Journal(path)
    j.close()
    return j.events


def test_a_torn_last_line_stays_in_place_across_attempts(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.write_text('{"event": "sent", "row": "a"}\n{"event": "sent", "row": "b", "ti')
    j = Journal(path)
    assert j.events[1] == {"event": "torn", "line": 2, "text": '{"event": "sent", "row": "b", "ti'}
    j.write({"event": "x"})
    j.close()
    for _ in range(3):  # every later attempt reads the same fragment in the same place
        events = _reopen(path)
        assert [e["event"] for e in events] == ["sent", "torn", "x"] and events[1]["line"] == 2
    j = Journal(path)
    j.write({"event": "y"})
    j.close()
    assert [e["event"] for e in _reopen(path)] == ["sent", "torn", "x", "y"]


def test_a_cut_acknowledgement_leaves_the_line_torn_and_last(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.write_text('{"event": "sent", "row": "a"}\n{"event": "sent", "row": "b", "ti{"event": "to')
    j = Journal(path)
    assert j.events[-1]["event"] == "torn" and j.events[-1]["line"] == 2
    j.write({"event": "x"})
    j.close()
    assert [e["event"] for e in _reopen(path)] == ["sent", "torn", "x"]


def test_a_torn_line_ending_in_a_newline_is_acknowledged_on_the_next(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.write_text('{"event": "sent", "row": "a"}\n{"event": "sent", "ro\n')
    j = Journal(path)
    j.write({"event": "x"})
    j.close()
    assert [e["event"] for e in _reopen(path)] == ["sent", "torn", "x"]


@pytest.mark.parametrize("damage", ['{"event": "se', "[1, 2]", "not json", '"just a string"'])
def test_a_damaged_line_that_is_not_the_last_is_refused(tmp_path, damage):
    path = tmp_path / "journal.jsonl"
    path.write_text("\n".join([json.dumps({"event": "sent"}), damage, json.dumps({"event": "reply"})]) + "\n")
    with pytest.raises(JournalDamaged, match=r"journal\.jsonl: line 2 is damaged .* not the last line"):
        Journal(path)
    assert path.read_text().count("\n") == 3  # nothing rewritten


def test_a_line_that_is_not_utf8_is_damaged_never_a_request_id(tmp_path):
    """Invalid UTF-8 was decoded with replacement characters and the line read as a request of an
    id nobody sent; the writer writes UTF-8, so such a line was changed after it was written."""
    path = tmp_path / "journal.jsonl"
    path.write_bytes(b'{"event": "sent", "row": "a"}\n{"event": "sent", "row": "b\xff"}\n{"event": "x"}\n')
    with pytest.raises(JournalDamaged, match=r"line 2 is not UTF-8"):
        Journal(path)
    path.write_bytes(b'{"event": "sent", "row": "a"}\n{"event": "sent", "row": "b\xff')  # last: a torn write
    assert Journal(path).events[-1]["event"] == "torn"


def test_a_torn_marker_excuses_only_the_line_it_follows(tmp_path):
    """A hand-added ``{"event": "torn", "line": N}`` excused a damaged line anywhere: the writer only
    ever acknowledges the last line, right after it (on its line or the next)."""
    path = tmp_path / "journal.jsonl"
    damaged = '{"event": "sent", "row": "a"}\n{"event": "se\n{"event": "x"}\n'
    for marker in ('{"event": "torn", "line": 2}\n', '{"event": "torn", "line": 7}\n'):
        path.write_text(damaged + marker)
        with pytest.raises(JournalDamaged):
            Journal(path)
    path.write_text('{"event": "sent", "row": "a"}\n{"event": "se\n{"event": "torn", "line": 2}\n{"event": "x"}\n')
    assert [e["event"] for e in _reopen(path)] == ["sent", "torn", "x"]  # the writer's own form still reads


def test_a_line_missing_its_fields_is_damaged_not_a_crash(tmp_path):
    """1D's replay raised KeyError/TypeError on a line that is JSON but lacks its fields; with the
    stage's check, such a line is damaged (refused in the middle, a torn write at the end)."""
    from stages.teach_cascade import _check_event

    path = tmp_path / "journal.jsonl"
    good = json.dumps({"event": "sent", "row": "a", "tier": "t", "reserved": 0.1})
    for bad in ({"event": "sent"}, {"event": "reply", "row": 5, "tier": "t", "usd": 0.1, "text": "x"}, {"event": "?"}):
        path.write_text("\n".join([good, json.dumps(bad), good]) + "\n")
        with pytest.raises(JournalDamaged, match="line 2 is damaged"):
            Journal(path, check=_check_event)
    path.write_text(good + "\n" + json.dumps({"event": "sent", "row": "b"}) + "\n")
    assert Journal(path, check=_check_event).events[-1]["event"] == "torn"
