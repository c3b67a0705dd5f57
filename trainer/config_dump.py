"""What a job records: each section's dump, and so the bytes its config CID hashes
(`lineage.store.runconfig.RunConfig.of_job` dumps the job; `JobConfig.canonical_json` too).

`recorded` is the one definition. Every section's serializer (`trainer.config_base.Section`)
hands it the full dump of the section's fields; it leaves out each field added after jobs
were first recorded while the field holds the value that means "as before it existed", so
a job that does not use a newer setting keeps the CID it always had. The forms of `[model]`
and `[outer]` (discriminated unions) dump only their own fields: the other family's fields
and the other exchange rules' settings are not theirs to leave out.

Sections are told apart by their `SECTION` name and form `TAG` (class variables), so this
module imports none of them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["recorded"]


def recorded(section: Any, data: Any) -> Any:
    """`data`, the dump of `section`'s fields, less those a run does not record at their
    values (a section of another kind, or a dump that is not a dict, passes unchanged)."""
    if not isinstance(data, dict):
        return data
    unset: dict[str, Any] = {}  # field -> the value at which it is left out
    match getattr(section, "SECTION", ""), getattr(section, "TAG", ""):
        case "model", "gpt":  # the fields the gpt family gained after its first runs
            unset = {"family": "gpt", "dtype": "float32", "activation_checkpointing": False}
        case "parallel", _:  # every replica in every round, as min_replicas unset
            unset = {"device": "auto", "numerics": "native", "min_replicas": None}
            if section.min_replicas == section.replicas:
                unset["min_replicas"] = section.replicas
        case "data", _:  # the sources and tokenizers of issue 15
            unset = {"dir": None, "tokenizer": "bytes", "text_field": "text"}
        case "outer.compression", _:  # top-k settings only for the kinds that use them
            unset = {"coding": "fixed"}
            if section.kind not in ("sparse", "adaptive"):
                unset.update(density=section.density, chunk=section.chunk)
        case "outer", rule:  # a record from before `arithmetic` re-dumps as it was
            unset = {"arithmetic": "float32"}
            if rule == "partial":
                unset.update(alpha=None, fragments=1)
    return {k: v for k, v in data.items() if k not in unset or v != unset[k]}
