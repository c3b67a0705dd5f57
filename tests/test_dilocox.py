"""Tests for the DiLoCoX engine: compression (round trips, error feedback, the adaptive rule),
the Transport's byte counts, config errors, and multi-process runs (marked slow): the
one-step-delay overlap, equivalences with plain training and AllReduce, the pipeline split,
determinism, and the aggregate recomputed from compressed contributions.

    .venv/bin/pytest tests/test_dilocox.py              # ~1-2 min on 2 cores
    .venv/bin/pytest tests/test_dilocox.py -m "not slow"
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lineage.store.cid import cid_for
from trainer import ConfigError, bytes_to_tensors, load_job, train_local
from trainer.compress import (
    Compressor,
    decode_contribution,
    dequantize_rows,
    lowrank_reconstruct,
    quantize_rows,
)
from trainer.config import CompressionConfig
from trainer.diloco import apply_outer_step
from trainer.transport import HEADER_BYTES, all_gather_bytes_sent, all_reduce_bytes_sent

# --- config ------------------------------------------------------------------------

BASE = {"name": "t", "outer": {"steps": 1, "inner_steps": 1}}


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"outer": {"compression": {"kind": "lowrank", "rank": 33}}, "model": {"d_model": 32}},
         "outer.compression.rank (33) exceeds the smallest side (32)"),
        ({"outer": {"compression": {"kind": "adaptive", "max_rank": 64}}, "model": {"seq_len": 16}},
         "outer.compression.max_rank (64) exceeds the smallest side (16)"),
        ({"outer": {"compression": {"bits": 3}}}, "outer.compression.bits: must be one of 1, 2, 4, 8"),
        ({"outer": {"compression": {"bits": 16}}}, "outer.compression.bits: must be one of 1, 2, 4, 8"),
        ({"transport": {"bandwidth_mbps": 0}}, "transport.bandwidth_mbps: must be > 0"),
        ({"transport": {"bandwidth_mbps": -5}}, "transport.bandwidth_mbps: must be > 0"),
        ({"outer": {"delay": 2}}, "outer.delay: must be 0 or 1 (got 2)"),
        ({"outer": {"delay": -1}}, "outer.delay: must be 0 or 1"),
        ({"outer": {"compression": {"kind": "zip"}}}, "outer.compression.kind: Input should be"),
        ({"parallel": {"sync": "gossip"}}, "parallel.sync: Input should be 'diloco' or 'allreduce'"),
        ({"outer": {"momentum": 0.0}}, "outer: nesterov = true needs momentum > 0"),
    ],
)
def test_bad_settings_name_the_field(patch: dict, expected: str) -> None:
    data = copy.deepcopy(BASE)
    for section, values in patch.items():
        target = data.setdefault(section, {})
        for k, v in values.items():
            if isinstance(v, dict):
                target.setdefault(k, {}).update(v)
            else:
                target[k] = v
    with pytest.raises(ConfigError) as info:
        load_job(data)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_lowrank_rank_equal_to_the_smallest_side_is_allowed() -> None:
    job = load_job({**BASE, "model": {"d_model": 32, "n_heads": 2},
                    "outer": {"steps": 1, "inner_steps": 1,
                              "compression": {"kind": "lowrank", "rank": 32, "bits": 4}}})
    assert job.outer.compression.rank == 32


# --- quantisation and low rank ---------------------------------------------------------


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 37),
    bits=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 2**16),
    scale=st.floats(1e-6, 1e3),
)
def test_quantize_round_trip_is_within_half_a_step(rows, cols, bits, seed, scale) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale
    packed, s = quantize_rows(x, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, math.ceil(cols * bits / 8))
    y = dequantize_rows(packed, s, bits, cols)
    bound = s[:, None] / 2 * (1 + 1e-5) + 1e-30
    assert bool(((x - y).abs() <= bound).all())
    assert torch.equal(y, dequantize_rows(packed.clone(), s.clone(), bits, cols))  # deterministic


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.integers(1, 6), cols=st.integers(1, 37), seed=st.integers(0, 2**16), scale=st.floats(1e-6, 1e3))
def test_one_bit_sends_the_sign_scaled_by_the_mean_magnitude(rows, cols, seed, scale) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale
    packed, s = quantize_rows(x, 1)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, math.ceil(cols / 8))
    y = dequantize_rows(packed, s, 1, cols)
    assert torch.allclose(s, x.abs().mean(dim=1))
    assert torch.equal(y, torch.where(x >= 0, 1.0, -1.0) * s[:, None])
    # Of all sign patterns scaled per row, mean |x| is the one nearest x in L2 too.
    for c in (0.5, 2.0):
        assert ((x - y) ** 2).sum() <= ((x - c * y) ** 2).sum() * (1 + 1e-6)


def test_quantize_zero_rows_stay_zero() -> None:
    x = torch.zeros(3, 5)
    x[1] = torch.arange(5.0)
    y = dequantize_rows(*quantize_rows(x, 4), 4, 5)
    assert torch.equal(y[0], torch.zeros(5)) and torch.equal(y[2], torch.zeros(5))


def test_lowrank_recovers_a_low_rank_matrix_and_reconstructs_like_matmul() -> None:
    g = torch.Generator().manual_seed(0)
    M = torch.randn(40, 3, generator=g) @ torch.randn(3, 24, generator=g)  # rank 3, (40, 24)
    comp = Compressor(CompressionConfig(kind="lowrank", rank=3, bits=8, power_iters=2),
                      {"w": M.shape}, seed=1)
    data = comp.compress({"w": M}, step=1)
    out = decode_contribution(data, {"w": M.shape})["w"]
    assert (out - M).norm() / M.norm() < 0.02
    u, v = torch.randn(3, 40, generator=g), torch.randn(3, 24, generator=g)
    assert torch.allclose(lowrank_reconstruct(u, v), u.T @ v, atol=1e-5)


@pytest.mark.slow  # not in --quick: many rounds per compressor
@pytest.mark.parametrize(
    "cfg",
    [
        CompressionConfig(kind="quantize", bits=8),
        CompressionConfig(kind="quantize", bits=4),
        CompressionConfig(kind="quantize", bits=2),
        CompressionConfig(kind="quantize", bits=1),
        CompressionConfig(kind="lowrank", rank=2, bits=4),
        CompressionConfig(kind="lowrank", rank=4, bits=8),
        CompressionConfig(kind="adaptive", max_rank=8),
    ],
    ids=lambda c: f"{c.kind}-r{c.rank}-b{c.bits}",
)
@settings(max_examples=6, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**16), m=st.integers(2, 24), n=st.integers(2, 24))
def test_error_feedback_loses_nothing_and_its_residual_stays_bounded(cfg, seed, m, n) -> None:
    """sum_t decoded_t + e_T == sum_t delta_t, and ||e_t|| stays within a few ||delta||."""
    shapes = {"w": torch.Size([m, n]), "b": torch.Size([n])}
    if cfg.kind == "lowrank" and cfg.rank > min(m, n):
        cfg = cfg.model_copy(update={"rank": min(m, n)})
    comp = Compressor(cfg, shapes, seed=seed)
    g = torch.Generator().manual_seed(seed)
    sent = {k: torch.zeros(v) for k, v in shapes.items()}
    total = {k: torch.zeros(v) for k, v in shapes.items()}
    worst = 0.0
    for step in range(1, 31):
        delta = {k: torch.randn(v, generator=g) for k, v in shapes.items()}
        data = comp.compress(delta, step, loss=1.0)
        decoded = decode_contribution(data, shapes)
        for k in shapes:
            sent[k] += decoded[k]
            total[k] += delta[k]
        residual = math.sqrt(sum(float(s.residual.pow(2).sum()) for s in comp.state.values()))
        scale = math.sqrt(sum(float(d.pow(2).sum()) for d in delta.values()))
        worst = max(worst, residual / scale)
    for k in shapes:
        assert torch.allclose(sent[k] + comp.state[k].residual, total[k], atol=1e-3)
    assert worst < 8.0, worst


def test_none_keeps_the_plain_delta_layout() -> None:
    shapes = {"a.weight": torch.Size([4, 3]), "a.bias": torch.Size([4])}
    delta = {n: torch.randn(s) for n, s in shapes.items()}
    data = Compressor(CompressionConfig(), shapes, seed=0).compress(delta, 1)
    assert list(bytes_to_tensors(data)) == ["delta/a.bias", "delta/a.weight"]
    assert all(torch.equal(decode_contribution(data, shapes)[n], delta[n]) for n in shapes)


def test_lowrank_payload_layout_and_size() -> None:
    shapes = {"w": torch.Size([64, 32]), "b": torch.Size([32])}
    comp = Compressor(CompressionConfig(kind="lowrank", rank=4, bits=4), shapes, seed=0)
    data = comp.compress({n: torch.randn(s) for n, s in shapes.items()}, 1)
    keys = bytes_to_tensors(data)
    assert sorted(keys) == ["meta/b", "meta/w", "q/b", "q_scale/b", "u/w", "u_scale/w", "v/w",
                            "v_scale/w"]
    assert keys["u/w"].shape == (4, 32) and keys["v/w"].shape == (4, 16)  # 4 bits: 2 per byte
    assert keys["meta/w"].tolist() == [2, 4, 4]
    assert len(data) < 64 * 32 * 4 / 10


def test_decode_rejects_malformed_contributions() -> None:
    shapes = {"w": torch.Size([8, 8])}
    comp = Compressor(CompressionConfig(kind="quantize", bits=4), shapes, seed=0)
    good = bytes_to_tensors(comp.compress({"w": torch.randn(8, 8)}, 1))
    from trainer.artifacts import tensors_to_bytes

    with pytest.raises(ValueError, match="missing q_scale/w"):
        decode_contribution(tensors_to_bytes({k: v for k, v in good.items() if k != "q_scale/w"}),
                            shapes)
    with pytest.raises(ValueError, match="no delta/w or meta/w"):
        decode_contribution(tensors_to_bytes({"x": torch.zeros(1)}), shapes)
    with pytest.raises(ValueError, match="decode"):
        decode_contribution(tensors_to_bytes(good), {"w": torch.Size([8, 9])})


def test_adaptive_picks_small_ranks_for_low_rank_deltas_and_quantises_noise_whole() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = {"low": torch.Size([64, 64]), "noise": torch.Size([64, 64])}
    comp = Compressor(CompressionConfig(kind="adaptive", max_rank=32, energy=0.9, warmup_steps=0),
                      shapes, seed=0)
    low = torch.randn(64, 2, generator=g) @ torch.randn(2, 64, generator=g)
    for step in range(1, 4):
        comp.compress({"low": low + 0.01 * torch.randn(64, 64, generator=g),
                       "noise": torch.randn(64, 64, generator=g)}, step)
    chosen = comp.per_tensor()
    assert 1 <= chosen["low"]["rank"] <= 3
    assert chosen["noise"]["rank"] == 0 and chosen["noise"]["bits"] == 4  # whole, 4-bit


def test_adaptive_is_more_aggressive_early_and_respects_the_byte_budget() -> None:
    cfg = CompressionConfig(kind="adaptive", max_rank=16, energy=0.9, warmup_steps=4)
    shapes = {"w": torch.Size([96, 96])}
    comp = Compressor(cfg, shapes, seed=0)
    g = torch.Generator().manual_seed(1)
    spectrum = torch.linspace(1, 0.05, 96)
    basis = torch.linalg.qr(torch.randn(96, 96, generator=g))[0]

    def delta():
        return {"w": (basis * spectrum) @ torch.linalg.qr(torch.randn(96, 96, generator=g))[0]}

    comp.compress(delta(), 1, loss=3.0)
    early = comp.last_stats["energy_target"]
    for t in range(2, 6):
        comp.compress(delta(), t, loss=3.0 - t * 0.1)
    assert early == pytest.approx(0.9 * (0.5 + 0.5 / 4)) and comp.last_stats["energy_target"] == 0.9
    unlimited = len(comp.compress(delta(), 6, loss=2.0))
    capped = len(comp.compress(delta(), 7, loss=1.9, budget_bytes=600))
    assert capped < unlimited and capped < 1000
    # The loss trend: no improvement eases the target.
    comp.compress(delta(), 8, loss=2.5)
    assert comp.last_stats["energy_target"] == pytest.approx(0.95)


@pytest.mark.parametrize("arithmetic", ["float32", "float64"])
@pytest.mark.parametrize(("momentum", "nesterov"), [(0.9, True), (0.5, False), (0.0, False)])
def test_outer_step_is_torch_sgd(momentum: float, nesterov: bool, arithmetic: str) -> None:
    """OuterOptimizer writes SGD's update out by hand (no torch.optim, so no torch._dynamo
    import in a verifier). In the float32 arithmetic of older runs it is SGD bit for bit;
    in the float64 one (hardware-independent, tests/test_portable_audit.py) it is SGD's
    update rounded once, so within a float32 rounding of it."""
    from trainer.config import OuterConfig
    from trainer.diloco import OuterOptimizer

    cfg = OuterConfig(lr=0.7, momentum=momentum, nesterov=nesterov, steps=1, inner_steps=1,
                      arithmetic=arithmetic)
    g = torch.Generator().manual_seed(7)
    params = {"a": torch.randn(33, 17, generator=g), "b": torch.randn(5, generator=g)}
    ours = OuterOptimizer(params, cfg)
    ref = {n: t.clone() for n, t in params.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=cfg.lr, momentum=momentum, nesterov=nesterov, foreach=False)
    if momentum:
        for p in ref.values():
            sgd.state[p]["momentum_buffer"] = torch.zeros_like(p)
    same = torch.equal if arithmetic == "float32" else (
        lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6))
    for _ in range(4):
        delta = {n: torch.randn(t.shape, generator=g) for n, t in params.items()}
        ours.step(delta)
        for n, p in ref.items():
            p.grad = delta[n].clone()
        sgd.step()
        for n in params:
            assert same(ours.params[n], ref[n]), n
            if momentum:
                assert same(ours.momentum()[n], sgd.state[ref[n]]["momentum_buffer"]), n
    again = OuterOptimizer.from_bytes(ours.to_bytes(), cfg)  # what a shard carries round-trips
    assert again.to_bytes() == ours.to_bytes()


@pytest.mark.parametrize("kind", ["quantize", "sparse", "lowrank", "adaptive", "gaps"])
def test_compression_a_batch_at_a_time_gives_the_same_bytes_and_residuals(kind: str, monkeypatch) -> None:
    """A compressor reads, codes and feeds back a bounded batch of tensors at a time
    (`stream_batches`), so its working memory is a batch's: whatever the batch size, the
    payload and the residuals are those of the whole stage at once."""
    from trainer import compress

    cfg = {"gaps": CompressionConfig(kind="quantize", bits=2, coding="gaps"),
           "sparse": CompressionConfig(kind="sparse", density=0.1, chunk=64),
           "lowrank": CompressionConfig(kind="lowrank", rank=2),
           "adaptive": CompressionConfig(kind="adaptive", max_rank=4),
           "quantize": CompressionConfig(kind="quantize", bits=4)}[kind]
    shapes = {"a": torch.Size([24, 16]), "b": torch.Size([16]), "c": torch.Size([8, 16]), "d": torch.Size([40, 12])}
    g = torch.Generator().manual_seed(3)
    deltas = [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(3)]
    runs = []
    for limit in (1 << 30, 1, 300):
        monkeypatch.setattr(compress, "STREAM_ELEMENTS", limit)
        comp = Compressor(cfg, shapes, seed=11)
        payloads = [comp.compress(d, t, loss=1.0 / t) for t, d in enumerate(deltas, 1)]
        runs.append((payloads, {n: st.residual.clone() for n, st in comp.state.items()}, comp.last_stats["rel_error"]))
    for payloads, residuals, rel in runs[1:]:
        assert payloads == runs[0][0]
        assert all(torch.equal(residuals[n], runs[0][1][n]) for n in shapes)
        assert rel == runs[0][2]


@pytest.mark.parametrize("arithmetic", ["float32", "float64"])
def test_the_outer_step_a_batch_and_a_slice_at_a_time_is_the_whole_step(arithmetic: str, monkeypatch) -> None:
    """`outer_step_from` decodes, averages and steps a batch of tensors at a time and the
    float64 update a slice of a tensor at a time (`STEP_ELEMENTS`): the same bits as decoding
    every contribution whole, the ordered mean and one step per tensor."""
    from trainer import compress, diloco
    from trainer.config import OuterConfig
    from trainer.diloco import OuterOptimizer, mean_in_order, outer_step_from

    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=True, steps=1, inner_steps=1, arithmetic=arithmetic)
    shapes = {"a": torch.Size([24, 16]), "b": torch.Size([16]), "c": torch.Size([40, 12])}
    g = torch.Generator().manual_seed(5)
    params = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    comps = [Compressor(CompressionConfig(kind="quantize", bits=4), shapes, seed=r) for r in range(3)]
    blobs = [c.compress({n: torch.randn(s, generator=g) for n, s in shapes.items()}, 1) for c in comps]
    names = sorted(shapes)
    whole = OuterOptimizer(params, cfg)
    decoded = [decode_contribution(b, shapes) for b in blobs]
    whole.step(dict(zip(names, mean_in_order([[d[n] for n in names] for d in decoded]), strict=True)))
    monkeypatch.setattr(compress, "STREAM_ELEMENTS", 100)
    monkeypatch.setattr(diloco, "STEP_ELEMENTS", 7)
    ours = OuterOptimizer(params, cfg)
    kept = outer_step_from(ours, blobs, names, keep=True)
    assert ours.to_bytes() == whole.to_bytes()
    assert kept is not None and all(torch.equal(k[n], d[n]) for k, d in zip(kept, decoded, strict=True) for n in names)


# --- transport byte counts -------------------------------------------------------------


def test_ring_byte_counts() -> None:
    assert all_gather_bytes_sent([100], 0) == 0
    # R = 2: each rank forwards only its own blob.
    assert all_gather_bytes_sent([100, 60], 0) == 100 + HEADER_BYTES
    assert all_gather_bytes_sent([100, 60], 1) == 60 + HEADER_BYTES
    # R = 3: rank 0 sends blobs 0 and 2 (not 1, its right neighbour's own).
    assert all_gather_bytes_sent([10, 20, 30], 0) == 10 + 30 + 2 * HEADER_BYTES
    assert all_reduce_bytes_sent(1000, 1, 0) == 0
    assert all_reduce_bytes_sent(1000, 2, 0) == 4 * 1000  # 2 (R-1)/R x 4 bytes x n
    assert all_reduce_bytes_sent(999, 3, 1) == 4 * (2 * 999 - 333 - 333)


# --- multi-process runs ----------------------------------------------------------------

JOB = {
    "name": "dx",
    "seed": 5,
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
    "parallel": {"replicas": 2, "stages": 2, "microbatches": 2},
    "data": {"batch_size": 4, "eval_batches": 2, "max_bytes": 300_000},
    "inner": {"warmup": 2},
    # tau fixed: `auto` is a wall-clock decision (recorded for replay), so two runs may differ.
    "outer": {"steps": 3, "inner_steps": 3, "delay": 1, "overlap": "partial", "tau": 1,
              "compression": {"kind": "adaptive", "max_rank": 8}},
}


def job_with(**patch) -> dict:
    job = copy.deepcopy(JOB)
    for section, values in patch.items():
        if isinstance(values, dict):
            job.setdefault(section, {}).update(values)
        else:
            job[section] = values
    if job["outer"].get("delay", 0) == 0:  # the overlap settings belong to delay = 1 only
        job["outer"].pop("overlap", None)
        job["outer"].pop("tau", None)
    return job


class Sink:
    def __init__(self) -> None:
        self.genesis = None
        self.steps: list = []

    def on_genesis(self, genesis) -> None:
        self.genesis = genesis

    def on_step(self, step) -> None:
        self.steps.append(step)

    def on_progress(self, progress) -> None:
        pass


def run(job: dict) -> Sink:
    sink = Sink()
    train_local(load_job(job), sink, timeout_s=180)
    return sink


def params_of(shards) -> dict[str, torch.Tensor]:
    out = {}
    for shard in shards:
        out.update({k: v for k, v in bytes_to_tensors(shard.data).items() if k.startswith("param/")})
    return out


@pytest.fixture(scope="module")
def dilocox_runs() -> tuple[Sink, Sink]:
    return run(JOB), run(JOB)


@pytest.mark.slow
def test_dilocox_aggregate_recomputes_from_compressed_contributions(dilocox_runs) -> None:
    sink = dilocox_runs[0]
    job = load_job(JOB)
    R, S = 2, 2
    assert [s.step for s in sink.steps] == [1, 2, 3]
    for s in range(S):
        parent = sink.genesis.stages[s].data
        for step in sink.steps:
            contributions = [step.contributions[r * S + s].data for r in range(R)]
            assert apply_outer_step(parent, contributions, job.outer) == step.stages[s].data
            parent = step.stages[s].data
    for step in sink.steps:
        for c in step.contributions:
            keys = bytes_to_tensors(c.data)
            assert any(k.startswith("u/") for k in keys) or any(k.startswith("q/") for k in keys)
            assert not any(k.startswith("delta/") for k in keys)
        m = step.metrics
        for key in ("bytes_sent", "payload_bytes", "compute_s", "rounds_wall_s", "compress_s",
                    "modelled_comm_s", "peak_rss_mb", "rel_error", "rank_mean", "bits_mean"):
            assert key in m and math.isfinite(m[key]), key
    # Every byte counted: per step and stage group, each replica forwards its own blob + header.
    expected = sum(m.metrics["payload_bytes"] + HEADER_BYTES * R * S for m in sink.steps)
    assert sink.steps[-1].metrics["bytes_sent"] == expected
    # Each step's contributions are the rounds' own data shards, in round order.
    assert len({c.data_shard for step in sink.steps for c in step.contributions}) == 3 * R


@pytest.mark.slow
def test_same_seed_twice_gives_identical_shard_and_contribution_cids(dilocox_runs) -> None:
    a, b = dilocox_runs
    assert [cid_for(s.data) for s in a.genesis.stages] == [cid_for(s.data) for s in b.genesis.stages]
    for x, y in zip(a.steps, b.steps, strict=True):
        assert [cid_for(s.data) for s in x.stages] == [cid_for(s.data) for s in y.stages]
        assert [cid_for(c.data) for c in x.contributions] == [cid_for(c.data) for c in y.contributions]
        assert x.metrics["eval_loss"] == y.metrics["eval_loss"]


@pytest.mark.slow
def test_r1_outer_lr1_equals_local_training_and_two_stages_equal_one() -> None:
    """R = 1, outer SGD lr 1 momentum 0 is plain local training; a 2-stage 1F1B pipeline
    gives the same gradients (SGD with H = 1: the contribution is lr x gradient) and loss."""
    common = {"parallel": {"replicas": 1, "stages": 1, "microbatches": 2},
              "inner": {"optimizer": "sgd", "lr": 0.05, "clip": 1e9, "warmup": 0},
              "outer": {"steps": 3, "inner_steps": 1, "lr": 1.0, "momentum": 0.0, "nesterov": False,
                        "delay": 0, "compression": {"kind": "none"}}}
    one = run(job_with(**common))
    two = run(job_with(**{**common, "parallel": {"replicas": 1, "stages": 2, "microbatches": 2}}))
    local = run(job_with(**{**common, "parallel": {"replicas": 1, "stages": 1, "microbatches": 2,
                                                   "sync": "allreduce"}}))
    for a, b in zip(one.steps, two.steps, strict=True):
        ga = {k: v for c in a.contributions for k, v in bytes_to_tensors(c.data).items()}
        gb = {k: v for c in b.contributions for k, v in bytes_to_tensors(c.data).items()}
        assert sorted(ga) == sorted(gb)
        for k in ga:
            assert torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-6), k
        assert a.metrics["eval_loss"] == pytest.approx(b.metrics["eval_loss"], rel=1e-5)
    pa, pl = params_of(one.steps[-1].stages), params_of(local.steps[-1].stages)
    for k in pa:
        assert torch.allclose(pa[k], pl[k], atol=1e-6), k
    assert local.steps[-1].metrics["bytes_sent"] == 0  # R = 1: nothing crosses replicas


@pytest.mark.slow
def test_h1_outer_lr1_matches_the_allreduce_baseline() -> None:
    """With H = 1, no compression, outer SGD lr 1 momentum 0 and a linear inner optimizer,
    the mean of the replicas' one-step updates is the all-reduced step."""
    common = {"parallel": {"replicas": 2, "stages": 1, "microbatches": 2},
              "inner": {"optimizer": "sgd", "lr": 0.05, "clip": 1e9, "warmup": 0},
              "outer": {"steps": 3, "inner_steps": 1, "lr": 1.0, "momentum": 0.0, "nesterov": False,
                        "delay": 0, "compression": {"kind": "none"}}}
    diloco = run(job_with(**common))
    ar = run(job_with(**{**common, "parallel": {**common["parallel"], "sync": "allreduce"}}))
    pd, pa = params_of(diloco.steps[-1].stages), params_of(ar.steps[-1].stages)
    for k in pd:
        assert torch.allclose(pd[k], pa[k], atol=1e-5), k
    assert diloco.steps[-1].metrics["eval_loss"] == pytest.approx(
        ar.steps[-1].metrics["eval_loss"], rel=1e-4)
    numel = sum(v.numel() for v in pa.values())
    assert ar.steps[-1].metrics["bytes_sent"] == 3 * sum(
        all_reduce_bytes_sent(numel, 2, r) for r in range(2))


