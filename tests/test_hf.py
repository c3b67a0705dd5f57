"""The Hugging Face adapter (trainer/hf.py) held to transformers itself, the oracle: our
exports load with `AutoModelForCausalLM.from_pretrained` and compute our logits; models
transformers saves start our runs (`resolve_init`, `load_init_weights`) and compute its
logits in ours; incremental decoding with the KV cache matches the full forward; every
way an init directory can disagree with the job is one ConfigError naming the cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.config import ModelConfig
from trainer.errors import ConfigError
from trainer.generate import generate
from trainer.hf import (
    from_hf,
    hf_config,
    load_init_weights,
    model_fields_from_hf,
    resolve_init,
    to_hf,
    write_hf_dir,
)
from trainer.llama import KVCache
from trainer.model import build_model, build_stage

transformers = pytest.importorskip("transformers")

TOL = 1e-5
BASE = {"family": "llama", "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32}
VARIANTS = {
    # Llama: no bias, n_kv_heads == n_heads, untied; non-default rope base and epsilon
    "llama": {**BASE, "rope_theta": 500000.0, "rms_norm_eps": 1e-6, "intermediate_size": 48},
    "llama-tied": {**BASE, "tie_embeddings": True},
    # Qwen2: q/k/v bias and grouped-query attention
    "qwen2-gqa": {**BASE, "qkv_bias": True, "n_kv_heads": 2, "rope_theta": 1e6},
    "gpt": {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32},
}
CLASSES = {"llama": "LlamaForCausalLM", "llama-tied": "LlamaForCausalLM",
           "qwen2-gqa": "Qwen2ForCausalLM", "gpt": "GPT2LMHeadModel"}


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere: fresh norms (ones) and biases (zeros) would hide a
    misplaced one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return module.eval()


def _ours(variant: str) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = ModelConfig(**VARIANTS[variant])
    return cfg, _perturbed(build_model(cfg, seed=1), seed=2)


def _tokens(cfg: ModelConfig, T: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, cfg.vocab_size, (2, T or cfg.seq_len), generator=g)  # (B, T)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- export: ours -> transformers ---------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_an_export_loads_in_transformers_and_computes_our_logits(tmp_path, variant):
    cfg, model = _ours(variant)
    out = tmp_path / "hf"
    write_hf_dir(out, cfg, dict(model.named_parameters()), {"run": 1, "step": 2})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == CLASSES[variant]
    x = _tokens(cfg)
    with torch.no_grad():
        assert _max_diff(theirs(x).logits, model(x)) <= TOL
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "lineage.json", "model.safetensors"]
    assert json.loads((out / "lineage.json").read_text()) == {"tokenizer": "bytes", "run": 1, "step": 2}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_rename_goes_both_ways(variant):
    cfg, model = _ours(variant)
    params = dict(model.named_parameters())
    back = from_hf(to_hf(params, cfg), cfg)
    assert sorted(back) == sorted(params)
    for name, t in params.items():
        assert torch.equal(back[name], t), name


def test_the_config_inverts_for_llama_and_qwen2():
    for variant in ("llama", "llama-tied", "qwen2-gqa"):
        cfg = ModelConfig(**VARIANTS[variant])
        fields = model_fields_from_hf(hf_config(cfg))
        assert ModelConfig(**fields) == ModelConfig(**{**VARIANTS[variant], "n_kv_heads": cfg.kv_heads,
                                                      "intermediate_size": cfg.ffn_size})


def test_write_hf_dir_refuses_a_non_empty_directory_and_leaves_nothing_on_failure(tmp_path):
    cfg, model = _ours("llama")
    params = dict(model.named_parameters())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        write_hf_dir(tmp_path / "full", cfg, params, {})
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep"]
    del params["norm.weight"]
    with pytest.raises(ConfigError, match="norm.weight is missing"):
        write_hf_dir(tmp_path / "out", cfg, params, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no temporary left either


# -- init: transformers -> ours -----------------------------------------------------------

def _hf_model(kind: str, **overrides):
    """A random transformers model of our test size (norms and biases perturbed too)."""
    common = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
    if kind == "qwen2":
        config = transformers.Qwen2Config(**{**common, "num_key_value_heads": 2,
                                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                                              **overrides})
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**{**common, "num_key_value_heads": 4,
                                              "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                                              **overrides})
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(4)
    return _perturbed(cls(config), seed=5)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Directories `save_pretrained` wrote: Llama (sharded, with an index), tied Llama, Qwen2."""
    root = tmp_path_factory.mktemp("hf")
    models = {"llama": _hf_model("llama"), "llama-tied": _hf_model("llama", tie_word_embeddings=True),
              "qwen2": _hf_model("qwen2")}
    for name, m in models.items():
        m.save_pretrained(root / name, max_shard_size="40KB" if name == "llama" else "50MB")
    assert (root / "llama" / "model.safetensors.index.json").is_file()
    return root, models


