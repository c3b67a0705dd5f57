"""The same job and seed give the same weights across refactors and across machines,
checked on tests/conftest.py's small job two ways:

- native numerics (`parallel.numerics = "native"`, PyTorch's kernels for this CPU): what
  three outer steps did to each stage's weights (the norm of theta_3 - theta_0 and its
  projection on a fixed random direction) and each step's losses, within 1e-4 of the
  pinned figures. Rounding differences between CPUs move these by about 1e-6; any change
  to what training computes moves them by far more. Native runs are not pinned by CID:
  three CPUs (two Xeons, an AMD EPYC) gave three sets of CIDs from the same code, and no
  setting of the math libraries made them agree;
- portable numerics (`parallel.numerics = "portable"`, trainer/portable.py): the stage
  shards and contributions by CID, byte for byte, pinned once: the same on every CPU, and
  trained again here under other kernels (`OTHER_KERNELS`) to the same CIDs. (The
  checkpoint manifests also link the config block, which holds the trainer's code hash,
  and the round-start states, which hold the trainer's kernel fingerprint: they change with
  any edit to trainer/ and with the machine; shards and contributions hold only tensors.)

A change that moves either changes what training computes, or how it is stored: it must
say so, and update the pins on purpose: `python tests/test_pinned_cids.py` prints them."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import small_job_toml, train_small

from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.manifest import get_manifest
from lineage.store.unixfs import read_bytes
from trainer.artifacts import bytes_to_tensors

#: Kernels unlike this machine's own: PyTorch's unvectorised kernels, MKL at SSE4.2, one thread.
OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OMP_NUM_THREADS": "1"}

# stage -> (|theta_3 - theta_0|, (theta_3 - theta_0) . v) over the stage's parameters in
# sorted name order, v ~ N(0, 1) from torch.Generator seed 0, in float64
PINNED_MOTION = [(2.8928764888875853, 0.9514940664562195), (4.426109919018449, 3.2891517189497637)]
PINNED_LOSSES = {  # step -> (train_loss, eval_loss)
    1: (5.440170168876648, 5.170418739318848),
    2: (4.948920905590057, 4.565205335617065),
    3: (4.282162547111511, 3.936518669128418),
}
MOTION_RTOL = LOSS_RTOL = 1e-4

#: The portable run's stage shards and contributions (step -> CIDs; [replica][stage]), the
#: same on every machine. Pinned 2026-12-04 on an AMD EPYC (AVX2), checked there under
#: OTHER_KERNELS, on aarch64 (qemu: scripts/arm64_replay recomputes these shards and
#: replays these contributions byte for byte), on an AMD EPYC with AVX-512 and on an Intel
#: Xeon with AVX-512 and AMX (12-05; each trained it again: the same CIDs).
#: scripts/gpu_check does the same between an H200 and CPUs.
PORTABLE_PINS = {"contributions": {1: [["bafkreid6se4yoyhuksvb44yg67636g6zmivfdsbhkujyh2xm7jnfvp3iba", "bafkreic5iq6im5vr5y26r7z4molmhqzzul2xv6q4xpiu34pcahseif4ooi"],
                       ["bafkreibm75leb5yvgv42apnv4323hf2m442keutuaatfds7lnfwnttf3ii", "bafkreiema57guz5usbafku6av7iksfiicfvp4eqwco7jduj4elotykwtgm"]],
                   2: [["bafkreih2mor44et2lsa2mba4lxhwsmahapiz6vsnt6pc5dkj6xzd7p6use", "bafkreid2ejiccogmz47bgpmuwwkpuabk5znpjtii2mmiprf7ufd5vfcjeu"],
                       ["bafkreidmbhjw5477rmcbvwvufwwqox7z3wetgtymv6np7kedntqqmo3qfa", "bafkreidy6emin4vgll2jnip4e3wfht5ufrp5bshz23v7r6lncwad7argeu"]],
                   3: [["bafkreicn27b6totj7kjm6q3row6kl7g7mfd77fpn7nn6d4ocqkuoul5pvq", "bafkreiee5whk7jjvew3qhdludi3hgs3tg2xm2uqaabfqefmv5xsf3k5tvu"],
                       ["bafkreib5acrkwfxotdpthl3aninq5kk7p2vwxkrjqc2yklrcjp5jfagv74", "bafkreib7ncdukaaobjz5dvb3d4f7nqbqkj3fv6yijjdkxtlzxuwqqtgwta"]]},
 "shards": {1: ["bafkreid7dy5f6d42xjw2yubvdk7zeqzdzg23uvxsktfzovqyrf25vwewce", "bafkreihw27pexagseojehormganjlv5a37p7vja6nklqgbtqzq5bx4wzfi"],
            2: ["bafkreiehge4n5w43kskujwq5w43ba7hoz53r2uylptsursglpyclzvlxda", "bafkreiemsnwobb2muc257v4mf742nfwf42dwld2nbjdswervzs3raoi4b4"],
            3: ["bafkreihuyfayrdtbshyuw4wiik5eesyw7xl3dqnhm63d47sg4brkvgcvwm", "bafkreie4vum4qjg5uyvw2jycpggvvd5qxi3uoc5kqnujagvzgb53wbimpy"]}}


def portable_job() -> str:
    return small_job_toml("e2e").replace("microbatches = 2", 'microbatches = 2\nnumerics = "portable"')


def _history(run_dir):
    """(blockstore, manifests from genesis to head)."""
    store = Blockstore(run_dir / "blocks")
    m = get_manifest(store, RunRecord.load(run_dir).head)
    out = [m]
    while m.parent is not None:
        m = get_manifest(store, m.parent)
        out.append(m)
    return store, out[::-1]


def _pins(run_dir) -> dict[str, dict]:
    _, history = _history(run_dir)
    steps = history[1:]
    return {"shards": {m.step: [str(c) for c in m.stages] for m in steps},
            "contributions": {m.step: [[str(c) for c in row] for row in m.contributions] for m in steps}}


@torch.no_grad()
def _motion(run_dir) -> list[tuple[float, float]]:
    store, history = _history(run_dir)
    out = []
    for c0, c1 in zip(history[0].stages, history[-1].stages, strict=True):
        a, b = bytes_to_tensors(read_bytes(store, c0)), bytes_to_tensors(read_bytes(store, c1))
        d = torch.cat([(b[k].double() - a[k].double()).flatten() for k in sorted(a) if k.startswith("param/")])
        v = torch.randn(d.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        out.append((d.norm().item(), (d @ v).item()))
    return out


def _losses(run_dir) -> dict[int, tuple[float, float]]:
    _, history = _history(run_dir)
    return {m.step: (m.metrics["train_loss"], m.metrics["eval_loss"]) for m in history[1:]}


@pytest.fixture(scope="module")
def native_run(tmp_path_factory):
    run_dir, _ = train_small(tmp_path_factory.mktemp("pinned"))
    return run_dir


def _train_portable(root: Path, env: dict[str, str] | None = None) -> Path:
    return train_small(root, env=env, job=portable_job())[0]


@pytest.mark.slow
def test_the_small_job_moves_the_weights_as_pinned(native_run):
    for stage, (got, want) in enumerate(zip(_motion(native_run), PINNED_MOTION, strict=True)):
        assert got[0] == pytest.approx(want[0], rel=MOTION_RTOL), f"stage {stage}: |theta_3 - theta_0|"
        # the projection's rounding noise scales with the motion, not with the projection
        assert abs(got[1] - want[1]) <= MOTION_RTOL * want[0], f"stage {stage}: projection {got[1]} != {want[1]}"
    assert _losses(native_run) == {t: pytest.approx(v, rel=LOSS_RTOL) for t, v in PINNED_LOSSES.items()}


@pytest.mark.slow
def test_a_portable_run_gives_the_pinned_shards_and_contributions(tmp_path):
    assert _pins(_train_portable(tmp_path)) == PORTABLE_PINS


@pytest.mark.slow
def test_a_portable_run_under_other_kernels_gives_the_same_cids(tmp_path):
    assert _pins(_train_portable(tmp_path, OTHER_KERNELS)) == PORTABLE_PINS


if __name__ == "__main__":
    import pprint

    native = train_small(Path(tempfile.mkdtemp()))[0]
    portable = _train_portable(Path(tempfile.mkdtemp()))
    sys.stdout.write(f"PINNED_MOTION = {_motion(native)!r}\n")
    sys.stdout.write(f"PINNED_LOSSES = {pprint.pformat(_losses(native))}\n")
    sys.stdout.write(f"PORTABLE_PINS = {pprint.pformat(_pins(portable), width=160)}\n")
