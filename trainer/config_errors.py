"""Pydantic validation errors as one line naming each problem's field path, unknown keys
first (and the known key an unknown one nearly spells): what `trainer.config.load_job`
and the worker's job-file loader raise."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = ["one_line"]


def one_line(err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """Every problem of a validation error on one line, joined by "; ": unknown keys first
    (the typo that explains a "Field required" beside it), each naming the field's path
    (under `prefix`, if given). With `model`, the class validated, an unknown key that is a
    near miss of a known one says which (`outer.inner_step: unknown key (did you mean
    inner_steps?)`)."""
    errors = err.errors(include_url=False)
    ordered = [e for e in errors if e["type"] == "extra_forbidden"] + \
              [e for e in errors if e["type"] != "extra_forbidden"]
    problems = [_problem(e, prefix, model) for e in ordered]
    return "; ".join(dict.fromkeys(problems))  # each once, in order


def _problem(error: Any, prefix: str, model: type[BaseModel] | None) -> str:
    """One validation error as `path: what is wrong`."""
    path = list(error["loc"])
    loc = ".".join(str(part) for part in ([prefix] if prefix else []) + path)
    if error["type"] == "extra_forbidden":
        what = "unknown section" if isinstance(error.get("input"), dict) else "unknown key"
        near = _near_miss(model, path) if model is not None and path else None
        msg = f"{what} (did you mean {near}?)" if near else what
    else:
        msg = error["msg"].removeprefix("Value error, ")
        given = error.get("input")
        if error["type"] != "value_error" and isinstance(given, str | int | float | bool):
            shown = json.dumps(given)  # TOML's spelling: "128" is a string, 128 a number
            msg += f" (got {shown if len(shown) <= 60 else shown[:57] + '...'})"
    return f"{loc}: {msg}" if loc else msg


def _near_miss(model: type[BaseModel], path: list[Any]) -> str | None:
    """The known key of the section at `path[:-1]` that `path[-1]` most resembles, if any."""
    import difflib

    section: Any = model
    for part in path[:-1]:
        if isinstance(part, int):  # an entry of a list of sections (`[[cheat]]`)
            continue
        field = section.model_fields.get(part) if _is_model(section) else None
        section = _model_in(field.annotation) if field is not None else None
    if not _is_model(section):
        return None
    close = difflib.get_close_matches(str(path[-1]), list(section.model_fields), n=1)
    return close[0] if close else None


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The section class an annotation holds (`X`, `X | None`, `list[X]`), if any."""
    from typing import get_args

    if _is_model(annotation):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