@pytest.mark.parametrize("name", ["llama", "llama-tied", "qwen2"])
def test_a_transformers_model_starts_ours_with_its_logits(hf_dirs, name):
    root, models = hf_dirs
    cfg = resolve_init(ModelConfig(family="llama", init=name, seq_len=32), base=root)
    assert cfg.init == str((root / name).resolve())
    assert (cfg.qkv_bias, cfg.tie_embeddings) == (name == "qwen2", name == "llama-tied")
    ours = build_model(cfg, seed=0)
    load_init_weights(ours, cfg.init)
    x = _tokens(cfg)
    with torch.no_grad():
        assert _max_diff(ours.eval()(x), models[name](x).logits) <= TOL


def test_a_pipeline_stage_reads_only_its_own_tensors(hf_dirs):
    root, models = hf_dirs
    cfg = resolve_init(ModelConfig(family="llama", init=str(root / "qwen2")), base=Path("/"))
    assert cfg.seq_len == 64  # unset: max_position_embeddings
    last = build_stage(cfg, 1, 2, seed=0)
    load_init_weights(last, cfg.init)
    theirs = dict(models["qwen2"].named_parameters())
    for name, p in last.named_parameters():
        key = name if name == "lm_head.weight" else f"model.{name}"
        assert torch.equal(p, theirs[key]), name
    assert not any(n.startswith("embed_tokens") for n, _ in last.named_parameters())


def test_incremental_decoding_with_the_cache_equals_the_full_forward():
    cfg, model = _ours("qwen2-gqa")
    x = _tokens(cfg, T=12)
    with torch.no_grad():
        full = model(x)  # (B, T, V)
        cache = KVCache()
        steps = [model(x[:, :5], cache)] + [model(x[:, t:t + 1], cache) for t in range(5, 12)]
    assert cache.pos == 12
    assert _max_diff(torch.cat(steps, dim=1), full) <= TOL


@pytest.mark.slow  # not in --quick: hundreds of full forwards
@pytest.mark.parametrize("variant", ["qwen2-gqa", "gpt"])
def test_generation_is_greedy_at_temperature_0_and_seeded_otherwise(variant):
    cfg, model = _ours(variant)
    prompt = list(b"def f(")
    greedy = generate(model, prompt, 20, temperature=0)
    ids = list(prompt)
    with torch.no_grad():  # the cache-free reference: argmax of a full forward per token
        for _ in range(20):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert greedy == ids[len(prompt):]
    seen: list[int] = []
    a = generate(model, prompt, 20, temperature=1.0, top_k=5, seed=1, on_token=seen.append)
    assert a == seen == generate(model, prompt, 20, temperature=1.0, top_k=5, seed=1)
    assert a != generate(model, prompt, 20, temperature=1.0, top_k=5, seed=2)
    # Past the context length both families keep going on a window of it.
    assert len(generate(model, prompt, cfg.seq_len + 4, temperature=0.5, seed=3)) == cfg.seq_len + 4


# -- init errors --------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path


def test_init_errors_name_the_cause(hf_dirs, tmp_path):
    root, _ = hf_dirs
    src = root / "qwen2"

    def refused(init: str, match: str, **fields) -> None:
        with pytest.raises(ConfigError, match=match) as info:
            resolve_init(ModelConfig(family="llama", init=init, **fields), base=tmp_path)
        assert "\n" not in str(info.value)

    refused("nowhere", "no such directory")
    (tmp_path / "empty").mkdir()
    refused("empty", "has no config.json")
    refused(str(src), r"model\.d_model: the job says 64, .*config.json says 32", d_model=64)
    refused(str(src), r"model\.qkv_bias: the job says false, .*config.json says true", qkv_bias=False)
    refused(str(src), r"model\.seq_len: the job says 100, beyond", seq_len=100)

    no_weights = _copy(src, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    refused("no-weights", "has no model.safetensors or model.safetensors.index.json")

    wrong = _copy(src, tmp_path / "wrong-shape")
    tensors = load_file(wrong / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 16)
    save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
    refused("wrong-shape", r"tensor model\.layers\.1\.mlp\.up_proj\.weight has shape \[64, 16\], "
                           r"the model needs \[64, 32\]")

    _edit_config(_copy(src, tmp_path / "rope-scaled"),
                 rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6})
    refused("rope-scaled", "rope_parameters.rope_type .*rope scaling is not reproduced")
    _edit_config(_copy(src, tmp_path / "rope-legacy"), rope_scaling={"type": "dynamic", "factor": 2.0})
    refused("rope-legacy", "config.json rope_scaling .*rope scaling")
    _edit_config(_copy(src, tmp_path / "sliding"), use_sliding_window=True)
    refused("sliding", "config.json use_sliding_window = true")


@pytest.mark.parametrize(("key", "value"), [("hidden_act", "gelu"), ("mlp_bias", True),
                                            ("attention_bias", True), ("head_dim", 16),
                                            ("model_type", "mistral")])
def test_config_json_we_do_not_reproduce_is_refused_by_key(key, value):
    config = {**hf_config(ModelConfig(**VARIANTS["llama"])), key: value}
    with pytest.raises(ConfigError, match=f"config.json {key}"):
        model_fields_from_hf(config)
