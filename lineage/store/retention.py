"""Retention: how much of a run's history its blockstore keeps (`[storage] keep`).

    [storage]
    keep = "all"        # default: every block of every step
    keep = "last:3"     # round-start states and superseded shards of the last 3 steps only
    keep = "every:10"   # ... of every 10th step (and the head)

    dlx cas gc --run-dir R [--keep POLICY] [--dry-run]

What a policy may remove: a step's round-start states (`replay[r][s]`, what replay
verification and a replay challenge start from) and its stage shards once a later step
supersedes them. What always stays: every manifest, the config block, the genesis, every
contribution (so `dlx verify`'s chain, content and aggregate levels stay possible: the
aggregate is recomputed forward from the genesis shards and the published contributions,
and each recomputed shard is checked against the CID its manifest names), the head's shards
and start states (a resume starts from them), and, for a step whose challenge window is
still open, what a challenge of it and the rollback an upheld one causes need: its start
states and its parent's shards and start states.

A step the policy keeps keeps its start states, its own shards and its parent's shards
(replaying step t checks its start weights against step t-1's shard). A kept start state
stored by reference to the shard whose weights it holds (lineage/store/roundstate.py: step
t-1's, or step t-2's under the restart rule) keeps that shard too, whatever the policy says
of its step: `plan` protects every block a kept file reaches, and the reference node links
the shard.

Removal (`Blockstore.prune`) first records each root it removes under `.pruned/`, then
unlinks blocks, each root before the blocks under it, so a crash at any point leaves no
corrupt block, only unreferenced ones the pin gc removes later; a block that a kept file,
a manifest or another pin set also reaches stays. Walks (pin gc, CAR export) pass over a
recorded root that is gone.
"""

from __future__ import annotations

import re
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multiformats import CID

from lineage.errors import BlockNotFoundError, StorageError

from .blockstore import Blockstore
from .cid import RAW, block_name
from .dag import links_of
from .manifest import Manifest, get_manifest

_POLICY = re.compile(r"^(?:(all)|(last|every):([1-9][0-9]{0,8}))$")


@dataclass(frozen=True)
class KeepPolicy:
    """`all`, `last:N` (the last N steps) or `every:K` (steps that are multiples of K)."""

    kind: str = "all"
    n: int = 0

    @classmethod
    def parse(cls, text: object) -> KeepPolicy:
        """The policy `text` names; ValueError (one line) for anything else."""
        m = _POLICY.match(text) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f'must be "all", "last:N" or "every:K" with N, K >= 1 (got {text!r})')
        return cls() if m.group(1) else cls(m.group(2), int(m.group(3)))

    def __str__(self) -> str:
        return self.kind if self.kind == "all" else f"{self.kind}:{self.n}"

    def keeps(self, step: int, head: int) -> bool:
        """Whether the policy alone keeps step `step`'s prunable blocks (the head's always)."""
        if self.kind == "all" or step >= head:
            return True
        if self.kind == "last":
            return step > head - self.n
        return step % self.n == 0


ALL = KeepPolicy()


def parse_keep(text: str) -> KeepPolicy:
    """`KeepPolicy.parse` for a command-line value: a bad one is a user error."""
    from trainer.errors import ConfigError

    try:
        return KeepPolicy.parse(text)
    except ValueError as exc:
        raise ConfigError(f"--keep: {exc}") from None


def run_policy(run_dir: Path) -> KeepPolicy:
    """The policy a run directory's job file (`job.toml`, copied there by `dlx train`) sets;
    `all` when it has none (a queue run's directory, an older run)."""
    try:
        storage = tomllib.loads((Path(run_dir) / "job.toml").read_text()).get("storage", {})
        return KeepPolicy.parse(storage.get("keep", "all"))
    except (OSError, tomllib.TOMLDecodeError, ValueError, AttributeError):
        return ALL


# -- which steps keep what ------------------------------------------------------------------


@dataclass(frozen=True)
class Kept:
    """The steps whose start states, and the steps whose stage shards, stay."""

    starts: frozenset[int]
    shards: frozenset[int]


