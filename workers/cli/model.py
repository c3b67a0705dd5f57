"""`dlx export` and `dlx generate`: a checkpoint as a Hugging Face model, or as text.

    dlx export runs/tiny-... -o tiny-hf              # the run's head checkpoint
    dlx export runs/tiny-... --step 3 -o tiny-hf-3
    dlx export bafyrei... --store ~/.dlx/blocks -o OUT  # any checkpoint by its CID
    dlx generate runs/tiny-... --prompt "def main(" --seed 1

The checkpoint is named as every command names a run (workers/cli/common.py, `name_run`): a
run directory or stack job gives the head in its run.json (no chain is read), a run id its
head on the chain, a CID itself; `--step N` walks the manifests' parent links back to step N. The full
model is the union of the stage shards' `param/` tensors (the outer momentum is not part
of a model) under the job configuration the manifest links. `export` writes the
directory `trainer.hf.write_hf_dir` describes, with lineage.json naming the run, step,
checkpoint, ledger and chain; `generate` streams the model's continuation of a
prompt to stdout (`trainer.generate`). A run with a tokenizer (lineage.store.datasets) exports it
as tokenizer.json (with tokenizer_config.json, for `AutoTokenizer`), and `generate` encodes
and decodes with it; a byte-level run uses UTF-8 bytes. Blocks come from `--store DIR`,
`--ipfs-api ADDR`, the run directory, the stack, or $DLX_STORE / $DLX_IPFS_API, as for `dlx lineage`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import (
    RUN_FORMS,
    ApiOpt,
    ChainIdOpt,
    LedgerOpt,
    RegistryOpt,
    RpcOpt,
    StackOpt,
    StoreOpt,
    TrustOpt,
    name_run,
    need_run,
    run_checkpoint,
    user_errors,
)

TargetArg = Annotated[str | None, typer.Argument(metavar="RUN", help=f"The checkpoint: a run's head, or --step N of it ({RUN_FORMS}).", show_default=False)]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="A run directory written by `dlx train` (its head checkpoint, or --step N); beside a CID or run id, where its blocks are.")]
StepOpt = Annotated[int | None, typer.Option("--step", help="Of a run (not a CID): the checkpoint of outer step N (0: the genesis).", show_default=False)]


@dataclass(frozen=True)
class Checkpoint:
    cid: Any  # multiformats.CID of the manifest
    manifest: Any  # lineage.store.manifest.Manifest
    job: Any  # trainer.config.JobConfig
    params: dict[str, Any]  # the full model's parameters (our names), float32
    record: Any = None  # lineage.chain.runrecord.RunRecord, when found through --run-dir
    data: Any = None  # lineage.store.datasets.DataRecord of the run's config (None: it predates them)
    tokenizer: bytes | None = None  # the run's tokenizer.json (None: byte tokens)

    def lineage(self) -> dict[str, Any]:
        """What lineage.json says of where the model came from."""
        r, m = self.record, self.manifest
        return {
            "run": r.run_id if r is not None else m.run,
            "name": r.name if r is not None else self.job.name,
            "step": m.step,
            "checkpoint": str(self.cid),
            "parent": None if m.parent is None else str(m.parent),
            "config": str(m.config),
            "ledger": r.ledger if r is not None else None,
            "chain_id": r.chain_id if r is not None else None,
            **({"data": self.data.to_json()} if self.data is not None else {}),
        }


def _error(message: str) -> Exception:
    from trainer.errors import ConfigError

    return ConfigError(message)


def load_checkpoint(target: str | None, run_dir: Path | None, step: int | None,
                    store: Path | None = None, ipfs_api: str | None = None, what: str = "dlx export",
                    **chain: Any) -> Checkpoint:
    """The checkpoint RUN `target` names (none: `run_dir`'s head), or its `step`; `chain`:
    where a run id's chain is (`run_checkpoint`'s rpc, chain_id, registry, ledger, stack)
    and whether a run directory's endpoints are trusted (`trust`)."""
    ref = need_run(name_run(target, run_dir=run_dir, stack=chain.get("stack")), what)
    if step is not None and ref.cid is not None:
        raise _error("--step goes with a run (a CID names one checkpoint already)")
    head, blocks, record = run_checkpoint(ref, run_dir=run_dir, store=store, ipfs_api=ipfs_api, **chain)
    cid = _cid(head)
    manifest = _manifest(blocks, cid)
    if step is not None:
        cid, manifest = _walk_to(blocks, cid, manifest, step)
    job = _job(blocks, manifest.config)
    data, tokenizer = _tokenizer(blocks, manifest.config)
    return Checkpoint(cid, manifest, job, _params(blocks, manifest), record, data, tokenizer)


