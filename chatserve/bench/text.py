"""Deterministic prompt text for the benchmarks, without a tokenizer or a download.

English-like sentences from word lists, drawn with a `random.Random(seed)`: the same seed gives the
same prompts on every machine, and two draws share no more than chance wording (no accidental
shared prefix for a prefix cache to find). Lengths are in approximate tokens: SmolLM2's tokenizer
gives about `CHARS_PER_TOKEN` characters per token on this text (measured; other tokenizers are
within ~15%); the real counts come back in each response's `usage`.

Shared by `chatserve bench serve` (chatserve/bench/datasets.py) and benchmarks/serving/bench_serving.py.
"""

from __future__ import annotations

import random

CHARS_PER_TOKEN = 4.9

SUBJECTS = (
    "the harbour master", "a young engineer", "the village council", "an old fisherman", "the railway company",
    "a travelling merchant", "the school teacher", "a team of surveyors", "the baker", "the lighthouse keeper",
    "a retired doctor", "the mayor", "a group of students", "the farmers of the valley", "a visiting scientist",
    "the ship's captain", "the night watchman", "a local historian", "the postmistress", "the miller",
    "the blacksmith", "a pair of botanists", "the ferry pilot", "the choir", "a newspaper reporter",
)
VERBS = (
    "repaired", "described", "measured", "painted", "studied", "explained", "built", "visited",
    "photographed", "mapped", "questioned", "recorded", "rebuilt", "inspected", "celebrated", "ignored",
    "cleaned", "defended", "sold", "borrowed", "restored", "catalogued", "sketched", "weighed", "guarded",
)
OBJECTS = (
    "the stone bridge", "a broken clock", "the northern cliffs", "the old mill", "a set of brass instruments",
    "the new railway line", "the church bell", "a map of the coast", "the harbour wall", "a cart full of barley",
    "the observatory", "the wooden trays", "the fishing nets", "a collection of letters", "the weather station",
    "the school roof", "a flock of sheep", "the market square", "the signal lantern", "the ferry",
    "the tide tables", "a chest of silver coins", "the orchard", "the town records", "the salmon ladder",
)
PLACES = (
    "near the river", "behind the bakery", "at the end of the pier", "on the hill above the village",
    "in the council hall", "beside the old chapel", "along the coast road", "under the great oak",
    "inside the lighthouse", "at the railway station", "across the valley", "by the frozen pond",
)
TIMES = (
    "before dawn", "during the autumn storms", "on a quiet Sunday", "after the harvest", "in the spring of 1852",
    "late one winter evening", "every Thursday", "at midday", "during the long drought", "the following summer",
    "on the first day of the fair", "just after the floods",
)
REASONS = (
    "because nobody else knew how", "so that the boats could return safely", "to settle an old argument",
    "while the rain kept falling", "although the mayor disagreed", "as the children watched",
    "to prepare for the festival", "for reasons nobody understood", "despite the cold wind",
    "with surprising patience", "after a long debate", "to the delight of the neighbours",
)
EXTRAS = (
    "It took {n} days and cost {m} coins.", "Only {n} people saw it happen.", "The records list {n} witnesses.",
    "Some said it was the {ord} time that year.", "The work needed {n} helpers and {m} nails.",
    "A note dated the {ord} of the month mentions it.",
)
QUESTIONS = (
    "Why did {s} decide that {o} needed attention {t}?",
    "Summarize in {n} sentences what happened {p} {t}.",
    "What would have changed if {s} had not {v} {o}?",
    "List {n} facts about {o} that the records mention.",
    "Who else was involved when {s} {v} {o}, and why?",
    "Explain how {o} is connected to {s}, in plain words.",
    "Compare what {s} did with what happened {p}.",
    "Write a short letter from {s} about {o}.",
)
FOLLOW_UPS = (
    "Thanks. Can you say more about {o}?", "And what did {s} think about it afterwards?",
    "Please make that shorter and mention {p}.", "Interesting. What happened {t}?",
    "Could you turn that into a list of {n} points?", "Why do you think {s} {v} {o}?",
)
ORD = ("first", "second", "third", "fourth", "fifth", "seventh", "tenth", "twelfth", "twentieth")


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def sentence(rng: random.Random) -> str:
    s = (f"{cap(rng.choice(SUBJECTS))} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)} "
         f"{rng.choice(TIMES)}, {rng.choice(REASONS)}.")
    if rng.random() < 0.3:
        s += " " + rng.choice(EXTRAS).format(n=rng.randint(2, 90), m=rng.randint(10, 900), ord=rng.choice(ORD))
    return s


def text_of_tokens(rng: random.Random, approx_tokens: int) -> str:
    """Sentences until about approx_tokens tokens (never empty)."""
    target = max(1, approx_tokens) * CHARS_PER_TOKEN
    parts: list[str] = []
    size = 0
    while size < target or not parts:
        s = sentence(rng)
        parts.append(s)
        size += len(s) + 1
    return " ".join(parts)


def fill(template: str, rng: random.Random) -> str:
    return template.format(s=rng.choice(SUBJECTS), v=rng.choice(VERBS), o=rng.choice(OBJECTS),
                           p=rng.choice(PLACES), t=rng.choice(TIMES), n=rng.randint(2, 6))


def question(rng: random.Random, i: int, approx_tokens: int) -> str:
    """A distinct question: a numbered question, then context sentences up to approx_tokens."""
    q = cap(fill(rng.choice(QUESTIONS), rng))
    head = f"Question {i + 1}: {q}"
    room = approx_tokens - len(head) / CHARS_PER_TOKEN
    return head if room < 8 else f"{head} Context: {text_of_tokens(rng, int(room))}"




def text_of_length(rng: random.Random, approx_tokens: int) -> str:
    """`text_of_tokens` cut at the word nearest to approx_tokens tokens: lengths within a few tokens
    of the target instead of up to a sentence over (the `random` dataset's fixed input length)."""
    target = int(max(1, approx_tokens) * CHARS_PER_TOKEN)
    text = text_of_tokens(rng, approx_tokens)
    if len(text) <= target:
        return text
    cut = text.rfind(" ", 0, target)
    return text[:cut] if cut > 0 else text[:target]
