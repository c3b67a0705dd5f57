"""Replays judged by the run's numerics and the kernels on both sides (lineage/audit/replay.py):
the flip-aware comparison of compressed contributions on synthetic payloads, the judging
policy, and, with real runs, `dlx verify`, `dlx challenge` and `dlx arbiter vote` from a
foreign kernel set (`ATEN_CPU_CAPABILITY=default` in the verifying process plays another
CPU): an honest native run is never refuted there, a real cheat still is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lineage.audit.replay import (
    DEFAULT_TOLERANCE,
    DEFAULT_TOLERANCE_NONE,
    EXACT,
    FLIP_AWARE,
    UNRECORDED,
    ReplicaReplay,
    StageReplay,
    _state_difference,
    compare_payloads,
    flip_allowance,
    flip_failure,
    judging_for,
)
from trainer.artifacts import tensors_to_bytes
from trainer.compress import Compressor, quantize_rows
from trainer.config import CompressionConfig

DLX = str(Path(sys.executable).parent / "dlx")
FOREIGN = {"ATEN_CPU_CAPABILITY": "default"}  # another CPU's kernels, played on this one
ROWS, COLS = 64, 64
SHAPES = {"w": torch.Size([ROWS, COLS])}


# --- synthetic payloads ---------------------------------------------------------------------


def codes_matrix(seed: int = 0) -> torch.Tensor:
    """4-bit codes in [-7, 7], each row holding a 7 (so `quantize_rows` keeps them exactly)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(-6, 7, (ROWS, COLS), generator=g)
    c[:, 0] = 7
    return c


def quant_payload(codes: torch.Tensor, scale: torch.Tensor) -> bytes:
    """A 4-bit quantised contribution of tensor "w" with these codes and row scales."""
    packed, unit = quantize_rows(codes.float(), 4)
    assert torch.equal(unit, torch.ones(ROWS))
    return tensors_to_bytes({"meta/w": torch.tensor([1, 4, 0], dtype=torch.int32), "q/w": packed,
                             "q_scale/w": scale.float()})


def scales() -> torch.Tensor:
    return torch.linspace(0.01, 0.02, ROWS)


def moved(codes: torch.Tensor, n: int, by: int = 1) -> torch.Tensor:
    """`codes` with `n` values (away from the 7s of column 0) moved by `by` levels, inside [-7, 7]."""
    out = codes.clone()
    flat = out[:, 1:].reshape(-1)
    for i in range(n):
        j = (i * 37) % flat.numel()
        flat[j] = flat[j] + by if flat[j] + by <= 7 else flat[j] - by
    out[:, 1:] = flat.view(ROWS, COLS - 1)
    return out


def judged(replayed: bytes, claimed: bytes, tolerance: float = DEFAULT_TOLERANCE) -> tuple[dict[str, Any], str]:
    cmp = compare_payloads(replayed, claimed, SHAPES)
    return cmp, flip_failure(cmp, tolerance)


def test_honest_one_level_flips_and_last_bit_scales_pass() -> None:
    c, s = codes_matrix(), scales()
    claimed = quant_payload(c, s)
    cmp, why = judged(quant_payload(moved(c, 3), s * (1 + 1e-7)), claimed)
    assert why == "" and (cmp["flips"], cmp["max_flip"], cmp["codes"]) == (3, 1, ROWS * COLS)
    assert 0 < cmp["scale_rel"] < 1e-6 and cmp["rest_rel_l2"] < 1e-6
    (t,) = cmp["tensors"]  # the continuity check's allowance: 3 values moved by one scale at most
    assert t["name"] == "w" and t["out"] == 3 and float(s.min()) < t["jump"] < float(s.max()) * 1.001
    same, why = judged(claimed, claimed)
    assert why == "" and same["flips"] == 0 and same["rest_rel_l2"] == 0.0


