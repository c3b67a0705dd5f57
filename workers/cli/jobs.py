"""`dlx` commands for the job queue: worker, submit, status, cancel, resume, up, down, runs, logs.

    dlx up --workers 2                 # local redis + anvil + 2 staked workers in .dlx/
    dlx submit examples/tiny.toml      # prints a job id at once
    dlx status JOB [--follow|--json]
    dlx cancel JOB                     # ranks stop at the next inner-step boundary
    dlx resume JOB                     # from the last checkpoint committed on chain
    dlx logs JOB                       # each rank's output, and the workers' lines on the job
    dlx runs [--stack DIR | --dir DIR] # id, name, steps, head, state, loss of every run
    dlx down                           # the chain stays: the next `up` resumes it
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import user_errors

STACK_HELP = "Stack directory written by `dlx up` (Redis, chain and ledger addresses)."


@user_errors
def worker(
    slots: Annotated[int | None, typer.Option("--slots", min=1, help="Rank slots this node offers (concurrent rank tasks); default $DLX_WORKER_SLOTS, else one per GPU, else 1.")] = None,
    queues: Annotated[str, typer.Option("--queues", help="Queues to consume.")] = "train,jobs,verify",
    address: Annotated[str | None, typer.Option("--address", help="The address other ranks reach this node at (rank 0's TCPStore and gloo); default $DLX_WORKER_ADDRESS or 127.0.0.1.")] = None,
    store_ports: Annotated[str | None, typer.Option("--store-ports", metavar="FIRST[-LAST]", help="Ports rank 0's TCPStore may listen on here (for a firewall); default: any free port.")] = None,
) -> None:
    """Run this machine as a training node: a Celery worker whose rank tasks sign with
    this node's key (DLX_NODE_KEY, or DLX_KEYSTORE + DLX_KEYSTORE_PASSWORD).
    The node's stake is checked on start (DLX_RPC, DLX_REGISTRY)."""
    from workers.queue.node import NodeIdentity

    if address:
        os.environ["DLX_WORKER_ADDRESS"] = address
    if store_ports:
        import re

        from trainer.errors import ConfigError

        m = re.fullmatch(r"(\d+)(?:-(\d+))?", store_ports.strip())
        if not m or not 0 < int(m[1]) <= int(m[2] or m[1]) < 65536:
            raise ConfigError(f"--store-ports: expected PORT or FIRST-LAST, got {store_ports!r}")
        os.environ["DLX_STORE_PORTS"] = store_ports.strip()
    me = NodeIdentity.from_env()
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # gloo must use the interface holding our address
        iface = interface_of(me.host)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
        else:
            sys.stderr.write(f"warning: no interface here holds {me.host}; set GLOO_SOCKET_IFNAME\n")
    rpc, registry = os.environ.get("DLX_RPC"), os.environ.get("DLX_REGISTRY")
    if rpc and registry:
        from web3.exceptions import Web3Exception

        from lineage.chain.client import Chain, chain_failure
        from trainer.errors import ConfigError

        chain_id = os.environ.get("DLX_CHAIN_ID") or None
        if chain_id is not None and not chain_id.isdigit():
            raise ConfigError(f"DLX_CHAIN_ID is not a chain id: {chain_id!r}")
        chain = Chain(rpc, int(chain_id) if chain_id else None)
        try:
            stake = chain.contract("NodeRegistry", registry).functions.stakeOf(me.address).call()
        except (OSError, Web3Exception) as exc:
            raise chain_failure(f"stake of {me.address} on registry {registry}", exc, rpc) from None
        if stake == 0:
            raise ConfigError(f"node {me.address} has no stake on registry {registry}: stake before starting a worker")
        sys.stderr.write(f"node {me.address}: stake {stake} wei on registry {registry}\n")
    import torch.distributed.pipelining  # noqa: F401  (torch and pipelining load once, not in the first task)

    import trainer.engine  # noqa: F401
    from workers.queue.app import app as celery_app
    from workers.queue.tasks import gpu_count

    if slots is None:
        slots = int(os.environ.get("DLX_WORKER_SLOTS", "0")) or max(1, gpu_count())

    beat = _announce(me, slots, queues)
    try:
        celery_app.worker_main([
            "worker", "--pool", "threads", "--concurrency", str(slots), "-Q", queues,
            "-n", f"{me.address[:10]}-{os.getpid()}@%h", "--loglevel", "INFO",
            "--without-gossip", "--without-mingle",
        ])
    finally:
        if beat is not None:
            beat.stop()


