"""The `dlx` CLI as a user meets it: help everywhere, fast, and one-line errors (exit 2)
for bad job files, with nothing started and no run directory written."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

DLX = str(Path(sys.executable).parent / "dlx")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny.toml"


def dlx(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


@pytest.mark.parametrize("cmd", [[], ["train"], ["lineage"], ["verify"]])
def test_every_command_answers_help(cmd):
    res = dlx(*cmd, "--help")
    assert res.returncode == 0, res.stderr
    assert "Usage" in res.stdout


def test_top_level_help_is_fast():
    dlx("--help")  # warm the file cache
    start = time.perf_counter()
    res = dlx("--help")
    assert res.returncode == 0
    assert time.perf_counter() - start < 2.0


BAD_JOBS = {
    "unknown_key": ("[outer]\nsteps = 2\ninner_steps = 3\nbogus = 1\n", "outer.bogus: unknown key"),
    # the typo first, naming the key it misses, then what it leaves missing
    "near_miss_key": ("[outer]\nsteps = 2\ninner_step = 4\n",
                      "outer.inner_step: unknown key (did you mean inner_steps?); outer.inner_steps: Field required"),
    # every problem, unknown keys first, on one line
    "every_problem": ("[model]\nd_model = '128'\n[inner]\nlrr = 1\n[outer]\nsteps = 2\ninner_steps = 3\n",
                      "inner.lrr: unknown key (did you mean lr?); model.d_model: Input should be a valid integer "
                      '(got "128")'),
    "h_zero": ("[outer]\nsteps = 2\ninner_steps = 0\n", "outer.inner_steps"),
    "stages_exceed_layers": (
        "[model]\nn_layers = 2\n[parallel]\nstages = 3\nmicrobatches = 4\n[outer]\nsteps = 2\ninner_steps = 3\n",
        "parallel.stages",
    ),
    "invalid_toml": ("[outer\nsteps = 2\n", "invalid TOML"),
    "wrong_type": ("[outer]\nsteps = \"many\"\ninner_steps = 3\n", "outer.steps"),
    "quorum_above_arbiters": (
        "[outer]\nsteps = 2\ninner_steps = 3\n[chain]\narbiters = ['0x70997970C51812dc3A010C7d01b50e0d17dc79C8']\n"
        "quorum = 2\n",
        "quorum must be between 1 and 1",
    ),
    "unknown_section": ("[outer]\nsteps = 2\ninner_steps = 3\n[chian]\nrpc = 'x'\n",
                        "chian: unknown section (did you mean chain?)"),
    "vocab_below_tokenizer": ("[model]\nvocab_size = 100\n[outer]\nsteps = 2\ninner_steps = 3\n",
                              "model.vocab_size (100) is smaller than the tokenizer's vocabulary"),
    "kv_heads_do_not_divide": (
        "[model]\nfamily = 'llama'\nn_heads = 4\nn_kv_heads = 3\n[outer]\nsteps = 2\ninner_steps = 3\n",
        "n_heads (4) is not divisible by n_kv_heads (3)"),
    "cuda_without_gpu": ("[parallel]\ndevice = 'cuda'\n[outer]\nsteps = 2\ninner_steps = 3\n",
                         "parallel.device = 'cuda' but this machine has 0 GPUs for 4 ranks"),
    "too_many_local_ranks": ("[parallel]\nreplicas = 33\nstages = 2\n[outer]\nsteps = 2\ninner_steps = 3\n",
                             "the most a local run starts on one machine"),
    "too_big_for_memory": ("[model]\nd_model = 16384\nn_layers = 48\nn_heads = 64\n[outer]\nsteps = 2\n"
                           "inner_steps = 3\n", "GiB of memory"),
    "density_zero": ("[outer]\nsteps = 2\ninner_steps = 3\n[outer.compression]\nkind = 'sparse'\ndensity = 0\n",
                     "outer.compression.density: must be in (0, 1] (got 0"),
    "density_above_one": ("[outer.compression]\nkind = 'sparse'\ndensity = 1.5\n[outer]\nsteps = 2\ninner_steps = 3\n",
                          "outer.compression.density: must be in (0, 1] (got 1.5"),
    "gaps_without_two_bits": ("[outer]\nsteps = 2\ninner_steps = 3\n[outer.compression]\nkind = 'quantize'\n"
                              "coding = 'gaps'\n",
                              "outer.compression: coding = 'gaps' needs kind = 'quantize' and bits = 2 "
                              "(kind is 'quantize', bits 8)"),
    "unknown_overlap_rule": ("[outer]\nsteps = 2\ninner_steps = 3\ndelay = 1\noverlap = 'lazy'\n",
                             "outer.overlap: Input should be 'partial', 'eager' or 'restart'"),
    "alpha_above_one": ("[outer]\nsteps = 2\ninner_steps = 3\ndelay = 1\nalpha = 1.5\n",
                        "outer.alpha: must be in [0, 1] (got 1.5)"),
    "tau_above_h": ("[outer]\nsteps = 2\ninner_steps = 3\ndelay = 1\ntau = 4\n",
                    "tau (4) must be in [0, inner_steps = 3]"),
    "tau_negative": ("[outer]\nsteps = 2\ninner_steps = 3\ndelay = 1\ntau = -1\n",
                     "tau (-1) must be in [0, inner_steps = 3]"),
    "overlap_without_delay": ("[outer]\nsteps = 2\ninner_steps = 3\noverlap = 'eager'\n",
                              "overlap needs delay = 1"),
    "tau_without_partial": ("[outer]\nsteps = 2\ninner_steps = 3\ndelay = 1\noverlap = 'restart'\ntau = 2\n",
                            'tau is a setting of overlap = "partial"'),
    "fragments_zero": ("[outer]\nsteps = 2\ninner_steps = 3\ndelay = 1\nfragments = 0\n", "outer.fragments"),
    "fragments_without_delay": ("[outer]\nsteps = 2\ninner_steps = 3\nfragments = 2\n",
                                "fragments needs delay = 1"),
    "fragments_without_partial": ("[outer]\nsteps = 2\ninner_steps = 3\ndelay = 1\noverlap = 'eager'\nfragments = 2\n",
                                  'fragments is a setting of overlap = "partial"'),
    "fragments_above_blocks": ("[model]\nn_layers = 4\n[parallel]\nstages = 2\nmicrobatches = 2\n[outer]\nsteps = 2\n"
                               "inner_steps = 3\ndelay = 1\nfragments = 3\n",
                               "outer.fragments (3) exceeds the blocks per stage (2"),
    "init_without_dir": ("[model]\nfamily = 'llama'\ninit = 'no-such-dir'\n[outer]\nsteps = 2\ninner_steps = 3\n",
                         "no-such-dir"),
}


@pytest.mark.parametrize("case", sorted(BAD_JOBS))
def test_a_bad_job_file_is_one_line_exit_2_and_writes_nothing(tmp_path, case):
    body, needle = BAD_JOBS[case]
    job = tmp_path / "job.toml"
    job.write_text('name = "bad"\n' + body)
    run_dir = tmp_path / "run"
    res = dlx("train", str(job), "--run-dir", str(run_dir), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert needle in lines[0]
    assert "Traceback" not in res.stderr
    assert not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml"]


def test_a_missing_job_file_is_one_line_exit_2(tmp_path):
    res = dlx("train", str(tmp_path / "nope.toml"), cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.strip() == f"dlx: error: job file not found: {tmp_path / 'nope.toml'}"
    assert list(tmp_path.iterdir()) == []


def test_a_non_empty_run_dir_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("x")
    res = dlx("train", str(EXAMPLE), "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 2
    assert "not empty" in res.stderr
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["keep.txt"]


def test_lineage_of_a_directory_that_is_no_run_is_one_line(tmp_path):
    res = dlx("lineage", "--run-dir", str(tmp_path))
    assert res.returncode == 2
    assert "not a run directory" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_example_job_file_is_valid():
    from workers.run.jobfile import load_job_file

    job = load_job_file(EXAMPLE)
    assert job.parallel.replicas == 2 and job.parallel.stages == 2
    assert job.outer.steps >= 4
    for path in sorted(EXAMPLE.parent.glob("*.toml")):  # every example loads
        assert load_job_file(path).name, path
    slow = load_job_file(EXAMPLE.parent / "slow-link.toml")
    assert (slow.outer.inner_steps, slow.outer.fragments, slow.outer.compression.coding, slow.transport.link) == (
        25, 2, "gaps", "simulated")
