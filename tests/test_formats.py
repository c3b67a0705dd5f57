"""docs/FORMATS.md, checked: each worked example is recomputed from the fixtures with the
rules the document states and independent tools only (hashlib, keccak from eth_hash,
secp256k1 recovery from eth_keys, the `dag_cbor` and `multiformats` libraries to decode,
torch for the generator and the outer step the document names), never with this
project's code; the cross-checks at the end then hold the live code to the same values.

The examples are the document's fenced blocks whose info string is ``json example:NAME``,
so the document cannot drift from what is checked. The fixtures (tests/data/formats/) are
the real output of ``tests/data/formats/regenerate.py``: the job ``tests/data/formats/job.toml``
(2 replicas x 2 stages, ``min_replicas = 1``, 2 outer steps, low-rank 4-bit compression)
trained on the dataset directory of five small text files beside it, copied to
/tmp/fmt/dataset (the job's ``[data] dir``, recorded in the config block), and committed by
``dlx train``'s sink, its second step over replica 1 alone (an elastic run's partial step):
some of its blocks, laid out as the blockstore lays them out, and what its chain recorded
(chain.json: the events, the `commitStep` call, the step record). A change of any format
fails here on purpose: regenerate the run and the examples together (that script), and say why.

    .venv/bin/pytest tests/test_formats.py -q
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import dag_cbor
import numpy as np
import pytest
import torch
from eth_hash.auto import keccak
from eth_keys import keys
from multiformats import CID

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "FORMATS.md"
DATA = Path(__file__).resolve().parent / "data" / "formats"
BLOCKS = DATA / "blocks"

RAW, DAG_PB, DAG_CBOR = 0x55, 0x70, 0x71
CHUNK = 262_144


# -- reading the document and the fixtures -------------------------------------------------

def examples() -> dict[str, Any]:
    """Every ``json example:NAME`` block of FORMATS.md, parsed, by name."""
    text = DOC.read_text()
    found = re.findall(r"^```json example:([\w-]+)\n(.*?)^```$", text, flags=re.S | re.M)
    return {name: json.loads(body) for name, body in found}


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return examples()


def chain() -> dict[str, Any]:
    """What the run's chain recorded (events, the commitStep call, the step record)."""
    return json.loads((DATA / "chain.json").read_text())


def unhex(text: str) -> bytes:
    return bytes.fromhex(text.removeprefix("0x"))


# -- CIDs and the blockstore layout, as FORMATS.md section 1 states them -------------------

def cid_text(codec: int, data: bytes) -> str:
    """CIDv1 of `data` under `codec` with sha2-256, in base32 (multibase prefix 'b')."""
    binary = bytes([1, codec, 0x12, 0x20]) + hashlib.sha256(data).digest()
    return "b" + base64.b32encode(binary).decode().rstrip("=").lower()


def cid_binary(text: str) -> bytes:
    """The binary form of a base32 CIDv1."""
    body = text[1:].upper()
    return base64.b32decode(body + "=" * (-len(body) % 8))


def block_path(cid: str) -> str:
    """Where the blockstore keeps block `cid`, relative to its root."""
    return f"{cid[-3:-1]}/{cid}"


def block(cid: str) -> bytes:
    data = (BLOCKS / block_path(cid)).read_bytes()
    codec = cid_binary(cid)[1]
    assert cid_text(codec, data) == cid, f"fixture block {cid} does not hash to its name"
    return data


def file_bytes(cid: str) -> bytes:
    """A UnixFS file of at most one chunk: its single raw block."""
    assert cid_binary(cid)[1] == RAW, f"{cid} is not a one-chunk file"
    return block(cid)


def dag_json(value: Any) -> Any:
    """A decoded DAG-CBOR value in DAG-JSON's shape: links {"/": cid}, bytes {"/": {"bytes": b64}}."""
    if isinstance(value, CID):
        return {"/": str(CID("base32", 1, value.codec, value.digest))}
    if isinstance(value, bytes):
        return {"/": {"bytes": base64.b64encode(value).decode().rstrip("=")}}
    if isinstance(value, dict):
        return {k: dag_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [dag_json(v) for v in value]
    return value


def from_dag_json(value: Any) -> Any:
    """Inverse of `dag_json`, for re-encoding a documented node."""
    if isinstance(value, dict) and set(value) == {"/"}:
        inner = value["/"]
        if isinstance(inner, str):
            return CID.decode(inner)
        b64 = inner["bytes"]
        return base64.b64decode(b64 + "=" * (-len(b64) % 4))
    if isinstance(value, dict):
        return {k: from_dag_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_dag_json(v) for v in value]
    return value


def digest(cid: str) -> str:
    """The 0x-hex sha2-256 digest inside a CID: what the ledger stores."""
    return "0x" + cid_binary(cid)[4:].hex()


# -- safetensors, contributions and the outer step ------------------------------------------

_NP = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "I64": "<i8", "U8": "u1"}


