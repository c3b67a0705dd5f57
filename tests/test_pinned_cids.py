"""The same job and seed give the same weights, byte for byte, across refactors: the stage
shards and contributions of tests/conftest.py's small job are pinned by CID. (The
checkpoint manifests themselves also link the config block, which holds the trainer's
code hash, so they change with any edit to trainer/; the shards and contributions hold
only tensors.) A change that moves one of these CIDs changes what training computes, or
how it is stored: it must say so, and update the pins on purpose.

The job runs with the math libraries held to their portable code paths (`PORTABLE`:
PyTorch's own kernels unvectorised, MKL in its conditional-numerical-reproducibility
mode, oneDNN at SSE4.1): by default each library picks kernels by the CPU's instruction
set (AVX2, AVX-512, AMX), and different kernels round differently. That is not the
whole story: the pins made on one AVX-512 machine (2026-12-02) did not match on a
Sapphire Rapids one (AVX-512 FP16, AMX) from the same training code, and none of the
settings tried there (each library's instruction-set cap, thread counts, glibc's hwcaps)
gave the old values back. So the pins are those of the CI machine. On a new CPU, run
`python tests/test_pinned_cids.py` (it prints the pins of the checkout's code) at the
commit that last set them; where that commit gives the new values too, the machine moved
them, not the code, and they may be re-pinned from it."""

from __future__ import annotations

import pytest
from conftest import train_small

from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.manifest import get_manifest

PINNED_SHARDS = {  # step -> the stage shards' CIDs
    1: ["bafkreig2lmtupzockxdz2t24a22gdl7zgk2xkbylzyeukogur4fz66y7a4", "bafkreif6gcw3l24ytdxoqsm42gayki3gf5urkz6gwf3ikjjnxevbef5s5q"],
    2: ["bafkreiay7r4woawt7khco4kyxhhrz5xustmcurdhnzysgpctey5h7fgh6u", "bafkreigmodbuoluyoieavqsg3zhqdrdikkmf652skabon3e47m5imfis2u"],
    3: ["bafkreianz2vyrjnvfxm7lpn5sktwlq4ldlw5gmk32olqi5x7ofql34po3m", "bafkreiaejoylyj4sooolvqpvavhyz2knvhgw4bt6g572etumkqoa2zbuc4"],
}
PINNED_CONTRIBUTIONS = {  # step -> [replica][stage] contribution CIDs
    1: [
        ["bafkreicifwn6c4jdta63g57nvwwawd7zwq74ygnlsb76jd5elhz3no75de", "bafkreialrgx7rsov36iprf7x4obrmzkxoutnnsqiac3e3ho6ddjzuncwsi"],
        ["bafkreie7w2dv237d6wyiz3aywvnd4al3gcjb3ekrvjumntdx2x3gkdowvi", "bafkreic7rizvuqp7ea2vgpnwe6c7upxinncgv4cx5btc47r7gqwo3u45vu"],
    ],
    2: [
        ["bafkreic37trxebw4rg5tblgeh3qvtiarsabmdwlba5ijrghd2qdxsotv2m", "bafkreihnlyugygqd6ig6uhgnknglzyvaku5f4agtirniuiaqbhbj7ofc5e"],
        ["bafkreid4i26wlxxfaqvqbu43254yvzoj5nb5jk27vmcj4l27badkpaikyy", "bafkreibgjd475x45xk3d7jbgzjwv4hlu3pzcm2idfum6vpzm25mjjej3ea"],
    ],
    3: [
        ["bafkreihct7exrbq2yx2dabxwftao2ryzhjlwq6s2dlhvceoybl4s6zy3ri", "bafkreidhmpgcxnpob3wmmvej6tl52lhxslbius64vqr3fxrla63n5rnquy"],
        ["bafkreidsmdzoz2o3rekstwfgzz5tl7wgbjwappjlbej2maa5f7c4owbueq", "bafkreiffdxvr5fufpuiw7mgrorw2wzqrw4ki63fm6p6omygf72cmb4q72i"],
    ],
}


def _history(run_dir):
    store = Blockstore(run_dir / "blocks")
    m = get_manifest(store, RunRecord.load(run_dir).head)
    out = {}
    while m.parent is not None:
        out[m.step] = m
        m = get_manifest(store, m.parent)
    return out


PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}


@pytest.fixture(scope="module")
def portable_run(tmp_path_factory):
    run_dir, _ = train_small(tmp_path_factory.mktemp("pinned"), env=PORTABLE)
    return run_dir


@pytest.mark.slow
def test_the_small_job_gives_the_pinned_shards_and_contributions(portable_run):
    pins = _pins(portable_run)
    assert pins["PINNED_SHARDS"] == PINNED_SHARDS
    assert pins["PINNED_CONTRIBUTIONS"] == PINNED_CONTRIBUTIONS


def _pins(run_dir) -> dict[str, dict]:
    history = _history(run_dir)
    return {"PINNED_SHARDS": {t: [str(c) for c in m.stages] for t, m in sorted(history.items())},
            "PINNED_CONTRIBUTIONS": {t: [[str(c) for c in row] for row in m.contributions]
                                     for t, m in sorted(history.items())}}


if __name__ == "__main__":  # print the pins this checkout's code gives on this machine
    import pprint
    import sys
    import tempfile
    from pathlib import Path

    pins = _pins(train_small(Path(tempfile.mkdtemp()), env=PORTABLE)[0])
    for name, table in pins.items():  # Python literals: the tables above, integer steps
        sys.stdout.write(f"{name} = {pprint.pformat(table, width=160)}\n")
