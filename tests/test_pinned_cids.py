"""The same job and seed give the same weights across refactors, checked two ways on
tests/conftest.py's small job:

- everywhere: what three outer steps did to each stage's weights (the norm of
  theta_3 - theta_0 and its projection on a fixed random direction) and each step's
  losses, within 1e-4 of the pinned figures. Rounding differences between CPUs move these
  by about 1e-6 (measured between this library's vectorised and portable kernels on one
  machine); any change to what training computes moves them by far more;
- on a CPU whose pins are recorded: the stage shards and contributions, by CID, byte for
  byte. (The checkpoint manifests themselves also link the config block, which holds the
  trainer's code hash, so they change with any edit to trainer/; shards and contributions
  hold only tensors.)

A change that moves either changes what training computes, or how it is stored: it must
say so, and update the pins on purpose.

The job runs with the math libraries held to their portable code paths (`PORTABLE`:
PyTorch's own kernels unvectorised, MKL in its conditional-numerical-reproducibility
mode, oneDNN at SSE4.1). That is not enough for the CIDs: pins made on three machines
(an AVX-512 Xeon, a Sapphire Rapids Xeon with AVX-512 FP16 and AMX, an AMD EPYC) from the
same training code all differed, and no setting of those libraries, thread counts or
glibc's hwcaps tried made them agree. So the CID pins are per CPU, keyed by an
arithmetic fingerprint: a hash of the outputs of a fixed probe (matmuls, GELU, softmax,
layer norm, cross entropy and an AdamW-style update at the small job's shapes, under the
same settings), written here and not in trainer/, so no change to the trainer moves it.
On a CPU with no recorded pins the CID test is skipped and says so; run
`python tests/test_pinned_cids.py` (it prints the fingerprint and the pins of the
checkout's code) at the commit that last set the pins, and add them under that
fingerprint."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import train_small

from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.manifest import get_manifest
from lineage.store.unixfs import read_bytes
from trainer.artifacts import bytes_to_tensors

PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}

# stage -> (|theta_3 - theta_0|, (theta_3 - theta_0) . v) over the stage's parameters in
# sorted name order, v ~ N(0, 1) from torch.Generator seed 0, in float64
PINNED_MOTION = [(2.8928764888875853, 0.9514940664562195), (4.426109919018449, 3.2891517189497637)]
PINNED_LOSSES = {  # step -> (train_loss, eval_loss)
    1: (5.440170168876648, 5.170418739318848),
    2: (4.948920905590057, 4.565205335617065),
    3: (4.282162547111511, 3.936518669128418),
}
MOTION_RTOL = LOSS_RTOL = 1e-4

PINS = {  # arithmetic fingerprint -> {"shards": step -> CIDs, "contributions": step -> [replica][stage]}
    "bf6827342f09119c": {  # AMD EPYC (Zen 4, AVX-512 with BF16), torch 2.13.0 CPU; pinned 2026-12-03
        "shards": {
            1: ["bafkreihhq44jodgg7wlyy6q2626bgx3zrfujpa335xkniizk453qi2lphu", "bafkreigqflz3czf6zyowpcr2l6c6ir5cx4xksployslirhxwaqvszpv2se"],
            2: ["bafkreibpcnnmz76ysv72a2g4n22k3vkah6sebpkf34lon7dvrr4grwuquq", "bafkreianorvov3vc63yq6fx23uruvbemf3akljzc2rjxksa5n5tupeg4ke"],
            3: ["bafkreid6ljraby2nkvsix2hskvlr4hhqc65kwxfjpei6qi2xttxuht62au", "bafkreiaucicrdzkhihokfwv277p32p36dcvbicids3ekuf5r2chj6ehsue"],
        },
        "contributions": {
            1: [["bafkreiewxcgsoqoekfjw6nwzdqwlf5humfnyqsiwwvvxwcsmtp2cyl5fja", "bafkreihdiken7gxoqhfw25c7cnzo6kpzym5pqysqzdqh46x2o6w2kd2bxi"],
                ["bafkreic7z5yry4275ghzwiqpfos7ppjyonxjwrp5nge62sudvtv7nipsya", "bafkreicg7nqhr5x6tccs5a5tkemli4la5h356c635ryhvgty57rsxixrbm"]],
            2: [["bafkreidlawnpufsyjmqrh3w6m2qtowtl7y3y7ni45jyp373i43lfx6sapy", "bafkreiayuqdjlkcq32etzpl5vzouxb5onpearib4hfsmdx4q56cigt5qqe"],
                ["bafkreibwmq2a636w75aixpi7ktfe4dpa4sdxcrjy5rdhx6yfwritjaqiue", "bafkreihaizmyfo3iqubrtsr76zudqqrs4nr2rssdnwnrqgcll4u3ap3mtm"]],
            3: [["bafkreicypjkcjxyesci2nuw4oua5je3jkl5dpxieskewgut7i3gj26hw2e", "bafkreidsgv47xhyvfppumhholcowwt2qamispsdpiwacgitxytfc7gtmbu"],
                ["bafkreihovykzrifbspq7nh6j3mcbrimq7qafxywufxq3ahgspnmw2cmaba", "bafkreidjwmlxiieyj7izez7u42ams3jgontgxwi7ykmgtsildtto7l3joa"]],
        },
    },
    "41e644a7ce906c67": {  # Intel Xeon (family 6 model 167, AVX-512 with AMX), torch 2.13.0 CPU; pinned 2026-12-03
        "shards": {
            1: ["bafkreig2lmtupzockxdz2t24a22gdl7zgk2xkbylzyeukogur4fz66y7a4", "bafkreif6gcw3l24ytdxoqsm42gayki3gf5urkz6gwf3ikjjnxevbef5s5q"],
            2: ["bafkreiay7r4woawt7khco4kyxhhrz5xustmcurdhnzysgpctey5h7fgh6u", "bafkreigmodbuoluyoieavqsg3zhqdrdikkmf652skabon3e47m5imfis2u"],
            3: ["bafkreianz2vyrjnvfxm7lpn5sktwlq4ldlw5gmk32olqi5x7ofql34po3m", "bafkreiaejoylyj4sooolvqpvavhyz2knvhgw4bt6g572etumkqoa2zbuc4"],
        },
        "contributions": {
            1: [["bafkreicifwn6c4jdta63g57nvwwawd7zwq74ygnlsb76jd5elhz3no75de", "bafkreialrgx7rsov36iprf7x4obrmzkxoutnnsqiac3e3ho6ddjzuncwsi"],
                ["bafkreie7w2dv237d6wyiz3aywvnd4al3gcjb3ekrvjumntdx2x3gkdowvi", "bafkreic7rizvuqp7ea2vgpnwe6c7upxinncgv4cx5btc47r7gqwo3u45vu"]],
            2: [["bafkreic37trxebw4rg5tblgeh3qvtiarsabmdwlba5ijrghd2qdxsotv2m", "bafkreihnlyugygqd6ig6uhgnknglzyvaku5f4agtirniuiaqbhbj7ofc5e"],
                ["bafkreid4i26wlxxfaqvqbu43254yvzoj5nb5jk27vmcj4l27badkpaikyy", "bafkreibgjd475x45xk3d7jbgzjwv4hlu3pzcm2idfum6vpzm25mjjej3ea"]],
            3: [["bafkreihct7exrbq2yx2dabxwftao2ryzhjlwq6s2dlhvceoybl4s6zy3ri", "bafkreidhmpgcxnpob3wmmvej6tl52lhxslbius64vqr3fxrla63n5rnquy"],
                ["bafkreidsmdzoz2o3rekstwfgzz5tl7wgbjwappjlbej2maa5f7c4owbueq", "bafkreiffdxvr5fufpuiw7mgrorw2wzqrw4ki63fm6p6omygf72cmb4q72i"]],
        },
    },
}


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


def probe() -> str:
    """The arithmetic fingerprint of this CPU, torch build and environment (see the module
    docstring): the small job's kinds of kernels at its shapes, hashed."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    outs = []
    x = r(4 * 32, 32).requires_grad_()
    w1, w2, wo = r(128, 32).requires_grad_(), r(32, 128).requires_grad_(), r(256, 32).requires_grad_()
    h = torch.nn.functional.layer_norm(x, (32,))
    h = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(h, w1)), w2)
    q, k = r(4, 2, 32, 16), r(4, 2, 32, 16)
    att = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
    loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, wo), torch.arange(128) % 256)
    loss.backward()
    outs += [h.detach(), att, loss.detach(), x.grad, w1.grad, w2.grad, wo.grad]
    m, v = w1.grad.mul(0.1), w1.grad.square().mul(0.001)
    outs.append(w1.detach().sub(m.div(v.sqrt().add(1e-8)), alpha=3e-3))
    digest = hashlib.sha256(torch.__version__.encode())
    for t in outs:
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def fingerprint() -> str:
    """`probe()` in a fresh process under PORTABLE, as the job's ranks run."""
    import os

    res = subprocess.run([sys.executable, __file__, "--fingerprint"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **PORTABLE}, check=True)
    return res.stdout.strip()


