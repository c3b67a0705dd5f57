"""The contracts' custom errors as typed exceptions (lineage/chain/reverts.py): the committed
module matches the ABIs it was generated from, and a revert is decoded into the class of its
name with the message it always had (`context: reverted with Name(k=v, ...)`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from eth_abi import encode
from eth_utils import keccak

from lineage.chain import reverts
from lineage.chain.client import contracts_out, decode_revert
from lineage.errors import ChainError, ChainRevertError

ROOT = Path(__file__).resolve().parent.parent


def test_the_committed_module_matches_the_contracts_abis():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_reverts.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_every_abi_error_has_its_class_and_selector():
    for contract in ("TrainingLedger", "NodeRegistry"):
        abi = json.loads((contracts_out() / f"{contract}.sol" / f"{contract}.json").read_text())["abi"]
        for item in (i for i in abi if i["type"] == "error"):
            cls = getattr(reverts, item["name"])
            assert issubclass(cls, ChainRevertError) and cls.__name__ == item["name"]
            types = [i["type"] for i in item["inputs"]]
            assert cls.inputs == tuple(zip([i["name"] for i in item["inputs"]], types, strict=True))
            assert cls.selector == "0x" + keccak(text=f"{item['name']}({','.join(types)})")[:4].hex()
            assert reverts.BY_SELECTOR[bytes.fromhex(cls.selector[2:])] is cls


def _revert(cls: type[ChainRevertError], *values: object) -> str:
    return cls.selector + encode([t for _, t in cls.inputs], list(values)).hex()


def test_a_revert_is_its_typed_class_with_the_message_it_always_had():
    err = decode_revert(_revert(reverts.LedgerWrongStep, 3, 2), "commit step 2")
    assert type(err) is reverts.LedgerWrongStep and isinstance(err, ChainRevertError)
    assert str(err) == "commit step 2: reverted with LedgerWrongStep(expected=3, got=2)"
    assert err.name == "LedgerWrongStep" and err.error_args == {"expected": 3, "got": 2}
    parent = decode_revert({"data": _revert(reverts.LedgerStaleParent, b"\x01" * 32, b"\x02" * 32)})
    assert str(parent) == f"reverted with LedgerStaleParent(expected=0x{'01' * 32}, got=0x{'02' * 32})"
    with pytest.raises(reverts.LedgerNoNodes, match=r"^create run: reverted with LedgerNoNodes\(\)$"):
        raise decode_revert(_revert(reverts.LedgerNoNodes), "create run")
    library = decode_revert(_revert(reverts.ECDSAInvalidSignatureLength, 64), "attest")
    assert type(library) is reverts.ECDSAInvalidSignatureLength


@pytest.mark.parametrize(("data", "message"), [
    ("0x", "x: reverted without a reason"),
    ("0xdeadbeef", "x: reverted with unknown error 0xdeadbeef"),
    (reverts.LedgerWrongStep.selector + "00", "x: reverted with LedgerWrongStep and arguments that do not decode"),
])
def test_revert_data_that_names_no_error_is_a_plain_chain_error(data, message):
    err = decode_revert(data, "x")
    assert type(err) is ChainError and str(err) == message
