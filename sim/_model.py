"""The engine timing model shared by the emulated engine (wall time) and the cluster replay (simulated time).

One engine serving one model on one GPU, at request granularity (sources of the numbers in docs/sim.md):

- **Queue.** Requests wait in arrival order (vLLM's FCFS). The head is admitted when the prefill stage is
  free, the batch has room (`max_batch` sequences) and the KV cache can hold its prompt and output; a head
  that does not fit blocks those behind it until running requests finish.
- **Prefill** is one stage, one request at a time: `encoder time of its media + uncached prompt tokens /
  prefill rate`, stretched by `1 + DECODE_INTERFERENCE × decoding / max_batch` (chunked prefill shares each
  step with the decode batch). Its end is the first token.
- **Decode.** The request then produces its other `output − 1` tokens at `TPOT(n) = (1 + slope × (n − 1)) /
  decode rate`, `n` the sequences decoding when its first token came (kept for the rest of the request).
- **Prefix cache.** Capacity in blocks of `block_tokens` tokens (the GPU class's 16-token KV blocks
  regrouped). The longest run of the prompt's leading blocks already cached is reused and skips prefill.
  Blocks are reference-counted; a block nobody references stays cached until evicted least recently used
  first, when an admission needs room. Output tokens and a partial last prompt block take private blocks for
  the life of the request.

Times are model seconds given by the caller: `advance(now)` processes everything due by `now`.
"""

from __future__ import annotations

import copy
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

GpuClass = Literal["a100", "h100", "l40s"]
Modality = Literal["image", "audio", "video"]

KV_BLOCK_TOKENS = 16
DECODE_INTERFERENCE = 1.0


@dataclass(frozen=True)
class GpuProfile:
    """Timing and capacity of one GPU class serving an 8B model in BF16 (sources in docs/sim.md)."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_batch_slope: float
    encoder_s: Mapping[str, float]
    """Seconds per media part by modality ("image", "audio", "video")."""
    kv_blocks: int
    """KV-cache capacity in 16-token blocks."""
    max_batch: int

    def tpot_s(self, decoding: int) -> float:
        """Seconds per output token of each of `decoding` sequences in the batch."""
        return (1 + self.decode_batch_slope * (max(1, decoding) - 1)) / self.decode_tokens_per_s

    def media_s(self, media: Mapping[str, int]) -> float:
        """Encoder seconds for media parts counted by modality; ValueError for an unknown modality."""
        try:
            return sum((self.encoder_s[m] * n for m, n in media.items()), 0.0)
        except KeyError as exc:
            raise ValueError(f"unknown media modality {exc.args[0]!r}") from None


PROFILES: dict[GpuClass, GpuProfile] = {
    "a100": GpuProfile(10_000.0, 60.0, 0.01, {"image": 0.030, "audio": 0.050, "video": 0.250}, 28_000, 128),
    "h100": GpuProfile(20_000.0, 100.0, 0.008, {"image": 0.015, "audio": 0.025, "video": 0.120}, 28_000, 192),
    "l40s": GpuProfile(6_000.0, 45.0, 0.012, {"image": 0.045, "audio": 0.070, "video": 0.350}, 13_000, 96),
}


def cached_tokens(prompt_tokens: int, media_tokens: int, held_blocks: int, block_tokens: int) -> int:
    """Prompt tokens a prefix cache holding the prompt's first `held_blocks` blocks spares its prefill: at most the
    text, which the blocks cover (media tokens are never reused), even where the last block held is partial."""
    return min(prompt_tokens - media_tokens, held_blocks * block_tokens)


@dataclass(eq=False)
class Job:
    """One request inside the model; the model fills in the times and the cache hit."""

    blocks: tuple[int, ...]
    """Chained ids of the prompt's full blocks of `block_tokens` (equal id = identical prefix up to it)."""
    prompt_tokens: int
    output_tokens: int
    encoder_s: float
    arrival_s: float
    tag: object = None
    """The caller's handle (the simulator's request, the emulator's stream)."""
    media_tokens: int = 0
    """Prompt tokens from media parts, which the prefix blocks do not cover (never reused)."""
    admitted_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    hit_blocks: int = 0
    private_blocks: int = field(default=0, repr=False)


Event = tuple[Literal["admitted", "first_token", "finished"], Job, float]
"""What `advance` reports: the job admitted (its cache hit known), its first token, or its end, and when."""