def test_a_two_level_move_a_scale_change_or_too_many_flips_fail_naming_the_tensor() -> None:
    c, s = codes_matrix(), scales()
    claimed = quant_payload(c, s)
    _, why = judged(quant_payload(moved(c, 1, by=2), s), claimed)
    assert why.startswith("tensor w: a code moved by 2 levels (1 of 4096 codes differ")
    bumped = s.clone()
    bumped[5] *= 1 + 1e-2  # 5e-3 of the largest scale
    cmp, why = judged(quant_payload(c, bumped), claimed)
    assert cmp["flips"] == 0 and why.startswith("tensor w: a scale differs by ")
    allowed = flip_allowance(ROWS * COLS)
    cmp, why = judged(quant_payload(moved(c, 200), s), claimed)
    assert cmp["max_flip"] == 1 and why == (f"200 of 4096 codes differ (at most {allowed} may); the most in "
                                            "tensor w (200 of 4096)")
    _, why = judged(quant_payload(moved(c, allowed), s), claimed)
    assert why == ""


def test_a_layout_that_differs_or_an_undecodable_payload_fails() -> None:
    c, s = codes_matrix(), scales()
    other = tensors_to_bytes({"meta/w": torch.tensor([1, 8, 0], dtype=torch.int32),
                              "q/w": quantize_rows(c.float(), 8)[0], "q_scale/w": s})
    _, why = judged(other, quant_payload(c, s))
    assert why.startswith("tensor w: the payloads encode it differently")
    _, why = judged(b"not safetensors", quant_payload(c, s))
    assert why.startswith("a payload does not decode")


def test_kind_none_is_plain_relative_l2() -> None:
    g = torch.Generator().manual_seed(1)
    d = torch.randn(ROWS, COLS, generator=g)
    claimed = tensors_to_bytes({"delta/w": d})
    cmp, why = judged(tensors_to_bytes({"delta/w": d * (1 + 1e-7)}), claimed, DEFAULT_TOLERANCE_NONE)
    assert why == "" and cmp["codes"] == 0 and 0 < cmp["rest_rel_l2"] < 2e-7
    noisy = tensors_to_bytes({"delta/w": d + 0.1 * torch.randn(ROWS, COLS, generator=g)})
    cmp, why = judged(noisy, claimed, DEFAULT_TOLERANCE_NONE)
    assert why.startswith("the values the flips leave differ by relative L2 ")


def _compress(cfg: CompressionConfig, m: torch.Tensor) -> bytes:
    return Compressor(cfg, SHAPES, seed=0).compress({"w": m}, 1)


def test_gaps_and_sparse_codes_and_a_sparse_swap_at_a_tie() -> None:
    g = torch.Generator().manual_seed(2)
    m = torch.randn(ROWS, COLS, generator=g)
    # 2-bit gaps: one value pushed across a rounding boundary (x/s from just below .5 to just above).
    gaps = CompressionConfig(kind="quantize", bits=2, coding="gaps")
    s0 = float(m[3].abs().max())
    a, b = m.clone(), m.clone()
    a[3, 9], b[3, 9] = 0.5 * s0 * (1 + 1e-6), 0.5 * s0 * (1 - 1e-6)
    cmp, why = judged(_compress(gaps, a), _compress(gaps, b))
    assert why == "" and (cmp["flips"], cmp["max_flip"]) == (1, 1)
    # Sparse, 64 per chunk, k = 7: the 7th and 8th magnitudes of chunk 0 tie to a few ulps.
    sparse = CompressionConfig(kind="sparse", bits=4, density=0.1, chunk=64)
    base = torch.full((ROWS, COLS), 1e-3)
    base[0, :6] = torch.tensor([7.0, 6.0, 5.0, 4.0, 3.0, 2.5])
    a, b = base.clone(), base.clone()
    a[0, 10], a[0, 20] = 1.0 + 1e-6, 1.0
    b[0, 10], b[0, 20] = 1.0, 1.0 + 1e-6
    cmp, why = judged(_compress(sparse, a), _compress(sparse, b))
    assert why == "" and cmp["swaps"] == 1 and cmp["flips"] == 0
    # A kept index moved to a value that is no tie (a 5-level value swapped for another index).
    c = b.clone()
    c[0, 2], c[0, 30] = 1e-3, 5.0
    cmp, why = judged(_compress(sparse, c), _compress(sparse, b))
    assert "no tie of magnitudes" in why