@pytest.mark.slow
def test_overlap_hides_the_exchange_behind_compute() -> None:
    """Simulated link, exchange shorter than a round's compute: delay 1 with the exchange
    overlapped with the whole next round (tau = H) hides all of it but the last flush.

    tau is fixed at H rather than `auto`: auto caps tau at H/4 for quality, and a quarter of
    this tiny model's round (a few ms a step) is shorter than any exchange worth timing."""
    T, E, H = 6, 0.1, 60  # rounds; seconds per exchange (one hop of latency, R = 2); inner steps
    common = {"parallel": {"replicas": 2, "stages": 1, "microbatches": 2},
              "outer": {"steps": T, "inner_steps": H, "compression": {"kind": "none"}},
              "transport": {"link": "simulated", "latency_ms": E * 1000}}
    sync = run(job_with(**{**common, "outer": {**common["outer"], "delay": 0}}))
    overlap = run(job_with(**{**common, "outer": {**common["outer"], "delay": 1, "tau": H}}))
    ms, mo = sync.steps[-1].metrics, overlap.steps[-1].metrics
    # delay 0 pays every exchange after its round's compute: sum (C_t + E);
    # delay 1 pays about sum max(C_t, E) + E, so it saves about sum min(C_t, E) - E.
    assert ms["modelled_comm_s"] == pytest.approx(T * E, abs=0.02)  # latency + the small bandwidth term
    assert ms["rounds_wall_s"] >= ms["compute_s"] + T * E * 0.95
    hidden = T * min(mo["compute_s"] / T, E) - E
    assert hidden > 0.3, f"rounds too short to test overlap: compute {mo['compute_s']:.2f}s"
    # Compare what each run spent beyond its own compute, so the check does not depend on
    # how fast this machine computed either run (CPU contention moves both runs' compute).
    sync_extra = ms["rounds_wall_s"] - ms["compute_s"]
    overlap_extra = mo["rounds_wall_s"] - mo["compute_s"]
    assert overlap_extra < sync_extra - 0.5 * hidden, (sync_extra, overlap_extra, hidden)
    assert mo["comm_wait_s"] < 0.5 * mo["modelled_comm_s"], (mo["comm_wait_s"], mo["modelled_comm_s"])