class EngineModel:
    """One engine's queue, prefill stage, decode batch and prefix cache, in model seconds."""

    def __init__(self, profile: GpuProfile, block_tokens: int = KV_BLOCK_TOKENS) -> None:
        if block_tokens < 1 or (block_tokens % KV_BLOCK_TOKENS and KV_BLOCK_TOKENS % block_tokens):
            raise ValueError(f"block_tokens must be a multiple or divisor of {KV_BLOCK_TOKENS}, got {block_tokens}")
        self.profile = profile
        self.block_tokens = block_tokens
        self.capacity_blocks = profile.kv_blocks * KV_BLOCK_TOKENS // block_tokens
        self.waiting: deque[Job] = deque()
        self.prefilling: Job | None = None
        self._prefill_end = math.inf
        self._decoding: list[tuple[float, int, Job]] = []  # (finish, sequence number, job), a heap
        self._seq = 0
        self._refs: dict[int, int] = {}  # referenced blocks -> references
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced blocks, least recent first
        self._private = 0
        self.stored: list[tuple[Job, tuple[int, ...]]] = []
        """Blocks newly cached per admission, for KV events; the emulator drains it, others may clear it."""
        self.removed: list[int] = []
        """Blocks evicted since last drained, for KV events."""
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.prefill_seconds = 0.0
        """Prefill time of the admitted requests, summed when they are admitted (vLLM's
        `request_prefill_time_seconds` histogram sum, which vLLM observes when a request ends): prompt tokens less
        cache hits over it is the engine's prefill speed as the replay's agent measures it."""

    # --- what a scrape would read -------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Sequences admitted and not finished (vLLM's `num_requests_running`)."""
        return len(self._decoding) + (self.prefilling is not None)

    @property
    def decoding(self) -> int:
        return len(self._decoding)

    @property
    def used_blocks(self) -> int:
        return len(self._refs) + len(self._free) + self._private

    @property
    def kv_usage(self) -> float:
        """Share of the cache held by running requests (vLLM's `kv_cache_usage_perc`: a cached block no request
        references is free, evictable on demand, so it does not count)."""
        return (len(self._refs) + self._private) / self.capacity_blocks

    @property
    def prefill_end_s(self) -> float:
        """When the prompt in prefill gets its first token (inf: none is in prefill)."""
        return self._prefill_end

    def cached(self, block: int) -> bool:
        return block in self._refs or block in self._free

    def copy(self) -> EngineModel:
        """An independent copy of the engine's queue, batch and cache, for a what-if: its jobs are copies (their
        times fill in on the copy alone; their tags are shared), its event lists start empty."""
        twin = copy.copy(self)
        jobs = {id(job): copy.copy(job) for job in (*self.waiting, *(job for _, _, job in self._decoding))}
        if self.prefilling is not None:
            jobs[id(self.prefilling)] = copy.copy(self.prefilling)
            twin.prefilling = jobs[id(self.prefilling)]
        twin.waiting = deque(jobs[id(job)] for job in self.waiting)
        twin._decoding = [(finish, seq, jobs[id(job)]) for finish, seq, job in self._decoding]
        twin._refs = dict(self._refs)
        twin._free = OrderedDict(self._free)
        twin.stored, twin.removed = [], []
        return twin

    # --- driving ------------------------------------------------------------------------------------------

    def fits(self, job: Job) -> bool:
        """Whether the job could ever be admitted (its prompt and output within the whole cache)."""
        return self._need(job) <= self.capacity_blocks

    def submit(self, job: Job, now: float) -> list[Event]:
        """Queue a job arriving at `now` (after `advance(now)`); ValueError when it can never fit the cache."""
        if not self.fits(job):
            raise ValueError(
                f"prompt and output ({self._need(job)} blocks) exceed the KV cache ({self.capacity_blocks})"
            )
        self.waiting.append(job)
        events: list[Event] = []
        if self.prefilling is None:
            self._start(now, events)
        return events

    def load_context(self, job: Job) -> int:
        """Cache the job's prompt blocks without computing them: a context loaded from elsewhere (a session's,
        which another engine computed), so that a prompt starting with them finds them cached. They take no
        prefill and no batch slot; they stay cached unreferenced, as a finished request's blocks do, most recently
        used, and those past the leading run already cached are recorded in `stored`, as an admission's are. The
        blocks newly cached; 0, and nothing cached, when the cache cannot make room for them."""
        hit = self._leading_hit(job)
        missing = sum(1 for block in job.blocks[hit:] if block not in self._refs and block not in self._free)
        if not self._evict_for(missing, set(job.blocks)):
            return 0
        for block in job.blocks:
            if block in self._free:
                self._free.move_to_end(block)
            elif block not in self._refs:
                self._free[block] = None
        if hit < len(job.blocks):
            self.stored.append((job, job.blocks[hit:]))
        return missing

    def next_event_s(self) -> float:
        """When something is next due (inf: nothing in progress)."""
        finish = self._decoding[0][0] if self._decoding else math.inf
        return min(self._prefill_end, finish)

    def advance(self, now: float) -> list[Event]:
        """Process every prefill end and finish due by `now`, in time order; the events, in order."""
        events: list[Event] = []
        while True:
            finish = self._decoding[0][0] if self._decoding else math.inf
            t = min(self._prefill_end, finish)
            if t > now:
                return events
            if self._prefill_end <= finish:
                job = self.prefilling
                assert job is not None
                self.prefilling, self._prefill_end = None, math.inf
                job.first_token_s = t
                job.finish_s = t + (job.output_tokens - 1) * self.profile.tpot_s(len(self._decoding) + 1)
                heapq.heappush(self._decoding, (job.finish_s, self._seq, job))
                self._seq += 1
                events.append(("first_token", job, t))
            else:
                _, _, job = heapq.heappop(self._decoding)
                self._release(job)
                events.append(("finished", job, t))
            if self.prefilling is None and self.next_event_s() > t:  # after everything due at t
                self._start(t, events)

    # --- internals ----------------------------------------------------------------------------------------

    def _need(self, job: Job) -> int:
        """Blocks a job holds while it runs: its full prompt blocks and its private blocks."""
        return len(job.blocks) + self._private_of(job)

    def _private_of(self, job: Job) -> int:
        return max(0, math.ceil((job.prompt_tokens + job.output_tokens) / self.block_tokens) - len(job.blocks))

    def _leading_hit(self, job: Job) -> int:
        """How many of the job's leading prompt blocks are cached (the prefix an admission reuses)."""
        hit = 0
        for block in job.blocks:
            if block not in self._refs and block not in self._free:
                break
            hit += 1
        return hit

    def _start(self, now: float, events: list[Event]) -> None:
        """Admit the head of the queue into prefill if the batch and the cache have room."""
        if not self.waiting or self.running >= self.profile.max_batch:
            return
        job = self.waiting[0]
        hit = self._leading_hit(job)
        private = self._private_of(job)
        new = len(job.blocks) - hit
        if not self._evict_for(new + private, set(job.blocks[:hit])):
            return
        self.waiting.popleft()
        for block in job.blocks:
            if block in self._free:
                del self._free[block]
                self._refs[block] = 1
            else:
                self._refs[block] = self._refs.get(block, 0) + 1
        if new:
            self.stored.append((job, job.blocks[hit:]))
        job.private_blocks = private
        self._private += private
        job.hit_blocks = hit
        job.cached_tokens = cached_tokens(job.prompt_tokens, job.media_tokens, hit, self.block_tokens)
        job.admitted_s = now
        self.prefix_queries_tokens += job.prompt_tokens
        self.prefix_hits_tokens += job.cached_tokens
        stretch = 1 + DECODE_INTERFERENCE * len(self._decoding) / self.profile.max_batch
        rate = self.profile.prefill_tokens_per_s
        self.prefilling = job
        duration = (job.encoder_s + (job.prompt_tokens - job.cached_tokens) / rate) * stretch
        self.prefill_seconds += duration
        self._prefill_end = now + duration
        events.append(("admitted", job, now))

    def _evict_for(self, needed: int, keep: set[int]) -> bool:
        """Evict least recently used free blocks (not in `keep`) until `needed` more fit; False if they cannot."""
        excess = self.used_blocks + needed - self.capacity_blocks
        if excess <= 0:
            return True
        evictable = len(self._free) - sum(1 for b in keep if b in self._free)
        if evictable < excess:
            return False
        skipped: list[int] = []
        while excess > 0:
            block, _ = self._free.popitem(last=False)
            if block in keep:
                skipped.append(block)
                continue
            self.removed.append(block)
            excess -= 1
        for block in reversed(skipped):
            self._free[block] = None
            self._free.move_to_end(block, last=False)
        return True

    def _release(self, job: Job) -> None:
        self._private -= job.private_blocks
        job.private_blocks = 0
        for block in job.blocks:
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
            else:
                del self._refs[block]
                self._free[block] = None
