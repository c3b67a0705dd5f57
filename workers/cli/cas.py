"""`dlx cas`: the content-addressed store from the command line.

    dlx cas add FILE                      # store a file, print its CID (== `ipfs add --cid-version=1`)
    dlx cas add -r DIR                    # store a directory tree, print its root CID (== `ipfs add -r`)
    dlx cas cid [-r] [--cid-version 0] PATH   # compute the CID only (== `ipfs add -n`)
    dlx cas get CID -o FILE|DIR           # write a file or a directory tree back, every block re-hashed
    dlx cas export --run-dir DIR -o run.car
    dlx cas import run.car
    dlx cas verify                        # re-hash every block, list the bad ones (exit 1)
    dlx cas gc [--keep last:2] [--dry-run]  # retention, then delete blocks no pin reaches

The store is found as for every command (workers/cli/common.py): `--ipfs-api MULTIADDR`,
`--store DIR`, a run's own blockstore directory with `--run-dir DIR`, $DLX_IPFS_API,
$DLX_STORE, else ~/.dlx/blocks.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import TrustOpt, check_run_endpoints, config_error, open_blocks, user_errors

app = typer.Typer(name="cas", help="Content-addressed storage: add, get, CIDs, CAR export/import, verify, gc.",
                  no_args_is_help=True)

StoreOpt = Annotated[Path | None, typer.Option("--store", help="Local blockstore directory (default: $DLX_STORE, else ~/.dlx/blocks).")]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Use this run's blockstore directory.")]
ApiOpt = Annotated[str | None, typer.Option("--ipfs-api", help="Use an IPFS daemon's RPC API, e.g. /ip4/127.0.0.1/tcp/5001/http (default $DLX_IPFS_API).")]
#: Where `dlx cas` keeps blocks when nothing names a store.
DEFAULT_BLOCKS = Path.home() / ".dlx" / "blocks"


def _open(store: Path | None, run_dir: Path | None, api: str | None, *, chain: bool = False,
          trust: bool = False) -> Any:
    """The store to use, by the one precedence (workers/cli/common.py), defaulting to
    ~/.dlx/blocks; a run's store is its blockstore directory, which `dlx cas` manages. With
    a run directory, what is read is printed and checked (`check_run_endpoints`; `chain`:
    the command also reads the run's chain)."""
    if run_dir is not None and store is None and api is None:
        from lineage.chain.runrecord import RunRecord

        check_run_endpoints(run_dir, RunRecord.load(run_dir), chain=chain, trust=trust, blocks_dir_only=True)
    return open_blocks(store, api, run_dir=run_dir, default=DEFAULT_BLOCKS, run_directory_only=True)


def _user_error(message: str) -> None:
    from trainer.errors import ConfigError

    raise ConfigError(message)


def _cid(text: str) -> Any:
    from lineage.store.cid import parse_cid

    try:
        return parse_cid(text)
    except ValueError as exc:
        _user_error(str(exc))


def _input(path: Path) -> Any:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        _user_error(f"no such file: {path}")
    except IsADirectoryError:
        _user_error(f"{path} is a directory; only files are supported")
    except OSError as exc:
        _user_error(f"cannot read {path}: {exc.strerror}")


RecursiveOpt = Annotated[bool, typer.Option("-r", "--recursive",
                                             help="PATH is a directory: import the tree (hidden entries skipped).")]


def _check_kind(path: Path, recursive: bool) -> None:
    """A directory needs -r and -r needs a directory; a missing path is named."""
    if not path.exists():
        _user_error(f"no such file or directory: {path}")
    if path.is_dir() and not recursive:
        _user_error(f"{path} is a directory; add -r to import the tree")
    if recursive and not path.is_dir():
        _user_error(f"{path} is not a directory; drop -r to import a file")


@app.command()
@user_errors
def add(
    path: Annotated[Path, typer.Argument(metavar="PATH", help="The file (or, with -r, the directory) to store.")],
    recursive: RecursiveOpt = False,
    pin: Annotated[str | None, typer.Option("--pin", help="Also pin it under this pin set name.")] = None,
    store: StoreOpt = None, run_dir: RunDirOpt = None, ipfs_api: ApiOpt = None,
) -> None:
    """Store PATH as UnixFS (as `ipfs add --cid-version=1`, `-r` for a directory) and print its CID."""
    _check_kind(path, recursive)
    # One batch: the blocks are synced to disk once, not one by one, and a failed add
    # leaves the store as it was.
    if recursive:
        from lineage.store.unixfs_dir import import_directory

        target = _open(store, run_dir, ipfs_api)
        with target.batch() as staged:
            cid = import_directory(path, staged.put)
    else:
        from lineage.store.unixfs import import_file

        with _input(path) as fh:
            target = _open(store, run_dir, ipfs_api)
            with target.batch() as staged:
                cid = import_file(fh, staged.put).cid
    if pin:
        target.pin(pin, [cid])
    sys.stdout.write(f"{cid}\n")


@app.command()
@user_errors
def cid(
    path: Annotated[Path, typer.Argument(metavar="PATH", help="The file (or, with -r, the directory) to hash.")],
    recursive: RecursiveOpt = False,
    cid_version: Annotated[int, typer.Option("--cid-version", min=0, max=1,
                                             help="1: `ipfs add --cid-version=1`; 0: plain `ipfs add`.")] = 1,
) -> None:
    """Print PATH's CID without storing anything."""
    _check_kind(path, recursive)
    if recursive:
        from lineage.store.unixfs_dir import import_directory

        sys.stdout.write(f"{import_directory(path, cid_version=cid_version)}\n")
        return
    from lineage.store.unixfs import import_file

    with _input(path) as fh:
        sys.stdout.write(f"{import_file(fh, cid_version=cid_version).cid}\n")


@app.command()
@user_errors
def get(
    cid_text: Annotated[str, typer.Argument(metavar="CID", help="The file's or directory's CID.")],
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Where to write (a file: default stdout; a directory: required).")] = None,
    store: StoreOpt = None, run_dir: RunDirOpt = None, ipfs_api: ApiOpt = None,
) -> None:
    """Write the file CID to -o FILE, or the directory CID's tree under -o DIR; every block
    is re-hashed, a bad one is an error naming it."""
    from lineage.store.roundstate import is_reference, read_round_state
    from lineage.store.unixfs import read_file
    from lineage.store.unixfs_dir import is_directory

    root = _cid(cid_text)
    target = _open(store, run_dir, ipfs_api)
    if is_directory(target, root):
        _get_tree(target, root, output)
        return

    def write(fh: Any) -> None:
        if is_reference(root):  # a round-start state stored by reference: rebuilt, checked
            fh.write(read_round_state(target, root))
        else:
            read_file(target, root, fh)

    if output is None:
        write(sys.stdout.buffer)
        return
    import secrets

    from trainer.errors import DlxError

    # Written in full before it takes the real name, to a fresh temporary name opened
    # exclusively and never through a symlink: no existing file is written or removed.
    tmp = output.with_name(f".dlx-{secrets.token_hex(8)}.dlx-tmp")
    made = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        made = True
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, output)
        made = False
    except DlxError:
        raise
    except OSError as exc:
        _user_error(f"cannot write {output}: {exc.strerror}")
    finally:
        if made:
            tmp.unlink(missing_ok=True)


