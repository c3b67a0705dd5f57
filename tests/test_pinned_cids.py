"""The same job and seed give the same weights, byte for byte, across refactors: the stage
shards and contributions of tests/conftest.py's small job are pinned by CID. (The
checkpoint manifests themselves also link the config block, which holds the trainer's
code hash, so they change with any edit to trainer/; the shards and contributions hold
only tensors.) A change that moves one of these CIDs changes what training computes, or
how it is stored: it must say so, and update the pins on purpose.

The job runs with the math libraries held to their portable code paths (`PORTABLE`:
PyTorch's own kernels unvectorised, MKL in its conditional-numerical-reproducibility
mode, oneDNN at SSE4.1), so the pins hold on any x86-64 machine: by default each library
picks kernels by the CPU's instruction set (AVX2, AVX-512), and different kernels round
differently."""

from __future__ import annotations

import pytest
from conftest import train_small

from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.manifest import get_manifest

PINNED_SHARDS = {  # step -> the stage shards' CIDs
    1: ["bafkreihhq44jodgg7wlyy6q2626bgx3zrfujpa335xkniizk453qi2lphu", "bafkreigqflz3czf6zyowpcr2l6c6ir5cx4xksployslirhxwaqvszpv2se"],
    2: ["bafkreibpcnnmz76ysv72a2g4n22k3vkah6sebpkf34lon7dvrr4grwuquq", "bafkreianorvov3vc63yq6fx23uruvbemf3akljzc2rjxksa5n5tupeg4ke"],
    3: ["bafkreid6ljraby2nkvsix2hskvlr4hhqc65kwxfjpei6qi2xttxuht62au", "bafkreiaucicrdzkhihokfwv277p32p36dcvbicids3ekuf5r2chj6ehsue"],
}
PINNED_CONTRIBUTIONS = {  # step -> [replica][stage] contribution CIDs
    1: [
        ["bafkreiewxcgsoqoekfjw6nwzdqwlf5humfnyqsiwwvvxwcsmtp2cyl5fja", "bafkreihdiken7gxoqhfw25c7cnzo6kpzym5pqysqzdqh46x2o6w2kd2bxi"],
        ["bafkreic7z5yry4275ghzwiqpfos7ppjyonxjwrp5nge62sudvtv7nipsya", "bafkreicg7nqhr5x6tccs5a5tkemli4la5h356c635ryhvgty57rsxixrbm"],
    ],
    2: [
        ["bafkreidlawnpufsyjmqrh3w6m2qtowtl7y3y7ni45jyp373i43lfx6sapy", "bafkreiayuqdjlkcq32etzpl5vzouxb5onpearib4hfsmdx4q56cigt5qqe"],
        ["bafkreibwmq2a636w75aixpi7ktfe4dpa4sdxcrjy5rdhx6yfwritjaqiue", "bafkreihaizmyfo3iqubrtsr76zudqqrs4nr2rssdnwnrqgcll4u3ap3mtm"],
    ],
    3: [
        ["bafkreicypjkcjxyesci2nuw4oua5je3jkl5dpxieskewgut7i3gj26hw2e", "bafkreidsgv47xhyvfppumhholcowwt2qamispsdpiwacgitxytfc7gtmbu"],
        ["bafkreihovykzrifbspq7nh6j3mcbrimq7qafxywufxq3ahgspnmw2cmaba", "bafkreidjwmlxiieyj7izez7u42ams3jgontgxwi7ykmgtsildtto7l3joa"],
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
    run_dir = portable_run
    history = _history(run_dir)
    shards = {t: [str(c) for c in m.stages] for t, m in sorted(history.items())}
    contributions = {t: [[str(c) for c in row] for row in m.contributions] for t, m in sorted(history.items())}
    assert shards == PINNED_SHARDS
    assert contributions == PINNED_CONTRIBUTIONS
