"""Tests for the trainer package: config validation, model split, data shards, and a real
multi-process DiLoCo run (marked slow) checked against the outer-step math.

    .venv/bin/pytest tests/test_trainer.py            # everything (~30-40 s on 2 cores)
    .venv/bin/pytest tests/test_trainer.py -m "not slow"
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from trainer import (
    ConfigError,
    DlxError,
    GenesisArtifacts,
    JobConfig,
    Progress,
    StepArtifacts,
    TrainingError,
    bytes_to_tensors,
    code_hash,
    load_job,
    tensors_to_bytes,
    train_local,
)
from trainer.config import DataConfig, ModelConfig, OuterConfig
from trainer.data import load_corpus
from trainer.diloco import apply_outer_step
from trainer.model import build_model, build_stage, stage_layers

BASE = {"name": "t", "outer": {"steps": 1, "inner_steps": 1}}


def job_dict(**sections: dict) -> dict:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


# --- config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"model": {"foo": 1}}, "model.foo: unknown key"),
        (
            {"outer": {"inner_steps": 0}},
            "outer.inner_steps: Input should be greater than or equal to 1",
        ),
        ({"parallel": {"stages": 5}}, "parallel.stages (5) exceeds model.n_layers (4)"),
        (
            {"data": {"batch_size": 6}},
            "data.batch_size (6) is not divisible by parallel.microbatches (4)",
        ),
        ({"model": {"vocab_size": 100}},
         "model.vocab_size (100) is smaller than the tokenizer's vocabulary (256"),
        ({"model": {"family": "llama", "n_heads": 4, "n_kv_heads": 3}},
         "model: n_heads (4) is not divisible by n_kv_heads (3)"),
        ({"model": {"family": "llama", "d_model": 30, "n_heads": 4}},
         "model: d_model (30) is not divisible by n_heads (4)"),
        ({"model": {"n_kv_heads": 2}}, "model: n_kv_heads is not a field of the gpt family"),
        ({"model": {"family": "llama", "mlp_ratio": 2}},
         "model: mlp_ratio is not a field of the llama family"),
        ({"model": {"init": "some/dir"}}, "model: init (a Hugging Face directory) needs family = 'llama'"),
        ({"model": {"family": "llama", "tie_embeddings": True}},
         "model.tie_embeddings needs parallel.stages = 1"),
        ({"model": {"dtype": "float16"}}, "model.dtype: Input should be 'float32' or 'bfloat16'"),
        ({"parallel": {"device": "tpu"}}, "parallel.device: Input should be 'auto', 'cpu' or 'cuda'"),
        (
            {"model": {"d_model": 30, "n_heads": 4}},
            "model: d_model (30) is not divisible by n_heads (4)",
        ),
        (
            {"parallel": {"schedule": "zigzag"}},
            "parallel.schedule: Input should be '1F1B' or 'GPipe'",
        ),
        ({"name": "has space"}, "name: String should match pattern"),
    ],
)
def test_config_errors_name_the_field(sections: dict, expected: str) -> None:
    data = job_dict(**{k: v for k, v in sections.items() if k != "name"})
    if "name" in sections:
        data["name"] = sections["name"]
    with pytest.raises(ConfigError) as info:
        load_job(data)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message
    assert isinstance(info.value, DlxError) and isinstance(info.value, ValueError)


def test_config_unknown_top_level_section_and_missing_outer() -> None:
    with pytest.raises(ConfigError, match=r"^chain: unknown section"):
        load_job(job_dict(chain={"rpc": "x"}))
    with pytest.raises(ConfigError, match=r"^outer: Field required"):
        load_job({"name": "t"})
    with pytest.raises(ConfigError, match="expected a table"):
        load_job(["not", "a", "dict"])  # type: ignore[arg-type]


def test_config_subclass_with_extra_sections() -> None:
    class ChainConfig(BaseModel):
        model_config = ConfigDict(extra="forbid")
        rpc: str = "embedded"

    class FullJob(JobConfig):
        chain: ChainConfig = ChainConfig()

    job = load_job(job_dict(chain={"rpc": "http://x"}), FullJob)
    assert isinstance(job, FullJob) and job.chain.rpc == "http://x"
    with pytest.raises(ConfigError, match=r"^chain.bogus: unknown key"):
        load_job(job_dict(chain={"bogus": 1}), FullJob)
    with pytest.raises(ConfigError, match=r"parallel.stages \(5\) exceeds"):
        load_job(job_dict(parallel={"stages": 5}), FullJob)


def test_canonical_json_is_sorted_compact_and_stable() -> None:
    a = load_job(job_dict(model={"d_model": 64}))
    b = load_job({"outer": {"inner_steps": 1, "steps": 1}, "model": {"d_model": 64}, "name": "t"})
    assert a.canonical_json() == b.canonical_json()
    text = a.canonical_json().decode()
    assert " " not in text and text.startswith('{"data":')


# --- model -------------------------------------------------------------------------


def test_stage_layers_split_evenly_earlier_stages_first() -> None:
    assert [len(stage_layers(5, s, 3)) for s in range(3)] == [2, 2, 1]
    assert [list(stage_layers(4, s, 2)) for s in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        stage_layers(2, 0, 3)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_stages_cover_all_params_once_and_chain_to_full_forward(stages: int) -> None:
    cfg = ModelConfig(d_model=32, n_layers=3, n_heads=2, seq_len=16)
    full = build_model(cfg, seed=7)
    parts = [build_stage(cfg, s, stages, seed=7) for s in range(stages)]
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())
    assert len(names) == len(set(names))
    full_params = dict(full.named_parameters())
    for part in parts:
        for n, p in part.named_parameters():
            assert torch.equal(p, full_params[n]), n
    x = torch.randint(0, cfg.vocab_size, (2, 16))  # (B, T)
    h = x
    for part in parts:
        h = part(h)
    assert h.shape == (2, 16, cfg.vocab_size)
    assert torch.equal(h, full(x))


def test_build_stage_is_deterministic_and_leaves_global_rng_alone() -> None:
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_stage(cfg, 0, 2, seed=1)
    after = torch.rand(1)
    b = build_stage(cfg, 0, 2, seed=1)
    assert torch.equal(before, after)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# --- data --------------------------------------------------------------------------

SMALL_DATA = DataConfig(max_bytes=300_000)


def test_shards_are_deterministic_and_differ_across_replicas_and_steps() -> None:
    corpus = load_corpus(SMALL_DATA)
    a = corpus.shard(0, 0, 1, 3, 4, 32)
    b = corpus.shard(0, 0, 1, 3, 4, 32)
    assert a.tokens.shape == (3, 4, 33) and a.tokens.dtype == torch.int64
    assert torch.equal(a.tokens, b.tokens) and a.digest == b.digest and len(a.digest) == 32
    others = [
        corpus.shard(0, 1, 1, 3, 4, 32),
        corpus.shard(0, 0, 2, 3, 4, 32),
        corpus.shard(1, 0, 1, 3, 4, 32),
    ]
    for other in others:
        assert not torch.equal(a.tokens, other.tokens)
        assert a.digest != other.digest


def test_eval_files_are_disjoint_from_train_files_and_corpus_is_capped() -> None:
    corpus = load_corpus(SMALL_DATA)
    assert corpus.eval_files and corpus.train_files
    assert not set(corpus.eval_files) & set(corpus.train_files)
    assert corpus.train.numel() + corpus.eval.numel() <= SMALL_DATA.max_bytes
    assert len(corpus.digest) == 64
    batches = corpus.eval_batches(2, 4, 32)
    assert batches.shape == (2, 4, 33) and torch.equal(batches, corpus.eval_batches(2, 4, 32))
    assert int(batches.max()) < 256


def test_default_corpus_loads_fast_once_cached() -> None:
    load_corpus(DataConfig())
    start = time.perf_counter()
    corpus = load_corpus(DataConfig())
    assert time.perf_counter() - start < 0.1
    assert corpus.train.numel() > 1_000_000


def test_files_source_reads_user_globs(tmp_path) -> None:
    for i in range(6):
        (tmp_path / f"f{i}.txt").write_bytes(bytes([65 + i]) * 2000)
    corpus = load_corpus(
        DataConfig(source="files", paths=[str(tmp_path / "*.txt")], eval_fraction=0.2)
    )
    assert len(corpus.train_files) + len(corpus.eval_files) == 6 and corpus.eval_files
    with pytest.raises(ConfigError, match="data.paths: no files match"):
        load_corpus(DataConfig(source="files", paths=[str(tmp_path / "*.nope")]))


# --- artifacts ---------------------------------------------------------------------


def test_safetensors_bytes_are_sorted_and_deterministic() -> None:
    t = {"b": torch.arange(3.0), "a": torch.ones(2, 2)}
    data = tensors_to_bytes(t)
    assert data == tensors_to_bytes(dict(reversed(list(t.items()))))
    back = bytes_to_tensors(data)
    assert list(back) == ["a", "b"] and torch.equal(back["b"], t["b"])
    assert len(code_hash()) == 32 and code_hash() == code_hash()


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]


@st.composite
def _tensor_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    # "__metadata__" names safetensors' own header entry: not a tensor name even the library reads back
    names = draw(st.lists((st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12)
                           | st.sampled_from(["param/h.0.w", "delta/emb", "ü", 'q"x', "b\\s"]))
                          .filter(lambda name: name != "__metadata__"), max_size=6, unique=True))
    out = {}
    for name in names:
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        dtype = draw(st.sampled_from(_DTYPES))
        raw = draw(st.binary(min_size=0, max_size=0)) if 0 in shape else None
        t = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size(),),
                          dtype=torch.uint8, generator=torch.Generator().manual_seed(len(out)))
        t = t.view(dtype)[: torch.Size(shape).numel()].reshape(shape) if raw is None else torch.empty(shape, dtype=dtype)
        out[name] = t
    return out


@settings(max_examples=150, deadline=None)
@given(_tensor_dicts())
def test_tensor_bytes_are_the_safetensors_librarys_bytes(tensors: dict[str, torch.Tensor]) -> None:
    """trainer.tensorbytes writes and reads safetensors itself (one copy, not three): its
    bytes must be the library's, and what it reads back the library's tensors, bit for bit."""
    from safetensors.torch import load, save

    from trainer import tensorbytes

    data = tensorbytes.encode(tensors)
    assert data == save(tensors)
    ours, theirs = tensorbytes.decode(data), load(data)
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape
        assert ours[name].reshape(-1).view(torch.uint8).tolist() == t.reshape(-1).view(torch.uint8).tolist()
        if t.numel():
            ours[name].reshape(-1)[0] = ours[name].reshape(-1)[-1]  # writable, and not the caller's bytes
    assert data == save(tensors)


@settings(max_examples=60, deadline=None)
@given(_tensor_dicts())
def test_tensor_bytes_written_to_a_file_are_encodes_bytes(tensors: dict[str, torch.Tensor]) -> None:
    """`tensorbytes.write` streams a rank's state into a file tensor by tensor: the file
    holds exactly `encode`'s bytes, and `index` reads its layout back."""
    import tempfile

    from trainer import tensorbytes

    data = tensorbytes.encode(tensors)
    with tempfile.TemporaryFile() as fh:
        assert tensorbytes.write(tensors, fh.fileno()) == len(data)
        fh.seek(0)
        assert fh.read() == data
    start, layout = tensorbytes.index(data, len(data))
    for name, t in tensors.items():
        dtype, shape, begin, end = layout[name]
        assert (dtype, shape) == (t.dtype, list(t.shape)) and end - begin == t.numel() * t.element_size()
        assert data[start + begin: start + end] == bytes(t.reshape(-1).view(torch.uint8).numpy())


