"""Which data-parallel replica runs a request: the one whose prefix cache holds the longest prefix of its
prompt (a conversation's next turn lands where its history is cached), weighed against its load. With prefill
and decode replicas (--kv-role), a pair: the same choice among each kind."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from zhuzi.engine.core.kv.page_manager import hash_chain

# A request in flight on a replica costs a newcomer about as much as recomputing this many prompt tokens:
# one more row in a decode batch slows every step of the reply a little, which over a reply adds up to a
# prefill of several hundred tokens (docs/benchmarks.md has the figures).
LOAD_COST_TOKENS = 512


@dataclass
class PrefixRouter:
    """Which replicas hold each page hash, from the pages each reports stored and evicted (messages.Outputs).
    A new prompt's hash chain is computed with the engine's own, so a match here is a match there. A cached
    prefix is weighed against the requests already running there: otherwise the first replica to cache a
    system prompt that every chat shares would draw every chat."""

    page_size: int
    holders: defaultdict[bytes, set[int]] = field(default_factory=lambda: defaultdict(set))

    def update(self, replica: int, stored: list[bytes], removed: list[bytes]) -> None:
        for h in removed:
            if (holding := self.holders.get(h)) is not None:
                holding.discard(replica)
                if not holding:
                    del self.holders[h]
        for h in stored:
            self.holders[h].add(replica)

    def forget(self, replica: int) -> None:
        for h in [h for h, holding in self.holders.items() if replica in holding]:
            self.update(replica, [], [h])

    def cached_tokens(self, prompt: list[int], replicas: set[int]) -> dict[int, int]:
        """How many leading tokens of prompt each replica holds in its prefix cache."""
        cached = dict.fromkeys(replicas, 0)
        # The engine always computes a prompt's last token, so only the full pages before it can hit.
        for n, h in enumerate(hash_chain(prompt[:-1], self.page_size), 1):
            replicas = replicas & self.holders.get(h, set())
            if not replicas:
                break
            for r in replicas:
                cached[r] = n * self.page_size
        return cached

    def pick(self, prompt: list[int], load: dict[int, int]) -> int:
        """The replica (a key of load: the live ones, with their requests in flight) to run prompt on."""
        if len(load) == 1 or not prompt:  # nothing to weigh (a snapshot has no prompt): the first
            return min(load)
        cached = self.cached_tokens(prompt, set(load))
        return min(load, key=lambda r: (load[r] * LOAD_COST_TOKENS - cached[r], r))

    def pick_pair(self, prompt: list[int], prefill: dict[int, int], decode: dict[int, int],
                  max_local: int) -> tuple[int | None, int]:
        """The decode replica to stream prompt's reply, and the prefill replica to compute the prompt first:
        None when the decode replica's own prefix cache leaves at most max_local tokens to compute."""
        target = self.pick(prompt, decode)
        if not prefill or len(prompt) - self.cached_tokens(prompt, {target})[target] <= max_local:
            return None, target
        return self.pick(prompt, prefill), target
