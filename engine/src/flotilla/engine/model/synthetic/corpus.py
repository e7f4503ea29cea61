"""A synthetic corpus with structure a tiny model learns in minutes: the trained presets' text.

Five kinds of document, each built from templates over names drawn for that document from 200 made-up
ones (one token each), so the model can only tell which name comes next by copying it from earlier in
the same document:

- code: a function whose name and parameters come back in its body and at its call site, or a class whose
  fields come back as `self.<field>` and in one getter each;
- steps: a numbered list that names the same service on every line, in a fixed order;
- lists: a numbered packing list, then a sentence that counts the items and repeats the owner's name;
- stories: templated sentences about two people, a town and a thing, each name repeated later;
- records: `name: ..., color: ..., size: ...` lines, then a sentence that recalls one record.

Everything is deterministic in the seed (pure Python, no torch): `training_documents(seed)` and
`held_out_documents(seed)` draw from the same templates with different random streams.
`CORPUS_VERSION` changes whenever the text changes, which retrains the cached presets.
"""

from __future__ import annotations

import random

CORPUS_VERSION = 2
KINDS = ("code", "steps", "lists", "stories", "records")
# Held-out documents use another random stream of the same generator.
HELD_OUT_OFFSET = 1_000_003

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u")]
STEMS = [
    "user", "order", "item", "price", "count", "cache", "token", "batch", "queue", "node",
    "route", "block", "file", "page", "score", "event", "frame", "shard", "layer", "record",
    "buffer", "signal", "report", "ticket", "window", "packet", "sensor", "budget", "invoice", "profile",
]  # fmt: skip
VERBS = ["process", "load", "update", "check", "build", "merge", "parse", "send", "store", "count"]
FIELDS = ["name", "size", "total", "owner", "status", "limit", "offset", "weight", "level", "index"]
JOBS = ["baker", "sailor", "teacher", "builder", "painter", "doctor", "farmer", "pilot", "weaver", "clerk"]
PLACES = ["market", "harbor", "library", "station", "garden", "bridge", "school", "bakery", "tower", "square"]
DAYS = ["morning", "evening", "Monday", "Friday", "spring", "winter"]
THINGS = ["lantern", "map", "letter", "boat", "clock", "key", "basket", "drum", "kite", "ledger"]
ITEMS = [
    "apples", "candles", "ropes", "lanterns", "nails", "maps", "blankets", "cups", "pencils",
    "batteries", "oranges", "bottles", "shirts", "books", "tickets", "plates",
]  # fmt: skip
COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
NUMBER_WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
STEPS = [
    "Build the {s} image.",
    "Run the {s} tests.",
    "Push the {s} image to the registry.",
    "Write the {s} config file.",
    "Start the {s} service.",
    "Check the {s} logs.",
    "Open the {s} dashboard.",
    "Tell the team that {s} is live.",
]