def test_the_continuity_allowance_covers_exactly_the_flipped_residuals() -> None:
    g = torch.Generator().manual_seed(3)
    residual = torch.randn(100, generator=g) * 1e-3
    moment = torch.rand(100, generator=g)
    state = {"compress/residual/w": residual, "inner/exp_avg_sq/w": moment, "compress/bits/w": torch.tensor([4])}
    left = dict(state, **{"inner/exp_avg_sq/w": moment * (1 + 1e-7)})
    flipped = residual.clone()
    flipped[[4, 50]] += 0.01  # two codes flipped by one scale (0.01)
    published = tensors_to_bytes(dict(state, **{"compress/residual/w": flipped}))
    allowance = {"compress/residual/w": (2, 0.01)}
    problem, rel = _state_difference(published, tensors_to_bytes(left), allowance)
    assert problem == "" and rel < 1e-6
    problem, rel = _state_difference(published, tensors_to_bytes(left), {"compress/residual/w": (1, 0.01)})
    assert problem == "" and rel > 1e-3  # the second flip is not allowed: it counts in full
    problem, _ = _state_difference(published, tensors_to_bytes(left), {"compress/residual/w": (2, 0.001)})
    assert problem == "compress/residual/w moved by more than the payload's flips explain"
    other = dict(left, **{"compress/bits/w": torch.tensor([8])})
    assert _state_difference(published, tensors_to_bytes(other), allowance)[0] == "compress/bits/w differs"


def test_the_judging_follows_numerics_fingerprints_and_an_explicit_tolerance() -> None:
    a, b = "AVX2 x86_64 torch probe 1", "DEFAULT x86_64 torch probe 2"
    assert judging_for("portable", a, b, None) == (EXACT, 0.0)
    assert judging_for("portable", a, b, 0.5) == (EXACT, 0.0)  # a tolerance does not loosen it
    assert judging_for("native", a, a, None) == (EXACT, 0.0)
    assert judging_for("native", a, b, None) == (FLIP_AWARE, DEFAULT_TOLERANCE)
    assert judging_for("native", a, b, None, compression="none") == (FLIP_AWARE, DEFAULT_TOLERANCE_NONE)
    assert judging_for("native", UNRECORDED, UNRECORDED, None) == (FLIP_AWARE, DEFAULT_TOLERANCE)
    assert judging_for("native", a, a, None, auto_exact=False) == (FLIP_AWARE, DEFAULT_TOLERANCE)
    assert judging_for("native", a, b, 0.0) == (EXACT, 0.0)
    assert judging_for("native", a, b, 1e-3) == (FLIP_AWARE, 1e-3)


def test_a_judged_replay_survives_json_with_its_figures() -> None:
    c, s = codes_matrix(), scales()
    claimed, replayed = quant_payload(c, s), quant_payload(moved(c, 1, by=2), s)
    st = StageReplay(1, "bafy-c", "bafy-r", False, 0.01, replayed, trained_on="A", judged=FLIP_AWARE,
                     tolerance=1e-5, compare=compare_payloads(replayed, claimed, SHAPES))
    r = ReplicaReplay(2, 1, [st], 0.5, "cp", replayed_on="B", numerics="native")
    back = ReplicaReplay.from_json(json.loads(json.dumps(r.as_json())))
    assert back.as_json() == r.as_json() and not back.ok
    doc = r.as_json()["stages"][0]
    assert (doc["flips"], doc["max_flip"], doc["trained_on"], doc["judged"]) == (1, 2, "A", FLIP_AWARE)
    assert back.failure() == ("step 2 replica 1 stage 1: replayed contribution bafy-r differs from the claimed "
                              "bafy-c (rel_l2 0.01, tolerance 1e-05): tensor w: a code moved by 2 levels (1 of "
                              "4096 codes differ; other kernels move a code by one level at most)")


