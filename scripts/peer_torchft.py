#!/usr/bin/env python
"""torchft's own DiLoCo and Streaming DiLoCo as peers for the benchmark.

    .venv/bin/python scripts/peer_torchft.py --variant diloco        # a small job, JSON out
    .venv/bin/python scripts/peer_torchft.py --variant streaming --fragments 2 --tau 1

`run_peer(job, variant)` trains the benchmark's job (the same dict our trainer takes) with
torchft 0.2.0 (`pip install torchft==0.2.0`): R replica processes (torch.multiprocessing,
spawn), each a replica group of one rank with its own TCPStore, a `torchft.manager.Manager`
over a `torchft.process_group.ProcessGroupGloo` on the CPU, joined through a
`torchft._torchft.LighthouseServer` that run_peer starts on a free port, and a
`torchft.local_sgd.DiLoCo` around the inner optimizer:

  variant "diloco"     DiLoCo(manager, [model], inner, outer, sync_every=H): synchronous
                       DiLoCo (one fragment, fragment_sync_delay 0, fragment_update_alpha 0);
  variant "streaming"  Streaming DiLoCo: the same class with the model cut into `fragments`
                       contiguous fragments (`model.stage(i, fragments)`: embeddings and the
                       first blocks ... the last blocks and the head), one outer SGD each,
                       fragment_sync_delay = tau (the pseudo-gradient is sent tau inner steps
                       before the fragment's outer step) and fragment_update_alpha = alpha
                       (after the outer step the fragment is lerp(global, local, alpha)).
                       Fragment i syncs at inner step (i+1)*H/fragments of every round, so
                       every fragment takes one outer step per H inner steps.

Each replica r trains the project's own pieces exactly as our trainer does at S = 1
(trainer/engine.py `inner_round`, `Pipeline._lone_stage_step`, `Pipeline.eval_loss`): the
model `build_model(cfg.model, cfg.seed)` (the same weights on every replica, so the Manager
runs with init_sync=False), `build_inner_optimizer`, `warmup_lr` per inner step counted from
0 over the run, `lm_loss` over `parallel.microbatches` microbatches, the global-norm clip to
`inner.clip`, `torch.manual_seed(derive_seed("round", seed, r, t))` at each round start, the
data shard `corpus.shard(seed, r, t, H, B, L)`, and the outer optimizer
torch.optim.SGD(lr, momentum, nesterov) of `[outer]`. One thread per replica and
deterministic algorithms, as our ranks run.

Ignored from the job (torchft has no equivalent): parallel.stages (always one stage),
parallel.sync, parallel.device (always CPU), outer.delay/overlap/tau/alpha (the peer's own
`tau` and `alpha` arguments govern the streaming variant), outer.compression (torchft's
quantisation needs triton/CUDA: pseudo-gradients go as float32), transport (loopback only)
and cheat.

Bytes (`bytes_sent`, summed over ranks): every tensor the Manager hands to the process group
(`ProcessGroup.allreduce`, counted by a subclass of torchft's ProcessGroupGloo), booked as a
ring all-reduce moves it: rank k of R sends `trainer.transport.all_reduce_bytes_sent(numel, R,
k, itemsize)` (about 2(R-1)/R * numel * itemsize; summed over ranks exactly 2(R-1) * numel *
itemsize), whatever algorithm gloo picks. With DiLoCo these are the pseudo-gradients, one
float32 allreduce per parameter per fragment sync (no bucketisation), and nothing else: the
Manager allreduces nothing per step beyond what DiLoCo asks. Plus any checkpoint a replica
serves to a recovering peer (the state dict's tensor bytes per receiver; none in a run
without failures, as init_sync is off). Not counted: the Lighthouse/Manager RPCs (quorum,
heartbeats, should_commit: small messages, independent of the model) and the gloo
rendezvous through the TCPStore.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import re
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

__all__ = ["TORCHFT_VERSION", "run_peer", "torchft_problem"]

TORCHFT_VERSION = "0.2.0"
VARIANTS = ("diloco", "streaming")
POLL_S = 0.2
STOP_GRACE_S = 5.0


def torchft_problem() -> str | None:
    """None if torchft 0.2.0 imports here with its Lighthouse, else one line saying why not."""
    try:
        import importlib.metadata

        version = importlib.metadata.version("torchft")
    except Exception:
        return "torchft is not installed (pip install torchft==0.2.0)"
    if version != TORCHFT_VERSION:
        return f"torchft {version} is installed, the peer is written for {TORCHFT_VERSION}"
    quiet = "RUST_LOG" not in os.environ and "torchft._torchft" not in sys.modules
    if quiet:  # torchft's Rust side logs every quorum tick at INFO; it reads RUST_LOG on import
        os.environ["RUST_LOG"] = "warn"
    try:
        from torchft._torchft import LighthouseServer  # noqa: F401
        from torchft.local_sgd import DiLoCo  # noqa: F401
        from torchft.manager import Manager  # noqa: F401
        from torchft.process_group import ProcessGroupGloo  # noqa: F401
    except Exception as exc:  # a broken wheel, a torch ABI mismatch, a missing native library
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"torchft {version} does not import: {type(exc).__name__}: {first}"
    finally:
        if quiet:
            os.environ.pop("RUST_LOG", None)
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(cfg: Any, variant: str, fragments: int, tau: int, alpha: float) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)} (got {variant!r})")
    H = cfg.outer.inner_steps
    if variant == "diloco":  # synchronous: torchft's defaults
        fragments, tau, alpha = 1, 0, 0.0
    if fragments < 1 or H % fragments != 0:
        raise ValueError(f"fragments ({fragments}) must be >= 1 and divide H = inner_steps ({H})")
    if fragments > cfg.model.n_layers:
        raise ValueError(f"fragments ({fragments}) exceeds model.n_layers ({cfg.model.n_layers})")
    if fragments > 1 and cfg.model.family == "llama" and cfg.model.tie_embeddings:
        raise ValueError("fragments > 1 cannot cut a model whose head reuses the embeddings")
    if not 0 <= tau < H // fragments:
        raise ValueError(f"tau ({tau}) must be in [0, H / fragments = {H // fragments})")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha ({alpha:g}) must be in [0, 1]")
    return {"fragments": fragments, "tau": tau, "alpha": float(alpha)}


def run_peer(job: dict, variant: str, *, eval_every: int = 1, tau: int = 1, alpha: float = 0.0,
             fragments: int = 1, timeout_s: float = 3600) -> dict:
    """Train `job` with torchft's DiLoCo ("diloco") or Streaming DiLoCo ("streaming") over R
    real replica processes; see the module docstring for what runs and what is counted.

    Returns {eval_loss (replica 0 after the last outer step), eval_by_step {t: eval loss of
    replica 0 after outer step t, every `eval_every` steps and the last}, train_loss (the
    last round's mean loss, averaged over replicas), tokens (T*H*R*B*L), bytes_sent (summed
    over ranks), allreduce_calls (per rank), checkpoint_bytes, wall_s (training loop of the
    slowest replica, evals included), compute_s (inner steps only, the slowest replica),
    process_s (the whole call), name, variant, and the settings used}.

    For "diloco", `fragments`, `tau` and `alpha` are ignored (1, 0, 0). Stops every process
    and the Lighthouse it started before returning, also on error. RuntimeError (one line)
    if torchft 0.2.0 cannot run here or a replica fails; ValueError for bad settings.
    """
    from trainer import load_job

    started = time.perf_counter()
    cfg = load_job(job)
    settings = _settings(cfg, variant, fragments, tau, alpha)
    if eval_every < 1:
        raise ValueError(f"eval_every ({eval_every}) must be >= 1")
    problem = torchft_problem()
    if problem is not None:
        raise RuntimeError(f"torchft peer unavailable: {problem}")
    from torchft._torchft import LighthouseServer

    R, T, H = cfg.parallel.replicas, cfg.outer.steps, cfg.outer.inner_steps
    B, L = cfg.data.batch_size, cfg.model.seq_len
    spec = {
        "job": cfg.model_dump(mode="json"),
        "variant": variant,
        **settings,
        "eval_every": eval_every,
        "timeout_s": float(timeout_s),
    }
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    procs: list[Any] = []
    lighthouse = None
    ok = False
    try:
        # Every replica must join each quorum (a lost one fails the run, not shrinks it).
        lighthouse = LighthouseServer(bind=f"[::]:{_free_port()}", min_replicas=R)
        port = int(re.search(r":(\d+)/?$", lighthouse.address()).group(1))
        spec["lighthouse"] = f"http://127.0.0.1:{port}"
        procs = [
            ctx.Process(target=_replica_main, args=(r, spec, events), name=f"torchft-peer-{r}",
                        daemon=True)
            for r in range(R)
        ]
        for p in procs:
            p.start()
        results = _collect(procs, events, R, started + timeout_s, timeout_s)
        ok = True
    finally:
        _stop(procs, STOP_GRACE_S if ok else 0.0)
        events.close()
        events.cancel_join_thread()
        if lighthouse is not None:
            lighthouse.shutdown()

    zero = results[0]
    evals = {int(t): v for t, v in zero["evals"].items()}
    return {
        "name": "torchft-diloco" if variant == "diloco" else "torchft-streaming",
        "variant": variant,
        "eval_loss": evals[T],
        "eval_by_step": evals,
        "train_loss": sum(results[r]["last_round_loss"] for r in range(R)) / R,
        "tokens": T * H * R * B * L,
        "bytes_sent": sum(results[r]["bytes_sent"] + results[r]["checkpoint_bytes"] for r in range(R)),
        "allreduce_calls": zero["allreduce_calls"],
        "checkpoint_bytes": sum(results[r]["checkpoint_bytes"] for r in range(R)),
        "wall_s": max(results[r]["wall_s"] for r in range(R)),
        "compute_s": max(results[r]["compute_s"] for r in range(R)),
        "process_s": time.perf_counter() - started,
        "replicas": R,
        "stages": 1,
        "rounds": T,
        "inner_steps_per_round": H,
        "outer_commits": zero["commits"],
        **settings,
        "eval_every": eval_every,
        "outer": {"lr": cfg.outer.lr, "momentum": cfg.outer.momentum,
                  "nesterov": cfg.outer.nesterov},
        "seed": cfg.seed,
        "torchft": TORCHFT_VERSION,
    }


def _collect(procs: list[Any], events: Any, R: int, deadline: float, timeout_s: float) -> dict:
    """Every replica's result, or RuntimeError naming the first replica that failed."""
    results: dict[int, dict] = {}
    while len(results) < R:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"torchft peer timed out after {timeout_s:g} s")
        event = _next_event(events, POLL_S)
        if event is None:
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
            if not dead:
                continue
            event = _next_event(events, 1.0)  # its last word, if it sent one
            if event is None or event[0] != "error":
                raise RuntimeError(f"torchft peer replica {dead[0]} died "
                                   f"(exit code {procs[dead[0]].exitcode})")
        kind, r, payload = event
        if kind == "error":
            raise RuntimeError(f"torchft peer replica {r} failed: {payload}")
        results[r] = payload
    return results


