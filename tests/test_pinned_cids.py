"""The same job and seed give the same weights, byte for byte, across refactors: the stage
shards and contributions of tests/conftest.py's small job are pinned by CID. (The
checkpoint manifests themselves also link the config block, which holds the trainer's
code hash, so they change with any edit to trainer/; the shards and contributions hold
only tensors.) A change that moves one of these CIDs changes what training computes, or
how it is stored: it must say so, and update the pins on purpose."""

from __future__ import annotations

import pytest

from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.manifest import get_manifest

PINNED_SHARDS = {  # step -> the stage shards' CIDs
    1: ["bafkreibaixa2uk43fh37fm3qdm3clxem3o3t4ds2agn4cbo3asdi3ydway", "bafkreicsdrjt6f6fr2v6jiqn6yentmh2z7n73xebcje3nxlqhrogps6ts4"],
    2: ["bafkreihqjkr7s3hwd4kvpsfp7dbtunfjuyk3ucmucsiqhsmvv74hotzwt4", "bafkreicamsfxjpu766dakzm5pdgbhz4ebp7vtlwyb6wss2dyr7i6yezidu"],
    3: ["bafkreihxe7z7jxf6vaqtzgnovgoybt5aa4lb3asus6via2cp4gzqqj7mz4", "bafkreiegdjvxukxmnkuhvsg5emwudiky22k725ames6fovuurmidxa43ei"],
}
PINNED_CONTRIBUTIONS = {  # step -> [replica][stage] contribution CIDs
    1: [
        ["bafkreiefqurcnbffs7r2ju3myh7r4sp67d7icxm2zgesaaenw7bvoqvuqe", "bafkreidwwdfrolzwu2hwgihytatnzbmk6epveebvvswtqykc53xmrobk2u"],
        ["bafkreiaa4xzkm4xbvb2h6ts6zzmb3xs6vywfn3l72tt5ds7ymewvnqwsoi", "bafkreick5lqy7dnkilmbq4e5pljmc53uoqux6n3j2xlgjehiuckwivxyhi"],
    ],
    2: [
        ["bafkreigordojkp4vvdzqbe2bcu5oroqvvzo2hqhpthf6l54mm3zhip3xua", "bafkreif5byvqe5srofxyxxglapcxlvex5nkas5eljrgoyz5xdjakeno3wi"],
        ["bafkreid66flupx3s6zarql4nqua2f2dyioddovxmmoqvlntv4q222apn7y", "bafkreic4676j6fxdlpffuegs6n4v5cnflo4t2bwvvamc7apr5ooi2imq6m"],
    ],
    3: [
        ["bafkreigjymnwjfdykmib3zlon2aoqd4egb4ronux5vnhrcvc6ejmhys26q", "bafkreifmyohkysbebc577cntex46ghbkvthips6eostk4zgkf5byfmzxkm"],
        ["bafkreiengvbw6gtoto63x33dcwtwhmhkiq2uyl2h4t2phmkddhf7imik7i", "bafkreif7tju6uqb262jcfb2vnmp5fumtfu2jrdoprjrzip6rs4mpjjeu7y"],
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


@pytest.mark.slow
def test_the_small_job_gives_the_pinned_shards_and_contributions(trained_run):
    run_dir, _ = trained_run
    history = _history(run_dir)
    shards = {t: [str(c) for c in m.stages] for t, m in sorted(history.items())}
    contributions = {t: [[str(c) for c in row] for row in m.contributions] for t, m in sorted(history.items())}
    assert shards == PINNED_SHARDS
    assert contributions == PINNED_CONTRIBUTIONS
