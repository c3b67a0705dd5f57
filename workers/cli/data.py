"""`dlx data prepare`: a job's dataset, tokenizer and token file, and their CIDs.

    dlx data prepare examples/bpe.toml                 # tokenize (once per machine), print the CIDs
    dlx data prepare examples/bpe.toml --store DIR     # and store all three in a blockstore
    dlx data prepare examples/bpe.toml --json

`dlx train` and `dlx submit` run the same preparation when the job's data are not prepared
on the machine yet (lineage.store.datasets: the data cache, $DLX_CACHE).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import user_errors

app = typer.Typer(name="data", help="Datasets, tokenizers and token files: prepare a job's data.",
                  no_args_is_help=True)


@app.command()
@user_errors
def prepare(
    job_file: Annotated[Path, typer.Argument(help="Job file (TOML) whose [data] to prepare.")],
    store: Annotated[Path | None, typer.Option("--store", help="Also store the dataset, tokenizer and token file in this blockstore directory.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the data record as JSON.")] = False,
) -> None:
    """Tokenize JOB_FILE's data (a progress bar on stderr) and print the dataset's root CID,
    the tokenizer's and the token file's, with the split; nothing is stored without --store."""
    from lineage.store.datasets import prepare_dataset
    from workers.cli.console import Ticker
    from workers.run.jobfile import load_job_file

    job = load_job_file(job_file)
    target = None
    if store is not None:
        from lineage.store.blockstore import Blockstore

        target = Blockstore(store)
    with Ticker("data", 0) as bar:
        record, prepared = prepare_dataset(job.data, job.model.vocab_size, target.put if target else None,
                                           progress=ticking(bar))
    if as_json:
        sys.stdout.write(json.dumps({**record.to_json(), "token_file": prepared.token_file}, indent=2) + "\n")
        return
    doc = record.to_json()
    for key in ("dataset", "tokenizer", "tokens"):
        sys.stdout.write(f"{key:<10} {doc[key]}\n")
    sys.stdout.write(f"{'split':<10} {record.train_tokens:,} training tokens ({record.documents - record.eval_documents:,} "
                     f"documents), {record.eval_tokens:,} held out ({record.eval_documents:,}), {record.dtype}\n")


def ticking(bar: Any) -> Any:
    """A lineage.store.datasets progress callback that draws on `bar` (a workers.cli.console.Ticker)."""
    def progress(phase: str, done: int, total: int) -> None:
        if phase == "dataset":
            bar.update(0, f"reading {total:,} files", total=0)
        else:  # bytes of text through the tokenizer (a BPE's training pass included)
            bar.update(round(done / 1e6, 1), "MB tokenized", total=round(total / 1e6, 1))

    return progress
