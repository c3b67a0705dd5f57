"""trainer: the DiLoCoX engine (model, data, pipeline, DiLoCo outer loop, local launcher).

It imports neither `lineage` nor `workers`; it reports every outer step through a
`StepSink` (see `trainer.artifacts`).
"""

from trainer.artifacts import (
    Contribution,
    GenesisArtifacts,
    Progress,
    StageShard,
    StepArtifacts,
    StepSink,
    bytes_to_tensors,
    code_hash,
    tensors_to_bytes,
)
from trainer.config import (
    DataConfig,
    InnerConfig,
    JobConfig,
    ModelConfig,
    OuterConfig,
    ParallelConfig,
    load_job,
)
from trainer.errors import ConfigError, DlxError, TrainingError
from trainer.launch import train_local

__all__ = [
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
    "bytes_to_tensors",
    "code_hash",
    "load_job",
    "tensors_to_bytes",
    "train_local",
]