@user_errors
def submit(
    job_file: Annotated[Path, typer.Argument(help="Job file (TOML).")],
    stack_dir: Annotated[Path, typer.Option("--stack", help=STACK_HELP)] = Path(".dlx"),
    rendezvous_s: Annotated[float, typer.Option("--rendezvous-timeout", min=1, help="Seconds for all ranks to join (an elastic job then starts with min_replicas or more).")] = 60.0,
    collective_timeout_s: Annotated[float, typer.Option("--collective-timeout", min=5, help="Seconds before a lost rank fails the round.")] = 60.0,
) -> None:
    """Queue a training job; prints its id at once."""
    sys.stdout.write(submit_job(stack_dir, job_file, rendezvous_s, collective_timeout_s) + "\n")


@user_errors
def status(
    job_id: Annotated[str, typer.Argument(help="Job id printed by `dlx submit`.")],
    stack_dir: Annotated[Path, typer.Option("--stack", help=STACK_HELP)] = Path(".dlx"),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (state, run id, outer step, loss).")] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Draw a live bar until the job ends.")] = False,
) -> None:
    """A job's state and progress, read from Redis."""
    from workers.queue.jobs import TERMINAL, JobStore, connect
    from workers.queue.stack import Stack

    store = JobStore(connect(Stack.load(stack_dir).redis_url))
    rec = store.reconcile(job_id)
    if as_json:
        keys = ("state", "run_id", "outer_step", "inner_step", "step", "loss", "eval_loss", "head",
                "bytes_sent", "lr", "tokens_per_s", "eta_s", "error", "attempt", "nodes", "run_dir",
                "epoch", "members", "member_nodes", "min_replicas", "replicas")
        doc = {"job": job_id, **{k: rec.get(k) for k in keys}, "rewards": reward_pool(rec)}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    from workers.cli.console import Ticker, console, is_tty

    T, H = int(rec["outer_steps"]), int(rec["inner_steps"])
    out = console()
    if follow and not is_tty():  # a pipe or a log: one line per committed outer step
        seen = int(rec.get("step") or 0) - 1 if rec.get("step") else 0  # the latest one, then every new one
        while True:
            for step in range(seen + 1, int(rec.get("step") or 0) + 1):
                out.print(step_line(job_id, store.step(job_id, step) or rec, T), markup=False)
                seen = step
            if rec["state"] in TERMINAL:
                break
            time.sleep(0.5)
            rec = store.get(job_id)
    else:
        with Ticker(f"job {job_id}", T * H) as bar:
            bar.update(*job_progress(rec, T, H))
            while follow and rec["state"] not in TERMINAL:
                time.sleep(0.5)
                rec = store.get(job_id)
                bar.update(*job_progress(rec, T, H))
    out.print(f"job {job_id}: {rec['state']}" + (f", run {rec['run_id']}" if rec.get("run_id") else "")
              + (f", head {rec['head']}" if rec.get("head") else ""), markup=False)
    if rec.get("members") is not None:
        out.print(members_line(rec), markup=False)
    if pool := reward_pool(rec):
        out.print(pool_line(pool), markup=False)
    if rec.get("error"):
        out.print(f"error: {rec['error']}", markup=False)


