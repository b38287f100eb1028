"""KV pages: allocation, reference counts, and the prefix cache (hash chain + LRU), which a KV
connector (connector.py) extends beyond the pool."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from zhuzi.engine.core.kv.connector import KVConnector
from zhuzi.engine.core.kv.state_slots import StateSlots
from zhuzi.engine.sequence import Sequence

FREED = -1  # a page table entry whose page went back to the pool, out of every layer's window


def page_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """A full page is known by its tokens and everything before it (the parent's hash)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


def hash_chain(tokens: list[int], page_size: int) -> Iterator[bytes]:
    """The hashes of the full pages of tokens, first to last (lazily: a caller may stop at a miss)."""
    parent = None
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_hash(parent, tokens[start:start + page_size])
        yield parent


@dataclass
class KVEvents:
    """Prefix-cache pages stored and evicted since they were last taken (for a router in front of replicas)."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)

    def take(self) -> tuple[list[bytes], list[bytes]]:
        taken = self.stored, self.removed
        self.stored, self.removed = [], []
        return taken


@dataclass
class PageManager:
    """The pool's pages. With a KV connector, a cached page about to be overwritten is handed to it first, a
    newly computed one is offered to it, and a prompt's next page that the pool lacks is looked up there and
    copied into a free page.

    Where every layer of the model slides (ModelConfig.kv_window), a sequence gives back each page that falls
    wholly out of its window (slide): its entry in the page table becomes FREED, so a position's page is
    still page_table[position // page_size]. A given-back page stays in the prefix cache, under its hash,
    until the pool needs it; a prompt then reuses the longest prefix whose last pages (all its next token's
    window reaches) are still in the pool, whatever became of the pages before: a page's hash stands for
    every token before it. With mixed layers (Gemma 3's full ones among sliding ones) every page stays in
    some layer's window: nothing is given back.

    A hybrid model's sequences hold state slots too (states): a live one, and one where the model leaves the state
    at each page boundary it crosses. When the sequence ends (or is preempted) that boundary state joins the
    prefix cache under its page's hash; a prompt reuses the longest cached prefix whose last page has its state
    kept, which the model copies to the live slot before its first step. With speculative decoding a sequence
    holds draft_slots more: a verify leaves its state after each draft in one, and the slots of the state after
    the tokens that stand become its live (and boundary) ones."""

    num_pages: int
    page_size: int
    enable_prefix_caching: bool = True
    # Per page, as plain lists: a tiny model's default pool has millions of pages, and an object per page cost a
    # second at every engine start.
    ref_counts: list[int] = field(init=False)
    hashes: list[bytes | None] = field(init=False)  # set once the page is full and its K/V computed
    free: OrderedDict[int, None] = field(init=False)  # LRU order: the first is evicted first
    cached: dict[bytes, int] = field(init=False)  # hash -> page id
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # of those, found cached
    events: KVEvents | None = None  # recorded only when someone takes them
    connector: KVConnector | None = None  # the tiers beyond the pool
    window: int | None = None  # every layer's sliding window, in tokens (None: a layer attends everything)
    states: StateSlots | None = None  # a hybrid model's state slots
    draft_slots: int = 0  # the state slots a sequence holds for speculative drafts

    def __post_init__(self) -> None:
        self.ref_counts = [0] * self.num_pages
        self.hashes = [None] * self.num_pages
        self.free = OrderedDict.fromkeys(range(self.num_pages))
        self.cached = {}

    @property
    def num_free_pages(self) -> int:
        return len(self.free)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _take(self, page_id: int) -> None:
        if self.ref_counts[page_id] == 0:
            del self.free[page_id]
        self.ref_counts[page_id] += 1

    def _take_free(self) -> int:
        page_id, _ = self.free.popitem(last=False)
        if (h := self.hashes[page_id]) is not None:  # evict: its old contents are about to be overwritten
            if self.connector is not None:
                self.connector.evicted(h, page_id)
            del self.cached[h]
            if self.events is not None:
                self.events.removed.append(h)
            self.hashes[page_id] = None
        self.ref_counts[page_id] = 1
        return page_id

    def _full_page_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Hashes of the full pages among the first num_tokens tokens (memoised: tokens only grow)."""
        hashes, size = seq.page_hashes, self.page_size
        while len(hashes) < num_tokens // size:
            start = len(hashes) * size
            hashes.append(page_hash(hashes[-1] if hashes else None, seq.token_ids[start:start + size]))
        return hashes[:num_tokens // size]

    def reuse_cached_prefix(self, seq: Sequence) -> int:
        """At admission: attach the longest cached prefix, which counts as computed; returns how many tokens
        it covers.

        The last token is always recomputed, since its logits are needed to sample."""
        assert not seq.page_table
        if not self.enable_prefix_caching:
            seq.num_computed_tokens = 0
            return 0
        self.prefix_queries += seq.num_tokens
        if self.window is not None:
            return self._reuse_window(seq)
        for h in self._full_page_hashes(seq, seq.num_tokens - 1):
            if h in self.cached:
                self._take(self.cached[h])
                seq.page_table.append(self.cached[h])
                self.prefix_hits += self.page_size
            elif (page_id := self._load(h)) is not None:
                seq.page_table.append(page_id)
            else:
                break
        if self.states is not None:
            self._cut_to_a_state(seq)
        seq.num_computed_tokens = len(seq.page_table) * self.page_size
        return seq.num_computed_tokens

    def _cut_to_a_state(self, seq: Sequence) -> None:
        """A hybrid model resumes from a cached state: the prefix shrinks to its last page whose state is kept,
        held for the step that copies it."""
        while seq.page_table:
            if (slot := self.hold_state(seq.page_hashes[len(seq.page_table) - 1])) is not None:
                seq.restore_slot = slot
                return
            self._drop(seq.page_table.pop())
            self.prefix_hits -= self.page_size

    def hold_state(self, h: bytes) -> int | None:
        """The cached state after page h, held (until released): in the pool, or copied there from a tier."""
        assert self.states is not None
        slot = self.states.hold(h)
        if slot is None and self.connector is not None and self.connector.has_state(h) \
                and (slot := self.states.take()) is not None:
            if not self.connector.load_state(h, slot):
                self.states.release(slot)
                return None
            self.states.publish(slot, h)
            slot = self.states.hold(h)
        return slot

    def _window_start(self, position: int) -> int:
        """The first page the window of the token at `position` reaches."""
        assert self.window is not None
        return max(0, position - self.window + 1) // self.page_size

    def _reuse_window(self, seq: Sequence) -> int:
        """reuse_cached_prefix where every layer slides: the longest prefix of full pages whose pages from its
        next token's window on are all cached (the pages before need not be: they are never read)."""
        hashes, size = self._full_page_hashes(seq, seq.num_tokens - 1), self.page_size
        best = run = 0
        for k, h in enumerate(hashes, 1):
            run = run + 1 if h in self.cached else 0
            if run >= k - self._window_start(k * size):
                best = k
        first = self._window_start(best * size)
        seq.page_table = [FREED] * first
        for h in hashes[first:best]:
            self._take(self.cached[h])
            seq.page_table.append(self.cached[h])
        seq.num_computed_tokens = best * size
        self.prefix_hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    def slide(self, seq: Sequence) -> None:
        """After a step, where every layer slides: give back seq's pages wholly before its next token's window
        (that token is at num_computed_tokens; the older of them first, to be evicted first)."""
        if self.window is None:
            return
        table, end = seq.page_table, min(self._window_start(seq.num_computed_tokens), len(seq.page_table))
        start = end
        while start > 0 and table[start - 1] != FREED:
            start -= 1
        for i in range(start, end):
            self._drop(table[i])
            table[i] = FREED

    def _load(self, h: bytes) -> int | None:
        """A page the connector's tiers hold, copied into a free page (taken for the caller)."""
        connector = self.connector
        if connector is None or not connector.lookup([h]):
            return None
        return self._fill(h, lambda page_id: connector.load(h, page_id))

    def adopt(self, h: bytes, write: Callable[[int], None]) -> bool:
        """A page computed elsewhere (sent by a prefill replica) joins the prefix cache, most recently used;
        False when the pool has no free page for it."""
        if h in self.cached:
            return True

        def fill(page_id: int) -> bool:
            write(page_id)
            return True

        if (page_id := self._fill(h, fill)) is None:
            return False
        if self.connector is not None:
            self.connector.computed(h, page_id)  # new to this engine's tiers too
        self._drop(page_id)
        return True

    def adopt_state(self, h: bytes, write: Callable[[int], None]) -> bool:
        """A hybrid model's state after page h, computed elsewhere (sent with the pages), joins the prefix cache;
        False when every state slot is held."""
        assert self.states is not None
        if h in self.states.cached:
            return True
        if (slot := self.states.take()) is None:
            return False
        write(slot)
        self.states.publish(slot, h)
        return True

    def _fill(self, h: bytes, fill: Callable[[int], bool]) -> int | None:
        """Take a free page, fill it (False: it could not be), and publish it as h; the page, still taken."""
        if not self.free:
            return None
        page_id = self._take_free()
        if not fill(page_id):
            self._drop(page_id)
            self.free.move_to_end(page_id, last=False)  # empty: the first to reuse
            return None
        self._publish(page_id, h)
        return page_id

    def _publish(self, page_id: int, h: bytes) -> None:
        self.hashes[page_id] = h
        self.cached[h] = page_id
        if self.events is not None:
            self.events.stored.append(h)

    def hold(self, page_ids: list[int]) -> None:
        """One more reference on each page (a pin): it stays in the pool until released."""
        for page_id in page_ids:
            self._take(page_id)

    def release(self, page_ids: list[int]) -> None:
        for page_id in page_ids:
            self._drop(page_id)

    def _drop(self, page_id: int) -> None:
        self.ref_counts[page_id] -= 1
        if self.ref_counts[page_id] == 0:
            self.free[page_id] = None

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more K/V entries (and a hybrid model's state slots); False if the pool is
        short (and no change but state slots taken, which free_sequence gives back)."""
        if self.states is not None and seq.state_slot is None and not self._take_states(seq):
            return False
        need = self.pages_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.page_table)
        if need > self.num_free_pages:
            return False
        seq.page_table.extend(self._take_free() for _ in range(need))
        return True

    def _take_states(self, seq: Sequence) -> bool:
        """A live slot, with prefix caching a boundary slot, and the draft slots."""
        assert self.states is not None
        if self.states.num_free < 1 + self.enable_prefix_caching + self.draft_slots:
            return False
        seq.state_slot = self.states.take()
        seq.boundary_slot = self.states.take() if self.enable_prefix_caching else None
        seq.draft_slots = [self.states.take() for _ in range(self.draft_slots)]
        seq.boundary_tokens = 0
        return True

    def computed(self, seq: Sequence, num_tokens: int, drafts: int = 0) -> None:
        """num_tokens more of seq's tokens have their K/V in its pages (a hybrid model's state moved on: its cached
        state was copied, and where they crossed a page boundary, the state there is in the boundary slot). drafts:
        the step verified that many drafts, of which num_tokens - 1 stand."""
        before, size = seq.num_computed_tokens, self.page_size
        seq.num_computed_tokens += num_tokens
        if self.states is None:
            return
        if seq.restore_slot is not None:
            self.states.release(seq.restore_slot)
            seq.restore_slot = None
        if drafts:
            self._keep_verified_states(seq, before, num_tokens, drafts)
            return
        if seq.boundary_slot is None:
            return
        if (boundary := seq.state_boundary(seq.num_computed_tokens, size)) > before:
            seq.boundary_tokens = boundary
        if seq.boundary_tokens and before < seq.num_prompt_tokens <= seq.num_computed_tokens:
            self._publish_prompt_state(seq)

    def _keep_verified_states(self, seq: Sequence, before: int, rows: int, drafts: int) -> None:
        """A verify ran 1 + drafts rows from `before` tokens (the model runner's state_runs): it left its state after
        row j in draft slot j - 1, after its last row in the live slot, and at the last page boundary its rows
        crossed in the last draft slot. The slots of the state after the rows that stand take those roles (an
        earlier boundary, crossed only where the page size is at most a verify's rows, is not kept)."""
        if rows <= drafts:
            i = rows - 1
            seq.state_slot, seq.draft_slots[i] = seq.draft_slots[i], seq.state_slot
        boundary = seq.state_boundary(before + 1 + drafts, self.page_size)
        if seq.boundary_slot is not None and before < boundary <= before + rows:
            seq.boundary_slot, seq.draft_slots[-1] = seq.draft_slots[-1], seq.boundary_slot
            seq.boundary_tokens = boundary

    def _publish_prompt_state(self, seq: Sequence) -> None:
        """The prompt is computed: its state at its last page boundary joins the prefix cache now (for the
        prompts that share it while this one decodes), and the sequence goes on in a fresh boundary slot."""
        assert self.states is not None and seq.boundary_slot is not None
        fresh = self.states.take()
        if fresh is not None:  # else every slot is held: this one stays its boundary slot
            self.states.publish(seq.boundary_slot, self._full_page_hashes(seq, seq.boundary_tokens)[-1])
            seq.boundary_slot, seq.boundary_tokens = fresh, 0

    def keep_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Only seq's first num_tokens tokens keep their K/V (the rest are computed again into the same slots)."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def register_computed(self, seq: Sequence) -> None:
        """After a step: publish every page that is now full and computed to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self._full_page_hashes(seq, seq.num_computed_tokens)
        for page_id, h in zip(seq.page_table, hashes):
            if page_id != FREED and self.hashes[page_id] is None and h not in self.cached:
                self._publish(page_id, h)
                if self.connector is not None:
                    self.connector.computed(h, page_id)

    def free_sequence(self, seq: Sequence) -> None:
        """Return a sequence's pages; cached ones stay findable until the pool needs them."""
        # the tail is least likely to be shared: evict it first
        if self.states is not None:
            self._free_states(seq)
        self.release([page_id for page_id in seq.page_table[::-1] if page_id != FREED])
        seq.page_table = []
        seq.num_computed_tokens = 0

    def _free_states(self, seq: Sequence) -> None:
        """Return a sequence's state slots; its state at the last page boundary joins the prefix cache."""
        assert self.states is not None
        if seq.boundary_slot is not None:
            if seq.boundary_tokens and self.enable_prefix_caching:
                self.states.publish(seq.boundary_slot, self._full_page_hashes(seq, seq.boundary_tokens)[-1])
            else:
                self.states.release(seq.boundary_slot)
        for slot in (seq.state_slot, seq.restore_slot, *seq.draft_slots):
            if slot is not None:
                self.states.release(slot)
        seq.state_slot = seq.boundary_slot = seq.restore_slot = None
        seq.draft_slots = []
        seq.boundary_tokens = 0