def _netns_available() -> bool:
    import os
    import shutil

    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _netns_available(), reason="netns links need root, ip and tc")
def test_netns_links_shape_real_traffic_and_change_no_bits() -> None:
    """Replicas in their own network namespaces behind 5 Mbit/s tc-shaped veths: the exchange
    really takes at least the link model's time, and the run's bytes and math are unchanged."""
    import subprocess

    def namespaces() -> set[str]:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return {line.split()[0] for line in listed.splitlines() if line.startswith("dlx")}

    before = namespaces()  # another test (test_queue_netns, on another xdist worker) may hold some
    sink = run(job_with(parallel={"replicas": 2, "stages": 1, "microbatches": 2},
                        outer={"steps": 2, "inner_steps": 2, "delay": 0,
                               "compression": {"kind": "none"}},
                        transport={"link": "netns", "bandwidth_mbps": 5}))
    m = sink.steps[-1].metrics
    assert m["modelled_comm_s"] > 0.1
    assert m["comm_wait_s"] >= 0.9 * m["modelled_comm_s"], m
    job = load_job(JOB)
    parent = sink.genesis.stages[0].data
    for step in sink.steps:
        contributions = [c.data for c in step.contributions]
        assert apply_outer_step(parent, contributions, job.outer) == step.stages[0].data
        parent = step.stages[0].data
    assert not namespaces() - before  # torn down: none of this run's namespaces is left