@user_errors
def cancel(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    stack_dir: Annotated[Path, typer.Option("--stack", help=STACK_HELP)] = Path(".dlx"),
) -> None:
    """Stop a job's ranks at the next inner-step boundary; committed steps stay committed."""
    from workers.queue.jobs import TERMINAL, JobStore, connect
    from workers.queue.stack import Stack

    store = JobStore(connect(Stack.load(stack_dir).redis_url))
    rec = store.get(job_id)
    if rec["state"] in TERMINAL:
        sys.stdout.write(f"job {job_id} already {rec['state']}\n")
        return
    store.request_cancel(job_id)
    if rec["state"] == "queued":
        store.finish(job_id, "cancelled")
    sys.stdout.write(f"cancel requested for job {job_id}\n")


@user_errors
def resume(
    job_id: Annotated[str, typer.Argument(help="Job id of a failed or cancelled job.")],
    stack_dir: Annotated[Path, typer.Option("--stack", help=STACK_HELP)] = Path(".dlx"),
) -> None:
    """Restart a failed or cancelled job from the last checkpoint committed on chain."""
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger
    from lineage.store.cid import DAG_CBOR, cid_from_digest
    from trainer.errors import ConfigError
    from workers.queue.jobs import JobStore, connect, settle_run_file
    from workers.queue.stack import Stack

    stack = Stack.load(stack_dir)
    store = JobStore(connect(stack.redis_url))
    rec = store.reconcile(job_id)
    if rec["state"] not in ("failed", "cancelled"):
        raise ConfigError(f"job {job_id} is {rec['state']}: only a failed or cancelled job can resume")
    if not rec.get("run_id"):
        raise ConfigError(f"job {job_id} committed nothing on chain: submit it again")
    rpc = stack.rpc if rec.get("stack") else rec["rpc"]  # the stack's chain may listen elsewhere since `dlx up`
    ledger = Ledger(Chain(rpc, int(rec["chain_id"])), rec["registry"], rec["ledger"])
    head, step = ledger.head(int(rec["run_id"]))
    if step >= int(rec["outer_steps"]):
        raise ConfigError(f"job {job_id} already committed all {step} steps")
    attempt = int(rec["attempt"]) + 1
    store.r.delete(store.key(job_id, "cancel"))
    store.update(job_id, state="queued", attempt=attempt, error=None, rpc=rpc,
                 resume_from={"step": step, "checkpoint": str(cid_from_digest(head, DAG_CBOR))})
    settle_run_file(rec["run_dir"], "queued")  # until its sink writes `running` again
    _send_ranks(stack.redis_url, job_id, int(rec["world"]), attempt)
    sys.stdout.write(f"job {job_id} resumes from step {step} (attempt {attempt})\n")


@user_errors
def up(
    workers: Annotated[int, typer.Option("--workers", min=0, max=30, help="Worker nodes to start (0: Redis and the chain only, for workers elsewhere).")] = 2,
    slots: Annotated[int, typer.Option("--slots", min=1, help="Rank slots per worker.")] = 2,
    stack_dir: Annotated[Path, typer.Option("--stack", help="Directory for the stack's state and logs.")] = Path(".dlx"),
    host: Annotated[str, typer.Option("--host", help="Address Redis and the chain also listen on, for workers elsewhere.")] = "127.0.0.1",
    rpc: Annotated[str | None, typer.Option("--rpc", help="Run on this chain instead of an anvil of the stack's own (needs --deployment; worker keys from $DLX_WORKER_KEYS).")] = None,
    deployment: Annotated[Path | None, typer.Option("--deployment", help="The contracts on --rpc's chain: a file written by `dlx deploy`.")] = None,
) -> None:
    """Start a local stack: redis-server, anvil (state file) and N staked workers; or, with
    --rpc and --deployment, Redis and N workers on that chain's deployed contracts."""
    import ipaddress

    from trainer.errors import ConfigError
    from workers.cli.console import count
    from workers.queue.jobs import redact
    from workers.queue.stack import up as stack_up
    from workers.queue.stack import up_on_deployment

    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"--host: not an IP address: {host!r}") from None
    if (rpc is None) != (deployment is None):
        raise ConfigError("--rpc and --deployment go together: a stack on your chain needs its deployed contracts "
                          "(`dlx deploy --rpc URL --out FILE`)")
    if rpc is not None and deployment is not None:
        stack = up_on_deployment(stack_dir, rpc, deployment, worker_keys(workers), slots, host=host)
    else:
        sys.stderr.write("warning: the stack's node keys are anvil's public development keys: local chain only\n")
        stack = stack_up(stack_dir, workers, slots, host=host)
    sys.stdout.write(f"redis {redact(stack.redis_url)} (password in {stack_dir / 'stack.json'})\nchain {stack.rpc} (id {stack.chain_id})\n"
                     f"ledger {stack.ledger}\n{count(len(stack.workers), 'worker')} x {count(slots, 'slot')}\n")


