"""Job files: TOML with the trainer's sections plus `[chain]` and `[storage]`.

    dlx train examples/tiny.toml

Every key is validated (pydantic, unknown keys rejected); a bad file raises ConfigError
with one line naming every problem, unknown keys first (with the known key a near miss
resembles: `outer.inner_step: unknown key (did you mean inner_steps?)`), before anything is
started or written.
"""

from __future__ import annotations

import importlib
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from trainer.config import JobConfig, ModelConfig, _Section, load_job, one_line
from trainer.errors import ConfigError

ETHER = 10**18
#: Arbiters per run: createRun stores each one (about 45,000 gas apiece, measured on anvil),
#: so 256 cost about 12M gas, well inside a 30M-gas block with the rest of the run.
MAX_ARBITERS = 256
#: The ledger keeps every challenge window below the registry's unbonding delay, which
#: `Ledger.deploy` sets to a week (lineage.chain.ledger.DEFAULT_UNBONDING_DELAY).
MAX_CHALLENGE_WINDOW_S = 7 * 24 * 3600 - 1


class ChainConfig(_Section):
    """Where outer steps are recorded."""

    rpc: str | None = Field(None, description="JSON-RPC URL (http:// or https://); unset starts an embedded anvil.")
    chain_id: int | None = Field(None, ge=1, description="Expected chain id; a mismatch is refused.")
    stake_wei: int = Field(ETHER, ge=1, description="Stake each node holds before the run starts.")
    min_stake_wei: int = Field(ETHER, ge=1, description="Minimum stake a node needs to attest in this run.")
    challenge_window_s: int = Field(
        3600, ge=0, le=MAX_CHALLENGE_WINDOW_S,
        description="Seconds a committed step stays challengeable (below a week: the unbonding delay)."
    )
    arbiters: list[str] = Field(
        default_factory=list,
        max_length=MAX_ARBITERS,
        description=f"Addresses whose verdicts resolve replay challenges (at most {MAX_ARBITERS}); none: steps "
        "cannot be challenged.",
    )
    quorum: int = Field(0, ge=0, description="Verdicts needed to resolve a challenge (1..len(arbiters)).")
    independence: Literal["keys", "operators"] = Field(
        "keys",
        description="What may not sign slots of two replicas of one step: a node key (keys), or the nodes of one "
        "operator, the registry's operator address of a node (operators).",
    )
    confirmations: int | None = Field(
        None, ge=0, le=64,
        description="Blocks on top of a commit before its step is named in run.json, printed and reported; unset: "
        "0 on the embedded anvil (nothing else writes to it, it never reorganises), 2 on any other chain.",
    )
    outage_s: float = Field(
        600, ge=0, description="Seconds an outage of the endpoint (refused, timed out, HTTP 429 or 5xx) is retried "
        "before the run fails (exit 1; --resume continues); not on the embedded anvil or the stack's, whose outage "
        "is a dead process.",
    )
    max_pending: int = Field(
        2, ge=1, description="Outer steps that may wait to be committed before the ranks pause.",
    )
    max_fee_gwei: float | None = Field(
        None, gt=0, description="The most a transaction pays per gas, in gwei; unset: no cap.",
    )
    replace_after_s: float = Field(
        30, gt=0, description="Seconds a transaction may wait unmined before it is replaced with 12.5% higher fees.",
    )
    log_range: int = Field(
        10_000, ge=1, description="Blocks per eth_getLogs request when the ledger's events are read (endpoints cap it).",
    )
    deployment: str | None = Field(
        None, min_length=1, description="A deployment file (`dlx deploy`, relative to the job file): `dlx train` uses its "
        "registry and ledger instead of deploying its own; needs rpc (or --rpc) on the file's chain.",
    )

    admission: Literal["closed", "open", "approved"] = Field(
        "closed",
        description="Who may join the run after it starts (issue 35): nobody (closed), any registered node with "
        "min_stake_wei of free stake (open), or a node holding an admission the submitter signed (approved).",
    )
    reward_wei_per_step: int = Field(
        0, ge=0, lt=2**128,
        description="Wei the run's pool pays each final step, split equally over its attested slots (0: no rewards).",
    )
    fund_wei: int = Field(0, ge=0, description="Wei the submitter puts in the run's reward pool when it is created.")

    @field_validator("rpc")
    @classmethod
    def _http_url(cls, rpc: str | None) -> str | None:
        if rpc is not None and not rpc.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// JSON-RPC URL (got {rpc!r})")
        return rpc

    def policy(self, embedded: bool) -> Any:
        """The `lineage.chain.tx.TxPolicy` of these settings, on a local anvil of our own
        (`embedded`: `dlx train`'s, or the stack's) or not. A local anvil that refuses has
        died, and no wait brings it back: there outages are not waited for."""
        from lineage.chain.tx import TxPolicy

        confirmations = self.confirmations if self.confirmations is not None else (0 if embedded else 2)
        return TxPolicy(confirmations=confirmations, outage_s=0.0 if embedded else self.outage_s,
                        max_fee_gwei=self.max_fee_gwei, replace_after_s=self.replace_after_s)

    @model_validator(mode="after")
    def _stake_covers_minimum(self) -> ChainConfig:
        if self.stake_wei < self.min_stake_wei:
            raise ValueError(f"stake_wei ({self.stake_wei}) is below min_stake_wei ({self.min_stake_wei})")
        return self

    @model_validator(mode="after")
    def _arbiters_and_quorum(self) -> ChainConfig:
        from eth_utils import is_address, to_checksum_address

        for a in self.arbiters:
            if not is_address(a):
                raise ValueError(f"arbiters: not an address: {a!r}")
        self.arbiters = [to_checksum_address(a) for a in self.arbiters]
        if len(set(self.arbiters)) != len(self.arbiters):
            raise ValueError("arbiters: an address is listed twice")
        if self.arbiters and not 1 <= self.quorum <= len(self.arbiters):
            raise ValueError(f"quorum must be between 1 and {len(self.arbiters)} (the arbiters), got {self.quorum}")
        if not self.arbiters and self.quorum:
            raise ValueError("quorum is set but no arbiters are listed")
        return self


