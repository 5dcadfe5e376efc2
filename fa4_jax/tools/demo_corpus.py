"""The demo's training text: a synthetic corpus generated deterministically, nothing downloaded.

Each line is one of a few kinds, each with structure a small causal language model can learn,
so the loss curve falls well below the unigram entropy within a few hundred steps:

- sentences from a tiny grammar with number agreement ("the red cats chase a small dog."),
- additions with their sums ("38+57=95."),
- arithmetic progressions ("count 12 15 18 21 24."),
- key-value recall, where the answer is only predictable by attending back to an earlier part
  of the line ("recall qd=4 mf=7 zk=1 ; mf?7.") - the part that needs attention to work.
"""
from __future__ import annotations

import numpy as np

_ADJECTIVES = ["red", "small", "old", "quick", "quiet", "green", "tall", "brave"]
_NOUNS = ["cat", "dog", "bird", "fox", "child", "farmer", "horse", "river"]
_PLURAL = {"child": "children", "fox": "foxes"}
_VERBS = ["chase", "see", "follow", "watch", "help", "find"]
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def generate_corpus(num_chars: int = 400_000, seed: int = 0) -> str:
    """Returns at least `num_chars` characters of newline-separated lines; same seed, same text."""
    rng = np.random.default_rng(seed)
    line_makers = (_grammar_line, _addition_line, _progression_line, _recall_line)
    lines, total = [], 0
    while total < num_chars:
        line = line_makers[rng.integers(len(line_makers))](rng)
        lines.append(line)
        total += len(line) + 1
    return "\n".join(lines) + "\n"


def _noun_phrase(rng) -> tuple[str, bool]:
    noun = _NOUNS[rng.integers(len(_NOUNS))]
    plural = bool(rng.integers(2))
    determiner = "the" if plural else ("the", "a")[rng.integers(2)]
    words = [determiner]
    if rng.random() < 0.6:
        words.append(_ADJECTIVES[rng.integers(len(_ADJECTIVES))])
    words.append(_PLURAL.get(noun, noun + "s") if plural else noun)
    return " ".join(words), plural


def _grammar_line(rng) -> str:
    subject, plural = _noun_phrase(rng)
    verb = _VERBS[rng.integers(len(_VERBS))]
    # Agreement: a singular subject takes the -s/-es form, so the verb depends on the subject.
    if not plural:
        verb += "es" if verb.endswith(("ch", "sh")) else "s"
    obj, _ = _noun_phrase(rng)
    return f"{subject} {verb} {obj}."


def _addition_line(rng) -> str:
    a, b = rng.integers(0, 100, size=2)
    return f"{a}+{b}={a + b}."


def _progression_line(rng) -> str:
    start, step = int(rng.integers(0, 50)), int(rng.integers(1, 6))
    terms = " ".join(str(start + step * i) for i in range(int(rng.integers(4, 8))))
    return f"count {terms}."


def _recall_line(rng) -> str:
    num_pairs = int(rng.integers(3, 6))
    # Distinct keys, so every question has exactly one answer in the line.
    key_ids = rng.choice(len(_LETTERS) ** 2, size=num_pairs, replace=False)
    keys = [_LETTERS[i // len(_LETTERS)] + _LETTERS[i % len(_LETTERS)] for i in key_ids]
    values = rng.integers(0, 10, size=num_pairs)
    pairs = " ".join(f"{k}={v}" for k, v in zip(keys, values))
    asked = int(rng.integers(num_pairs))
    return f"recall {pairs} ; {keys[asked]}?{values[asked]}."


class CharTokenizer:
    """Character-level tokenizer over the characters of a given text."""

    def __init__(self, text: str):
        self.alphabet = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self._ids[c] for c in text], dtype=np.int32)