def worker_keys(workers: int) -> list[Any]:
    """The node keys of a stack on the user's chain: DLX_WORKER_KEYS, comma-separated private
    keys, one per worker (from the environment only; never printed)."""
    from eth_account import Account

    from trainer.errors import ConfigError

    raw = [k.strip() for k in os.environ.get("DLX_WORKER_KEYS", "").split(",") if k.strip()]
    if len(raw) < workers:
        raise ConfigError(f"DLX_WORKER_KEYS holds {len(raw)} private key(s); --workers {workers} needs one each")
    keys = []
    for i, key in enumerate(raw[:workers], start=1):
        try:
            keys.append(Account.from_key(key))
        except (ValueError, TypeError):
            raise ConfigError(f"DLX_WORKER_KEYS: key {i} is not a valid private key") from None
    if len({k.address for k in keys}) < len(keys):
        raise ConfigError("DLX_WORKER_KEYS: a key appears twice (each worker is its own node)")
    return keys


@user_errors
def down(
    stack_dir: Annotated[Path, typer.Option("--stack", help="Directory of the stack to stop.")] = Path(".dlx"),
) -> None:
    """Stop exactly the processes `dlx up` started."""
    from workers.queue.stack import down as stack_down

    pids = stack_down(stack_dir)
    sys.stdout.write(f"stopped {len(pids)} processes (the chain and its ledger stay in {stack_dir / 'chain'} "
                     "for the next `dlx up`)\n")


@user_errors
def runs(
    stack_dir: Annotated[Path | None, typer.Option("--stack", help="List the runs of this stack (up or down). Default: .dlx if there is one, else --dir runs.")] = None,
    directory: Annotated[Path | None, typer.Option("--dir", help="List the run directories in this directory (e.g. runs/ of `dlx train`).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (a list of runs).")] = False,
) -> None:
    """The runs a stack or a directory holds: id, name, steps, state, eval loss, when its
    run.json was last written, head. A run id counts on its own chain: each `dlx train`
    run without --rpc has a chain of its own, so each is run 1. A stack's runs show their
    job's state, from Redis while the stack is up, else from their run.json."""
    from trainer.errors import ConfigError
    from workers.queue.stack import run_summaries

    if stack_dir is not None and directory is not None:
        raise ConfigError("--stack and --dir: give one")
    if stack_dir is None and directory is None:  # the stack here, else `dlx train`'s runs/
        stack_dir, directory = (Path(".dlx"), None) if Path(".dlx").is_dir() else (None, Path("runs"))
        if directory is not None and not directory.is_dir():
            raise ConfigError("no runs here (no stack in .dlx, no runs/ directory): pass --stack DIR or --dir DIR")
    if stack_dir is not None and not stack_dir.is_dir():
        raise ConfigError(f"no local stack in {stack_dir}: run `dlx up` first")
    rows = run_summaries(directory, stack_dir)
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    for row in [{"id": "id", "name": "name", "steps": "steps", "state": "state", "loss": "loss",
                 "updated": "last written", "head": "head", "run_dir": "run dir"}, *rows]:
        loss = row["loss"] if isinstance(row["loss"], str) else "-" if row["loss"] is None else f"{row['loss']:.4f}"
        sys.stdout.write(f"{row['id']!s:>4}  {row['name']!s:<16} {row['steps']!s:>5}  {row['state']!s:<10} "
                         f"{loss:>7}  {row['updated']:<16}  {row['head'] or '-'}  {row['run_dir']}\n")