def _cid(text: str) -> Any:
    from lineage.store.cid import parse_cid

    try:
        return parse_cid(text)
    except ValueError as exc:
        raise _error(str(exc)) from None


def _tokenizer(blocks: Any, config: Any) -> tuple[Any, bytes | None]:
    """The run's data record and tokenizer.json bytes (read by CID, re-hashed)."""
    from lineage.store.runconfig import RunConfig
    from lineage.store.unixfs import read_bytes

    data = RunConfig.load(blocks, config).data
    if data is None or data.tokenizer is None:
        return data, None
    return data, read_bytes(blocks, data.tokenizer)


def _manifest(blocks: Any, cid: Any) -> Any:
    from lineage.errors import StorageError
    from lineage.store.cid import DAG_CBOR
    from lineage.store.manifest import Manifest

    if cid.codec.name != DAG_CBOR:
        raise _error(f"{cid} is not a checkpoint manifest (a {cid.codec.name} block; manifests are {DAG_CBOR})")
    data = blocks.get(cid)  # BlockNotFoundError: "block not found: CID"
    try:
        return Manifest.decode(data)
    except StorageError as exc:
        detail = str(exc).removeprefix("malformed checkpoint manifest: ")
        raise _error(f"{cid} is not a checkpoint manifest ({detail})") from None


def _walk_to(blocks: Any, cid: Any, manifest: Any, step: int) -> tuple[Any, Any]:
    """The ancestor of `manifest` (itself included) at outer step `step`."""
    head_step = manifest.step
    while manifest.step > step and manifest.parent is not None:
        cid = manifest.parent
        manifest = _manifest(blocks, cid)
    if manifest.step != step:
        raise _error(f"the run has no step {step} (its head is step {head_step})")
    return cid, manifest


def _job(blocks: Any, config: Any) -> Any:
    from pydantic import ValidationError

    from lineage.audit.replay import job_of
    from trainer.config import JobConfig, one_line

    try:
        return job_of(blocks, config, with_data=False)
    except ValidationError as err:
        raise _error(f"the checkpoint's job configuration {config} is invalid: {one_line(err, model=JobConfig)}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise _error(f"{config} is not a job configuration block ({exc})") from None


def _params(blocks: Any, manifest: Any) -> dict[str, Any]:
    """The full model's parameters: every stage shard's `param/` tensors."""
    from lineage.store.unixfs import read_bytes
    from trainer.artifacts import bytes_to_tensors

    params: dict[str, Any] = {}
    for s, shard in enumerate(manifest.stages):
        try:
            tensors = bytes_to_tensors(read_bytes(blocks, shard))
        except Exception as exc:  # safetensors raises its own error types for bad bytes
            from trainer.errors import DlxError

            if isinstance(exc, DlxError):
                raise
            raise _error(f"stage shard {s} ({shard}) is not safetensors: {exc}") from None
        for key, t in tensors.items():
            if key.startswith("param/"):
                name = key.removeprefix("param/")
                if name in params:
                    raise _error(f"parameter {name} is in more than one stage shard")
                params[name] = t
    return params


def _text_codec(tokenizer: bytes | None, prompt: str, out: Any) -> tuple[list[int], Any, Any]:
    """The prompt's token ids, a callback writing each generated token's text to `out` as
    soon as it is whole, and one ending the line: byte tokens without a tokenizer, else the
    run's own tokenizer (text emitted as the decoded sequence grows)."""
    if tokenizer is None:
        decoder = _decoder()

        def emit_byte(token: int) -> None:
            # Tokens past the byte range (a larger vocabulary) stand for no text.
            text = decoder.decode(bytes([token])) if token < 256 else "\ufffd"
            out.write(text)
            out.flush()

        return list(prompt.encode("utf-8")), emit_byte, lambda: out.write(decoder.decode(b"", final=True) + "\n")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer.decode("utf-8"))
    generated: list[int] = []
    shown = [""]

    def emit(token: int) -> None:
        generated.append(token)
        text = tok.decode(generated)
        if not text.endswith("\ufffd"):  # a character still waiting for its last byte
            out.write(text[len(shown[0]):])
            out.flush()
            shown[0] = text

    def finish() -> None:
        out.write(tok.decode(generated)[len(shown[0]):] + "\n")
        out.flush()

    return tok.encode(prompt).ids, emit, finish