# --- real runs, replayed from a foreign kernel set ---------------------------------------------

ETHER = 10**18
#: The run's arbiters (quorum 2): dev accounts past the 2x2 world's node keys (1..4).
ARBITER_INDICES = (6, 7, 8)
CHALLENGER_INDEX = 9


def _job(name: str, extra: str = "") -> str:
    from conftest import small_job_toml

    return small_job_toml(name, extra='delay = 1\noverlap = "partial"\ntau = 1\n'
                                      '[outer.compression]\nkind = "quantize"\nbits = 4\n' + extra)


def _dlx(*args: Any, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    (res,) = _dlx_all([args], env=env, timeout=timeout)
    return res


def _dlx_all(calls: list[tuple[Any, ...]], env: dict[str, str] | None = None, envs: list[dict[str, str]] | None = None,
             timeout: float = 600) -> list[subprocess.CompletedProcess[str]]:
    """`dlx ARGS` for each ARGS of `calls`, all at once (commands that only read the run and
    its chain), each with `env` or its own of `envs` added: their finished processes, in order."""
    clean = {k: v for k, v in os.environ.items() if (not k.startswith("DLX_") or k == "DLX_TEST_EXTENSION") and k not in FOREIGN}
    procs = [subprocess.Popen([DLX, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**clean, **(env or {}), **(envs[i] if envs else {})})
             for i, args in enumerate(calls)]
    try:
        done = []
        for args, proc in zip(calls, procs, strict=True):
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess([DLX, *map(str, args)], proc.returncode, out, err))
        return done
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _train(root: Path, toml: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    job = root / "job.toml"
    job.write_text(toml)
    res = _dlx("train", job, "--run-dir", root / "run")
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "run"


needs_foreign = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                                   reason="this CPU's own kernels are ATen's default set: nothing foreign to play")


@pytest.mark.slow
@needs_foreign
def test_dlx_verify_reports_both_fingerprints_and_judges_a_foreign_replay_flip_aware(tmp_path) -> None:
    run_dir = _train(tmp_path / "native", _job("native"))
    # Four verifications of the run (they only read it), at once: from the foreign kernel set,
    # its table, under this machine's own kernels, and with an explicit tolerance of 0.
    res, text, own, strict = _dlx_all([
        ("verify", "--run-dir", run_dir, "--replay", "1.0", "--json"),
        ("verify", "--run-dir", run_dir, "--replay", "0.2"),
        ("verify", "--run-dir", run_dir, "--replay", "1.0", "--json"),
        ("verify", "--run-dir", run_dir, "--replay", "0.2", "--json", "--tolerance", "0"),
    ], envs=[FOREIGN, FOREIGN, {}, FOREIGN])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(res.stdout)
    kernels = report["kernels"]
    (trained,) = kernels["trained_on"]
    (replayed,) = kernels["replayed_on"]
    assert trained.startswith(torch.backends.cpu.get_cpu_capability()) and replayed.startswith("DEFAULT ")
    assert kernels["numerics"] == ["native"] and kernels["judged"] == [
        {"judged": FLIP_AWARE, "tolerance": DEFAULT_TOLERANCE}]
    assert kernels["notes"] == [f"native run: trained on {trained}, replayed on {replayed}: judged within "
                                f"tolerance {DEFAULT_TOLERANCE:g} with flip-aware comparison"]
    stages = [st for r in report["replay"] for st in r["stages"]]
    assert len(stages) == 12 and all(r["replayed_on"] == replayed for r in report["replay"])
    assert all(st["trained_on"] == trained and st["judged"] == FLIP_AWARE and st["max_flip"] <= 1 for st in stages)
    assert not any(st["exact"] for st in stages)  # the kernels differ: so do the last bits
    assert all(st["state_rel_l2"] is not None for r in report["replay"] if r["step"] < 3 for st in r["stages"])
    words = " ".join(text.stdout.split())
    assert text.returncode == 0 and "judged within tolerance" in words and f"replayed on {replayed}" in words
    # The same run verified under its own kernels: bit for bit, as before.
    report = json.loads(own.stdout)
    assert own.returncode == 0 and report["kernels"]["notes"] == []
    assert all(st["exact"] and st["judged"] == EXACT for r in report["replay"] for st in r["stages"])
    # An explicit 0 asks for bit for bit: the foreign replay then fails, naming the judging.
    assert strict.returncode == 1 and "judged bit for bit" in json.dumps(json.loads(strict.stdout)["steps"])