def _get_tree(target: Any, root: Any, output: Path | None) -> None:
    """Restore the directory `root` under `output` (a new directory appears complete)."""
    from lineage.store.unixfs_dir import read_tree

    if output is None:
        raise config_error(f"{root} is a directory; give -o DIR to restore it")
    if output.exists() and not output.is_dir():
        _user_error(f"{output} exists and is not a directory")
    count = read_tree(target, root, output)
    sys.stderr.write(f"restored {count} file(s) under {output}\n")


@app.command("export")
@user_errors
def export_(
    run_dir: Annotated[Path, typer.Option("--run-dir", help="The run directory written by `dlx train`.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The CAR file to write.")],
) -> None:
    """Write a CAR v1 of everything reachable from the run's head (manifests, shards, contributions)."""
    from lineage.chain.runrecord import RunRecord
    from lineage.store.car import export_car
    from workers.cli.console import Ticker

    record = RunRecord.load(run_dir)
    head = record.head or record.genesis
    if not head:
        _user_error(f"run in {run_dir} has no checkpoint yet")
    target = _open(None, run_dir, None)
    tmp = output.with_name(f".{output.name}.dlx-tmp")
    try:
        with open(tmp, "wb") as fh, Ticker(f"export {output}", 0):
            count = export_car(target, [_cid(head)], fh)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    sys.stderr.write(f"exported {count} blocks from head {head}\n")
    sys.stdout.write(f"{head}\n")


@app.command("import")
@user_errors
def import_(
    car: Annotated[Path, typer.Argument(help="A CAR v1 file.")],
    pin: Annotated[str | None, typer.Option("--pin", help="Pin its roots under this pin set name.")] = None,
    store: StoreOpt = None, run_dir: RunDirOpt = None, ipfs_api: ApiOpt = None,
) -> None:
    """Import every block of a CAR (all or nothing, each re-hashed); prints its roots."""
    from lineage.store.car import import_car
    from workers.cli.console import Ticker

    with _input(car) as fh:
        target = _open(store, run_dir, ipfs_api)
        with Ticker(f"import {car}", 0):
            roots = import_car(target, fh)
    if pin:
        target.pin(pin, roots)
    for root in roots:
        sys.stdout.write(f"{root}\n")


