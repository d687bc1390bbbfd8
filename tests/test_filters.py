"""Quality, language and domain decisions on rows a user would recognise."""

from __future__ import annotations

from methods.curation.example import Example
from methods.curation.filters import LanguageConfig, LanguageFilter, QualityConfig, infer_domain, quality_reason


def ex(instruction="", output="", domain="general", input_=""):
    return Example("id", "src", domain, instruction, input_, output)


def test_quality_reasons():
    cfg = QualityConfig(min_chars=16, max_chars=200)
    assert quality_reason(ex("Tell me a story.", "Once upon a time there was a fox."), cfg) is None
    assert quality_reason(ex("Tell me a story.", ""), cfg) == "empty"
    assert quality_reason(ex("Hi", "Yo"), cfg) == "too_short"
    assert quality_reason(ex("Tell me a story.", "word " * 60), cfg) == "too_long"
    assert quality_reason(ex("Tell me a story.", "He said, â€œhelloâ€\x9d to me."), cfg) == "garbled"  # mojibake
    assert quality_reason(ex("Tell me a story.", "bad \ufffd decode here"), cfg) == "garbled"
    assert quality_reason(ex("Tell me a story.", "ok \x07 bell char here"), cfg) == "garbled"
    assert quality_reason(ex("Hi", "12 34 56 78 90 12 34 56 78 90 12 34"), cfg) == "garbled"  # 2 letters in 26
    assert quality_reason(ex("Tell me a story.", "Aaa" + "!" * 70), cfg) == "garbled"


def test_language_filter_keeps_english_and_drops_confident_others():
    f = LanguageFilter(LanguageConfig())
    english = ex("Describe how to make a cup of tea.", "Boil water, add the tea bag and wait three minutes.")
    french = ex("Décrivez comment préparer une tasse de thé.", "Faites bouillir de l'eau et ajoutez le sachet de thé.")
    german = ex("Beschreibe, wie man eine Tasse Tee zubereitet.", "Wasser kochen, den Teebeutel hinzufügen und warten.")
    assert f.reason(f.language(english)) is None
    assert f.language(french) == "fr" and f.reason("fr") == "language:fr"
    assert f.language(german) == "de"
    assert f.language(ex("Sum?", "4")) == "und"  # too short to tell: kept
    code = ex("Write a function that reverses a list.", "def rev(xs):\n    return xs[::-1]", domain="code")
    assert f.language(code) == "en"  # judged on the instruction, not the program


def test_domain_inference():
    assert infer_domain(ex("Write a Python function to add two numbers.", "def add(a, b):\n    return a + b")) == "code"
    assert infer_domain(ex("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = 7")) == "math"
    assert (
        infer_domain(ex("Give me three tips for sleeping well.", "Keep a schedule, avoid screens, exercise."))
        == "general"
    )