def _inventory(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words: list[str] = []
    while len(words) < count:
        word = rng.choice(SYLLABLES) + rng.choice(SYLLABLES)
        if word not in words:
            words.append(word)
    return words


# Made-up names of two syllables, few enough that the tokenizer learns each as one token: a name is then
# copied whole from earlier in the document, the first thing a small model learns to copy.
NAMES = _inventory(200, seed=20240601)


def made_up_word(rng: random.Random) -> str:
    return rng.choice(NAMES)


def made_up_words(rng: random.Random, count: int) -> list[str]:
    """`count` different names."""
    return rng.sample(NAMES, count)


def identifier(rng: random.Random) -> str:
    """A snake_case name: two stems, or a made-up word and a stem (which only copying predicts)."""
    if rng.random() < 0.5:
        first, second = rng.sample(STEMS, 2)
        return f"{first}_{second}"
    return f"{made_up_word(rng)}_{rng.choice(STEMS)}"


def code_function(rng: random.Random) -> str:
    verb = rng.choice(VERBS)
    name = identifier(rng)
    a, b = rng.sample(STEMS, 2)
    field = rng.choice(FIELDS)
    limit = rng.randint(2, 99)
    body = [
        f"    {a} = load_{name}({a})",
        f"    total = {a}.{field} + {b}",
        f"    if total > {limit}:",
        f"        return save_{name}({a}, total)",
    ]
    extras = [
        f'    log("{verb} {name}", {a}, {b})',
        f"    {b} = {b} + {a}.{field}",
        f'    assert {a} is not None, "{name} needs {a}"',
    ]
    body[1:1] = rng.sample(extras, rng.randint(0, 2))
    result = rng.choice(["result", "out", "value", f"new_{a}"])
    lines = [f"def {verb}_{name}({a}, {b}):", *body, f"    return {a}", ""]
    lines.append(f"{result} = {verb}_{name}({a}_{rng.randint(1, 9)}, {rng.randint(0, 50)})")
    lines.append(f"print({result})")
    return "\n".join(lines)


def code_class(rng: random.Random) -> str:
    name = made_up_word(rng).capitalize() + rng.choice(STEMS).capitalize()
    fields = rng.sample(FIELDS, rng.randint(2, 4))
    lines = [f"class {name}:", f"    def __init__(self, {', '.join(fields)}):"]
    lines += [f"        self.{f} = {f}" for f in fields]
    for f in fields:
        lines += ["", f"    def get_{f}(self):", f"        return self.{f}"]
    var = name.lower()
    args = ", ".join(str(rng.randint(0, 99)) for _ in fields)
    lines += ["", f"{var} = {name}({args})", f"print({var}.get_{rng.choice(fields)}())"]
    return "\n".join(lines)


def steps_list(rng: random.Random) -> str:
    service = made_up_word(rng) + rng.choice(["", "-api", "-db", "-worker"])
    chosen = sorted(rng.sample(range(len(STEPS)), rng.randint(3, 6)))
    lines = [f"How to deploy {service}:"]
    lines += [f"{i}. {STEPS[k].format(s=service)}" for i, k in enumerate(chosen, start=1)]
    lines.append(f"Done: {service} is deployed in {len(chosen)} steps.")
    return "\n".join(lines)


def packing_list(rng: random.Random) -> str:
    owner, town = (name.capitalize() for name in made_up_words(rng, 2))
    items = rng.sample(ITEMS, rng.randint(3, 6))
    lines = [f"Packing list for {owner}'s trip to {town}:"]
    lines += [f"{i}. {rng.choice(NUMBER_WORDS[1:])} {item}" for i, item in enumerate(items, start=1)]
    joined = ", ".join(items[:-1]) + f" and {items[-1]}"
    lines.append(f"{owner} packs {len(items)} kinds of things for {town}: {joined}.")
    return "\n".join(lines)


def story(rng: random.Random) -> str:
    p, q, town = (name.capitalize() for name in made_up_words(rng, 3))
    job, job2 = rng.sample(JOBS, 2)
    place = rng.choice(PLACES)
    thing = rng.choice(THINGS)
    day = rng.choice(DAYS)
    sentences = [
        f"{p} lives in {town}.",
        f"{p} works as a {job}.",
        f"Every {day}, {p} walks to the {place} in {town}.",
        f"At the {place}, {p} meets {q}, who is a {job2}.",
        f"{q} asks {p} about the {thing}.",
        f'"{p}, the {thing} is ready," says {q}.',
        f"{p} takes the {thing} home to {town}.",
    ]
    # The sentence that introduces the second person always comes before those that name them.
    keep = sentences[:4] + sorted(rng.sample(sentences[4:], rng.randint(1, 3)), key=sentences.index)
    return " ".join(keep)


def records(rng: random.Random) -> str:
    names = made_up_words(rng, rng.randint(3, 6))
    rows = [(name, rng.choice(COLORS), rng.randint(1, 20)) for name in names]
    lines = [f"name: {n}, color: {c}, size: {s}" for n, c, s in rows]
    n, c, s = rng.choice(rows)
    lines.append(f"The {n} is {c} and has size {s}.")
    return "\n".join(lines)


GENERATORS = {
    "code": lambda rng: code_function(rng) if rng.random() < 0.6 else code_class(rng),
    "steps": steps_list,
    "lists": packing_list,
    "stories": story,
    "records": records,
}


def documents(seed: int, count: int) -> list[str]:
    """`count` documents, the kinds in turn, each from the seeded stream."""
    rng = random.Random(seed)
    return [GENERATORS[KINDS[i % len(KINDS)]](rng) for i in range(count)]


def training_documents(seed: int = 0, count: int = 20000) -> list[str]:
    return documents(seed, count)


def held_out_documents(seed: int = 0, count: int = 500) -> list[str]:
    """Documents from the same templates that training never sees (another random stream)."""
    return documents(seed + HELD_OUT_OFFSET, count)


def tokenizer_texts(seed: int = 0, count: int = 4000) -> list[str]:
    """The text the trained presets' BPE is learned from (a slice of the training documents)."""
    return documents(seed, count)


def sample_prompts(seed: int = 0, count: int = 16) -> list[str]:
    """Prompts cut from held-out documents: each a document's first lines (or first words), whose
    continuation partly copies names the prompt holds (for greedy demos, speculative decoding and
    quantization checks). A prompt ends at the end of a line, never with the newline: byte-level BPE
    merges a newline with the next line's indentation, so a trailing newline would be a token boundary
    that training never showed."""
    prompts = []
    for doc in held_out_documents(seed, count):
        lines = doc.split("\n")
        if len(lines) >= 3:
            prompts.append("\n".join(lines[: max(2, len(lines) // 2)]).rstrip())
        else:
            words = doc.split(" ")
            prompts.append(" ".join(words[: max(4, len(words) // 2)]))
    return prompts