def _portable_run(tmp_path: Path) -> Path:
    return _train(tmp_path / "portable", _job("portable").replace("microbatches = 2",
                                                                  'microbatches = 2\nnumerics = "portable"'))


@pytest.mark.slow
def test_a_portable_run_replays_bit_for_bit_abroad_and_a_tolerance_does_not_loosen_it(tmp_path) -> None:
    run_dir = _portable_run(tmp_path)
    res = _dlx("verify", "--run-dir", run_dir, "--replay", "1.0", "--tolerance", "0.01", "--json", env=FOREIGN)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert report["kernels"]["notes"] == [
        "portable run: every replay must be bit for bit; --tolerance 0.01 does not loosen it"]
    assert all(st["exact"] and st["judged"] == EXACT for r in report["replay"] for st in r["stages"])


# Slot (1, 1) poisons its contribution from step 2 (the attack catalogue's noise of the delta's own size).
POISON = '[[cheat]]\nmode = "poison"\nreplica = 1\nstage = 1\nfrom_step = 2\n'


@pytest.fixture(scope="module")
def arbitrated_native(tmp_path_factory) -> Path:
    """A native 2x2 run with three arbiters (quorum 2), slot (1, 1) poisoned from step 2,
    trained under this machine's own kernels."""
    from lineage.chain.anvil import dev_accounts

    accounts = dev_accounts(10)
    arbiters = json.dumps([accounts[i].address for i in ARBITER_INDICES])
    return _train(tmp_path_factory.mktemp("arbitrated"),
                  _job("arbitrated", f"[chain]\narbiters = {arbiters}\nquorum = 2\n\n{POISON}"))


def _key_env(role: str, index: int) -> dict[str, str]:
    from lineage.chain.anvil import dev_accounts

    return {**FOREIGN, f"DLX_{role.upper()}_KEY": "0x" + bytes(dev_accounts(10)[index].key).hex()}


def _vote_calls(run_dir: Path, challenge: int, *args: str, n: int = 2) -> list[tuple[tuple[Any, ...], dict[str, str]]]:
    """`n` arbiters' `dlx arbiter vote CHALLENGE ARGS --replay`, from the foreign kernel set:
    (arguments, environment) for `_votes`."""
    return [(("arbiter", "vote", challenge, *args, "--replay", "--run-dir", run_dir), _key_env("arbiter", i))
            for i in ARBITER_INDICES[:n]]


def _votes(*calls: list[tuple[tuple[Any, ...], dict[str, str]]]) -> list[list[subprocess.CompletedProcess[str]]]:
    """The votes of each list of `_vote_calls`, all at once (a vote only reads the chain):
    their finished processes, a list per list."""
    flat = [call for group in calls for call in group]
    done = iter(_dlx_all([args for args, _ in flat], envs=[env for _, env in flat]))
    return [[next(done) for _ in group] for group in calls]


