"""What a job records: each section's dump, and so the bytes its config CID hashes
(`lineage.store.runconfig.RunConfig.of_job` dumps the job; `JobConfig.canonical_json` too).

`recorded` is the one definition. Every section's serializer (`trainer.config_base.Section`)
hands it the full dump of the section's fields; it leaves out each field added after jobs
were first recorded while the field holds the value that means "as before it existed", so
a job that does not use a newer setting keeps the CID it always had. The forms of `[model]`
and `[outer]` (discriminated unions) dump only their own fields: the other family's fields
and the other exchange rules' settings are not theirs to leave out.
"""

from __future__ import annotations

from typing import Any

from trainer.config import DataConfig, ParallelConfig
from trainer.config_model import GptConfig
from trainer.config_outer import CompressionConfig, OuterConfig, PartialOuter

__all__ = ["recorded"]


def recorded(section: Any, data: Any) -> Any:
    """`data`, the dump of `section`'s fields, less those a run does not record at their
    values (a section of another kind, or a dump that is not a dict, passes unchanged)."""
    if not isinstance(data, dict):
        return data
    unset: dict[str, Any] = {}  # field -> the value that leaves it out
    if isinstance(section, GptConfig):  # the fields the gpt family gained after its first runs
        unset = {"family": "gpt", "dtype": "float32", "activation_checkpointing": False}
    elif isinstance(section, ParallelConfig):
        unset = {"device": "auto", "numerics": "native", "min_replicas": None}
        if section.min_replicas == section.replicas:  # every replica, as unset
            unset["min_replicas"] = section.replicas
    elif isinstance(section, DataConfig):  # the sources and tokenizers of issue 15
        unset = {"dir": None, "tokenizer": "bytes", "text_field": "text"}
    elif isinstance(section, CompressionConfig):
        unset = {"coding": "fixed"}
        if section.kind not in ("sparse", "adaptive"):  # top-k settings: only for the kinds using them
            unset.update(density=section.density, chunk=section.chunk)
    elif isinstance(section, OuterConfig):
        unset = {"arithmetic": "float32"}  # a record from before the field re-dumps as it was
        if isinstance(section, PartialOuter):
            unset.update(alpha=None, fragments=1)
    return {k: v for k, v in data.items() if k not in unset or v != unset[k]}
