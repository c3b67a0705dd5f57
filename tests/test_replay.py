"""Replay verification (level 4): a round re-run from its published start state gives the
claimed contribution bit for bit; a tampered start state, contribution or next-round state
is caught. Real runs (`dlx train`: processes, gloo, anvil, blockstore), real replays; the
honest run through the installed `dlx verify`, the others through the same command run in
this process (tests/dlx_testing/here.py)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from dlx_testing.here import dlx_here

from lineage.audit.replay import ReplicaReplay, StageReplay, check_continuity, job_of, replay_many
from lineage.audit.verify import sample_pairs
from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.cid import parse_cid
from lineage.store.manifest import get_manifest, put_manifest
from lineage.store.roundstate import is_reference, read_start_state, round_state_ref
from lineage.store.unixfs import import_bytes, read_bytes
from trainer.artifacts import bytes_to_tensors, tensors_to_bytes
from trainer.compress import Compressor, payload_budget
from trainer.config import CompressionConfig, load_job
from trainer.model import build_stage
from trainer.pipeline import build_inner_optimizer
from trainer.replay import replay_rounds
from trainer.rounds import load_round_state, round_state

DLX = str(Path(sys.executable).parent / "dlx")


def dlx(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=timeout)


# --- state round trips (no processes) ---------------------------------------------------------


def test_compressor_state_round_trips_and_continues_identically() -> None:
    cfg = CompressionConfig(kind="adaptive", max_rank=4, warmup_steps=2)
    shapes = {"w": torch.Size([16, 12]), "b": torch.Size([12])}
    g = torch.Generator().manual_seed(0)

    def delta() -> dict[str, torch.Tensor]:
        return {n: torch.randn(s, generator=g) for n, s in shapes.items()}

    a = Compressor(cfg, shapes, seed=3)
    a.compress(delta(), 1, loss=2.0)
    b = Compressor(cfg, shapes, seed=99)  # another seed: everything must come from the state
    b.load_state_tensors(a.state_tensors())
    d = delta()
    assert a.compress(d, 2, loss=2.5, budget_bytes=300) == b.compress(d, 2, loss=2.5, budget_bytes=300)
    assert tensors_to_bytes(a.state_tensors()) == tensors_to_bytes(b.state_tensors())
    with pytest.raises(ValueError, match="compress/residual/w"):
        b.load_state_tensors({**a.state_tensors(), "compress/residual/w": torch.zeros(3)})


def test_a_capped_adaptive_payload_records_its_budget_and_an_uncapped_one_does_not() -> None:
    cfg = CompressionConfig(kind="adaptive", max_rank=8)
    shapes = {"w": torch.Size([32, 32])}
    w = {"w": torch.randn(32, 32, generator=torch.Generator().manual_seed(1))}
    assert payload_budget(Compressor(cfg, shapes, seed=0).compress(w, 1, budget_bytes=1e9)) is None
    assert payload_budget(Compressor(cfg, shapes, seed=0).compress(w, 1, budget_bytes=100.5)) == 100.5


def test_round_state_round_trips_weights_inner_state_and_compressor() -> None:
    job = load_job({"name": "rs", "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8},
                    "outer": {"steps": 2, "inner_steps": 2, "compression": {"kind": "lowrank", "rank": 2}}})
    module = build_stage(job.model, 0, 2, job.seed)
    inner = build_inner_optimizer(module, job)
    module(torch.randint(0, 256, (2, 8))).sum().backward()
    inner.step()
    shapes = {n: p.shape for n, p in module.named_parameters()}
    comp = Compressor(job.outer.compression, shapes, seed=1)
    comp.compress({n: torch.randn(s) for n, s in shapes.items()}, 1)
    state = round_state(module, inner, comp, 2, 2)
    assert any(k.startswith("inner/exp_avg/") for k in bytes_to_tensors(state))

    other = build_stage(job.model, 0, 2, job.seed + 1)
    other_inner = build_inner_optimizer(other, job)
    other_comp = Compressor(job.outer.compression, shapes, seed=2)
    assert load_round_state(state, other, other_inner, other_comp) == (2, 2)
    assert round_state(other, other_inner, other_comp, 2, 2) == state
    with pytest.raises(ValueError, match="param/"):
        load_round_state(state, build_stage(job.model, 1, 2, job.seed), other_inner, other_comp)


def test_sampling_is_deterministic_covers_the_fraction_and_never_none() -> None:
    a = sample_pairs([1, 2, 3, 4], 2, 0.25, b"head")
    assert a == sample_pairs([1, 2, 3, 4], 2, 0.25, b"head") and len(a) == 2
    assert len(sample_pairs([1, 2, 3, 4], 2, 0.01, b"head")) == 1
    assert sample_pairs([1, 2], 2, 1.0, b"x") == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_a_replay_result_survives_json_for_the_verify_queue() -> None:
    r = ReplicaReplay(2, 1, [StageReplay(0, "bafy-a", "bafy-b", False, math.inf, b"x")], 0.5, "cp")
    back = ReplicaReplay.from_json(json.loads(json.dumps(r.as_json())))
    assert back.as_json() == r.as_json() and not back.ok
    assert back.failure() == r.failure() == ("step 2 replica 1 stage 0: replayed contribution bafy-b differs "
                                             "from the claimed bafy-a (rel_l2 inf, tolerance 0)")


def test_the_allreduce_baseline_has_nothing_to_replay() -> None:
    job = load_job({"name": "ar", "parallel": {"sync": "allreduce"}, "outer": {"steps": 1, "inner_steps": 1}})
    with pytest.raises(ValueError, match="allreduce"):
        replay_rounds(job, [])


@pytest.mark.slow  # not in --quick: `dlx verify` runs
@pytest.mark.parametrize(("args", "message"), [
    (["--replay", "1.5"], "--replay must be a fraction between 0 and 1 (got 1.5)"),
    (["--tolerance", "-1"], "--tolerance must be a finite number >= 0 (got -1)"),
])
def test_bad_replay_options_are_one_line_errors(tmp_path, args, message) -> None:
    res = dlx("verify", "--run-dir", str(tmp_path), *args, timeout=120)
    assert res.returncode == 2 and res.stderr == f"dlx: error: {message}\n"


# --- an honest run, through the CLI ---------------------------------------------------------


@pytest.mark.slow
def test_an_honest_run_replays_bit_for_bit_through_dlx_verify(trained_run) -> None:
    run_dir, _ = trained_run
    res = dlx("verify", "--run-dir", str(run_dir), "--replay", "1.0", "--json")
    assert res.returncode == 0, res.stderr + res.stdout
    report = json.loads(res.stdout)
    assert report["ok"] and report["replay_seconds"] > 0
    assert [s["passed"] for s in report["steps"]] == [["chain", "content", "aggregate", "data", "replay"]] * 3
    assert sorted((r["step"], r["replica"]) for r in report["replay"]) == [(t, r) for t in (1, 2, 3) for r in (0, 1)]
    for r in report["replay"]:
        assert r["ok"] and r["seconds"] > 0 and not r["error"]
        assert all(s["exact"] and s["rel_l2"] == 0.0 and s["replayed"] == s["claimed"] for s in r["stages"])


#: `dlx` whose sink stores every round-start state as a plain UnixFS file, as it did before
#: states referred to committed shards: a writer of the old form.
LEGACY_DLX = ("import sys; from workers.run.sink import LedgerSink; "
              "from workers.run.sink import _put_file; "
              "LedgerSink._put_start = lambda self, store, data, shards: _put_file(store, data); "
              "from workers.cli import main; sys.argv[0] = 'dlx'; main()")


def _history(run_dir: Path) -> tuple[Blockstore, list]:
    record = RunRecord.load(run_dir)
    store = record.open_store(run_dir)
    hist = [get_manifest(store, record.head)]
    while hist[-1].parent is not None:
        hist.append(get_manifest(store, hist[-1].parent))
    return store, hist[::-1]


@pytest.mark.slow
def test_a_run_stored_before_references_still_verifies_and_replays(trained_run, tmp_path) -> None:
    """The shared run's job, stored the old way: the same shards and contributions, every
    start state a plain file holding the bytes the new form rebuilds, more bytes stored;
    and the new readers verify and replay it."""
    run_dir = tmp_path / "legacy"
    res = subprocess.run([sys.executable, "-c", LEGACY_DLX, "train", str(trained_run[0].parent / "job.toml"),
                          "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    old_store, old = _history(run_dir)
    new_store, new = _history(trained_run[0])
    assert [m.stages for m in old] == [m.stages for m in new]
    assert [m.contributions for m in old] == [m.contributions for m in new]
    for a, b in zip(old[1:], new[1:], strict=True):
        assert not any(is_reference(c) for row in a.replay for c in row)
        assert all(is_reference(c) for row in b.replay for c in row)  # synchronous: all on the parent shard
        for r, row in enumerate(a.replay):
            for s, cid in enumerate(row):
                assert read_start_state(old_store, a, r, s) == read_bytes(old_store, cid) \
                    == read_start_state(new_store, b, r, s)

    def stored(d: Path) -> int:
        return sum(p.stat().st_size for p in (d / "blocks").rglob("*") if p.is_file())

    assert stored(trained_run[0]) < stored(run_dir)
    res = dlx_here("verify", "--run-dir", run_dir, "--replay", "1.0", "--json")
    assert res.returncode == 0, res.stderr + res.stdout
    report = json.loads(res.stdout)
    assert [s["passed"] for s in report["steps"]] == [["chain", "content", "aggregate", "data", "replay"]] * 3
    assert all(s["exact"] for r in report["replay"] for s in r["stages"]) and len(report["replay"]) == 6


# --- one-step delay, adaptive compression with a budget that bites, and tampering ------------


# Every overlap rule, and every compression kind under one of them (`none`: the honest run
# above). The partial rule with tau = auto over this link (100 bit/s) merges after a
# round's last inner step; tau = 1 merges in the middle of one.
DELAYED = {
    "partial-auto-adaptive": ('overlap = "partial"\n', 'kind = "adaptive"\nmax_rank = 8\n'),
    "partial-tau1-int1": ('overlap = "partial"\ntau = 1\n', 'kind = "quantize"\nbits = 1\n'),
    "partial-mix-gaps": ('overlap = "partial"\ntau = 2\nalpha = 0.5\n',
                         'kind = "quantize"\nbits = 2\ncoding = "gaps"\n'),
    "partial-fragments-int4": ('overlap = "partial"\ntau = 2\nfragments = 2\n', 'kind = "quantize"\nbits = 4\n'),
    "eager-sparse": ('overlap = "eager"\n', 'kind = "sparse"\ndensity = 0.1\nchunk = 64\nbits = 4\n'),
    "restart-lowrank": ('overlap = "restart"\n', 'kind = "lowrank"\nrank = 2\n'),
}


@pytest.fixture(scope="module", params=sorted(DELAYED))
def delayed_run(request, tmp_path_factory, small_job):
    """A 2x2 run with delay 1 over a link so slow (100 bit/s) that an adaptive payload's
    byte budget caps it: the decisions depend on wall-clock time."""
    rule, kind = DELAYED[request.param]
    root = tmp_path_factory.mktemp("replay")
    job = root / "job.toml"
    job.write_text(small_job("replay", n_layers=4 if "fragments" in request.param else 2,  # 2 blocks a stage
                             extra=f"delay = 1\n{rule}[outer.compression]\n{kind}"
                                   "[transport]\nbandwidth_mbps = 0.0001\n"))
    run_dir = root / "run"
    res = dlx("train", str(job), "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    record = RunRecord.load(run_dir)
    store = Blockstore(record.blocks_dir(run_dir))
    cps, steps = {3: parse_cid(record.head)}, {}
    for t in (3, 2, 1):
        steps[t] = get_manifest(store, cps[t])
        cps[t - 1] = steps[t].parent
    return store, steps, cps, request.param, run_dir


def _put_tensors(store, tensors) -> object:
    return import_bytes(tensors_to_bytes(tensors), store.put).cid


def _with(manifest, **cells):
    """A copy of `manifest` with replay/contributions cells replaced: {"replay": {(r, s): cid}}."""
    out = {}
    for table, changes in cells.items():
        rows = [list(row) for row in getattr(manifest, table)]
        for (r, s), cid in changes.items():
            rows[r][s] = cid
        out[table] = rows
    return replace(manifest, **out)


@pytest.mark.slow
def test_every_overlap_rule_replays_exactly_and_tampering_is_caught(delayed_run, tmp_path) -> None:
    store, steps, cps, name, run_dir = delayed_run
    # The user's command (in this process): every level, every round of every replica
    # replayed, bit for bit.
    res = dlx_here("verify", "--run-dir", run_dir, "--replay", "1.0", "--json")
    assert res.returncode == 0, res.stderr + res.stdout
    report = json.loads(res.stdout)
    assert report["ok"] and [s["passed"] for s in report["steps"]] == [["chain", "content", "aggregate", "data", "replay"]] * 3
    assert all(s["exact"] for r in report["replay"] for s in r["stages"]) and len(report["replay"]) == 6
    m2, m3 = steps[2], steps[3]
    assert [len(row) for row in m2.replay] == [2, 2]
    # Start states on a committed shard are stored as references to it (lineage/store/
    # roundstate.py): every rule's round 1 starts from the genesis, and under the restart
    # rule every round from the shard two steps back (the genesis for round 2).
    shards = {t: get_manifest(store, cps[t]).stages for t in (0, 1)}
    for t in (1, 2, 3) if name.startswith("restart") else (1,):
        refs = [(s, c) for row in steps[t].replay for s, c in enumerate(row)]
        assert all(is_reference(c) and round_state_ref(store, c).weights == shards[max(t - 2, 0)][s]
                   for s, c in refs), t
    if "adaptive" in name:
        capped = [payload_budget(read_bytes(store, c)) for m in steps.values() for row in m.contributions for c in row]
        assert all(b is not None for b in capped)  # the budget bit: replay must re-use it to be exact

    # A copy of the store holding tampered variants of step 2 (and of step 3's start state).
    tampered = Blockstore(tmp_path / "blocks")
    shutil.copytree(store.root, tampered.root, dirs_exist_ok=True)
    start = bytes_to_tensors(read_start_state(store, m2, 1, 0))
    moment = next(k for k in start if k.startswith("inner/exp_avg/"))
    bad_moment = _put_tensors(tampered, {**start, moment: start[moment] * 2})   # optimizer state
    weight = next(k for k in start if k.startswith("param/"))
    bad_weight = _put_tensors(tampered, {**start, weight: start[weight] + 1e-3})  # start weights
    cp_moment = put_manifest(tampered, _with(m2, replay={(1, 0): bad_moment}))
    cp_weight = put_manifest(tampered, _with(m2, replay={(1, 0): bad_weight}))
    cp_claim = put_manifest(tampered, _with(m2, contributions={(0, 1): m2.contributions[1][1]}))

    # Every honest round was replayed exactly by `dlx verify --replay 1.0` above; in process,
    # step 2 replica 0 (its end states feed the continuity checks) and the tampered variants.
    items = [(str(cps[2]), 0), (str(cp_moment), 1), (str(cp_weight), 1), (str(cp_claim), 0)]
    replica0_step2, moment_r, weight_r, claim_r = replay_many(tampered, items)

    r = replica0_step2
    assert r.ok and not r.error, r.failure()
    assert all(s.exact and s.rel_l2 == 0.0 and s.replayed == s.claimed for s in r.stages)
    assert r.seconds > 0 and len(r.end_states) == 2

    # Stage 0's optimizer state was touched (stage 1 differs too: it trains on stage 0's output).
    assert not moment_r.ok and not moment_r.stages[0].reason
    assert not moment_r.stages[0].exact and moment_r.stages[0].rel_l2 > 0
    assert "step 2 replica 1 stage 0: replayed contribution" in moment_r.failure()

    expected = {"partial": "start weights are not the end of round 1",
                "eager": "start weights are neither step 1's outer weights nor the eager step",
                "restart": "start weights are not the outer weights of step 1 or 0"}[name.split("-")[0]]
    assert not weight_r.ok and expected in weight_r.stages[0].reason, weight_r.stages[0].reason

    assert not claim_r.ok and claim_r.stages[0].exact
    assert not claim_r.stages[1].exact and claim_r.stages[1].rel_l2 > 0.05

    # Continuity: step 2's replayed end state is step 3's published start state...
    assert (replica0_step2.step, replica0_step2.replica) == (2, 0)
    check_continuity(tampered, replica0_step2, str(cps[3]))
    assert replica0_step2.ok
    # ...and a step 3 that publishes another optimizer state is caught.
    nxt = bytes_to_tensors(read_start_state(store, m3, 0, 1))
    k = next(k for k in nxt if k.startswith("inner/exp_avg_sq/"))
    cp3 = put_manifest(tampered, _with(m3, replay={(0, 1): _put_tensors(tampered, {**nxt, k: nxt[k] * 0})}))
    check_continuity(tampered, replica0_step2, str(cp3))
    assert not replica0_step2.ok and "is not the state this round leaves" in replica0_step2.stages[1].reason

    if "fragments" in name:  # round 1 sent group 0: the rest of step 2's start is bound by continuity
        _fragment_continuity(store, tampered, steps, cps)

    # The replay used the run's recorded configuration (no cheat, the job's own settings).
    assert job_of(store, m2.config).outer.delay == 1


def _fragment_continuity(store, tampered, steps, cps) -> None:
    """With fragments a round's start weights are mostly weights no round has sent yet: a
    replay of round 1 ends at them (its end state holds the weights), and a step 2 that
    publishes other ones, in a group round 1 did not send, is caught by continuity."""
    from trainer.diloco import fragment_groups, fragment_of

    m2 = steps[2]
    start = bytes_to_tensors(read_start_state(store, m2, 1, 0))
    shapes = {k.removeprefix("param/"): v.shape for k, v in start.items() if k.startswith("param/")}
    unsent = next(n for n in sorted(shapes) if n not in fragment_of(1, fragment_groups(shapes, 2)))
    cp = put_manifest(tampered, _with(m2, replay={(1, 0): _put_tensors(
        tampered, {**start, f"param/{unsent}": start[f"param/{unsent}"] + 1e-3})}))
    (round1,) = replay_many(tampered, [(str(cps[1]), 1)])
    assert round1.ok and all(s.exact for s in round1.stages)
    assert any(k.startswith("param/") for k in bytes_to_tensors(round1.end_states[0]))
    check_continuity(tampered, round1, str(cps[2]))
    assert round1.ok, round1.failure()  # the honest step 2 starts where round 1 ended
    check_continuity(tampered, round1, str(cp))
    assert not round1.ok and "is not the state this round leaves" in round1.stages[0].reason