def kept_steps(policy: KeepPolicy | None, head: int, open_steps: Iterable[int] = ()) -> Kept:
    """What `policy` (None: nothing beyond what must stay) keeps of a run at step `head`
    while `open_steps` are still challengeable."""
    starts = {head} | {t for t in range(1, head) if policy is not None and policy.keeps(t, head)}
    shards = {0, head} | starts | {t - 1 for t in starts if policy is not None}
    for t in open_steps:
        starts |= {t, t - 1}
        shards.add(t - 1)
    starts.discard(0)
    return Kept(frozenset(starts), frozenset(shards))


def prunable(history: list[Manifest], kept: Kept) -> Iterator[CID]:
    """The roots (start-state and shard files) of `history` (manifests by step) that `kept`
    lets go."""
    for m in history[1:]:
        if m.step not in kept.starts:
            yield from (cid for row in m.replay for cid in row)
        if m.step not in kept.shards:
            yield from m.stages


def retained(history: list[Manifest], kept: Kept) -> Iterator[CID]:
    """The files of `history` that `kept` keeps: everything `prunable` does not list."""
    for m in history:
        yield m.config
        yield from (cid for row in m.contributions for cid in row)
        if m.step == 0 or m.step in kept.starts:
            yield from (cid for row in m.replay for cid in row)
        if m.step == 0 or m.step in kept.shards:
            yield from m.stages


def open_steps(ledger: Any, run_id: int, head: int, cache: dict[int, int] | None = None) -> set[int]:
    """The steps up to `head` whose challenge window is still open on `ledger` (none when
    the run has no arbiters: its steps cannot be challenged). Newest first, stopping at the
    first closed one: windows close in step order. `cache` keeps commit times across calls.

    A window is open while the next block's timestamp can still be within it; that block
    is no earlier than the latest one, nor than now (a chain idle since the run ended mines
    its next block at the current time)."""
    if ledger.arbiters_of(run_id)[1] == 0:
        return set()
    window = int(ledger.ledger.functions.challengeWindowOf(run_id).call())
    now = max(int(ledger.chain.w3.eth.get_block("latest")["timestamp"]), int(time.time()))
    cache = {} if cache is None else cache
    out = set()
    for t in range(head, 0, -1):
        if t not in cache:
            cache[t] = ledger.step_info(run_id, t).committed_at
        if cache[t] + window < now:
            break
        out.add(t)
    return out


# -- history and reachability ---------------------------------------------------------------


def history(store: Any, head: CID | str, cache: dict[str, Manifest] | None = None) -> list[Manifest]:
    """The manifests from the genesis to `head`, indexed by step (`cache`: by CID, across calls)."""
    cache = {} if cache is None else cache
    out: list[Manifest] = []
    cid: CID | str | None = head
    while cid is not None:
        key = str(cid)
        if key not in cache:
            cache[key] = get_manifest(store, cid)
        out.append(cache[key])
        cid = cache[key].parent
    out.reverse()
    if [m.step for m in out] != list(range(len(out))):
        raise StorageError(f"the history of {head} is not steps 0..{len(out) - 1}")
    return out


@dataclass
class Reach:
    """Blocks reachable from roots, reading only the blocks that link (raw leaves are known
    by their CIDs). `links` caches each linking block's links: blocks never change."""

    store: Any
    links: dict[str, list[CID]] = field(default_factory=dict)

    def blocks(self, roots: Iterable[CID], into: dict[str, CID] | None = None,
               pruned: frozenset[str] = frozenset()) -> dict[str, CID]:
        """Add to `into` (name -> CID) every block under `roots`, each root before the blocks
        under it; a block that is gone adds itself only (retention removed it, or it never
        arrived: not this walk's concern)."""
        seen: dict[str, CID] = {} if into is None else into
        stack = list(reversed(list(roots)))
        while stack:
            cid = stack.pop()
            name = block_name(cid)[0]
            if name in seen:
                continue
            seen[name] = cid
            if cid.codec.name == RAW or name in pruned:
                continue
            if name not in self.links:
                try:
                    self.links[name] = links_of(cid, self.store.get(cid))
                except BlockNotFoundError:
                    continue
            stack.extend(reversed(self.links[name]))
        return seen