@user_errors
def logs(
    job_id: Annotated[str, typer.Argument(help="Job id printed by `dlx submit`.")],
    stack_dir: Annotated[Path, typer.Option("--stack", help=STACK_HELP)] = Path(".dlx"),
    rank: Annotated[int | None, typer.Option("--rank", min=0, help="Only this rank's training output.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing the ranks' new lines until the job ends.")] = False,
) -> None:
    """A job's logs: each rank's training output (every attempt, from the run directory)
    and what the stack's workers logged about the job's tasks."""
    from trainer.errors import ConfigError
    from workers.queue.stack import job_logs

    try:
        found = job_logs(stack_dir, job_id, rank)
    except ConfigError:
        if not follow:
            raise
        found = []  # a queued or starting job: its logs come as its ranks start
    for title, lines in found:
        sys.stdout.write(f"== {title}\n")
        sys.stdout.writelines(lines)
    sys.stdout.flush()
    if follow:
        _follow_logs(stack_dir, job_id, rank)


def _follow_logs(stack_dir: Path, job_id: str, rank: int | None) -> None:
    """`dlx logs --follow`: print what the rank logs gain (a new attempt's log too, under its
    title) until the job is in a final state and its logs are still; Ctrl-C stops."""
    from workers.queue.jobs import TERMINAL, JobError, JobStore, connect
    from workers.queue.stack import Stack, rank_log_title, rank_logs

    store = JobStore(connect(Stack.load(stack_dir).redis_url))
    seen = {p: p.stat().st_size for p in rank_logs(stack_dir, job_id, rank)}
    current: Path | None = max(seen, default=None, key=lambda p: p.stat().st_mtime)
    try:
        while True:
            state = store.state(job_id)
            grew = False
            for path in rank_logs(stack_dir, job_id, rank):
                size = path.stat().st_size
                if size <= seen.get(path, 0):
                    continue
                with open(path, "rb") as fh:
                    fh.seek(seen.get(path, 0))
                    chunk = fh.read(size - seen.get(path, 0))
                cut = chunk.rfind(b"\n") + 1  # whole lines only; the rest comes with the next read
                if cut == 0:
                    continue
                if path != current:
                    sys.stdout.write(f"== {rank_log_title(path)}\n")
                    current = path
                sys.stdout.write(chunk[:cut].decode(errors="replace"))
                seen[path] = seen.get(path, 0) + cut
                grew = True
            sys.stdout.flush()
            if state in TERMINAL and not grew:
                sys.stdout.write(f"== job {job_id} {state}\n")
                return
            time.sleep(0.5)
    except KeyboardInterrupt:
        return
    except JobError as exc:
        raise JobError(f"--follow: {exc} (`dlx up` if the stack is down)") from None


def register(app: typer.Typer) -> None:
    """Add the job-queue commands to the `dlx` app."""
    app.command()(worker)
    app.command()(submit)
    app.command()(status)
    app.command()(cancel)
    app.command()(resume)
    app.command()(up)
    app.command()(down)
    app.command()(runs)
    app.command()(logs)