@pytest.fixture(scope="module")
def portable_run(tmp_path_factory):
    run_dir, _ = train_small(tmp_path_factory.mktemp("pinned"), env=PORTABLE)
    return run_dir


@pytest.mark.slow
def test_the_small_job_moves_the_weights_as_pinned(portable_run):
    for stage, (got, want) in enumerate(zip(_motion(portable_run), PINNED_MOTION, strict=True)):
        assert got[0] == pytest.approx(want[0], rel=MOTION_RTOL), f"stage {stage}: |theta_3 - theta_0|"
        # the projection's rounding noise scales with the motion, not with the projection
        assert abs(got[1] - want[1]) <= MOTION_RTOL * want[0], f"stage {stage}: projection {got[1]} != {want[1]}"
    assert _losses(portable_run) == {t: pytest.approx(v, rel=LOSS_RTOL) for t, v in PINNED_LOSSES.items()}


@pytest.mark.slow
def test_the_small_job_gives_the_pinned_shards_and_contributions(portable_run):
    key = fingerprint()
    if key not in PINS:
        pytest.skip(f"no CID pins for this CPU (fingerprint {key}): `python {Path(__file__).name}` prints them")
    assert _pins(portable_run) == PINS[key]


def test_the_fingerprint_is_a_function_of_the_machine():
    """The key is stable on one machine and sees the kernels: the default (vectorised)
    code paths give another value than the portable ones on any CPU with AVX2."""
    import os

    assert fingerprint() == fingerprint()
    default = subprocess.run([sys.executable, __file__, "--fingerprint"], capture_output=True, text=True,
                             timeout=120, check=True,
                             env={k: v for k, v in os.environ.items() if k not in PORTABLE}).stdout.strip()
    assert len(default) == 16 and default != fingerprint()


if __name__ == "__main__":
    if sys.argv[1:] == ["--fingerprint"]:
        print(probe())
        raise SystemExit(0)
    import pprint
    import tempfile

    run_dir = train_small(Path(tempfile.mkdtemp()), env=PORTABLE)[0]
    sys.stdout.write(f"# fingerprint {fingerprint()}\n")
    sys.stdout.write(f"PINS entry = {pprint.pformat(_pins(run_dir), width=160)}\n")
    sys.stdout.write(f"PINNED_MOTION = {_motion(run_dir)!r}\n")
    sys.stdout.write(f"PINNED_LOSSES = {pprint.pformat(_losses(run_dir))}\n")