@app.command()
@user_errors
def verify(store: StoreOpt = None, run_dir: RunDirOpt = None, ipfs_api: ApiOpt = None) -> None:
    """Re-hash every stored block; list the corrupt ones and exit 1 if there are any."""
    target = _open(store, run_dir, ipfs_api)
    broken = target.verify()
    for cid in broken:
        sys.stdout.write(f"corrupt {cid}\n")
    if broken:
        sys.stderr.write(f"dlx: error: {len(broken)} corrupt block(s), first {broken[0]}\n")
        raise typer.Exit(1)
    sys.stderr.write("every block matches its CID\n")


@app.command()
@user_errors
def gc(
    keep: Annotated[str | None, typer.Option("--keep", metavar="POLICY", help='Retention: "all", "last:N" or "every:K" (default: the run\'s storage.keep with --run-dir; "all" otherwise).')] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be removed; remove nothing.")] = False,
    grace: Annotated[float, typer.Option("--grace", min=0, help="Keep blocks younger than this (seconds): unpinned ones, and those retention would remove (a run still writing may be re-using them).")] = 600,
    store: StoreOpt = None, run_dir: RunDirOpt = None, ipfs_api: ApiOpt = None, trust_endpoints: TrustOpt = False,
) -> None:
    """Apply each pinned run's retention policy (round-start states and superseded shards;
    never manifests, contributions, the head or what an open challenge window needs), then
    delete blocks that no pin set reaches (a run pins its head). Prints each removed block
    and the count and bytes."""
    from lineage.store.blockstore import Blockstore
    from lineage.store.retention import ALL, parse_keep, run_policy

    policy = parse_keep(keep) if keep is not None else run_policy(run_dir) if run_dir else ALL
    target = _open(store, run_dir, ipfs_api, chain=run_dir is not None and policy != ALL, trust=trust_endpoints)
    if not isinstance(target, Blockstore):
        if policy != ALL:
            _user_error("--keep applies to a local blockstore; an IPFS daemon keeps what it pins")
        removed = target.gc(grace)
        for cid in removed:
            sys.stdout.write(f"removed {cid}\n")
        sys.stderr.write(f"removed {len(removed)} block(s)\n")
        return
    verb = "would remove" if dry_run else "removed"
    pruned = pruned_bytes = 0
    if policy != ALL:
        for cid, size in _retain(target, policy, run_dir, dry_run, time.time() - grace):
            sys.stdout.write(f"{verb} {cid}\n")
            pruned, pruned_bytes = pruned + 1, pruned_bytes + size
    sizes: dict[str, int] = {}
    unpinned = target.gc(grace, dry_run=dry_run, sizes=sizes)
    for cid in unpinned:
        sys.stdout.write(f"{verb} {cid}\n")
    total = pruned_bytes + sum(sizes.values())
    sys.stderr.write(f"{verb} {pruned + len(unpinned)} block(s), {total} bytes "
                     f"({pruned} by retention keep = {policy}, {len(unpinned)} unpinned)\n")


def _retain(store: Any, policy: Any, run_dir: Path | None, dry_run: bool,
            touched_before: float) -> list[tuple[Any, int]]:
    """Apply `policy` to the run in `run_dir`, or to every run pinned in `store`; returns
    the removed blocks and their sizes (blocks touched after `touched_before` stay). With --run-dir the run's chain says which steps are
    still challengeable; without it a challengeable run's commit times are unknown, so all
    its steps count as open."""
    from lineage.store.manifest import get_manifest
    from lineage.store.retention import Reach, history, kept_steps, plan
    from trainer.errors import DlxError

    if run_dir:
        from lineage.chain.runrecord import RunRecord

        record = RunRecord.load(run_dir)
        heads = [_cid(record.head)] if record.steps else []
    else:
        heads = [root for roots in store.pins().values() for root in roots]
    out = []
    reach = Reach(store)
    for head in heads:
        try:
            m = get_manifest(store, head)
        except DlxError:  # a pin set of plain files: no run to thin
            continue
        if run_dir:
            open_ = _open_steps(run_dir, m.step)
        else:
            open_ = set(range(1, m.step + 1)) if _challengeable(store, m) else set()
        p = plan(store, head, history(store, head), kept_steps(policy, m.step, open_), reach)
        going = [c for c in p.blocks if store.mtime(c) <= touched_before]
        out += [(cid, store.size(cid)) for cid in going]
        if not dry_run:
            store.prune(p.roots, going, touched_before)
    return out


def _open_steps(run_dir: Path, head: int) -> set[int]:
    from lineage.chain.runrecord import RunRecord
    from lineage.store.retention import open_steps

    record = RunRecord.load(run_dir)
    with record.open_ledger(run_dir) as ledger:
        return open_steps(ledger, record.run_id, head)


def _challengeable(store: Any, m: Any) -> bool:
    """Whether the run's recorded config lets its steps be challenged (arbiters, a window)."""
    from lineage.store.runconfig import RunConfig

    chain = RunConfig.load(store, m.config).job.get("chain", {})
    return bool(chain.get("quorum")) and bool(chain.get("challenge_window_s"))