def _next_event(events: Any, timeout: float) -> tuple[str, int, Any] | None:
    try:
        return events.get(timeout=timeout)
    except queue.Empty:
        return None


def _stop(procs: list[Any], grace_s: float) -> None:
    """Stop the replica processes this call started (by handle): wait up to `grace_s` for
    them to exit, then TERM, then KILL."""
    end = time.monotonic() + grace_s
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)


# -- one replica (a spawned process) -------------------------------------------------------


def _replica_main(r: int, spec: dict, events: Any) -> None:
    try:
        events.put(("done", r, _train_replica(r, spec)))
    except BaseException as exc:
        lines = str(exc).strip().splitlines()
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
        events.put(("error", r, f"{type(exc).__name__}: {lines[0] if lines else ''}{at}"))
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        events.close()
        events.join_thread()


def _counting_gloo(timeout: timedelta) -> Any:
    """torchft's reconfigurable ProcessGroupGloo, booking every allreduce as a ring moves it."""
    from torchft.process_group import ProcessGroupGloo

    from trainer.transport import all_reduce_bytes_sent

    class CountingGloo(ProcessGroupGloo):
        def __init__(self, timeout: timedelta) -> None:
            super().__init__(timeout=timeout)
            self.bytes_sent = 0
            self.calls = 0
            self._where = (0, 1)  # (this replica's rank, replicas) in the current quorum

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                      *args: Any, **kwargs: Any) -> None:
            self._where = (rank, world_size)
            super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

        def _book(self, tensors: list[torch.Tensor]) -> None:
            rank, world = self._where
            for t in tensors:
                self.bytes_sent += all_reduce_bytes_sent(t.numel(), world, rank, t.element_size())
                self.calls += 1

        def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
            self._book(tensors)
            return super().allreduce(tensors, opts)

        def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> Any:
            self._book(tensors)
            return super().allreduce_coalesced(tensors, opts)

    return CountingGloo(timeout)