def test_spilled_bytes_reach_the_launcher_as_the_same_bytes(tmp_path) -> None:
    """A rank's spilled start state (`Spill`, a `Blob`) pickled through a multiprocessing
    queue arrives as the very bytes `tensors_to_bytes` gives, its file link removed on
    arrival; pickled between ranks (torch.distributed's object collectives) it stays a Blob
    of its own link; each Blob's file goes with it. `StoredTensors` reads tensors back one
    at a time from either form."""
    import gc
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from trainer.artifacts import Blob, Spill, StoredTensors

    g = torch.Generator().manual_seed(0)
    tensors = {"param/w": torch.randn(7, 5, generator=g), "param/b": torch.randn(5, generator=g),
               "inner/exp_avg/w": torch.randn(7, 5, generator=g), "round/outer_step": torch.tensor([3])}
    data = tensors_to_bytes(tensors)
    blob = Spill(str(tmp_path)).tensors(tensors)
    assert len(blob) == len(data) and blob.read() == data
    assert pickle.loads(ForkingPickler.dumps(blob)) == data  # what the launcher's sink receives
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(blob.path)]  # the link is gone
    other = pickle.loads(pickle.dumps(blob))
    assert isinstance(other, Blob) and other.path != blob.path and other.read() == data
    for source in (data, blob):
        params = StoredTensors(source, "param/")
        assert sorted(params) == ["b", "w"]
        assert all(torch.equal(params[n], tensors[f"param/{n}"]) for n in params)
    del blob, other, source, params
    gc.collect()
    assert not list(tmp_path.iterdir())