def submit_job(stack_dir: Path, job_file: Path, rendezvous_s: float = 60.0, collective_timeout_s: float = 60.0) -> str:
    """Validate `job_file`, record the job in the stack's Redis and send its rank tasks;
    returns the job id (`dlx submit`)."""
    from workers.run.jobfile import load_job_file

    job = load_job_file(job_file)  # before anything is written
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

    stack = Stack.load(stack_dir)
    refuse_what_the_stack_cannot_honour(job, stack)
    if job.test_hooks() is not None:  # test-only; the rule's module loads the trainer, which other jobs need not wait for
        from workers.run.local import refuse_cheat_off_local_chain

        refuse_cheat_off_local_chain(job, stack.rpc, stack.chain_id, queue=True)  # as the rank tasks would, later
    store = JobStore(connect(stack.redis_url))
    refuse_what_the_workers_cannot_serve(job, stack, store)
    from lineage.store.blockstore import Blockstore
    from lineage.store.datasets import prepare_dataset

    # Tokenized here, once; every rank fetches the token file by CID from the stack's store.
    data, _ = prepare_dataset(job.data, job.model.vocab_size, Blockstore(stack.blocks).put)
    job_id = store.create({
        # `[model] init` paths are the job file's; the rank tasks resolve them from here.
        "job_toml": job_file.read_text(), "job_dir": str(job_file.resolve().parent), "name": job.name, "rpc": stack.rpc, "chain_id": stack.chain_id,
        "registry": stack.registry, "ledger": stack.ledger, "blocks": stack.blocks,
        # run.json finds the stack's own chain through it after down and up; a user's chain stays where it is
        "stack": None if stack.deployment else str(Path(stack.dir).resolve()),
        "replicas": job.parallel.replicas, "stages": job.parallel.stages, "world": job.world_size,
        "min_replicas": job.parallel.min_replicas or job.parallel.replicas,
        "outer_steps": job.outer.steps, "inner_steps": job.outer.inner_steps,
        "rendezvous_s": rendezvous_s, "collective_timeout_s": collective_timeout_s,
        "data": data.to_json(),
    })
    store.update(job_id, run_dir=str(stack.runs / job_id))
    _send_ranks(stack.redis_url, job_id, job.world_size, attempt=1)
    return job_id


def refuse_what_the_stack_cannot_honour(job: Any, stack: Any) -> None:
    """Refuse, before anything is queued, a job the stack would not run as its file says:
    every queued job is recorded on the stack's chain and stored in the stack's blockstore,
    so `[chain] rpc`/`chain_id` and `[storage] backend`/`api`/`path` must agree with them,
    or be left out."""
    from trainer.errors import ConfigError

    chain, storage = job.chain, job.storage
    if chain.rpc is not None and chain.rpc.rstrip("/") != stack.rpc.rstrip("/"):
        raise ConfigError(f"chain.rpc: the stack records every job on its own chain ({stack.rpc}), not {chain.rpc}: "
                          "leave chain.rpc out, or run the job with `dlx train`")
    if chain.chain_id is not None and chain.chain_id != stack.chain_id:
        raise ConfigError(f"chain.chain_id is {chain.chain_id}, but the stack's chain at {stack.rpc} has id "
                          f"{stack.chain_id}")
    if chain.deployment is not None and not _same_deployment(job, stack):
        raise ConfigError(f"chain.deployment: the stack records every job on its own ledger ({stack.ledger}), "
                          "not a deployment file's: leave chain.deployment out, or run the job with `dlx train`")
    if storage.backend != "local" or storage.path is not None:
        given = storage.api if storage.backend == "ipfs" else storage.path
        raise ConfigError(f"storage: the stack stores every job's blocks in its own blockstore ({stack.blocks}), "
                          f"not {given}: leave [storage] backend, api and path out, or run the job with `dlx train`")


def _same_deployment(job: Any, stack: Any) -> bool:
    """Whether the job's `[chain] deployment` names the contracts the stack runs on (a
    stack started with that deployment: `dlx up --deployment`)."""
    from lineage.chain.deploy import Deployment

    if not stack.deployment:
        return False
    dep = Deployment.load(Path(job.chain.deployment))
    return (dep.chain_id, dep.registry, dep.ledger) == (stack.chain_id, stack.registry, stack.ledger)