def _decoder() -> Any:
    """UTF-8 bytes in, text out: a character split across tokens waits for its last byte;
    an invalid sequence becomes U+FFFD."""
    import codecs

    return codecs.getincrementaldecoder("utf-8")(errors="replace")


@user_errors
def export_(
    target: TargetArg = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="The Hugging Face directory to write (must not exist, or be empty).", show_default=False)] = None,
    run_dir: RunDirOpt = None,
    step: StepOpt = None,
    store: StoreOpt = None,
    ipfs_api: ApiOpt = None,
    stack: StackOpt = None,
    rpc: RpcOpt = None, chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
    trust_endpoints: TrustOpt = False,
) -> None:
    """Write a checkpoint as a Hugging Face model directory (config.json,
    model.safetensors, generation_config.json, lineage.json) that
    `AutoModelForCausalLM.from_pretrained` loads: llama as LlamaForCausalLM or
    Qwen2ForCausalLM, gpt as GPT2LMHeadModel."""
    if output is None:
        raise _error("give the output directory: -o OUT")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise _error(f"{output} exists and is not empty")  # before any loading
    from workers.cli.console import Ticker

    with Ticker(f"export {output}", 0):
        cp = load_checkpoint(target, run_dir, step, store, ipfs_api, "dlx export", stack=stack, rpc=rpc, chain_id=chain_id,
                             registry=registry, ledger=ledger, trust=trust_endpoints)
        from trainer.hf import write_hf_dir

        write_hf_dir(output, cp.job.model, cp.params, cp.lineage(), tokenizer=cp.tokenizer)
    sys.stderr.write(f"exported step {cp.manifest.step} ({cp.cid}) of run {cp.lineage()['run']}\n")
    sys.stdout.write(f"{output}\n")


@user_errors
def generate(
    target: TargetArg = None,
    prompt: Annotated[str, typer.Option("--prompt", help="The text to continue (encoded with the run's tokenizer; one token per UTF-8 byte where it has none).")] = "",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="How many tokens to generate.")] = 200,
    temperature: Annotated[float, typer.Option("--temperature", help="Softmax temperature; 0 is greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the K likeliest tokens.")] = 50,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampler: the same seed gives the same text.")] = 0,
    run_dir: RunDirOpt = None,
    step: StepOpt = None,
    store: StoreOpt = None,
    ipfs_api: ApiOpt = None,
    stack: StackOpt = None,
    rpc: RpcOpt = None, chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
    trust_endpoints: TrustOpt = False,
) -> None:
    """Continue --prompt with a checkpoint's model, streaming the text to stdout."""
    if not prompt:
        raise _error("give a non-empty --prompt")
    if max_new_tokens < 1:
        raise _error(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise _error(f"--temperature must be >= 0, got {temperature}")
    if top_k < 1:
        raise _error(f"--top-k must be at least 1, got {top_k}")
    cp = load_checkpoint(target, run_dir, step, store, ipfs_api, "dlx generate", stack=stack, rpc=rpc, chain_id=chain_id,
                         registry=registry, ledger=ledger, trust=trust_endpoints)

    from trainer.generate import generate as sample
    from trainer.hf import check_params, load_params
    from trainer.model import build_model

    check_params(cp.params, cp.job.model)  # before a model of the config's size is built
    model = build_model(cp.job.model, cp.job.seed)
    load_params(model, cp.params)
    ids, emit, finish = _text_codec(cp.tokenizer, prompt, sys.stdout)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    sample(model, ids, max_new_tokens, temperature, top_k, seed, emit)
    finish()


def register(app: typer.Typer) -> None:
    """Add export and generate to the `dlx` app."""
    app.command("export")(export_)
    app.command()(generate)
