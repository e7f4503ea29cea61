"""The `routing` workload, pure and seeded: S long system prompts, U users each bound to one of them, T
turns per user. Turn t sends the system prompt, the user's earlier messages with the assistant's replies,
and the user's message t; the reply is appended before the next turn. So every user's prompts share the
system prompt with a quarter (S = 4) of the other users, and each turn shares all of the previous turn's
prompt: the two prefixes a cache-aware router can keep on one replica.

Text is pseudo-words from a fixed syllable set (what the tiny presets' tokenizers were trained on: a few
tokens per word), so sizes are given in words; the benchmark converts its token targets with the ratio it
measures on the engine's own tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_SYLLABLES = tuple(a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou", "ee"))


def words(rng: random.Random, count: int) -> str:
    """`count` pseudo-words, with a full stop every dozen or so."""
    out = []
    for i in range(count):
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        out.append(word + ("." if i % 13 == 12 else ""))
    return " ".join(out)


@dataclass(frozen=True)
class Conversation:
    index: int  # the order sessions start in
    user: int
    system: int  # index into Workload.system_prompts
    messages: tuple[str, ...]  # the user's message of each turn


@dataclass(frozen=True)
class Workload:
    system_prompts: tuple[str, ...]
    conversations: tuple[Conversation, ...]

    @property
    def turns(self) -> int:
        return max((len(c.messages) for c in self.conversations), default=0)

    @property
    def requests(self) -> int:
        return sum(len(c.messages) for c in self.conversations)


def make_workload(
    systems: int, users: int, turns: int, system_words: int, user_words: int, seed: int = 0,
    preamble_words: int = 0,
) -> Workload:  # fmt: skip
    """Users are bound to system prompts round-robin (user u to prompt u mod S), then shuffled, so the
    sessions of one system prompt are spread over the run; the same arguments give the same workload.

    The system prompts differ from their first word, unless `preamble_words` > 0: then they all begin
    with the same preamble of that many words (a shared instruction block), which the prefix caches
    and the gateway's prefix table also see as a common prefix."""
    if systems < 1 or users < 1 or turns < 1 or system_words < 1 or user_words < 1 or preamble_words < 0:
        raise ValueError("systems, users, turns, system_words and user_words must be at least 1, "
                         "preamble_words at least 0")  # fmt: skip
    rng = random.Random(seed)
    preamble = words(random.Random(f"preamble-{seed}"), preamble_words) + "\n" if preamble_words else ""
    prompts = tuple(preamble + words(rng, system_words) for _ in range(systems))
    order = list(range(users))
    rng.shuffle(order)
    conversations = tuple(
        Conversation(
            index=i,
            user=user,
            system=user % systems,
            messages=tuple(f"User {user}, question {t}: {words(rng, user_words)}" for t in range(turns)),
        )
        for i, user in enumerate(order)
    )
    return Workload(prompts, conversations)


def chat_messages(system_prompt: str, history: list[tuple[str, str]], message: str) -> list[dict[str, str]]:
    """The `messages` of one turn: the system prompt, each earlier (user, assistant) pair, the new message."""
    out = [{"role": "system", "content": system_prompt}]
    for asked, answered in history:
        out += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    out.append({"role": "user", "content": message})
    return out


def longest_prompt_words(workload: Workload, reply_words: int) -> int:
    """Words in the longest turn's prompt (the last turn of the longest conversation), counting each
    earlier reply as `reply_words`: what must fit in the model's context."""
    longest = 0
    for conversation in workload.conversations:
        system = len(workload.system_prompts[conversation.system].split())
        asked = sum(len(m.split()) for m in conversation.messages)
        longest = max(longest, system + asked + reply_words * (len(conversation.messages) - 1))
    return longest
