"""Hugging Face checkpoints to and from our models (after torchtitan's state_dict_adapter).

A run can start from a local Hugging Face directory (`[model] init = "path"`) and any
checkpoint exports to one that `transformers.AutoModelForCausalLM.from_pretrained` loads
and that computes our logits (tests/test_hf.py holds the two to 1e-5):

- `llama` is `LlamaForCausalLM`, or `Qwen2ForCausalLM` when `qkv_bias` (Qwen2 always has
  q/k/v biases and Llama's `attention_bias` would bias `o_proj` too); the tensors are ours
  renamed (a `model.` prefix, `lm_head.weight` as is, absent when the embeddings are tied);
- `gpt` is `GPT2LMHeadModel` with `activation_function = "gelu"` (the exact erf GELU our
  `nn.GELU()` computes, not GPT-2's own tanh "gelu_new") and untied embeddings; GPT-2's
  Conv1D stores (in, out) matrices, so the four projection weights are transposed.

Nothing here imports transformers: it is the test oracle, not a dependency. The
configuration goes both ways through `hf_config` and `model_fields_from_hf`, which refuses
what our models do not reproduce exactly (rope scaling, sliding windows, MLP biases, other
activations) by naming the config.json key. `resolve_init` checks an init directory
against the job (fields, tensor names and shapes, from the safetensors headers only);
`load_init_weights` fills a pipeline stage from it; `write_hf_dir` writes an export.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from trainer.config import GptConfig, LlamaConfig, ModelConfig, one_line
from trainer.errors import ConfigError
from trainer.model import skeleton

__all__ = [
    "check_params",
    "from_hf",
    "hf_config",
    "load_init_weights",
    "load_params",
    "model_fields_from_hf",
    "resolve_init",
    "to_hf",
    "write_hf_dir",
]

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_MAX_HEADER = 100_000_000  # the safetensors library's own limit
# GPT-2's Conv1D layers: weight (in, out) where our nn.Linear has (out, in).
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

# What transformers assumes for a key config.json leaves out (its config classes' defaults),
# for the keys we read; keys with no entry here must be present.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "hidden_act": "silu"},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "hidden_act": "silu"},
}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Fields a job may set and an init directory's config.json also fixes; seq_len is the
# training context, which may be shorter than the model's max_position_embeddings.
_FROM_HF = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
            "intermediate_size", "rope_theta", "rms_norm_eps", "qkv_bias", "tie_embeddings")


# -- configuration ------------------------------------------------------------------------

def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for `cfg`'s transformers class (see the module docstring)."""
    common: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "initializer_range": 0.02,
        "use_cache": True,
        # A byte vocabulary has no special tokens: every id is a byte value.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "float32",
    }
    if isinstance(cfg, GptConfig):
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            **common,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.mlp_ratio * cfg.d_model,
            "activation_function": "gelu",  # exact erf GELU: nn.GELU()'s default
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": False,
        }
    assert isinstance(cfg, LlamaConfig), f"no Hugging Face class for family {cfg.family!r}"
    model_type = "qwen2" if cfg.qkv_bias else "llama"
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        **common,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.d_model // cfg.n_heads,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        # transformers 5 reads rope_parameters; 4.x read the top-level rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
                      layer_types=["full_attention"] * cfg.n_layers)
    return config


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig field values (family llama) from a Llama or Qwen2 config.json; ConfigError
    naming the key for anything our Llama does not reproduce exactly. `seq_len` is the
    config's max_position_embeddings."""
    model_type = config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ConfigError(f"config.json model_type {model_type!r} is not one we reproduce "
                          f"(one of {', '.join(sorted(_ARCHITECTURES))})")
    archs = config.get("architectures")
    if archs is not None and archs != [_ARCHITECTURES[model_type]]:
        raise ConfigError(f"config.json architectures {archs!r}: expected "
                          f"[{_ARCHITECTURES[model_type]!r}] for model_type {model_type!r}")

    def get(key: str) -> Any:
        if key in config:
            return config[key]
        if key in _HF_DEFAULTS[model_type]:
            return _HF_DEFAULTS[model_type][key]
        raise ConfigError(f"config.json has no {key}")

    def refuse_unless(key: str, ok: bool, why: str) -> None:
        if not ok:
            raise ConfigError(f"config.json {key} = {json.dumps(config.get(key))}: {why}")

    d, heads = get("hidden_size"), get("num_attention_heads")
    refuse_unless("hidden_act", get("hidden_act") == "silu", "only silu (SwiGLU) is reproduced")
    if isinstance(d, int) and isinstance(heads, int) and heads > 0 and config.get("head_dim") is not None:
        refuse_unless("head_dim", config["head_dim"] == d // heads,
                      f"the head size must be hidden_size / num_attention_heads ({d // heads})")
    refuse_unless("mlp_bias", not config.get("mlp_bias", False), "MLP biases are not reproduced")
    refuse_unless("attention_dropout", not config.get("attention_dropout", 0.0),
                  "attention dropout is not reproduced")
    if model_type == "llama":
        refuse_unless("attention_bias", not config.get("attention_bias", False),
                      "Llama's attention_bias also biases o_proj, which we do not reproduce "
                      "(Qwen2's q/k/v bias is model_type qwen2)")
    else:
        refuse_unless("use_sliding_window", not config.get("use_sliding_window", False),
                      "sliding-window attention is not reproduced")
        layer_types = config.get("layer_types")
        refuse_unless("layer_types", layer_types is None or set(layer_types) <= {"full_attention"},
                      "only full attention is reproduced")
    kv = get("num_key_value_heads")
    return {
        "family": "llama",
        "vocab_size": get("vocab_size"),
        "d_model": d,
        "n_layers": get("num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": heads if kv is None else kv,
        "intermediate_size": get("intermediate_size"),
        "rope_theta": _rope_theta(config),
        "rms_norm_eps": get("rms_norm_eps"),
        "qkv_bias": model_type == "qwen2",
        "tie_embeddings": get("tie_word_embeddings"),
        "seq_len": get("max_position_embeddings"),
    }


def _rope_theta(config: dict[str, Any]) -> float:
    """The rotary base of a config that uses plain (unscaled, full-width) RoPE."""
    scaling = config.get("rope_scaling")
    if scaling is not None and (not isinstance(scaling, dict)
                                or scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
        raise ConfigError(f"config.json rope_scaling = {json.dumps(scaling)}: rope scaling is not reproduced")
    params = config.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"config.json rope_parameters = {json.dumps(params)}: expected a table")
    if params.get("rope_type", "default") != "default":
        raise ConfigError(f"config.json rope_parameters.rope_type = {json.dumps(params['rope_type'])}: "
                          "rope scaling is not reproduced")
    other = sorted(set(params) - {"rope_type", "rope_theta"})
    if other:  # partial_rotary_factor, per-layer-type tables, ...
        raise ConfigError(f"config.json rope_parameters.{other[0]}: only rope_type 'default' with "
                          "rope_theta is reproduced")
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("config.json partial_rotary_factor: partial rotary embeddings are not reproduced")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


# -- tensor names -------------------------------------------------------------------------

def _hf_name(name: str, family: str) -> str:
    if name == "lm_head.weight":
        return name
    if family == "gpt":
        return "transformer." + (f"h.{name.removeprefix('blocks.')}" if name.startswith("blocks.") else name)
    return "model." + name


def _our_name(hf: str, family: str) -> str:
    if hf == "lm_head.weight":
        return hf
    if family == "gpt":
        rest = hf.removeprefix("transformer.")
        return f"blocks.{rest.removeprefix('h.')}" if rest.startswith("h.") else rest
    return hf.removeprefix("model.")


def _is_conv1d(name: str, family: str) -> bool:
    return family == "gpt" and name.endswith(_GPT2_CONV1D)


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our full model's parameter names and shapes (built on the meta device: no memory)."""
    return {n: tuple(p.shape) for n, p in skeleton(cfg).named_parameters()}


def check_params(params: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """ConfigError unless `params` (our names) are exactly `cfg`'s parameters with their
    shapes, checked on the meta device: nothing is allocated, so a hostile config with
    shards that do not fit is refused before a model is built from it."""
    _check_names(params, cfg)


def _check_names(params: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    want = _shapes(cfg)
    for name in sorted(set(want) | set(params)):
        if name not in params:
            raise ConfigError(f"parameter {name} is missing for this model configuration")
        if name not in want:
            raise ConfigError(f"parameter {name} is not one of this model's")
        if tuple(params[name].shape) != want[name]:
            raise ConfigError(f"parameter {name} has shape {list(params[name].shape)}, "
                              f"the model needs {list(want[name])}")


def to_hf(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full model's parameters (its `named_parameters()`: a tied head is not among them)
    under transformers' names and layouts; ConfigError if they are not `cfg`'s model's."""
    _check_names(params, cfg)
    out = {}
    for name, t in params.items():
        out[_hf_name(name, cfg.family)] = t.t() if _is_conv1d(name, cfg.family) else t
    return out


def from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf`: a transformers state dict as our parameters. A tied head
    (`lm_head.weight` when `tie_embeddings`) and rotary tables (`inv_freq`) are dropped."""
    out = {}
    for hf, t in tensors.items():
        if _ignored(hf, cfg):
            continue
        name = _our_name(hf, cfg.family)
        out[name] = t.t() if _is_conv1d(name, cfg.family) else t
    _check_names(out, cfg)
    return out


def _ignored(hf: str, cfg: ModelConfig) -> bool:
    """Tensors a transformers checkpoint may hold that are no parameter of ours."""
    tied_head = isinstance(cfg, LlamaConfig) and cfg.tie_embeddings and hf == "lm_head.weight"
    gpt2_mask = cfg.family == "gpt" and hf.endswith((".attn.bias", ".attn.masked_bias"))  # old buffers
    return tied_head or gpt2_mask or hf.endswith("rotary_emb.inv_freq")


# -- starting from a Hugging Face directory -----------------------------------------------

def resolve_init(model: ModelConfig, base: Path) -> ModelConfig:
    """`model` with its `init` directory checked and its unset fields filled from the
    directory's config.json (relative paths are against `base`, the job file's directory;
    the result holds the absolute path). The fields the job set must agree with config.json
    and the weights (safetensors headers only) must be exactly our model's tensors.
    `seq_len`, the training context, may be shorter than config.json's
    max_position_embeddings (its value when unset). ConfigError, one line, for anything
    else; nothing is written."""
    if not isinstance(model, LlamaConfig) or model.init is None:  # gpt: never from a directory
        return model
    path = (Path(base) / Path(model.init).expanduser()).resolve()
    config = _read_config(path)
    hf_fields = model_fields_from_hf(config)
    explicit = {k: getattr(model, k) for k in model.model_fields_set}
    for key in _FROM_HF:
        if key in explicit:
            job, theirs = model.kv_heads if key == "n_kv_heads" else explicit[key], hf_fields[key]
            if job != theirs:
                raise ConfigError(f"model.{key}: the job says {json.dumps(job)}, "
                                  f"{path}/config.json says {json.dumps(theirs)}")
    limit = hf_fields.pop("seq_len")
    if "seq_len" in explicit and explicit["seq_len"] > limit:
        raise ConfigError(f"model.seq_len: the job says {explicit['seq_len']}, beyond "
                          f"{path}/config.json's max_position_embeddings {limit}")
    merged = {**hf_fields, "seq_len": limit, **explicit, "init": str(path)}
    try:
        resolved = ModelConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(f"{one_line(err, 'model', ModelConfig)} (with {path}/config.json)") from None
    _check_weights(path, resolved)
    return resolved


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ConfigError(f"model.init: no such directory: {path}")
    from trainer.bounded import read_json

    try:
        config = read_json(path / "config.json", "model.init:", limit=1 << 20)
    except FileNotFoundError:
        raise ConfigError(f"model.init: {path} has no config.json") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.init: {path}/config.json is not a JSON object")
    return config


def _weight_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (one file, or a sharded index)."""
    index = path / WEIGHTS_INDEX
    if index.is_file():
        try:
            from trainer.bounded import read_json

            weight_map = read_json(index, "model.init:")["weight_map"]
            files = {name: path / file for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"model.init: malformed {index}: {exc}") from None
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ConfigError(f"model.init: {index} names {file.name}, which is missing")
        return files
    single = path / WEIGHTS
    if not single.is_file():
        raise ConfigError(f"model.init: {path} has no {WEIGHTS} or {WEIGHTS_INDEX}")
    return {name: single for name in _header(single)}


def _header(file: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensor entries ({name: {dtype, shape, ...}}), read from its
    header alone: an 8-byte little-endian length, then that much JSON."""
    try:
        with open(file, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > min(_MAX_HEADER, os.fstat(fh.fileno()).st_size - 8):
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(fh.read(n))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model.init: {file} is not safetensors: {exc}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"model.init: {file} is not safetensors: the header is not an object")
    header.pop("__metadata__", None)
    return header


def _check_weights(path: Path, cfg: ModelConfig) -> None:
    files = _weight_files(path)
    have: dict[str, dict[str, Any]] = {}
    for file in sorted(set(files.values())):
        entries = _header(file)
        have.update({name: entries[name] for name in entries if files.get(name) == file})
    missing = sorted(set(files) - set(have))
    if missing:
        raise ConfigError(f"model.init: {missing[0]} is in {WEIGHTS_INDEX} but not in {files[missing[0]].name}")
    want = {_hf_name(n, cfg.family): s for n, s in _shapes(cfg).items()}
    if isinstance(cfg, LlamaConfig) and cfg.tie_embeddings and "lm_head.weight" in have:  # a tied head may be saved; it must fit
        want["lm_head.weight"] = (cfg.vocab_size, cfg.d_model)
    for name in sorted(want):
        if name not in have:
            raise ConfigError(f"model.init: {path} lacks tensor {name} (shape {list(want[name])})")
        entry = have[name]
        shape = tuple(entry.get("shape", ()))
        if shape != want[name]:
            raise ConfigError(f"model.init: tensor {name} has shape {list(shape)}, "
                              f"the model needs {list(want[name])}")
        if entry.get("dtype") not in _FLOAT_DTYPES:
            raise ConfigError(f"model.init: tensor {name} has dtype {entry.get('dtype')}, not a float type")
    extra = sorted(n for n in set(have) - set(want) if not _ignored(n, cfg))
    if extra:
        raise ConfigError(f"model.init: tensor {extra[0]} in {path} is not one of the model's")


@torch.no_grad()
def load_params(module: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy `params` (our names) into `module`'s parameters as float32: every parameter
    must be given with its shape, and nothing else (ConfigError naming the tensor)."""
    named = dict(module.named_parameters())
    for name in sorted(set(named) | set(params)):
        if name not in params:
            raise ConfigError(f"parameter {name} is missing")
        if name not in named:
            raise ConfigError(f"parameter {name} is not one of the model's")
        _copy_param(named[name], name, params[name])


def _copy_param(p: torch.Tensor, name: str, t: torch.Tensor) -> None:
    if p.shape != t.shape:
        raise ConfigError(f"parameter {name} has shape {list(t.shape)}, the model needs {list(p.shape)}")
    p.copy_(t.to(torch.float32))


@torch.no_grad()
def load_init_weights(module: nn.Module, init_dir: str) -> None:
    """Fill a llama pipeline stage (or the full model) from the Hugging Face directory
    `init_dir` (checked by `resolve_init`): only the tensors this stage holds are read, one
    at a time (`pread`, no mapping of the file), each copied into its parameter and let
    go, so the load holds the stage and one tensor of the file."""
    files = _weight_files(Path(init_dir))
    named = dict(module.named_parameters())
    wanted: dict[Path, dict[str, str]] = {}  # file -> {hf name: our name}
    for name in named:
        hf = _hf_name(name, "llama")
        if hf not in files:
            raise ConfigError(f"model.init: {init_dir} lacks tensor {hf}")
        wanted.setdefault(files[hf], {})[hf] = name
    for file, names in wanted.items():
        with safe_open(str(file), framework="pt", backend="pread") as fh:
            for hf, ours in names.items():
                _copy_param(named[ours], ours, fh.get_tensor(hf))


# -- exporting ----------------------------------------------------------------------------

def write_hf_dir(out: Path, cfg: ModelConfig, params: dict[str, torch.Tensor], lineage: dict[str, Any],
                 tokenizer: bytes | None = None) -> None:
    """Write a Hugging Face model directory at `out`: config.json, model.safetensors
    (transformers' names, float32, contiguous), generation_config.json, lineage.json
    (`lineage`, plus "tokenizer") and, with `tokenizer` (a tokenizer.json's bytes, as the run
    trained with), tokenizer.json and tokenizer_config.json, so `AutoTokenizer` loads it; a
    byte vocabulary ("tokenizer": "bytes") needs no tokenizer files, and none are written.
    `params` are the full model's (our names). `out` must not exist or be an empty
    directory; everything is written in a temporary directory renamed into place, so a
    failure leaves nothing behind."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty")
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in to_hf(params, cfg).items()}
    eos = _eos_id(tokenizer)
    files: dict[str, Any] = {
        "config.json": hf_config(cfg),
        "generation_config.json": {
            "bos_token_id": None, "eos_token_id": eos, "pad_token_id": None,
            "do_sample": True, "temperature": 0.8, "top_k": 50, "max_length": cfg.seq_len,
        },
        "lineage.json": {"tokenizer": "bytes" if tokenizer is None else "tokenizer.json", **lineage},
    }
    if tokenizer is not None:
        files["tokenizer_config.json"] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_len,
                                          **({"eos_token": EOS_TOKEN} if eos is not None else {})}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(dict(sorted(tensors.items())), str(tmp / WEIGHTS), metadata={"format": "pt"})
        if tokenizer is not None:
            (tmp / "tokenizer.json").write_bytes(tokenizer)  # byte for byte the file the run recorded
        for name, doc in files.items():
            (tmp / name).write_text(json.dumps(doc, indent=2) + "\n")
        os.rename(tmp, out)  # replaces an empty directory; refuses a non-empty one
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"cannot write {out}: {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


EOS_TOKEN = "<|endoftext|>"  # the document separator of the token files (trainer.dataset)


def _eos_id(tokenizer: bytes | None) -> int | None:
    """The id of `<|endoftext|>` among a tokenizer.json's added tokens, if it has one."""
    if tokenizer is None:
        return None
    try:
        added = json.loads(tokenizer).get("added_tokens", [])
    except (ValueError, AttributeError):
        raise ConfigError("the run's tokenizer.json is not JSON") from None
    return next((t["id"] for t in added if isinstance(t, dict) and t.get("content") == EOS_TOKEN), None)
