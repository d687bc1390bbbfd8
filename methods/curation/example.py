"""The one schema every source is normalised to, and the record of a rejected row."""

from __future__ import annotations

import unicodedata
from dataclasses import asdict, dataclass

__all__ = ["DOMAINS", "Example", "Reject", "normalize_text"]

DOMAINS = ("general", "code", "math")


@dataclass
class Example:
    """One instruction example (plain text sources: empty instruction, the text in ``output``)."""

    id: str
    source: str
    domain: str
    instruction: str
    input: str
    output: str

    @property
    def text(self) -> str:
        return "\n".join(part for part in (self.instruction, self.input, self.output) if part)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Reject:
    """A row that could not be read: quarantined in ``rejects.jsonl``, counted in the card."""

    source: str
    file: str
    line: int
    field: str
    reason: str
    raw: str

    def message(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        field = f" field '{self.field}'" if self.field else ""
        return f"{where}:{field} {self.reason}"

    def to_dict(self) -> dict:
        return asdict(self)


def normalize_text(text: str) -> str:
    """Unicode NFC, Unix newlines, no trailing spaces at line ends or around the text."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip()