def safetensors(data: bytes) -> tuple[list[str], dict[str, np.ndarray]]:
    """(header keys in header order, tensors by name) of a safetensors blob."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, entry in header.items():
        lo, hi = entry["data_offsets"]
        out[name] = np.frombuffer(body[lo:hi], dtype=_NP[entry["dtype"]]).reshape(entry["shape"])
    return list(header), out


def dequantize(packed: np.ndarray, scale: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """b-bit values, 8/b per byte, low bits first; value = (u - (2**(b-1)-1)) * row scale
    (1 bit: (2u - 1) * scale)."""
    per = 8 // bits
    u = (packed[:, :, None].astype(np.int32) >> (np.arange(per) * bits)) & (2**bits - 1)
    u = u.reshape(packed.shape[0], -1)[:, :cols].astype(np.float32)
    if bits == 1:
        return (u * 2 - 1) * scale[:, None]
    return (u - np.float32(2 ** (bits - 1) - 1)) * scale[:, None]


def decode_payload(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One parameter's pseudo-gradient from a contribution (codecs none, 1 and 2)."""
    if f"delta/{name}" in tensors:
        return tensors[f"delta/{name}"]
    codec, bits, rank = (int(v) for v in tensors[f"meta/{name}"][:3])
    m, n = (1, shape[0]) if len(shape) == 1 else (shape[0], int(np.prod(shape[1:])))
    if codec == 1:
        out = dequantize(tensors[f"q/{name}"], tensors[f"q_scale/{name}"], bits, n)
    else:
        assert codec == 2, f"{name}: codec {codec} is not decoded here"
        u = dequantize(tensors[f"u/{name}"], tensors[f"u_scale/{name}"], bits, m)
        v = dequantize(tensors[f"v/{name}"], tensors[f"v_scale/{name}"], bits, n)
        assert u.shape[0] == v.shape[0] == rank
        out = np.zeros((m, n), dtype=np.float32)
        for k in range(rank):
            out += u[k][:, None] * v[k][None, :]
    return out.reshape(shape)


def outer_step(parent: bytes, contributions: list[bytes], lr: float, mu: float) -> dict[str, torch.Tensor]:
    """The new shard's tensors: mean of the decoded contributions in replica order, then
    torch.optim.SGD's single-tensor Nesterov update, written out as FORMATS.md states it."""
    _, shard = safetensors(parent)
    payloads = [safetensors(c)[1] for c in contributions]
    out = {}
    for key in sorted(k for k in shard if k.startswith("param/")):
        name = key.removeprefix("param/")
        p = torch.tensor(shard[key])
        buf = torch.tensor(shard[f"momentum/{name}"])
        deltas = [torch.from_numpy(decode_payload(t, name, p.shape).copy()) for t in payloads]
        grad = deltas[0].clone()
        for d in deltas[1:]:
            grad.add_(d)
        grad.div_(len(deltas))
        buf.mul_(mu).add_(grad, alpha=1)
        grad = grad.add(buf, alpha=mu)
        p.add_(grad, alpha=-lr)
        out[key], out[f"momentum/{name}"] = p, buf
    return out


# -- data: the token file and the shard draw ----------------------------------------------

