"""Cheating nodes, for tests only: make one slot of a run misbehave, so that a test can
show which layer of the verifier (or the ledger) catches it (tests/test_attacks.py,
docs/audit.md, "Attack catalogue").

This module is a test extension, never imported by production code: the tests' conftest
names it in `DLX_TEST_EXTENSION` (workers.run.jobfile.EXTENSION_ENV) and puts tests/ on
PYTHONPATH, so every `dlx` process a test starts (and the ranks it spawns) reads job files
with `CheatingJobFile`, the production schema plus a `[cheat]` table (or several
`[[cheat]]` tables, `CheatConfig`). Without that variable a `[cheat]` table is an unknown
key. The runners refuse cheats on any chain but a local one
(`workers.run.local.refuse_cheat_off_local_chain`). A cheat never enters the run's recorded
configuration (the field is never dumped): a cheating node does not announce itself, so a
replay re-runs honest code.

Nothing on the production path asks whether a run cheats: `JobFile.test_hooks` (None in
production) returns one `Cheats` object built from the tables, which the runners inject
where the honest defaults would be, into
every rank (`trainer.control.RankControl.hooks`, a `trainer.hooks.RankHooks`) and into the
coordinator's sink (`workers.run.sink.CommitHooks`: which shard bytes it stores, which parent
it commits on, which key signs a slot) and, under `dlx train`, its signer (equivocation).
Torch is imported only by a poisoning rank, so job-file parsing stays light.

Modes, each active at every outer step >= `from_step`:
- poison: slot (replica, stage) publishes its honest pseudo-gradient plus Gaussian noise
  (std = `scale` x the delta's RMS), and sends that same payload through the transport,
  so the aggregate matches the published contributions and only replay catches it;
- skip_work: every stage of `replica` skips its inner steps (a pipeline's stages must
  agree, or it deadlocks) and still claims the round: a zero pseudo-gradient, loss 0;
- stale_parent: the coordinator builds and commits the step on its head's parent, so the
  ledger reverts with LedgerStaleParent;
- equivocate: the slot's node also signs a second claim with a different contribution
  for the same (run, step, replica, stage) (`Cheats.signer` wraps `dlx train`'s signer);
- bad_aggregate: the coordinator stores stage `stage`'s new shard slightly off the
  aggregate of the published contributions, while the replicas co-sign the true one: the
  manifest links a shard nobody co-signed (`dlx verify`, chain level);
- collude_shard: every replica of stage `stage` co-signs the shard the coordinator stores
  slightly off the aggregate (as bad_aggregate), so levels 1-2 pass and only the aggregate
  level catches it; an aggregate challenge slashes every co-signer;
- wrong_shard: slot (replica, stage) co-signs another digest than its peers of the stage,
  so the ledger reverts with LedgerShardMismatch;
- shared_key: slot (replica, stage) is signed with the key of slot (0, stage), one node in
  two replicas, so the ledger reverts with LedgerNotIndependent (signer side: workers/run/sink.py);
- equivocate_result: as equivocate, but the second claim differs in its co-signed shard
  digest (`reportResultEquivocation`);
- hold (no misbehaviour: a test's pacing): every rank waits, before the inner steps of
  outer step `from_step` only, until the file `until` exists (at most HOLD_MAX_S), so that
  a test can let something happen at a known point of a run (a returning node waiting to
  join) however slowly the machine starts processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import Field, field_validator, model_validator

from lineage.chain.attest import ContributionClaim, Domain, SignedClaim
from trainer.config import JobConfig, _Section
from trainer.hooks import RankHooks, unchanged
from workers.run.jobfile import JobFile

if TYPE_CHECKING:
    from eth_account.signers.local import LocalAccount

    from trainer.engine import Round, RoundLoop
    from trainer.world import Topology
    from workers.run.sink import Signer

__all__ = [
    "JOB_FILE",
    "SIGNER_MODES",
    "CheatConfig",
    "CheatingJobFile",
    "CheatMode",
    "Cheats",
    "check_cheats",
    "hooks",
]

ClaimT = TypeVar("ClaimT")

#: Where an equivocating `dlx train` run leaves both signed claims of a step.
EQUIVOCATION_DIR = "equivocation"

#: Modes acted out by the signer holding every slot's key: only `dlx train` has one.
SIGNER_MODES = ("equivocate", "equivocate_result", "shared_key")

CheatMode = Literal["poison", "skip_work", "stale_parent", "equivocate", "bad_aggregate", "collude_shard",
                    "wrong_shard", "shared_key", "equivocate_result", "hold"]

#: The longest a `hold` waits for its file: then the run goes on (and the test fails on what it asserts).
HOLD_MAX_S = 600.0


class CheatConfig(_Section):
    """Test-only: make one slot misbehave so a test can show which layer catches it.

    Off unless the job file has a `[cheat]` table (or several `[[cheat]]` tables); refused
    on any chain but a local one (workers/run/local.py). The module docstring documents the modes.
    """

    mode: CheatMode = Field(
        description="poison: publish (and send) the pseudo-gradient plus noise; skip_work: "
        "the replica skips its inner steps but claims the round; stale_parent: the commit "
        "names an older parent; equivocate: the slot's node also signs a second, different "
        "claim; bad_aggregate: the coordinator stores a stage shard that is not the aggregate; "
        "collude_shard: every replica of the stage co-signs such a shard; wrong_shard: the slot co-signs "
        "another shard than its peers; shared_key: replica 0's key signs the slot; equivocate_result: "
        "the node also signs a claim with another co-signed shard; hold: every rank waits before "
        "step from_step's inner steps until the file `until` exists (pacing, not misbehaviour)."
    )
    replica: int = Field(0, ge=0, description="The cheating slot's replica.")
    stage: int = Field(0, ge=0, description="The cheating slot's stage (skip_work: all stages).")
    from_step: int = Field(1, ge=1, description="First outer step cheated; every later one too.")
    scale: float = Field(
        1.0, gt=0.0, description="poison: noise std as a multiple of the pseudo-gradient's RMS."
    )
    until: str | None = Field(None, description="hold: the file whose existence ends the wait.")

    def active(self, step: int) -> bool:
        return step >= self.from_step


def check_cheats(cheats: list[CheatConfig], job: JobConfig) -> None:
    """ValueError (one line, naming the table) for a cheat that does not fit `job`."""
    p = job.parallel
    for i, c in enumerate(cheats):
        where = f"cheat.{i}" if len(cheats) > 1 else "cheat"
        if c.replica >= p.replicas or c.stage >= p.stages:
            raise ValueError(f"{where}: slot ({c.replica}, {c.stage}) is outside the "
                             f"{p.replicas} x {p.stages} world")
        if c.from_step > job.outer.steps:
            raise ValueError(f"{where}: from_step ({c.from_step}) is past outer.steps "
                             f"({job.outer.steps})")
        if c.mode == "stale_parent" and c.from_step < 2:
            raise ValueError(f"{where}: stale_parent needs from_step >= 2 (step 1's only "
                             "possible parent is the genesis)")
        if p.sync == "allreduce":
            raise ValueError(f"{where}: cheats need parallel.sync = 'diloco'")
        if (c.mode == "hold") != (c.until is not None):
            raise ValueError(f"{where}: `until` goes with mode 'hold', and only with it")


def hooks(cheats: list[CheatConfig], job: JobConfig) -> Cheats | None:
    """The one injected object that acts out `cheats` in `job`'s run (None for an honest
    job: the runners then inject nothing and every default stays honest)."""
    return Cheats(cheats, job.seed, job.parallel.stages) if cheats else None


class CheatingJobFile(JobFile):
    """The production job file plus the test-only `[cheat]` tables."""

    cheat: list[CheatConfig] = Field(
        default_factory=list,
        exclude=True,  # never dumped, so never hashed or recorded: a cheating node does not announce itself
        description="Test-only misbehaviour, local chains only: one `[cheat]` table or several "
        "`[[cheat]]` tables (tests/dlx_testing/cheat.py).",
    )

    @field_validator("cheat", mode="before")
    @classmethod
    def _one_or_many_cheats(cls, value: object) -> object:
        return [value] if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _cheats_fit(self) -> CheatingJobFile:
        check_cheats(self.cheat, self)
        return self

    def test_hooks(self) -> Cheats | None:
        return hooks(self.cheat, self)


#: What workers.run.jobfile.job_file_class reads job files with while this extension is named.
JOB_FILE = CheatingJobFile


class Cheats(RankHooks):
    """Every cheat of a run, as the hooks the ranks, the sink and the signer call
    (picklable: it travels to spawned ranks)."""

    def __init__(self, cheats: list[CheatConfig], seed: int, stages: int) -> None:
        self.cheats, self.seed, self.stages = list(cheats), seed, stages

    def queue_refusal(self) -> str | None:
        """Why the job queue cannot act these cheats out (None: it can). The queue has no
        signer modes (equivocate, equivocate_result, shared_key): there each node signs in its
        own worker, and only `dlx train` holds every slot's key."""
        for c in self.cheats:
            if c.mode in SIGNER_MODES:
                return f"cheat: mode {c.mode!r} runs only under `dlx train`, not the job queue"
        return None

    def active(self, mode: CheatMode, step: int) -> list[CheatConfig]:
        """The cheats of `mode` that act at outer step `step`."""
        return [c for c in self.cheats if c.mode == mode and c.active(step)]

    def _slot_active(self, mode: CheatMode, step: int, replica: int, stage: int) -> bool:
        return any((c.replica, c.stage) == (replica, stage) for c in self.active(mode, step))

    # --- the ranks (trainer.hooks.RankHooks) ----------------------------------------------

    def publish(self, topo: Topology) -> Callable[[int, Any], Any]:
        """poison: (round, honest delta) -> the delta plus seeded Gaussian noise."""
        mine = [c for c in self.cheats if c.mode == "poison" and (c.replica, c.stage) == (topo.replica, topo.stage)]
        if not mine:
            return unchanged
        return _Poison(mine, self.seed, topo.replica, topo.stage)

    def inner_phase(self, loop: RoundLoop, rnd: Round) -> float:
        """skip_work: claim the round (loss 0, a zero pseudo-gradient) without its inner
        steps, but keep the stop collective's beat and the partial rule's merge. hold: wait
        for the file first (every rank, so no collective waits on a held peer)."""
        for c in self.cheats:
            if c.mode == "hold" and rnd.t == c.from_step and c.until is not None:
                _wait_for_file(Path(c.until), HOLD_MAX_S)
        if not any(c.active(rnd.t) for c in self.cheats if c.mode == "skip_work" and c.replica == loop.topo.replica):
            return loop.inner_steps(rnd)
        for h in range(loop.job.outer.inner_steps if loop.control.cancellable else 0):
            loop.check_stop(rnd, h)
        if rnd.merge_at is not None:
            loop.merge(rnd)
        return 0.0

    def cosigned_shard(self, topo: Topology, step: int, data: bytes,
                       digest: Callable[[bytes], bytes]) -> bytes:
        """collude_shard: the digest of the coordinator's nudged shard; wrong_shard (that
        slot): another digest; else `digest(data)`."""
        if any(c.stage == topo.stage for c in self.active("collude_shard", step)):
            data = _nudged(data)
        out = digest(data)
        if self._slot_active("wrong_shard", step, topo.replica, topo.stage):
            out = hashlib.sha256(b"wrong shard" + out).digest()
        return out

    # --- the coordinator's sink (workers.run.sink.CommitHooks) --------------------------------

    def stored_shard(self, step: int, stage: int, data: bytes) -> bytes:
        """bad_aggregate, collude_shard: the stage shard with every outer parameter nudged."""
        modes = [*self.active("bad_aggregate", step), *self.active("collude_shard", step)]
        return _nudged(data) if any(c.stage == stage for c in modes) else data

    def stale_parent(self, step: int) -> bool:
        """stale_parent: the coordinator commits `step` on its head's parent."""
        return bool(self.active("stale_parent", step))

    def signing_slot(self, step: int, slot: int) -> int:
        """shared_key: slot (r, s) is signed with the key of slot (0, s)."""
        replica, stage = divmod(slot, self.stages)
        return stage if self._slot_active("shared_key", step, replica, stage) else slot

    # --- the signer of `dlx train` (workers.run.local.equivocating_signer) --------------------

    def equivocating_slots(self, step: int) -> list[tuple[int, int]]:
        """The (replica, stage) slots whose node signs two different claims for `step`."""
        modes = [*self.active("equivocate", step), *self.active("equivocate_result", step)]
        return sorted({(c.replica, c.stage) for c in modes})

    def second_claim(self, step: int, claim: ClaimT) -> ClaimT:
        """The other claim an equivocating slot signs for `step`: `claim` (a dataclass with
        `replica`, `stage`, `contribution` and `new_shard`) with another contribution digest
        (equivocate) or another co-signed shard digest (equivocate_result)."""
        c: Any = claim
        if self._slot_active("equivocate_result", step, c.replica, c.stage):
            return dataclasses.replace(c, new_shard=hashlib.sha256(c.new_shard).digest())
        return dataclasses.replace(c, contribution=hashlib.sha256(c.contribution).digest())

    def signer(self, sign: Signer, keys: list[LocalAccount], domain: Domain, run_dir: Path) -> Signer:
        """`dlx train`'s signer: sign as `sign` does, and for each equivocating slot also sign
        a second claim that differs only in its contribution digest (equivocate) or its
        co-signed shard digest (equivocate_result, `second_claim`); both signed claims go to
        <run dir>/equivocation/step-N-a.json (the one committed) and step-N-b.json."""
        S = self.stages

        def signer(step: int, claims: list[ContributionClaim]) -> list[bytes]:
            signatures = sign(step, claims)
            at = {(c.replica, c.stage): i for i, c in enumerate(claims)}  # a step's present slots
            for replica, stage in self.equivocating_slots(step):
                if (replica, stage) not in at:
                    continue
                slot, i = replica * S + stage, at[(replica, stage)]
                honest = claims[i]
                other = self.second_claim(step, honest)
                out = run_dir / EQUIVOCATION_DIR
                out.mkdir(exist_ok=True)
                SignedClaim(domain, honest, signatures[i]).save(out / f"step-{step}-a.json")
                SignedClaim.sign(other, domain, keys[slot].key).save(out / f"step-{step}-b.json")
            return signatures

        return signer