def _train_replica(r: int, spec: dict) -> dict:
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft's Rust side loads
    logging.getLogger("torchft").setLevel(logging.ERROR)  # CPU-only warnings (NCCL recorder)
    torch.set_num_threads(1)  # as our ranks
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager

    from trainer import load_job
    from trainer.data import derive_seed, load_corpus
    from trainer.model import build_model
    from trainer.pipeline import autocast, build_inner_optimizer, lm_loss, warmup_lr

    cfg = load_job(spec["job"])
    R, T, H = cfg.parallel.replicas, cfg.outer.steps, cfg.outer.inner_steps
    B, L, M = cfg.data.batch_size, cfg.model.seq_len, cfg.parallel.microbatches
    F, eval_every = spec["fragments"], spec["eval_every"]
    timeout = timedelta(seconds=spec["timeout_s"])
    device = torch.device("cpu")

    corpus = load_corpus(cfg.data)
    eval_batches = corpus.eval_batches(cfg.data.eval_batches, B, L, seed=cfg.seed)
    model = build_model(cfg.model, cfg.seed)
    if cfg.model.init is not None:  # genesis = the imported weights, as our trainer
        from trainer.hf import load_init_weights

        load_init_weights(model, cfg.model.init)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    inner = build_inner_optimizer(model, cfg)
    parts = [model] if F == 1 else [model.stage(i, F) for i in range(F)]
    outer = [
        torch.optim.SGD(part.parameters(), lr=cfg.outer.lr, momentum=cfg.outer.momentum,
                        nesterov=cfg.outer.nesterov)
        for part in parts
    ]

    store = torch.distributed.TCPStore(host_name="127.0.0.1", port=0, is_master=True,
                                       wait_for_workers=False)
    pg = _counting_gloo(timeout)

    def state_dict() -> dict:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=R,
        use_async_quorum=False,  # DiLoCo requires it
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timedelta(seconds=60),
        rank=0,
        world_size=1,  # one rank per replica group (S = 1)
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=spec["lighthouse"],
        replica_id=f"peer_{r}",
        hostname="127.0.0.1",
        init_sync=False,  # every replica builds the same weights from the seed
        max_retries=0,  # a failed commit fails the run instead of retrying the round
    )
    checkpoint_bytes = [0]
    transport = manager._checkpoint_transport
    send = transport.send_checkpoint

    def counting_send(dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        leaves = torch.utils._pytree.tree_leaves(state_dict)
        size = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
        checkpoint_bytes[0] += size * len(dst_ranks)
        send(dst_ranks=dst_ranks, step=step, state_dict=state_dict, timeout=timeout)

    transport.send_checkpoint = counting_send

    @torch.no_grad()
    def eval_loss() -> float:  # Pipeline.eval_loss at S = 1
        model.eval()
        total = 0.0
        for batch in eval_batches:
            x, y = batch[:, :-1], batch[:, 1:]  # (B, L) each
            with autocast(cfg, device):
                logits = model(x)
            total += lm_loss(logits.float(), y).item()
        model.train()
        return total / len(eval_batches)

    # Inner-step time without DiLoCo's hook (the sync): one post hook before DiLoCo's, one after.
    marks = {"stepped": 0.0, "synced": 0.0}

    def mark(key: str) -> Any:
        def hook(*_: Any) -> None:
            marks[key] = time.perf_counter()
        return hook

    evals: dict[int, float] = {}
    compute_s = 0.0
    round_loss = math.nan
    try:
        before = inner.register_step_post_hook(mark("stepped"))
        with DiLoCo(
            manager,
            parts,
            inner,
            outer,
            sync_every=H,
            backup_device=device,
            pin_memory=False,
            fragment_sync_delay=spec["tau"],
            fragment_update_alpha=spec["alpha"],
        ):
            after = inner.register_step_post_hook(mark("synced"))
            loop_start = time.perf_counter()
            for t in range(1, T + 1):
                tokens = corpus.shard(cfg.seed, r, t, H, B, L).tokens  # (H, B, L + 1)
                torch.manual_seed(derive_seed("round", cfg.seed, r, t))  # as inner_round
                losses = []
                for h in range(H):
                    step_start = time.perf_counter()
                    lr = warmup_lr(cfg.inner.lr, cfg.inner.warmup, (t - 1) * H + h)
                    for g in inner.param_groups:
                        g["lr"] = lr
                    inner.zero_grad(set_to_none=True)
                    x, y = tokens[h, :, :-1], tokens[h, :, 1:]  # (B, L) each
                    losses.append(_lone_stage_step(model, cfg, device, x, y, M, lm_loss, autocast))
                    _clip(params, cfg.inner.clip)
                    inner.step()  # DiLoCo's hook: prepare / perform a fragment's sync
                    compute_s += marks["stepped"] - step_start
                round_loss = sum(losses) / H
                if manager.current_step() != t * F:
                    raise RuntimeError(f"outer step {t}: torchft committed {manager.current_step()} "
                                       f"fragment syncs, expected {t * F}")
                if r == 0 and (t % eval_every == 0 or t == T):
                    evals[t] = eval_loss()
            wall_s = time.perf_counter() - loop_start
            after.remove()
        before.remove()
    finally:
        manager.shutdown(wait=False)
    return {
        "evals": evals,
        "last_round_loss": round_loss,
        "bytes_sent": pg.bytes_sent,
        "allreduce_calls": pg.calls,
        "checkpoint_bytes": checkpoint_bytes[0],
        "compute_s": compute_s,
        "wall_s": wall_s,
        "commits": manager.current_step(),
    }


def _lone_stage_step(model: Any, cfg: Any, device: torch.device, x: torch.Tensor,
                     y: torch.Tensor, M: int, lm_loss: Any, autocast: Any) -> float:
    """trainer.pipeline.Pipeline._lone_stage_step: M microbatches' mean losses backward in
    turn, the gradients accumulating, then divided by M once."""
    losses = []
    with autocast(cfg, device):
        for xm, ym in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
            loss = lm_loss(model(xm), ym)
            loss.backward()
            losses.append(loss.detach())
    if M > 1:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(M)
    return torch.stack(losses).mean().item()


def _clip(params: list[torch.Tensor], max_norm: float) -> None:
    """trainer.engine.clip_pipeline_grad_norm at S = 1 (no process group needed)."""
    from trainer.pipeline import clip_pipeline_grad_norm

    clip_pipeline_grad_norm(params, max_norm, None, 1)


# -- command line ---------------------------------------------------------------------------


def small_job(args: argparse.Namespace) -> dict:
    return {
        "name": "peer",
        "seed": args.seed,
        "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": 4,
                  "seq_len": args.seq_len},
        "parallel": {"replicas": args.replicas, "stages": 1, "microbatches": 2},
        "data": {"batch_size": args.batch, "eval_batches": 4, "max_bytes": 4_000_000},
        "inner": {"lr": args.lr, "warmup": 20},
        "outer": {"steps": args.rounds, "inner_steps": args.inner_steps},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=VARIANTS, default="diloco")
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--tau", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=0.0)
    ap.add_argument("--d-model", type=int, default=96)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ours", action="store_true",
                    help="also run our trainer's synchronous DiLoCo on the same job (S = 1)")
    args = ap.parse_args()
    job = small_job(args)
    out = {"torchft": run_peer(job, args.variant, tau=args.tau, alpha=args.alpha,
                               fragments=args.fragments)}
    if args.ours:
        from trainer import load_job, train_local

        class Last:
            def __init__(self) -> None:
                self.last: Any = None
                self.evals: dict[int, float] = {}

            def on_genesis(self, genesis: Any) -> None:
                pass

            def on_step(self, step: Any) -> None:
                self.last = step
                self.evals[step.step] = step.metrics["eval_loss"]

            def on_progress(self, progress: Any) -> None:
                pass

        sink = Last()
        start = time.perf_counter()
        train_local(load_job(job), sink, timeout_s=3600)
        m = sink.last.metrics
        out["ours"] = {"eval_loss": m["eval_loss"], "eval_by_step": sink.evals,
                       "bytes_sent": m["bytes_sent"], "wall_s": m["wall_s"],
                       "compute_s": m["compute_s"], "process_s": time.perf_counter() - start}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