class StorageConfig(_Section):
    """Where blocks (checkpoints, contributions, manifests) are stored."""

    backend: Literal["local", "ipfs"] = Field(
        "local", description="local: a blockstore directory; ipfs: a daemon's Kubo RPC API."
    )
    path: str | None = Field(None, description="Blockstore directory; unset uses <run dir>/blocks.")
    api: str | None = Field(
        None, description="Kubo RPC API multiaddr (backend = ipfs), e.g. /ip4/127.0.0.1/tcp/5001/http."
    )
    keep: str = Field(
        "all", description='Round-start states and superseded shards kept: "all", "last:N" or "every:K" '
                           "steps (lineage/store/retention.py); never manifests, contributions or the head.",
    )

    @field_validator("keep", mode="before")
    @classmethod
    def _keep_policy(cls, value: object) -> object:
        from lineage.store.retention import KeepPolicy

        return str(KeepPolicy.parse(value))

    @model_validator(mode="after")
    def _api_matches_backend(self) -> StorageConfig:
        if self.backend == "ipfs" and not self.api:
            raise ValueError("api must name the daemon's RPC address when backend is 'ipfs'")
        if self.backend == "local" and self.api:
            raise ValueError("api is only for backend = 'ipfs'")
        if self.backend == "ipfs" and self.keep != "all":
            raise ValueError("keep applies to the local blockstore; an IPFS daemon keeps what it pins")
        return self


class TrackingConfig(_Section):
    """How a run's metrics are watched (TensorBoard, MLflow): not what was trained, so it
    stays out of the recorded config, as `[storage]` does."""

    tensorboard: bool = Field(False, strict=True, description="Write TensorBoard event files to <run dir>/tensorboard.")
    mlflow: str | None = Field(None, description="MLflow tracking URI (file:/dir, sqlite:///f.db, http://host:port).")
    experiment: str | None = Field(None, min_length=1, description="MLflow experiment name; unset: the job's name.")

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_installed(cls, on: bool) -> bool:
        if on:
            from workers.run.tracking import check_tensorboard

            check_tensorboard()
        return on

    @field_validator("mlflow")
    @classmethod
    def _mlflow_uri(cls, uri: str | None) -> str | None:
        if uri is not None:
            from workers.run.tracking import check_mlflow

            check_mlflow(uri)
        return uri