class _Poison:
    """Picklable poison `DeltaHook` for one slot: from each cheat's `from_step` on, add
    Gaussian noise of std `scale` x the delta's RMS, seeded so a poisoned run is as
    reproducible as an honest one."""

    def __init__(self, cheats: list[CheatConfig], seed: int, replica: int, stage: int) -> None:
        self.cheats, self.seed, self.replica, self.stage = cheats, seed, replica, stage

    def __call__(self, round_t: int, delta: Any) -> Any:
        import torch

        from trainer.data import derive_seed

        live = [c for c in self.cheats if c.active(round_t)]
        if not live:
            return delta
        gen = torch.Generator().manual_seed(derive_seed("cheat", self.seed, self.replica, self.stage, round_t))
        out = {}
        for name in sorted(delta):
            d = delta[name]
            rms = d.float().pow(2).mean().sqrt().clamp_min(1e-8)
            noise = torch.randn(d.shape, generator=gen, dtype=torch.float32)
            out[name] = d + (live[0].scale * rms * noise).to(d.dtype)
        return out


def _wait_for_file(path: Path, limit_s: float) -> None:
    import time

    deadline = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _nudged(data: bytes) -> bytes:
    """The same shard with every outer parameter nudged by 1e-3 (not the aggregate)."""
    from trainer.artifacts import bytes_to_tensors, tensors_to_bytes

    tensors = bytes_to_tensors(data)
    return tensors_to_bytes({k: t + 1e-3 if k.startswith("param/") else t for k, t in tensors.items()})


def hold_before(job: Path, step: int, until: Path) -> None:
    """Append a `hold` to the job file `job`: its ranks wait before outer step `step` until
    the file `until` exists (a test's pacing: something must happen mid-run)."""
    job.write_text(job.read_text() + f'\n[cheat]\nmode = "hold"\nfrom_step = {step}\nuntil = "{until}"\n')