@dataclass
class Plan:
    """What a retention pass removes."""

    roots: list[CID]   # start-state and shard files that go
    blocks: list[CID]  # every block that goes, each root before the blocks under it
    size: int          # their bytes


def plan(store: Blockstore, head: CID, hist: list[Manifest], kept: Kept, reach: Reach | None = None) -> Plan:
    """The blocks to remove from `store` so that the run `hist` (ending at `head`) keeps
    only what `kept` says, and nothing that a kept file, a manifest or another pin set
    reaches (content addressing lets two files share a block)."""
    reach = reach or Reach(store)
    pruned = frozenset(store.pruned())
    keep = list(dict.fromkeys(retained(hist, kept)))
    keep_names = {block_name(c)[0] for c in keep}
    doomed_roots = [c for c in dict.fromkeys(prunable(hist, kept))
                    if block_name(c)[0] not in keep_names and store.has(c)]
    if not doomed_roots:
        return Plan([], [], 0)
    # past the genesis every manifest has a parent (`history` walked to hist[0] through them)
    own = {block_name(c)[0] for c in [*(m.parent for m in hist[1:] if m.parent is not None), head]}
    protect = reach.blocks(keep, None, pruned)
    for roots in store.pins().values():
        if not {block_name(c)[0] for c in roots} <= own:  # another run's (or a user's) pin set
            reach.blocks(roots, protect, pruned)
    going: dict[str, CID] = {}
    for root in doomed_roots:
        for name, cid in reach.blocks([root], None, pruned).items():
            if name not in protect and name not in own:
                going.setdefault(name, cid)
    roots = [c for c in doomed_roots if block_name(c)[0] in going]
    return Plan(roots, list(going.values()), sum(store.size(c) for c in going.values()))


# -- applying it ----------------------------------------------------------------------------


@dataclass
class Retention:
    """Applies a run's policy after each commit: the StepSink's `on_committed` callback,
    wrapping the one the caller had (`then`)."""

    store: Blockstore
    policy: KeepPolicy
    ledger: Any
    record: Any  # RunRecord: its run id is known once the genesis is created
    then: Callable[..., None] | None = None
    _manifests: dict[str, Manifest] = field(default_factory=dict, init=False, repr=False)
    _committed_at: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _reach: Reach | None = field(default=None, init=False, repr=False)

    @classmethod
    def for_job(cls, job: Any, store: Any, ledger: Any, record: Any,
                then: Callable[..., None] | None = None) -> Callable[..., None] | None:
        """The callback to pass as `on_committed`: `then` itself for `keep = "all"`."""
        policy = KeepPolicy.parse(job.storage.keep)
        if policy == ALL:
            return then
        return cls(store, policy, ledger, record, then)

    def __call__(self, step: int, checkpoint: CID, artifacts: Any) -> None:
        hist = history(self.store, checkpoint, self._manifests)
        kept = kept_steps(self.policy, step, open_steps(self.ledger, self.record.run_id, step, self._committed_at))
        self._reach = self._reach or Reach(self.store)
        p = plan(self.store, checkpoint, hist, kept, self._reach)
        self.store.prune(p.roots, p.blocks)
        if self.then:
            self.then(step, checkpoint, artifacts)


def allowed_missing(store: Any, hist: list[Manifest], policy: KeepPolicy, open_: Iterable[int]) -> set[str]:
    """Names of the roots `dlx verify` may find gone without failing: those `policy` lets
    go, and those the store records as removed by retention (say `dlx cas gc --keep`)
    that are of a prunable kind; never anything an open challenge window needs."""
    if not hist:
        return set()
    open_ = set(open_)
    head = hist[-1].step
    by_policy = {block_name(c)[0] for c in prunable(hist, kept_steps(policy, head, open_))}
    recorded = set(store.pruned()) if hasattr(store, "pruned") else set()
    prunable_kind = {block_name(c)[0] for c in prunable(hist, kept_steps(None, head, open_))}
    return by_policy | (recorded & prunable_kind)