class JobFile(JobConfig):
    """A job file: the training job plus chain and storage settings."""

    chain: ChainConfig = Field(default_factory=ChainConfig, description="Ledger settings.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Block storage.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="Metrics trackers.")

    def test_hooks(self) -> Any:
        """What a test extension (`EXTENSION_ENV`) injects in place of the honest defaults,
        into the ranks (`trainer.hooks.RankHooks`), the sink (`workers.run.sink.CommitHooks`) and
        `dlx train`'s signer; None, always, for a production job file."""
        return None

    def training_config(self) -> JobConfig:
        """The trainer's view: the same job without chain and storage settings."""
        return JobConfig.model_validate(self.model_dump(exclude={"chain", "storage", "tracking"}))


#: Test-only: names a module (the tests' `dlx_testing.cheat`) whose `JOB_FILE`, a JobFile
#: subclass, every job file is read with instead; unset (production), nothing is imported.
EXTENSION_ENV = "DLX_TEST_EXTENSION"


def job_file_class() -> type[JobFile]:
    """The schema job files are read with: JobFile, or a test extension's subclass."""
    name = os.environ.get(EXTENSION_ENV)
    if not name:
        return JobFile
    cls = importlib.import_module(name).JOB_FILE
    if not (isinstance(cls, type) and issubclass(cls, JobFile)):
        raise ConfigError(f"{EXTENSION_ENV}={name}: its JOB_FILE is not a JobFile subclass")
    return cls


def load_job_file(path: str | Path, base: Path | None = None) -> JobFile:
    """Load and validate a job file; relative `[model] init` and `[data]` paths (`paths`,
    `dir`, a tokenizer.json) are resolved against `base` (default: the file's own directory; a run directory's copy of the job file
    passes the original's, which run.json records as `job_dir`)."""
    path = Path(path)
    from trainer.bounded import read_bounded

    if path.is_dir():
        raise ConfigError(f"job file is a directory: {path}")
    try:
        raw = read_bounded(path, 1 << 20, "job file")
    except FileNotFoundError:
        raise ConfigError(f"job file not found: {path}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"job file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML in {path}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"invalid TOML in {path}: nested too deeply") from None
    return load_job(with_deployment_path(with_init_model(data, base or path.parent), base or path.parent),
                    job_file_class())


def with_deployment_path(data: dict, base: Path) -> dict:
    """`[chain] deployment` resolved against `base` (the job file's directory), as `[data]` paths are."""
    chain = data.get("chain") if isinstance(data, dict) else None
    if not isinstance(chain, dict) or not isinstance(chain.get("deployment"), str) or not chain["deployment"]:
        return data
    return {**data, "chain": {**chain, "deployment": str(base / Path(chain["deployment"]).expanduser())}}


def with_init_model(data: dict, base: Path) -> dict:
    """A job whose `[model] init` names a Hugging Face directory gets the rest of its model
    section from that directory's config.json (fields it gives must agree with it), before
    the job is validated as a whole (so stage counts are checked against the real depth).
    Relative paths are the job file's; the resolved section names the absolute path. The
    `[data]` section's paths are resolved against `base` too (trainer.dataset.resolve_data_paths)."""
    if isinstance(data, dict) and "data" in data:
        from trainer.dataset import resolve_data_paths

        data = {**data, "data": resolve_data_paths(data["data"], base)}
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("init") is None:
        return data
    from trainer.hf import resolve_init

    try:
        cfg = ModelConfig.model_validate(model)
    except ValidationError as err:
        raise ConfigError(one_line(err, "model", ModelConfig)) from None
    return {**data, "model": resolve_init(cfg, base).model_dump(mode="json")}