def refuse_what_the_workers_cannot_serve(job: Any, stack: Any, store: Any) -> None:
    """Refuse, before anything is queued, a job the live workers cannot serve: it needs a
    rank slot per rank (else it would only fail at the rendezvous timeout, with the same
    numbers), and its nodes stake for themselves (each must already hold `chain.stake_wei`
    and `min_stake_wei`)."""
    from trainer.errors import ConfigError

    workers = _live_slots(stack, store)
    offered = sum(w["slots"] for w in workers)
    if offered < _slots_needed(job):  # an elastic job starts with min_replicas (workers/queue/rendezvous.py)
        raise ConfigError(f"the job needs {_slots_needed(job)} rank slots; the stack's live workers offer {offered} "
                          f"({len(workers)} worker{'s' if len(workers) != 1 else ''}): start more workers "
                          "(`dlx worker`) or use fewer replicas or stages")
    _refuse_understaked(job, stack, workers)


def _live_slots(stack: Any, store: Any) -> list[dict[str, Any]]:
    """The workers that take rank tasks now: those announcing themselves in Redis
    (`WorkerBeat`), and the stack's own workers still starting (alive, not announced yet)."""
    from workers.queue.jobs import live_workers
    from workers.queue.stack import alive

    announced = [w for w in live_workers(store.r) if "train" in w["queues"]]
    seen = {(w["node"], w["pid"]) for w in announced}
    starting = [{"node": w["node"], "slots": w["slots"], "pid": w["pid"]} for w in stack.workers
                if (w["node"], w["pid"]) not in seen and alive(w["pid"])]
    return announced + starting


def _slots_needed(job: Any) -> int:
    """The rank slots a job starts with: all of them, an elastic job's min_replicas x stages."""
    return job.parallel.min_present * job.parallel.stages


def _refuse_understaked(job: Any, stack: Any, workers: list[dict[str, Any]]) -> None:
    """Queued nodes stake for themselves (`dlx node stake`): a job whose stake the live
    nodes do not hold would have its attestations refused on chain, step after step."""
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger
    from trainer.errors import ConfigError

    need = max(job.chain.stake_wei, job.chain.min_stake_wei)
    ledger = Ledger(Chain(stack.rpc, stack.chain_id), stack.registry, stack.ledger)
    stakes = {node: ledger.registry.stake_of(node) for node in {w["node"] for w in workers}}
    offered = sum(w["slots"] for w in workers if stakes[w["node"]] >= need)
    if offered < _slots_needed(job):
        node, most = max(stakes.items(), key=lambda kv: kv[1])
        raise ConfigError(f"chain.stake_wei: the job wants nodes holding {need} wei; the live workers whose nodes "
                          f"hold that offer {offered} of its {_slots_needed(job)} rank slots (the most a node holds: "
                          f"{most} wei, {node}): nodes stake for themselves (`dlx node stake`)")


def _announce(me: Any, slots: int, queues: str) -> Any:
    """Announce this worker in Redis (`WorkerBeat`); None, with a warning, if Redis does not
    answer now (the worker itself waits for its broker; `dlx submit` then counts it late)."""
    from workers.queue.app import redis_url
    from workers.queue.jobs import JobError, WorkerBeat, connect

    try:
        r = connect(redis_url())
    except JobError as exc:
        sys.stderr.write(f"warning: {exc}: this worker's slots are not announced\n")
        return None
    return WorkerBeat(r, {"node": me.address, "slots": slots, "queues": queues.split(","),
                          "pid": os.getpid(), "host": me.host})


