"""scripts/peer_torchft.py: torchft's DiLoCo and Streaming DiLoCo as benchmark peers.

Each run starts its own Lighthouse and two replica processes (run_peer stops them all).
torchft's synchronous DiLoCo (and Streaming DiLoCo with one fragment, tau = 1) is held to a
single-process reference of the same algorithm built here from the trainer's pieces: R
replicas' inner rounds in turn, the mean of their pseudo-gradients, one outer SGD step.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import peer_torchft  # noqa: E402

from trainer import load_job  # noqa: E402
from trainer.data import derive_seed, load_corpus  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.pipeline import (  # noqa: E402
    build_inner_optimizer,
    clip_pipeline_grad_norm,
    lm_loss,
    warmup_lr,
)

PROBLEM = peer_torchft.torchft_problem()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROBLEM is not None, reason=f"torchft peer unavailable: {PROBLEM}"),
]

JOB = {
    "name": "peer-tiny",
    "seed": 5,
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16},
    "parallel": {"replicas": 2, "stages": 1, "microbatches": 2},
    "data": {"batch_size": 2, "eval_batches": 2, "max_bytes": 300_000},
    "inner": {"lr": 3e-3, "warmup": 2},
    "outer": {"steps": 3, "inner_steps": 3},
}


def reference(job: dict, tau: int = 0, alpha: float = 0.0) -> dict[int, float]:
    """torchft's one-fragment (Streaming) DiLoCo in one process: eval loss of replica 0
    after each outer step. Each replica sends theta_global - theta_local after H - tau inner
    steps, trains tau more, then takes lerp(new theta_global, its local weights, alpha)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the replicas run
    try:
        with torch.random.fork_rng(devices=[]):
            return _reference(job, tau, alpha)
    finally:
        torch.set_num_threads(threads)


def _reference(job: dict, tau: int, alpha: float) -> dict[int, float]:
    cfg = load_job(job)
    R, T, H = cfg.parallel.replicas, cfg.outer.steps, cfg.outer.inner_steps
    B, L, M = cfg.data.batch_size, cfg.model.seq_len, cfg.parallel.microbatches
    corpus = load_corpus(cfg.data)
    evals = corpus.eval_batches(cfg.data.eval_batches, B, L, seed=cfg.seed)
    glob = build_model(cfg.model, cfg.seed)
    outer = torch.optim.SGD(glob.parameters(), lr=cfg.outer.lr, momentum=cfg.outer.momentum,
                            nesterov=cfg.outer.nesterov)
    models = [build_model(cfg.model, cfg.seed) for _ in range(R)]
    inners = [build_inner_optimizer(m, cfg) for m in models]
    out = {}
    for t in range(1, T + 1):
        deltas = []
        for r, (m, inner) in enumerate(zip(models, inners, strict=True)):
            tokens = corpus.shard(cfg.seed, r, t, H, B, L).tokens
            torch.manual_seed(derive_seed("round", cfg.seed, r, t))
            for h in range(H):
                for g in inner.param_groups:
                    g["lr"] = warmup_lr(cfg.inner.lr, cfg.inner.warmup, (t - 1) * H + h)
                inner.zero_grad(set_to_none=True)
                x, y = tokens[h, :, :-1], tokens[h, :, 1:]
                for xm, ym in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
                    lm_loss(m(xm), ym).backward()
                for p in m.parameters():
                    p.grad.div_(M)
                clip_pipeline_grad_norm(list(m.parameters()), cfg.inner.clip, None, 1)
                inner.step()
                if h == H - 1 - tau:
                    with torch.no_grad():
                        deltas.append([g.detach() - p.detach()
                                       for g, p in zip(glob.parameters(), m.parameters(), strict=True)])
        with torch.no_grad():
            for i, g in enumerate(glob.parameters()):
                g.grad = sum(d[i] for d in deltas) / R
            outer.step()
            outer.zero_grad()
            for m in models:
                for g, p in zip(glob.parameters(), m.parameters(), strict=True):
                    p.copy_(torch.lerp(g, p, alpha))
        m0 = models[0].eval()
        with torch.no_grad():
            out[t] = sum(lm_loss(m0(b[:, :-1]), b[:, 1:]).item() for b in evals) / len(evals)
        m0.train()
    return out


def n_params(job: dict) -> int:
    return sum(p.numel() for p in build_model(load_job(job).model, 0).parameters())


def test_diloco_matches_the_reference():
    res = peer_torchft.run_peer(copy.deepcopy(JOB), "diloco", timeout_s=300)
    ref = reference(JOB)
    assert res["variant"] == "diloco" and res["fragments"] == 1 and res["tau"] == 0
    assert sorted(res["eval_by_step"]) == [1, 2, 3]
    assert all(math.isfinite(v) for v in res["eval_by_step"].values())
    for t, want in ref.items():
        assert res["eval_by_step"][t] == pytest.approx(want, rel=1e-5, abs=1e-6), t
    assert res["eval_loss"] == res["eval_by_step"][3]
    assert res["outer_commits"] == 3
    # One float32 ring all-reduce of the whole model per outer step: 2 (R - 1) numel * 4 bytes.
    assert res["bytes_sent"] == 3 * 2 * 1 * n_params(JOB) * 4
    assert res["checkpoint_bytes"] == 0
    assert res["tokens"] == 3 * 3 * 2 * 2 * 16
    assert 0 < res["compute_s"] <= res["wall_s"]


def test_streaming_runs_and_matches_the_reference():
    res = peer_torchft.run_peer(copy.deepcopy(JOB), "streaming", tau=1, alpha=0.5,
                                eval_every=2, timeout_s=300)
    assert res["variant"] == "streaming" and res["tau"] == 1 and res["alpha"] == 0.5
    assert sorted(res["eval_by_step"]) == [2, 3]  # every 2nd step and always the last
    assert all(math.isfinite(v) for v in res["eval_by_step"].values())
    ref = reference(JOB, tau=1, alpha=0.5)
    for t in (2, 3):
        assert res["eval_by_step"][t] == pytest.approx(ref[t], rel=1e-5, abs=1e-6), t
    assert res["bytes_sent"] == 3 * 2 * 1 * n_params(JOB) * 4


def test_bad_settings_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="variant"):
        peer_torchft.run_peer(copy.deepcopy(JOB), "async")
    with pytest.raises(ValueError, match="tau"):
        peer_torchft.run_peer(copy.deepcopy(JOB), "streaming", tau=3)
    with pytest.raises(ValueError, match="fragments"):
        peer_torchft.run_peer(copy.deepcopy(JOB), "streaming", fragments=3, tau=0)