def is_eval(key: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(b"eval-split:" + key.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def dataset_files() -> list[str]:
    root = DATA / "dataset"
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def token_file(fraction: float) -> tuple[bytes, list[str], list[str]]:
    """The byte tokenizer's token file (uint16 little-endian), training then held-out files."""
    files = dataset_files()
    held = [f for f in files if is_eval(f, fraction)]
    if not held:
        held = [min(files, key=lambda f: hashlib.sha256(f.encode()).digest())]
    train = [f for f in files if f not in held]
    ids = b"".join((DATA / "dataset" / f).read_bytes() for f in train + held)
    return np.frombuffer(ids, dtype=np.uint8).astype("<u2").tobytes(), train, held


def derive_seed(*parts: object) -> int:
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1


def shard_tokens(train: np.ndarray, seed: int, replica: int, step: int,
                 H: int, B: int, T: int) -> tuple[int, torch.Tensor]:
    """(the generator seed, the (H, B, T + 1) token ids) replica `replica` trains on for `step`."""
    s = derive_seed("shard", seed, replica, step)
    g = torch.Generator().manual_seed(s)
    tokens = torch.from_numpy(train.astype(np.int64))
    starts = torch.randint(0, tokens.numel() - (T + 1) + 1, (H * B,), generator=g)
    windows = tokens[starts[:, None] + torch.arange(T + 1)]
    return s, windows.view(H, B, T + 1)


# -- UnixFS directories (dag-pb), hand-encoded ---------------------------------------------

def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def pb_bytes(field: int, data: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(data)) + data


def directory(entries: list[tuple[str, str, int]]) -> bytes:
    """A UnixFS Directory node: links (Hash, Name, Tsize) sorted by name bytes, then Data."""
    links = b"".join(
        pb_bytes(2, pb_bytes(1, cid_binary(cid)) + pb_bytes(2, name.encode()) + varint(3 << 3) + varint(size))
        for name, cid, size in sorted(entries, key=lambda e: e[0].encode()))
    return links + pb_bytes(1, b"\x08\x01")


def tree_cid(path: Path) -> tuple[str, int, dict[str, str]]:
    """(CID, Tsize, the hex of every directory block by CID) of a directory on disk."""
    entries, blocks = [], {}
    for child in sorted(path.iterdir()):
        if child.is_dir():
            cid, size, sub = tree_cid(child)
            blocks.update(sub)
        else:
            data = child.read_bytes()
            assert len(data) <= CHUNK, "the fixture's files are one chunk each"
            cid, size = cid_text(RAW, data), len(data)
        entries.append((child.name, cid, size))
    node = directory(entries)
    cid = cid_text(DAG_PB, node)
    blocks[cid] = node.hex()
    return cid, len(node) + sum(size for _, _, size in entries), blocks


# -- code hash ----------------------------------------------------------------------------

def code_hash(files: dict[str, bytes]) -> bytes:
    h = hashlib.sha256()
    for rel in sorted(files):
        name, blob = rel.encode(), files[rel]
        h.update(len(name).to_bytes(4, "big") + name + len(blob).to_bytes(8, "big") + blob)
    return h.digest()


# -- EIP-712 -------------------------------------------------------------------------------

DOMAIN_TYPE = b"EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)"
CONTRIBUTION_TYPE = (b"Contribution(uint256 runId,uint64 step,uint32 replica,uint32 stage,uint256 replicaSet,"
                     b"bytes32 parent,bytes32 contribution,bytes32 dataShard,bytes32 codeHash,int64 lossMicros,"
                     b"bytes32 newShard)")


def word(value: int) -> bytes:
    """A 32-byte ABI word: unsigned big-endian, or two's complement for a negative int."""
    return (value % 2**256).to_bytes(32, "big")


def domain_separator(name: str, version: str, chain_id: int, contract: str) -> bytes:
    return keccak(keccak(DOMAIN_TYPE) + keccak(name.encode()) + keccak(version.encode())
                  + word(chain_id) + word(int(contract, 16)))


def struct_hash(msg: dict[str, Any]) -> bytes:
    ints = ("runId", "step", "replica", "stage", "replicaSet")
    words = [word(msg[k]) for k in ints]
    words += [unhex(msg[k]) for k in ("parent", "contribution", "dataShard", "codeHash")]
    words += [word(msg["lossMicros"]), unhex(msg["newShard"])]
    return keccak(keccak(CONTRIBUTION_TYPE) + b"".join(words))


def recover(digest32: bytes, r: bytes, vs: bytes) -> str:
    """The address that signed `digest32`, from an EIP-2098 (r, vs) signature."""
    w = int.from_bytes(vs, "big")
    s, parity = w & ((1 << 255) - 1), w >> 255
    sig = keys.Signature(vrs=(parity, int.from_bytes(r, "big"), s))
    return sig.recover_public_key_from_msg_hash(digest32).to_checksum_address()


def event_topic(signature: str) -> str:
    return "0x" + keccak(signature.encode()).hex()


# -- the examples, recomputed ---------------------------------------------------------------

def test_every_documented_example_is_checked(doc):
    """A new example in the document needs a test; a test's example must exist."""
    assert set(doc) == set(CHECKED), f"unchecked: {set(doc) - set(CHECKED)}, missing: {set(CHECKED) - set(doc)}"


def test_cid_and_blockstore_path(doc):
    ex = doc["cid"]
    data = file_bytes(ex["cid"])
    assert len(data) == ex["size"]
    assert hashlib.sha256(data).hexdigest() == ex["sha256"]
    assert cid_binary(ex["cid"]).hex() == ex["binary"]
    assert cid_text(RAW, data) == ex["cid"]
    assert block_path(ex["cid"]) == ex["path"]


def test_pin_file(doc):
    ex = doc["pin"]
    run = json.loads((DATA / "run.json").read_text())
    assert ex["name"] == re.sub(r"[^A-Za-z0-9_.-]", "_", f"{run['name']}-{run['run_id']}")[:128]
    assert ex["lines"] == [run["head"]] == (BLOCKS / ".pins" / ex["name"]).read_text().split()


def row_of(manifest: dict[str, Any], replica: int) -> int:
    """Replica `replica`'s row in a manifest's contributions, data and replay: its place in
    `replicas` when the manifest lists them (a partial step), else its id."""
    return manifest["replicas"].index(replica) if "replicas" in manifest else replica


def test_manifests_decode_and_reencode(doc):
    for key in ("genesis", "manifest"):
        ex = doc[key]
        data = block(ex["cid"])
        assert cid_text(DAG_CBOR, data) == ex["cid"]
        assert dag_json(dag_cbor.decode(data)) == ex["node"]
        assert dag_cbor.encode(from_dag_json(ex["node"])) == data, "DAG-CBOR is canonical: one node, one byte string"
    parent = dag_cbor.decode(block(doc["manifest"]["node"]["parent"]["/"]))  # step 1, whose parent is genesis
    assert parent["step"] == doc["manifest"]["node"]["step"] - 1
    assert dag_json(parent["parent"]) == {"/": doc["genesis"]["cid"]}


def test_config_block(doc):
    ex = doc["config"]
    data = block(ex["cid"])
    assert dag_json(dag_cbor.decode(data)) == ex["node"]
    assert doc["manifest"]["node"]["config"] == {"/": ex["cid"]}
    assert digest(ex["cid"]) == chain()["runCreated"]["configDigest"]


def test_genesis_digest_on_chain(doc):
    assert digest(doc["genesis"]["cid"]) == chain()["runCreated"]["genesisDigest"]


def test_metrics_digest(doc):
    ex = doc["metrics-digest"]
    metrics = dag_cbor.decode(block(doc["manifest"]["cid"]))["metrics"]
    encoded = dag_cbor.encode(metrics)
    assert encoded.hex() == ex["dag-cbor"]
    on_chain = chain()["stepCommitted"]["metrics_digest"]
    assert "0x" + hashlib.sha256(encoded).hexdigest() == ex["metricsDigest"] == on_chain


def test_token_file_and_split(doc):
    ex = doc["token-file"]
    fraction = doc["config"]["node"]["job"]["data"]["eval_fraction"]
    tokens, train, held = token_file(fraction)
    assert (train, held) == (ex["train"], ex["eval"])
    assert {f: is_eval(f, fraction) for f in dataset_files()} == ex["held_out"]
    assert len(tokens) == ex["bytes"]
    assert cid_text(RAW, tokens) == ex["cid"] == doc["config"]["node"]["data"]["tokens"]["/"]
    data = doc["config"]["node"]["data"]
    assert len(tokens) // 2 == data["train_tokens"] + data["eval_tokens"]


def test_data_shard(doc):
    ex = doc["data-shard"]
    job = doc["config"]["node"]["job"]
    tokens, _, _ = token_file(job["data"]["eval_fraction"])
    train = np.frombuffer(tokens, dtype="<u2")[:doc["config"]["node"]["data"]["train_tokens"]]
    seed, windows = shard_tokens(train, job["seed"], ex["replica"], ex["step"], job["outer"]["inner_steps"],
                                 job["data"]["batch_size"], job["model"]["seq_len"])
    assert seed == ex["generator_seed"]
    assert windows[0, 0, :8].tolist() == ex["first_tokens"]
    shard = "0x" + hashlib.sha256(windows.numpy().astype("<u2").tobytes()).hexdigest()
    manifest = dag_cbor.decode(block(doc["manifest"]["cid"]))
    row = row_of(manifest, ex["replica"])
    assert shard == ex["dataShard"] == "0x" + manifest["data"][row].hex()
    slot = row * job["parallel"]["stages"]
    assert chain()["commitStepCall"]["attestations"][slot]["dataShard"] == shard


def test_dataset_directory(doc):
    ex = doc["dataset-dir"]
    cid, _, blocks = tree_cid(DATA / "dataset")
    assert cid == ex["cid"] == doc["config"]["node"]["data"]["dataset"]["/"]
    assert blocks == ex["blocks"]
    for c, hexed in blocks.items():
        assert block(c).hex() == hexed


def test_shard_layout_and_new_shard(doc):
    ex = doc["shard"]
    data = file_bytes(ex["cid"])
    names, tensors = safetensors(data)
    assert struct.unpack("<Q", data[:8])[0] == ex["header_bytes"]
    assert names == sorted(names) and names[:2] == ex["first_keys"]
    assert {k: list(tensors[k].shape) for k in ex["shapes"]} == ex["shapes"]
    assert "0x" + hashlib.sha256(data).hexdigest() == ex["newShard"] == digest(ex["cid"])
    stage = ex["stage"]
    manifest = dag_cbor.decode(block(doc["manifest"]["cid"]))
    assert str(CID("base32", 1, "raw", manifest["stages"][stage].digest)) == ex["cid"]
    atts = chain()["commitStepCall"]["attestations"]
    assert {a["newShard"] for a in atts if a["stage"] == stage} == {ex["newShard"]}


def test_contribution_payload(doc):
    ex = doc["contribution"]
    data = file_bytes(ex["cid"])
    _, tensors = safetensors(data)
    assert {k: tensors[k].tolist() for k in ex["meta"]} == ex["meta"]
    assert "0x" + hashlib.sha256(data).hexdigest() == ex["digest"]
    manifest = dag_cbor.decode(block(doc["manifest"]["cid"]))
    slot = row_of(manifest, ex["replica"]) * 2 + ex["stage"]
    assert chain()["commitStepCall"]["attestations"][slot]["contribution"] == ex["digest"]
    assert {k: list(tensors[k].shape) for k in ex["shapes"]} == ex["shapes"]


def test_aggregate_recomputes_the_new_shard(doc):
    ex = doc["aggregate"]
    new = outer_step(file_bytes(ex["parent_shard"]), [file_bytes(c) for c in ex["contributions"]],
                     ex["lr"], ex["momentum"])
    _, stored = safetensors(file_bytes(ex["new_shard"]))
    assert sorted(new) == sorted(stored)
    for k, t in new.items():
        assert np.array_equal(t.numpy().view(np.uint32), stored[k].view(np.uint32)), f"{k} differs"


def test_replica_set(doc):
    """The step's replicaSet: bit r for each replica r the manifest lists (all R when it
    lists none), its attestations exactly those replicas x every stage, in slot order."""
    ex, call, rec = doc["roots"], chain()["commitStepCall"], chain()["stepCommitted"]
    manifest = dag_cbor.decode(block(doc["manifest"]["cid"]))
    R, S = (doc["config"]["node"]["job"]["parallel"][k] for k in ("replicas", "stages"))
    present = manifest.get("replicas", list(range(R)))
    assert sum(1 << r for r in present) == ex["replicaSet"] == call["replicaSet"] == rec["replica_set"]
    assert [(a["replica"], a["stage"]) for a in call["attestations"]] == [(r, s) for r in present for s in range(S)]
    assert {a["replicaSet"] for a in call["attestations"]} == {ex["replicaSet"]}
    assert len(manifest["contributions"]) == len(manifest["data"]) == len(manifest["replay"]) == len(present)
    assert len(present) >= doc["config"]["node"]["job"]["parallel"]["min_replicas"] == chain()["runCreated"]["minReplicas"]


def test_roots_and_witness_hash(doc):
    ex = doc["roots"]
    call, rec = chain()["commitStepCall"], chain()["stepCommitted"]
    contribs = [a["contribution"] for a in call["attestations"]]
    assert contribs == ex["contributions"]
    root = "0x" + keccak(b"".join(unhex(c) for c in contribs)).hex()
    assert root == ex["contributionsRoot"] == rec["contributions_root"]
    shards = [a["newShard"] for a in call["attestations"][:2]]
    assert shards == ex["newShards"]
    shards_root = keccak(b"".join(unhex(s) for s in shards))
    assert "0x" + shards_root.hex() == ex["shardsRoot"] == rec["shards_root"]
    signers = keccak(b"".join(word(int(a, 16)) for a in ex["signers"]))
    assert "0x" + signers.hex() == ex["signersHash"]
    witness = "0x" + keccak(signers + shards_root + word(ex["replicaSet"]))[:20].hex()
    assert witness == ex["witnessHash"] == chain()["stepInfo"]["witnessHash"]


def test_eip712_digest_and_signature(doc):
    ex = doc["eip712"]
    d = ex["domain"]
    sep = domain_separator(d["name"], d["version"], d["chainId"], d["verifyingContract"])
    assert "0x" + keccak(DOMAIN_TYPE).hex() == ex["domainTypehash"]
    assert "0x" + sep.hex() == ex["domainSeparator"]
    assert "0x" + keccak(CONTRIBUTION_TYPE).hex() == ex["contributionTypehash"] == chain()["contributionTypehash"]
    sh = struct_hash(ex["message"])
    assert "0x" + sh.hex() == ex["structHash"]
    digest32 = keccak(b"\x19\x01" + sep + sh)
    assert "0x" + digest32.hex() == ex["digest"]
    signer = recover(digest32, unhex(ex["r"]), unhex(ex["vs"]))
    # the node of slot (replica, stage): node r * S + s of the run, whatever the step's set
    node = ex["message"]["replica"] * chain()["runCreated"]["stages"] + ex["message"]["stage"]
    assert signer == ex["signer"] == chain()["runCreated"]["nodes"][node]
    w = int.from_bytes(unhex(ex["vs"]), "big")
    assert (hex(w & ((1 << 255) - 1)), 27 + (w >> 255)) == (ex["s"], ex["v"])
    att = chain()["commitStepCall"]["attestations"][ex["slot"]]
    assert (att["r"], att["vs"]) == (ex["r"], ex["vs"])
    msg, call = ex["message"], chain()["commitStepCall"]
    assert (msg["runId"], msg["step"], msg["parent"]) == (call["runId"], call["step"], call["parent"])
    assert {k: att[k] for k in msg if k in att} == {k: msg[k] for k in msg if k in att}
    _, _, version, chain_id, contract, *_ = chain()["eip712Domain"]
    assert (version, chain_id, contract) == (d["version"], d["chainId"], d["verifyingContract"])


def test_events_decode(doc):
    ex = doc["events"]
    logs = chain()["logs"]
    for name, log in zip(("StepCommitted", "ContributionAttested"), logs, strict=True):
        e = ex[name]
        assert event_topic(e["signature"]) == e["topic0"] == log["topics"][0]
        data = unhex(log["data"])
        words = ["0x" + data[i:i + 32].hex() for i in range(0, len(data), 32)]
        assert log["topics"][1:] == e["topics"] and words == e["data"]
    rec = chain()["stepCommitted"]
    committed = ex["StepCommitted"]["data"]
    assert [committed[0], committed[1], committed[2], committed[4], committed[5]] == [
        rec["parent"], rec["contributions_root"], rec["metrics_digest"], rec["shards_root"],
        "0x" + word(rec["replica_set"]).hex()]


def test_code_hash(doc):
    ex = doc["code-hash"]
    files = {k: v.encode() for k, v in ex["files"].items()}
    assert "0x" + code_hash(files).hex() == ex["codeHash"]


def test_run_record(doc):
    run = json.loads((DATA / "run.json").read_text())
    assert run == doc["run-record"]
    assert run["config"] == doc["config"]["cid"] and run["genesis"] == doc["genesis"]["cid"]
    assert run["head"] == doc["manifest"]["cid"]
    assert run["nodes"] == chain()["runCreated"]["nodes"]


CHECKED = {
    "cid", "pin", "genesis", "manifest", "config", "metrics-digest", "token-file",
    "data-shard", "dataset-dir", "shard", "contribution", "aggregate", "roots", "eip712", "events",
    "code-hash", "run-record",
}


# -- cross-checks: the live code computes the documented values ------------------------------

def test_live_code_matches_the_document(doc):
    """The project's own implementations give the values FORMATS.md documents."""
    from lineage.chain.attest import ContributionClaim, Domain
    from lineage.store.manifest import Manifest
    from lineage.store.runconfig import RunConfig
    from lineage.store.unixfs_dir import import_tree
    from trainer.data import derive_seed as live_seed
    from trainer.diloco import apply_outer_step

    m = doc["manifest"]
    live = Manifest.decode(block(m["cid"]))
    assert live.encode() == block(m["cid"])
    present = m["node"].get("replicas", [])
    assert [live.row(r) for r in present] == list(range(len(present)))
    ex = doc["eip712"]
    d, msg = ex["domain"], ex["message"]
    claim = ContributionClaim(msg["runId"], msg["step"], msg["replica"], msg["stage"], unhex(msg["parent"]),
                              unhex(msg["contribution"]), unhex(msg["dataShard"]), unhex(msg["codeHash"]),
                              msg["lossMicros"], unhex(msg["newShard"]), msg["replicaSet"])
    domain = Domain(d["chainId"], d["verifyingContract"], d["version"])
    assert "0x" + claim.digest(domain).hex() == ex["digest"]
    assert live_seed("shard", 7, doc["data-shard"]["replica"], doc["data-shard"]["step"]) == \
        doc["data-shard"]["generator_seed"]
    root = DATA / "dataset"
    tree = [(f, (root / f).read_bytes()) for f in dataset_files()]
    assert str(import_tree(tree)) == doc["dataset-dir"]["cid"]
    agg = doc["aggregate"]
    # a record from before `outer.arithmetic`: it reads as the float32 arithmetic it ran
    cfg = RunConfig(job=doc["config"]["node"]["job"], code=b"").training_job().outer
    new = apply_outer_step(file_bytes(agg["parent_shard"]), [file_bytes(c) for c in agg["contributions"]], cfg)
    assert cid_text(RAW, new) == agg["new_shard"]


def test_live_code_stores_a_round_state_by_reference_as_documented(tmp_path):
    """A round-start state on a committed shard, stored by the live code, is the node
    section 7 documents, and the document's rule, `safetensors` itself, rebuilds it."""
    from safetensors.torch import load, save

    from lineage.store.blockstore import Blockstore
    from lineage.store.roundstate import param_digest, put_round_state
    from lineage.store.unixfs import import_bytes

    g = torch.Generator().manual_seed(0)
    params = {"param/h.0.w": torch.randn(8, 4, generator=g), "param/h.0.b": torch.randn(4, generator=g)}
    shard = save({**params, **{k.replace("param/", "momentum/"): v / 3 for k, v in params.items()}})
    state = save({**params, **{k.replace("param/", "inner/exp_avg/"): v * 2 for k, v in params.items()},
                  "round/outer_step": torch.tensor([2]), "round/inner_step": torch.tensor([8]),
                  "round/kernels": torch.tensor(list(b"AVX2 probe 1"), dtype=torch.uint8)})
    store = Blockstore(tmp_path / "blocks")
    shard_cid = import_bytes(shard, store.put).cid
    text = str(put_round_state(store, state, [(shard_cid, param_digest(shard))]))
    raw = (tmp_path / "blocks" / block_path(text)).read_bytes()
    assert cid_text(DAG_CBOR, raw) == text
    node = dag_cbor.decode(raw)
    assert set(node) == {"version", "kind", "weights", "rest", "size", "sha256"}
    assert (node["version"], node["kind"], node["size"]) == (1, "round-state", len(state))
    assert node["sha256"] == hashlib.sha256(state).digest()
    assert dag_json(node["weights"]) == {"/": cid_text(RAW, shard)}
    rest_cid = dag_json(node["rest"])["/"]
    assert cid_binary(rest_cid)[1] == RAW  # one chunk: the file is its block
    rest = (tmp_path / "blocks" / block_path(rest_cid)).read_bytes()
    assert cid_text(RAW, rest) == rest_cid
    assert rest == save({k: v for k, v in load(state).items() if not k.startswith("param/")})
    assert save({**load(rest), **{k: v for k, v in load(shard).items() if k.startswith("param/")}}) == state


def test_live_code_hash_follows_the_documented_rule():
    """trainer.artifacts.code_hash is the documented rule over trainer/**/*.py."""
    from trainer.artifacts import code_hash as live

    pkg = ROOT / "trainer"
    files = {p.relative_to(pkg).as_posix(): p.read_bytes() for p in pkg.rglob("*.py")}
    assert code_hash(files) == live()
