"""Replay a replica's round from its published start state (verification level 4).

    payloads = replay_round(job, step=2, replica=1, start_states=[s0, s1])   # one per stage

Replicas are named by id everywhere (their data shards and seeds follow the id), so a
round of any replica replays alike whether or not every replica took part in its step
(elastic training, trainer/engine.py).

A round's start state (`trainer.rounds.round_state`, stored with every contribution) holds
a rank's local weights, inner optimizer state and compressor state at the start of the
round. Replaying starts S local processes (spawn, gloo; stage s = rank s), loads those
states and runs the same `inner_round` training runs, on the same data shard
`corpus.shard(seed, replica, t, H, B, L)`, with one thread and deterministic algorithms;
then it compresses reference - theta_local with `trainer.diloco.contribution`, the one
function training calls too (the reference is the start weights, or under the partial
overlap rule the committed shard of the step before, which the round also merged at its
recorded `round/merge_step`). On the machine class that trained, the payloads are
bit-identical to the published ones. The processes run under `trainer.supervisor`.

Start weights that no checkpoint holds (the eager and partial rules) are derived from
committed data and checked rather than trusted: `eager_start_matches` recomputes the eager
lookahead, `partial_start_reason` re-compresses the previous round from its published
compressor state and requires its published contribution, byte for byte.

The adaptive rule's bandwidth cap depends on a wall-clock budget nobody can re-measure:
pass the claimed payloads (`claimed`) and the replay re-runs the rule with the budget the
claim recorded (`trainer.compress.payload_budget`), so the decisions are the same.

`replay_rounds` replays many (step, replica) items in one launch, so the start-up cost
(spawning, importing torch, loading the corpus, building the pipeline) is paid once. Each
item also returns the state the round leaves behind (`end_states`: `round_state` without
the weights), which a verifier compares with the next round's published start state. The
items' bytes (given as bytes or as spilled `trainer.artifacts.Blob`s) travel to the
processes, and the end states back, as files of a directory of the replay's own: each
process reads one item at a time, and nothing holds every item's states at once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from trainer.artifacts import Blob, spill_directory
from trainer.config import JobConfig
from trainer.errors import TrainingError
from trainer.supervisor import ChildOptions, Supervisor

__all__ = [
    "ReplayItem",
    "ReplayResult",
    "eager_start_matches",
    "fresh_state_core",
    "partial_start_reason",
    "replay_round",
    "replay_rounds",
    "state_core",
]

COLLECTIVE_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class ReplayItem:
    """Replica `replica`'s round `step`: every stage's start state, and optionally the
    claimed payloads (their recorded adaptive budgets are re-used)."""

    step: int
    replica: int
    start_states: list[bytes] | list[Blob]
    claimed: list[bytes] | None = None
    outer: list[bytes] | list[Blob] | None = None  # the partial rule: each stage's committed shard of step - 1


@dataclass
class ReplayResult:
    """Per stage: the re-encoded payload and the state the round left (no weights)."""

    payloads: list[bytes] = field(default_factory=list)
    end_states: list[bytes] = field(default_factory=list)
    data_shard: bytes = b""  # sha256 of the tokens replayed
    loss: float = 0.0  # the replayed round's mean loss
    seconds: float = 0.0  # replay wall time of this item (slowest stage), start-up excluded
    error: str = ""  # set when a start state could not be loaded; payloads are then empty


def replay_round(
    job: JobConfig,
    step: int,
    replica: int,
    start_states: list[bytes],
    claimed: list[bytes] | None = None,
) -> list[bytes]:
    """Re-run replica `replica`'s inner steps of round `step` from `start_states` (one per
    stage) and return the S re-encoded contribution payloads. ValueError if a start state
    does not fit the job."""
    (result,) = replay_rounds(job, [ReplayItem(step, replica, start_states, claimed)])
    if result.error:
        raise ValueError(result.error)
    return result.payloads


def replay_rounds(job: JobConfig, items: list[ReplayItem], *, timeout_s: float | None = None) -> list[ReplayResult]:
    """Replay every item in one launch of S processes; results in item order. An item
    whose start state does not load gets `error` set (the others still run); a process
    that dies raises TrainingError."""
    from trainer.launch import free_port

    S = job.parallel.stages
    if job.parallel.sync == "allreduce":
        raise ValueError("the allreduce baseline publishes no start states: nothing to replay")
    for item in items:
        if len(item.start_states) != S or (item.claimed is not None and len(item.claimed) != S):
            raise ValueError(f"step {item.step} replica {item.replica}: need one start state per stage ({S})")
    if not items:
        return []
    from trainer.data import with_prepared_data

    job = with_prepared_data(job)  # one token file for the S processes
    if job.outer.rule == "partial" and any(it.outer is None or len(it.outer) != S for it in items):
        raise ValueError("the partial overlap rule needs each stage's committed shard of the step before")
    results = [ReplayResult(payloads=[b""] * S, end_states=[b""] * S) for _ in items]
    init_method = f"tcp://127.0.0.1:{free_port()}"
    with spill_directory("replay") as files:
        per_rank = [
            [(it.step, it.replica, _filed(files, it.start_states[s]), None if it.claimed is None else it.claimed[s],
              None if it.outer is None else _filed(files, it.outer[s])) for it in items]
            for s in range(S)
        ]
        with Supervisor(warm=True) as sup:  # forked from the warm server: one torch import, not S
            for s in range(S):
                sup.start(s, _replay_rank, (s, S, init_method, job, per_rank[s], files), name=f"dlx-replay-{s}",
                          options=ChildOptions(where=False))
            _collect(sup, S, results, timeout_s)
    for r in results:
        if r.error:
            r.payloads, r.end_states = [], []
    return results


def _collect(sup: Supervisor, S: int, results: list[ReplayResult], timeout_s: float | None) -> None:
    """Fill `results` from the S replay processes' ("result", stage, ...) events until every
    one is done; TrainingError if one fails, dies or the replay exceeds `timeout_s`."""
    done: set[int] = set()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(done) < S:
        if deadline is not None and time.monotonic() > deadline:
            raise TrainingError(f"replay timed out after {timeout_s:g} s")
        event = sup.next_event()
        if event is None:
            dead = sup.dead()
            if dead:
                raise TrainingError(f"replay rank {dead[0][0]} died: process exited with code {dead[0][1]}")
            continue
        kind, rank, payload = event
        if kind == "error":
            raise TrainingError(f"replay rank {rank} failed: {payload}")
        if kind == "done":
            done.add(rank)
            continue
        i, out, end, digest, loss, secs, error = payload
        r = results[i]
        r.payloads[rank], r.end_states[rank] = out, _take_file(end) if end else b""
        r.seconds = max(r.seconds, secs)
        r.error = r.error or error
        if rank == 0:
            r.data_shard, r.loss = digest, loss
    sup.join()


def _filed(directory: str, data: bytes | Blob) -> str:
    """A file of `directory` holding `data` (a new name for a Blob's file): its path."""
    path = os.path.join(directory, f"in-{len(os.listdir(directory))}")
    if isinstance(data, Blob):
        os.link(data.path, path)
    else:
        with open(path, "xb") as fh:
            fh.write(data)
    return path


def _take_file(path: str) -> bytes:
    """A file's bytes; the file is removed."""
    with open(path, "rb") as fh:
        data = fh.read()
    os.unlink(path)
    return data


def _replay_rank(emit: Any, rank: int, S: int, init_method: str, job: JobConfig, items: list[tuple],
                 files: str) -> None:
    """A supervised child's work: stage `rank` of every item, one ("result", rank, ...) event
    each (`_collect` reads them), its end state written into `files` (the event names it).
    An item's start state and shard are read from their files when its turn comes."""
    import torch
    import torch.distributed as dist

    from trainer.metrics import release_free_memory
    from trainer.model import build_stage
    from trainer.pipeline import Pipeline
    from trainer.world import Topology, agree_device, gpu_usable

    torch.set_num_threads(1)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as trainer.engine.run_rank
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=S, timeout=COLLECTIVE_TIMEOUT)
    try:
        topo = Topology(rank, 1, S)  # one pipeline; the replica's own seeds are passed explicitly
        # The job's device where this machine has a GPU per stage (bit for bit needs the
        # machine class that trained), else the CPU.
        device = agree_device(job, rank if gpu_usable(rank) else None, strict=False)
        group = dist.new_group(list(range(S)), backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else None)
        from trainer.data import load_corpus

        corpus = load_corpus(job.data, job.model.vocab_size)
        module = build_stage(job.model, rank, S, job.seed, job.parallel.numerics).to(device)
        pipeline = Pipeline(module, topo, group, job, device)
        for i, item in enumerate(items):
            release_free_memory()  # the last item's optimizer, compressor and buffers
            emit("result", (i, *_replay_item(job, pipeline, corpus, item, os.path.join(files, f"end-{i}-{rank}"))))
    finally:
        dist.destroy_process_group()