def job_progress(rec: Mapping[str, Any], T: int, H: int) -> tuple[int, str]:
    """(inner steps done, the rest as text) of a job record, for `dlx status`'s bar."""
    from workers.cli.console import human_seconds, megabytes

    o, i = int(rec.get("outer_step") or 0), int(rec.get("inner_step") or 0)
    done = T * H if rec["state"] == "completed" else max(0, (o - 1) * H + i)
    text = f"{rec['state']} outer {o}/{T} inner {i}/{H}"
    if rec.get("eta_s") is not None and rec["state"] == "running":  # early: a narrow terminal cuts the tail
        text += f" left {human_seconds(rec['eta_s'])}"
    if rec.get("loss") is not None:
        text += f" loss {rec['loss']:.3f}"
    if rec.get("lr") is not None:
        text += f" lr {rec['lr']:.2e} {rec.get('tokens_per_s') or 0:,.0f} tok/s"
    text += f" sent {megabytes(rec.get('bytes_sent') or 0)}"
    return done, text


def members_line(rec: Mapping[str, Any]) -> str:
    """An elastic job's current replica set and each replica's nodes (`dlx status`)."""
    nodes = rec.get("member_nodes") or {}
    each = [f"replica {r} ({', '.join(nodes.get(str(r), []))})" for r in rec["members"]]
    return (f"members: {len(rec['members'])} of {rec.get('replicas')} replicas (min {rec.get('min_replicas')}, "
            f"epoch {rec.get('epoch', 0)}): " + "; ".join(each))


def reward_pool(rec: Mapping[str, Any]) -> dict[str, Any] | None:
    """The reward terms of the job's run, read from the chain (issue 35): its admission
    rule, wei a final step pays and wei left in its pool (as strings: JSON numbers lose
    precision above 2**53). None before the run exists, for a closed run without rewards,
    or while the chain does not answer (`dlx status` reads Redis first)."""
    if not rec.get("run_id") or not rec.get("rpc"):
        return None
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger
    from lineage.chain.rewards import run_terms
    from lineage.errors import ChainError

    try:
        terms = run_terms(Ledger(Chain(rec["rpc"], int(rec["chain_id"])), rec["registry"], rec["ledger"]),
                          int(rec["run_id"]))
    except (ChainError, OSError, ValueError):
        return None
    if terms.admission == "closed" and not terms.reward_per_step and not terms.pool:
        return None
    return {"admission": terms.admission, "reward_per_step_wei": str(terms.reward_per_step),
            "pool_wei": str(terms.pool), "ended": bool(terms.ended_at)}


def pool_line(pool: dict[str, Any]) -> str:
    """`dlx status`'s line for `reward_pool`'s terms."""
    from workers.cli.node import fmt_wei

    return (f"rewards: {fmt_wei(int(pool['reward_per_step_wei']))} a final step, pool "
            f"{fmt_wei(int(pool['pool_wei']))} left (admission {pool['admission']})")


def step_line(job_id: str, rec: Mapping[str, Any], T: int) -> str:
    """One committed outer step of a job as a plain line (`dlx status --follow` off a
    terminal), from its `step_N` summary in the job record (or the record itself)."""
    from workers.cli.console import megabytes

    loss = rec.get("eval_loss")
    return (f"job {job_id}: step {rec['step']}/{T} eval_loss {'-' if loss is None else f'{loss:.4f}'} "
            f"sent {megabytes(rec.get('bytes_sent') or 0)} head {rec.get('head')}")


def interface_of(address: str) -> str | None:
    """The network interface holding IPv4 `address` here (Linux), for GLOO_SOCKET_IFNAME."""
    import fcntl
    import socket
    import struct

    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def rank_task_id(job_id: str, attempt: int, rank: int) -> str:
    """Each rank task's id is its idempotency key: a redelivery carries the same id."""
    return f"{job_id}-a{attempt}-r{rank}"


def _send_ranks(redis_url: str, job_id: str, world: int, attempt: int) -> None:
    from workers.queue.app import make_app

    app = make_app(redis_url)
    for rank in range(world):
        app.send_task("workers.queue.tasks.run_rank", args=(job_id, rank, attempt), queue="train",
                      task_id=rank_task_id(job_id, attempt, rank))
