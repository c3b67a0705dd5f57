"""trainer: the DiLoCoX engine (model, data, pipeline, DiLoCo outer loop with its exchange
overlapped with computation, compression with error feedback, the Transport, the local launcher).

It imports neither `lineage` nor `workers`; it reports every outer step through a
`StepSink` (see `trainer.artifacts`).
"""

from importlib import import_module
from typing import Any

# Names resolve lazily (PEP 562): importing `trainer.errors` or `trainer.config` must not
# pull in torch, so `dlx --help` and the storage/chain tools stay fast.
_HOME = {
    **dict.fromkeys(
        ["Contribution", "GenesisArtifacts", "Progress", "StageShard", "StepArtifacts",
         "StepSink", "bytes_to_tensors", "code_hash", "tensors_to_bytes"],
        "trainer.artifacts",
    ),
    **dict.fromkeys(
        ["CompressionConfig", "DataConfig", "InnerConfig", "JobConfig", "ModelConfig",
         "OuterConfig", "ParallelConfig", "TransportConfig", "load_job"],
        "trainer.config",
    ),
    **dict.fromkeys(["ConfigError", "DlxError", "TrainingError"], "trainer.errors"),
    "train_local": "trainer.launch",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(import_module(_HOME[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


__all__ = [
    "CompressionConfig",
    "ConfigError",
    "Contribution",
    "DataConfig",
    "DlxError",
    "GenesisArtifacts",
    "InnerConfig",
    "JobConfig",
    "ModelConfig",
    "OuterConfig",
    "ParallelConfig",
    "Progress",
    "StageShard",
    "StepArtifacts",
    "StepSink",
    "TrainingError",
    "TransportConfig",
    "bytes_to_tensors",
    "code_hash",
    "load_job",
    "tensors_to_bytes",
    "train_local",
]