def test_a_spill_directory_left_by_a_killed_process_goes_with_the_next(tmp_path, monkeypatch) -> None:
    """A launcher killed outright cannot remove its spill directory: the next one of the
    same kind removes those whose process is gone, and leaves the live ones."""
    import subprocess
    import sys
    import tempfile

    from trainer.artifacts import spill_directory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"dlx-spill-{int(gone.stdout)}-x"
    live = tmp_path / f"dlx-spill-{os.getpid()}-y"
    other = tmp_path / f"dlx-replay-{int(gone.stdout)}-z"
    for d in (dead, live, other):
        d.mkdir()
        (d / "state").write_bytes(b"x")
    with spill_directory("spill") as new:
        assert os.path.isdir(new) and not dead.exists() and live.exists() and other.exists()
    assert not os.path.exists(new)


@pytest.mark.parametrize("data", [
    b"", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",  # too short; an empty header is fine
    (16).to_bytes(8, "little") + b'{"a":1}         ',  # an entry that is no tensor
    (64).to_bytes(8, "little") + b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}          ' + bytes(8),
    (64).to_bytes(8, "little") + b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}          ' + bytes(8),
    (72).to_bytes(8, "little") + b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32",'
    b'"shape":[1],"data_offsets":[0,4]}}' + bytes(4),
    (64).to_bytes(8, "little") + b' {"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}         ' + bytes(4),
    (64).to_bytes(8, "little") + b'{"a":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}}          ' + bytes(4),
])
def test_tensor_bytes_leave_malformed_input_to_the_library(data: bytes) -> None:
    from safetensors.torch import load

    from trainer import tensorbytes

    try:
        expected = load(data)
    except Exception:  # the library's verdict, as the project's one-line error (exit 2)
        with pytest.raises(tensorbytes.TensorBytesError, match="^not safetensors: "):
            tensorbytes.decode(data)
    else:
        got = tensorbytes.decode(data)
        assert sorted(got) == sorted(expected) and all(torch.equal(got[k], expected[k]) for k in got)


