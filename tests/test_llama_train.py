"""The llama family through the real engine: a 2-stage pipeline (torch.distributed
pipelining over gloo, separate processes) computes the unsplit model's loss and gradients;
bfloat16 autocast and activation checkpointing train, and an honest bf16 run replays bit
for bit through `dlx verify`; the gpt family's config dumps (and hashes) as it did before
the families existed; the model's parameter count matches what it builds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dlx_testing.here import dlx_here

from trainer.compress import decode_contribution
from trainer.config import ModelConfig, load_job
from trainer.launch import train_local
from trainer.model import build_model, build_stage

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import RecordingSink  # noqa: E402

DLX = str(Path(sys.executable).parent / "dlx")

LLAMA = {"family": "llama", "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "seq_len": 32, "qkv_bias": True}


def _job(parallel: dict, **model: object) -> object:
    return load_job({
        "name": "llama", "seed": 5, "model": {**LLAMA, **model},
        "parallel": {"microbatches": 2, **parallel},
        "data": {"batch_size": 4, "eval_batches": 2, "max_bytes": 200_000},
        # Plain SGD, one inner step: each pseudo-gradient is lr x the clipped gradient.
        "inner": {"optimizer": "sgd", "lr": 0.1, "warmup": 0},
        "outer": {"steps": 2, "inner_steps": 1},
    })


@pytest.mark.parametrize("model", [dict(LLAMA), {**LLAMA, "qkv_bias": False, "n_kv_heads": 4},
                                   {"d_model": 32, "n_layers": 3, "n_heads": 2}])
def test_parameter_count_is_what_the_model_builds(model: dict) -> None:
    cfg = ModelConfig(**model)
    assert sum(p.numel() for p in build_model(cfg, 0).parameters()) == cfg.n_params()


def test_stages_chain_to_the_unsplit_forward_and_backward() -> None:
    cfg = ModelConfig(**LLAMA)
    whole = build_model(cfg, seed=3)
    parts = [build_stage(cfg, s, 2, seed=3) for s in range(2)]
    x = torch.randint(0, cfg.vocab_size, (2, 16))  # (B, T)
    torch.testing.assert_close(parts[1](parts[0](x)), whole(x), rtol=0, atol=0)
    assert sorted(n for p in parts for n, _ in p.named_parameters()) == sorted(
        n for n, _ in whole.named_parameters())


@pytest.mark.slow
def test_a_two_stage_pipeline_gives_the_unsplit_loss_and_gradients() -> None:
    def run(stages: int) -> RecordingSink:
        sink = RecordingSink()
        train_local(_job({"replicas": 1, "stages": stages}), sink, timeout_s=180)
        return sink

    piped, whole = run(2), run(1)
    for a, b in zip(piped.steps, whole.steps, strict=True):
        assert a.contributions[0].loss == pytest.approx(b.contributions[0].loss, rel=1e-6)
        assert a.metrics["eval_loss"] == pytest.approx(b.metrics["eval_loss"], rel=1e-6)
        cfg = _job({"replicas": 1, "stages": 1}).model
        shapes = {n: p.shape for n, p in build_model(cfg, 0).named_parameters()}
        grads_whole = decode_contribution(b.contributions[0].data, shapes)
        grads_piped: dict[str, torch.Tensor] = {}
        for c in a.contributions:
            stage_shapes = {n: p.shape for n, p in build_stage(cfg, c.stage, 2, 0).named_parameters()}
            grads_piped.update(decode_contribution(c.data, stage_shapes))
        assert sorted(grads_piped) == sorted(grads_whole)
        for name, g in grads_whole.items():
            torch.testing.assert_close(grads_piped[name], g, rtol=1e-5, atol=1e-7, msg=name)
        assert any(g.abs().max() > 0 for g in grads_whole.values())


def test_a_gpt_config_dumps_as_before_the_families_existed() -> None:
    job = load_job({"name": "t", "outer": {"steps": 1, "inner_steps": 1}})
    assert job.model.model_dump() == {"vocab_size": 256, "d_model": 128, "n_layers": 4, "n_heads": 4,
                                      "seq_len": 128, "mlp_ratio": 4, "dropout": 0.0}
    assert "device" not in job.parallel.model_dump()
    llama = load_job({"name": "t", "model": LLAMA, "outer": {"steps": 1, "inner_steps": 1}})
    assert "mlp_ratio" not in llama.model.model_dump() and llama.model.model_dump()["family"] == "llama"
    assert load_job(llama.model_dump(mode="json")) == llama  # the dump is the job


BF16_JOB = """
name = "bf16"
seed = 11

[model]
family = "llama"
d_model = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
seq_len = 32
dtype = "bfloat16"
activation_checkpointing = true

[parallel]
replicas = 2
stages = 2
microbatches = 2

[data]
max_bytes = 200000
batch_size = 4
eval_batches = 2

[outer]
steps = 2
inner_steps = 3
"""


@pytest.mark.slow
def test_bf16_with_activation_checkpointing_trains_and_replays_bit_for_bit(tmp_path) -> None:
    job = tmp_path / "bf16.toml"
    job.write_text(BF16_JOB)
    run_dir = tmp_path / "run"
    train = subprocess.run([DLX, "train", str(job), "--run-dir", str(run_dir)],
                           capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr
    said = " ".join(train.stderr.split())
    assert "llama 47K parameters" in said and "on cpu (auto: 0 GPUs for 4 ranks)" in said
    verify = dlx_here("verify", "--run-dir", run_dir, "--replay", "1")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "replayed 4 (step, replica) rounds" in verify.stdout and "4 bit for bit" in verify.stdout


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_lone_stage_shortcut_is_the_pipeline_schedule_bit_for_bit(schedule, family, monkeypatch) -> None:
    """S = 1 skips torch.distributed.pipelining (its per-step machinery cost ~7%); the loss
    and every gradient must stay what the schedule computes, or replay of older runs breaks."""
    import torch.distributed as dist

    from trainer import pipeline, world

    model = dict(LLAMA) if family == "llama" else {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32}
    job = load_job({"name": "t", "model": model, "parallel": {"replicas": 1, "stages": 1, "microbatches": 4,
                                                                "schedule": schedule},
                    "data": {"batch_size": 8}, "outer": {"steps": 1, "inner_steps": 1}})
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{__import__('trainer.launch').launch.free_port()}",
                            rank=0, world_size=1)
    try:
        results = []
        for shortcut in (False, True):
            monkeypatch.setattr(pipeline, "LONE_STAGE_SHORTCUT", shortcut)
            module = build_stage(job.model, 0, 1, job.seed)
            pipe = pipeline.Pipeline(module, world.Topology(0, 1, 1), dist.group.WORLD, job)
            assert (pipe.schedule is None) == shortcut
            loss = pipe.train_step(tokens[:, :-1], tokens[:, 1:])
            results.append((loss, {n: p.grad.clone() for n, p in module.named_parameters()}))
    finally:
        dist.destroy_process_group()
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == loss_b
    for name, g in grads_a.items():
        assert torch.equal(g, grads_b[name]), name