def _replay_item(job: JobConfig, pipeline: Any, corpus: Any, item: tuple, end_path: str) -> tuple:
    """One item on this stage, (step, replica, start state's file, claimed payload, shard's
    file): (payload, the file at `end_path` its end state was written to, data digest,
    loss, seconds, error), from a fresh inner optimizer and compressor loaded with its start
    state. Every stage skips an item one stage's start state does not load (a collective)."""
    import torch
    import torch.distributed as dist

    from trainer import tensorbytes
    from trainer.compress import Compressor
    from trainer.data import derive_seed
    from trainer.pipeline import StageRank, build_inner_optimizer
    from trainer.rounds import rerun_round, round_tensors

    step, replica = item[0], item[1]
    began, stage, H = time.perf_counter(), pipeline.topo.stage, job.outer.inner_steps
    shapes = {n: p.shape for n, p in pipeline.module.named_parameters()}
    rank = StageRank(job, pipeline, build_inner_optimizer(pipeline.module, job),
                     Compressor(job.outer.compression, shapes, derive_seed("compress", job.seed, replica, stage)),
                     corpus)
    try:
        first_step, budget, outer, merge_step = _load_item(job, rank, item)
        error = ""
    except Exception as exc:  # safetensors and torch raise their own types too
        error = f"step {step} replica {replica} stage {stage}: {' '.join(str(exc).split())}"
    bad = torch.tensor([1 if error else 0], dtype=torch.int32)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=pipeline.group)  # every stage skips, or none
    if bad.item():
        return b"", b"", b"", 0.0, 0.0, error or f"step {step} replica {replica}: another stage's start state is invalid"
    payload, loss, digest = rerun_round(rank, replica, step, first_step, budget, outer=outer, merge_step=merge_step)
    # With fragments the next round starts from these weights, most of them never sent:
    # the end state keeps them, for the continuity check to bind the next start to them.
    keep = job.outer.fragments > 1
    end = _core(round_tensors(rank.module, rank.inner, rank.compressor, step + 1, first_step + H,
                              weights=keep), keep)  # less the replayer's kernel fingerprint
    fd = os.open(end_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        tensorbytes.write(end, fd)  # `state_core`'s bytes, never whole in memory
    finally:
        os.close(fd)
    return payload, end_path, digest, loss, time.perf_counter() - began, ""


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _load_item(job: JobConfig, rank: Any, item: tuple) -> tuple[int, float | None, Any, int | None]:
    """Load an item's start state (read from its file) into `rank`: (first inner step, the
    claimed payload's budget, the partial rule's reference weights (copied out of the
    shard's file) and merge step). Each file's bytes go once used, the state's before the
    shard's are read. ValueError if they do not fit."""
    import torch

    from trainer.artifacts import tensor_views
    from trainer.compress import payload_budget
    from trainer.rounds import load_round_state, merge_step_of

    step, _, state_file, claimed, shard_file = item
    state = _read(state_file)
    outer_step, first_step = load_round_state(state, rank.module, rank.inner, rank.compressor)
    merge_step = merge_step_of(state) if job.outer.rule == "partial" else None  # it loaded: it reads
    del state
    if outer_step != step:
        raise ValueError(f"start state is for round {outer_step}, not {step}")
    budget = None if claimed is None else payload_budget(claimed)
    if job.outer.rule != "partial":
        return first_step, budget, None, None
    tensors = tensor_views(_read(shard_file))  # the pseudo-gradient's reference, the merge's outer weights
    params = {k.removeprefix("param/") for k in tensors if k.startswith("param/")}
    if params != {k.removeprefix("momentum/") for k in tensors if k.startswith("momentum/")}:
        raise ValueError("stage shard: param/ and momentum/ keys do not match")
    outer = {n: tensors[f"param/{n}"].to(torch.float32, copy=True) for n in sorted(params)}
    del tensors
    if merge_step is not None and merge_step > job.outer.inner_steps:
        raise ValueError(f"start state merges at inner step {merge_step} of {job.outer.inner_steps}")
    return first_step, budget, outer, merge_step


def state_core(state: bytes, weights: bool = False) -> bytes:
    """A round state without its weights (the part one round hands to the next), as bytes
    comparable with a replay's `end_states`; `weights`: with them (a run with fragments,
    whose end states keep the weights)."""
    from trainer.artifacts import tensor_views, tensors_to_bytes

    return tensors_to_bytes(_core(tensor_views(state), weights))


def _core(tensors: Any, weights: bool) -> dict[str, Any]:
    """The round-state tensors `state_core` keeps."""
    from trainer.artifacts import KERNELS_KEY, MERGE_STEP_KEY

    return {k: tensors[k] for k in tensors
            if (weights or not k.startswith("param/")) and k not in (MERGE_STEP_KEY, KERNELS_KEY)}


def fresh_state_core(job: JobConfig, replica: int, stage: int, round_t: int) -> bytes:
    """The state core a rank starts round `round_t` with after a restart (`dlx resume`):
    a new inner optimizer and a new compressor."""
    import torch

    from trainer.compress import Compressor
    from trainer.data import derive_seed
    from trainer.model import build_stage
    from trainer.pipeline import build_inner_optimizer
    from trainer.rounds import round_state

    module = build_stage(job.model, stage, job.parallel.stages, job.seed, job.parallel.numerics)
    shapes = {n: p.shape for n, p in module.named_parameters()}
    compressor = Compressor(job.outer.compression, shapes, derive_seed("compress", job.seed, replica, stage))
    inner = build_inner_optimizer(module, job)
    with torch.no_grad():
        return state_core(round_state(module, inner, compressor, round_t, (round_t - 1) * job.outer.inner_steps,
                                      weights=False))


def eager_start_matches(job: JobConfig, replica: int, start_state: bytes, shard_before: bytes,
                        own_claimed: bytes, stale_claimed: list[bytes] | None,
                        members: tuple[int, ...] | None = None) -> bool:
    """The eager rule: whether a round's start weights are `trainer.diloco.eager_start` of
    the committed state two steps back (`shard_before`), this replica's contribution of the
    previous round and every present replica's of the round before it, in replica order
    (None when the previous round was the first its run, or its membership epoch,
    computed). `members`: the replica ids present in the round's step (None: all R); a
    membership epoch's rounds share one set, so the round before has the same."""
    from trainer.artifacts import param_tensors, same_tensors
    from trainer.compress import decode_contribution
    from trainer.diloco import OuterOptimizer, eager_start

    outer = OuterOptimizer.from_bytes(shard_before, job.outer)
    shapes = {n: p.shape for n, p in outer.params.items()}
    own = decode_contribution(own_claimed, shapes)
    stale = None if stale_claimed is None else [decode_contribution(c, shapes) for c in stale_claimed]
    present = tuple(range(job.parallel.replicas)) if members is None else tuple(members)
    if replica not in present or (stale is not None and len(stale) != len(present)):
        return False
    expected = eager_start(outer, stale, own, present.index(replica), len(present))
    return same_tensors(param_tensors(start_state), expected)


def partial_start_reason(job: JobConfig, replica: int, stage: int, start_state: bytes, prev_state: bytes,
                         prev_claimed: bytes, prev_reference: bytes) -> str:
    """The partial rule: a round's start weights W are the previous round's end weights,
    which no checkpoint holds. They are bound to committed data instead: compressing
    `prev_reference`'s weights (the previous round's reference, its committed parent
    shard) minus W from the previous round's published compressor state must give exactly
    the contribution it published (`prev_claimed`) and exactly the compressor state this
    round published. "" when both hold, else why not. With fragments only the fragment
    the previous round sent is bound so; a replay of that round binds the rest
    (`lineage.audit.replay.check_continuity`: its end state holds the weights)."""
    import torch

    from trainer.artifacts import param_tensors, same_tensors, tensor_views
    from trainer.compress import Compressor, payload_budget
    from trainer.data import derive_seed
    from trainer.diloco import PseudoGradient, step_names

    # Views of the bytes (read only), not copies: a verifier may hold several stages' states.
    reference = param_tensors(prev_reference)
    weights = param_tensors(start_state)
    if weights.keys() != reference.keys() or any(weights[k].shape != reference[k].shape for k in weights):
        return "start weights do not match the stage's parameters"
    shapes = {n: p.shape for n, p in reference.items()}
    compressor = Compressor(job.outer.compression, shapes, derive_seed("compress", job.seed, replica, stage))
    try:
        prev = tensor_views(prev_state)
        compressor.load_state_tensors(prev)
        mine = tensor_views(start_state)
    except Exception as exc:  # safetensors raises its own error type for bad bytes
        return f"start state does not load: {' '.join(str(exc).split())}"
    prev_loss = mine.get("compress/prev_loss")
    loss = None if prev_loss is None else float(prev_loss.reshape(-1)[0])
    step = int(prev["round/outer_step"][0])
    names = step_names(shapes, job.outer.fragments, step)  # with fragments the rest is checked by continuity
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks compress: a matmul's bits follow the thread count
    try:
        with torch.no_grad():
            delta = PseudoGradient(reference, weights, sorted(names))  # each tensor when compressed
            payload = compressor.compress(delta, step, loss, payload_budget(prev_claimed))
    finally:
        torch.set_num_threads(threads)
    if payload != prev_claimed:
        return (f"start weights are not the end of round {step}: compressing them against step {step - 1}'s "
                f"shard does not give the contribution round {step} published")
    after = compressor.state_tensors()
    published = {k: v for k, v in mine.items() if k.startswith("compress/")}
    if not same_tensors(after, published):
        return f"the compressor state does not follow from round {step}'s"
    return ""