# --- multi-process runs ------------------------------------------------------------

SMALL_JOB = {
    "name": "small",
    "seed": 3,
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
    "parallel": {"replicas": 2, "stages": 2, "microbatches": 2},
    "data": {"batch_size": 4, "eval_batches": 2, "max_bytes": 300_000},
    "inner": {"warmup": 2},
    "outer": {"steps": 2, "inner_steps": 3},
}


class RecordingSink:
    def __init__(self) -> None:
        self.genesis: GenesisArtifacts | None = None
        self.steps: list[StepArtifacts] = []
        self.progress: list[Progress] = []

    def on_genesis(self, genesis: GenesisArtifacts) -> None:
        self.genesis = genesis

    def on_step(self, step: StepArtifacts) -> None:
        self.steps.append(step)

    def on_progress(self, progress: Progress) -> None:
        self.progress.append(progress)


@pytest.fixture(scope="module")
def two_runs() -> tuple[RecordingSink, RecordingSink]:
    job = load_job(SMALL_JOB)
    sinks = (RecordingSink(), RecordingSink())
    for sink in sinks:
        train_local(job, sink, timeout_s=120)
    return sinks


@pytest.mark.slow
def test_train_local_reports_genesis_steps_and_slots_in_order(two_runs) -> None:
    sink = two_runs[0]
    R, S = 2, 2
    assert sink.genesis is not None and [s.stage for s in sink.genesis.stages] == [0, 1]
    for shard in sink.genesis.stages:
        tensors = bytes_to_tensors(shard.data)
        assert all(not v.any() for k, v in tensors.items() if k.startswith("momentum/"))
        assert all(v.dtype == torch.float32 for v in tensors.values())
    assert [s.step for s in sink.steps] == [1, 2]
    for step in sink.steps:
        assert [s.stage for s in step.stages] == list(range(S))
        assert [(c.replica, c.stage) for c in step.contributions] == [
            (r, s) for r in range(R) for s in range(S)
        ]
        for c in step.contributions:
            assert len(c.data_shard) == 32 and c.loss > 0
            assert all(k.startswith("delta/") for k in bytes_to_tensors(c.data))
        # All stages of one replica saw the same data and report the same loss.
        for r in range(R):
            mine = step.contributions[r * S : (r + 1) * S]
            assert len({c.data_shard for c in mine}) == 1 and len({c.loss for c in mine}) == 1
        assert step.contributions[0].data_shard != step.contributions[S].data_shard
        for key in ("eval_loss", "train_loss", "tokens", "inner_steps", "wall_s"):
            assert key in step.metrics
    assert sink.steps[-1].metrics["inner_steps"] == 6
    assert sink.steps[-1].metrics["tokens"] == 2 * 3 * 2 * 4 * 32
    # Every inner step is reported once, in order, with its lr and a rate (S = 2: in batches).
    assert [(p.outer_step, p.inner_step, p.outer_steps, p.inner_steps) for p in sink.progress] == [
        (t, h, 2, 3) for t in (1, 2) for h in (1, 2, 3)]
    assert all(p.lr > 0 and p.tokens_per_s > 0 and p.eta_s >= 0 and p.loss > 0 for p in sink.progress)
    assert sink.progress[-1].eta_s == 0 and sink.progress[-1].global_step == 6


