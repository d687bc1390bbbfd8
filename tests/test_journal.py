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
