"""A small deterministic dataset the project generates itself, so that a clone without
``../shared`` still runs the tiny preset end to end. Stories, general instructions, arithmetic
word problems with worked answers, and short Python functions; a few rows are planted
near-duplicates so that deduplication has something to do."""

from __future__ import annotations

import random

from methods.curation.example import Example

__all__ = ["synthetic_examples"]

_NAMES = ["Lily", "Tom", "Mia", "Ben", "Sue", "Max", "Anna", "Sam", "Lucy", "Jack"]
_THINGS = ["ball", "kite", "cat", "dog", "boat", "tree", "cake", "hat", "book", "drum"]
_PLACES = ["park", "garden", "beach", "forest", "kitchen", "school", "farm", "river"]
_FEELINGS = ["happy", "sad", "brave", "curious", "sleepy", "proud", "scared", "kind"]
_TOPICS = ["recycling", "sleep", "exercise", "reading", "friendship", "gardening", "saving money", "cooking"]
_OPS = [
    ("add", "a + b", "the sum of a and b"),
    ("subtract", "a - b", "a minus b"),
    ("multiply", "a * b", "the product of a and b"),
    ("maximum", "max(a, b)", "the larger of a and b"),
]


def _story(rng: random.Random) -> tuple[str, str, str]:
    name, thing, place, feel = rng.choice(_NAMES), rng.choice(_THINGS), rng.choice(_PLACES), rng.choice(_FEELINGS)
    friend = rng.choice([n for n in _NAMES if n != name])
    text = (
        f"Once upon a time, there was a little {rng.choice(['girl', 'boy'])} named {name}. "
        f"{name} loved to play with a {thing} in the {place}. One day, {name} felt {feel}. "
        f'{friend} came to the {place} and said, "Can I play with your {thing}?" '
        f"{name} smiled and shared the {thing}. They played together until the sun went down, "
        f"and {name} learned that sharing makes everyone {rng.choice(_FEELINGS)}."
    )
    return "", "", text


def _instruction(rng: random.Random) -> tuple[str, str, str]:
    topic = rng.choice(_TOPICS)
    tips = rng.sample(["start small", "be consistent", "ask for help", "keep notes", "set a goal", "rest well"], 3)
    return (
        f"Give three simple tips about {topic}.",
        "",
        f"Here are three tips about {topic}: first, {tips[0]}; second, {tips[1]}; third, {tips[2]}. "
        f"Small steps every day make {topic} easier.",
    )


def _math(rng: random.Random) -> tuple[str, str, str]:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(1, 9)
    total = a + b - c
    return (
        f"{name} has {a} {thing}s and buys {b} more. Then {name} gives away {c}. How many {thing}s does {name} have "
        "now?",
        "",
        f"{name} starts with {a} and buys {b}, so {a} + {b} = {a + b}. "
        f"After giving away {c}, {a + b} - {c} = {total}.\n#### {total}",
    )


def _code(rng: random.Random) -> tuple[str, str, str]:
    op, expr, desc = rng.choice(_OPS)
    fname = f"{op}_{rng.choice(['numbers', 'values', 'pair', 'two'])}"
    return (
        f"Write a Python function named {fname} that returns {desc}.",
        "",
        f'def {fname}(a, b):\n    """Return {desc}."""\n    return {expr}',
    )


_KINDS = [("general", _story), ("general", _instruction), ("math", _math), ("code", _code)]


def _near_copy(rng: random.Random, text: str) -> str:
    """Case and whitespace changes plus one dropped word: a near-duplicate, not an exact one."""
    words = text.split(" ")
    if len(words) > 8:
        del words[rng.randrange(1, len(words) - 1)]
    return "  ".join(words).upper() if rng.random() < 0.5 else " ".join(words) + "  "


def synthetic_examples(rows: int, seed: int) -> list[Example]:
    rng = random.Random(seed)
    out: list[Example] = []
    for i in range(rows):
        if out and i % 20 == 19:  # every 20th row is a near-duplicate of an earlier one
            src = out[rng.randrange(len(out))]
            instruction, input_, output = src.instruction, src.input, _near_copy(rng, src.output)
            domain = src.domain
        else:
            domain, make = _KINDS[i % len(_KINDS)]
            instruction, input_, output = make(rng)
        out.append(Example(f"synthetic-{i + 1:06d}", "synthetic", domain, instruction, input_, output.strip()))
    return out