@pytest.mark.slow
def test_outer_step_reproduces_from_genesis_and_contributions(two_runs) -> None:
    """theta_1 = NesterovSGD(theta_0, grad = mean_r delta_r): bit for bit the float64
    formula docs/FORMATS.md writes out (the outer arithmetic), and within a float32
    rounding of torch.optim.SGD's float32 step."""
    sink = two_runs[0]
    outer = OuterConfig(**SMALL_JOB["outer"])
    R, S = 2, 2
    lr, mu = outer.lr, outer.momentum
    assert sink.genesis is not None
    for s in range(S):
        genesis = bytes_to_tensors(sink.genesis.stages[s].data)
        deltas = [bytes_to_tensors(sink.steps[0].contributions[r * S + s].data) for r in range(R)]
        names = [k.removeprefix("param/") for k in genesis if k.startswith("param/")]
        params = {n: genesis[f"param/{n}"].clone() for n in names}
        sgd = torch.optim.SGD(list(params.values()), lr=lr, momentum=mu, nesterov=True, foreach=False)
        expected = {}
        for n, p in params.items():
            sgd.state[p]["momentum_buffer"] = genesis[f"momentum/{n}"].clone()
            p.grad = (deltas[0][f"delta/{n}"] + deltas[1][f"delta/{n}"]) / R
            g = p.grad.double()
            b = genesis[f"momentum/{n}"].double() * mu + g
            expected[f"param/{n}"] = (p.detach().double() - (g + b * mu) * lr).float()
            expected[f"momentum/{n}"] = b.float()
        sgd.step()
        assert tensors_to_bytes(expected) == sink.steps[0].stages[s].data
        for n, p in params.items():
            assert torch.allclose(expected[f"param/{n}"], p, rtol=1e-6, atol=1e-7), n
        # The packaged verifier helper agrees for every step.
        parent = sink.genesis.stages[s].data
        for step in sink.steps:
            contributions = [step.contributions[r * S + s].data for r in range(R)]
            assert apply_outer_step(parent, contributions, outer) == step.stages[s].data
            parent = step.stages[s].data