@pytest.mark.slow
@needs_foreign
def test_from_a_foreign_kernel_set_an_honest_node_is_never_slashable_and_a_cheat_still_is(arbitrated_native):
    from lineage.chain.anvil import dev_accounts, rpc_call
    from lineage.chain.runrecord import RunRecord

    run_dir = arbitrated_native
    record = RunRecord.load(run_dir)
    accounts = dev_accounts(10)
    honest, cheater, challenger = accounts[1], accounts[4], accounts[CHALLENGER_INDEX]  # slots (0, 0), (1, 1)
    with record.open_ledger(run_dir, writable=True) as ledger:
        rpc_call(ledger.chain.rpc_url, "anvil_setBalance", [challenger.address, hex(100 * ETHER)])
        ledger.registry.ensure_staked(challenger, ETHER)
        honest_stake = ledger.registry.stake_of(honest.address)
    env = _key_env("node", CHALLENGER_INDEX)
    run = str(record.run_id)

    # The honest node: its replay on another kernel set is within the calibrated rule.
    res = _dlx("challenge", run, 2, "--node", honest.address, "--run-dir", run_dir, env=env)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == "dlx: error: replay matches the claim; nothing to challenge"
    assert "judged within tolerance" in res.stderr

    # An over-strict challenger (an explicit tolerance below the last bits) opens one anyway:
    # no arbiter on the foreign kernels upholds it, whatever tolerance it asks for; they dismiss.
    res = _dlx("challenge", run, 2, "--node", honest.address, "--tolerance", "1e-12", "--run-dir", run_dir,
               "--json", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    frivolous = json.loads(res.stdout)["challenge"]
    uphold, strict_uphold, dismiss = _votes(_vote_calls(run_dir, frivolous, "--uphold", n=1),
                                            _vote_calls(run_dir, frivolous, "--uphold", "--tolerance", "1e-12", n=1),
                                            _vote_calls(run_dir, frivolous, "--dismiss"))
    for vote in uphold:
        assert vote.returncode == 2 and "matches the claim" in vote.stderr and "refusing to sign an uphold" in vote.stderr
    for vote in strict_uphold:
        assert vote.returncode == 2 and "the calibrated flip-aware rule accepts this replay" in vote.stderr, vote.stderr
    sigs = []
    for vote in dismiss:
        assert vote.returncode == 0, vote.stderr[-3000:]
        sigs.append(vote.stdout.strip())
    res = _dlx("arbiter", "resolve", frivolous, "--dismiss", *sigs, "--run-dir", run_dir, "--json", env=env)
    assert res.returncode == 0 and not json.loads(res.stdout)["upheld"], res.stderr[-3000:]

    # The poisoned slot: challenged, upheld and slashed from the foreign kernel set.
    res = _dlx("challenge", run, 2, "--node", cheater.address, "--run-dir", run_dir, "--json", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    done = json.loads(res.stdout)
    assert (done["replica"], done["stage"]) == (1, 1) and "flip-aware within" in done["judging"]
    assert done["failure"], done
    dismiss, uphold = _votes(_vote_calls(run_dir, done["challenge"], "--dismiss", n=1),
                             _vote_calls(run_dir, done["challenge"], "--uphold"))
    for vote in dismiss:
        assert vote.returncode == 2 and "refusing to sign a dismissal" in vote.stderr
    sigs = []
    for vote in uphold:
        assert vote.returncode == 0, vote.stderr[-3000:]
        assert "differs from the claim" in vote.stderr
        sigs.append(vote.stdout.strip())
    res = _dlx("arbiter", "resolve", done["challenge"], "--uphold", *sigs, "--run-dir", run_dir, "--json", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["upheld"] and out["node"] == cheater.address and int(out["slashed_wei"]) > 0
    with record.open_ledger(run_dir) as ledger:
        assert ledger.registry.stake_of(cheater.address) == 0
        assert ledger.registry.stake_of(honest.address) == honest_stake