@pytest.mark.slow
def test_two_runs_give_identical_bytes(two_runs) -> None:
    a, b = two_runs
    assert a.genesis == b.genesis
    for x, y in zip(a.steps, b.steps, strict=True):
        assert x.stages == y.stages
        assert x.contributions == y.contributions
        assert x.metrics["eval_loss"] == y.metrics["eval_loss"]


@pytest.mark.slow
def test_rank_failure_becomes_one_line_training_error() -> None:
    # Windows longer than the held-out text: every rank fails while loading eval batches.
    bad = {
        **SMALL_JOB,
        "model": {**SMALL_JOB["model"], "seq_len": 512},
        "data": {**SMALL_JOB["data"], "max_bytes": 20_000},
    }
    with pytest.raises(
        TrainingError, match=r"^rank \d+ failed: ConfigError: data: corpus part has"
    ) as info:
        train_local(load_job(bad), RecordingSink(), timeout_s=120)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_killed_rank_is_named_as_the_cause_not_its_peers_echoes() -> None:
    class Killer(RecordingSink):
        def on_progress(self, progress: Progress) -> None:
            for child in multiprocessing.active_children():
                if child.name == "dlx-rank-1":
                    os.kill(child.pid, signal.SIGKILL)

    job = load_job({**SMALL_JOB, "outer": {"steps": 2, "inner_steps": 10}})
    with pytest.raises(
        TrainingError, match=r"^rank 1 failed: process exited with code -9 \(SIGKILL\)$"
    ):
        train_local(job, Killer(), timeout_s=120)
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("dlx-rank")]


@pytest.mark.slow
def test_sink_exception_stops_the_ranks_and_propagates() -> None:
    class Boom(RecordingSink):
        def on_genesis(self, genesis: GenesisArtifacts) -> None:
            raise KeyError("sink broke")

    with pytest.raises(KeyError, match="sink broke"):
        train_local(load_job(SMALL_JOB), Boom(), timeout_s=120)


@pytest.mark.slow
def test_three_stage_gpipe_matches_the_unsplit_model() -> None:
    """A 1x3 GPipe pipeline (a middle stage, p2p eval through it) trains like 1x1."""

    def eval_losses(parallel: dict) -> list[float]:
        job = load_job(
            {**SMALL_JOB, "model": {**SMALL_JOB["model"], "n_layers": 3}, "parallel": parallel}
        )
        sink = RecordingSink()
        train_local(job, sink, timeout_s=120)
        assert [(c.replica, c.stage) for c in sink.steps[0].contributions] == [
            (0, s) for s in range(parallel["stages"])
        ]
        return [s.metrics["eval_loss"] for s in sink.steps]

    piped = eval_losses({"replicas": 1, "stages": 3, "microbatches": 2, "schedule": "GPipe"})
    whole = eval_losses({"replicas": 1, "stages": 1, "microbatches": 2})
    assert piped == pytest.approx(whole, rel=1e-5)
    assert piped[-1] < piped[0]


def test_a_job_for_the_queue_may_have_more_than_16_ranks() -> None:
    """The paper ran 160 GPUs; only a local run caps ranks (trainer.launch.check_local)."""
    job = load_job(job_dict(parallel={"replicas": 40, "stages": 4}))
    assert job.world_size == 160
