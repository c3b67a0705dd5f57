"""Pydantic validation errors as one line naming each problem's field path, unknown keys
first (and the known key an unknown one nearly spells): what `trainer.config.load_job`
and the worker's job-file loader raise.

The forms of a section (`trainer.config_base.Tagged`: the model family, the exchange rule)
are discriminated unions, whose errors pydantic locates under the form's tag
(`outer.eager.tau`); the path a user reads has no tags (`outer`), and a key of another form
says which form it belongs to (`outer: tau is a setting of overlap = "partial" (overlap is
"eager")`), given the validated class (`model`)."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from trainer.config_base import shown

__all__ = ["one_line"]

#: Pydantic's errors for a discriminated union's tag that names no form.
_UNROUTED = ("union_tag_invalid", "union_tag_not_found")


def one_line(err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None) -> str:
    """Every problem of a validation error on one line, joined by "; ": unknown keys first
    (the typo that explains a "Field required" beside it), each naming the field's path
    (under `prefix`, if given). With `model`, the class validated, an unknown key that is a
    near miss of a known one says which (`outer.inner_step: unknown key (did you mean
    inner_steps?)`), and a section's form tags are left out of the paths."""
    errors = err.errors(include_url=False)
    ordered = [e for e in errors if e["type"] == "extra_forbidden"] + \
              [e for e in errors if e["type"] != "extra_forbidden"]
    problems = [_problem(e, prefix, model) for e in ordered]
    return "; ".join(dict.fromkeys(problems))  # each once, in order


def _problem(error: Any, prefix: str, model: type[BaseModel] | None) -> str:
    """One validation error as `path: what is wrong`."""
    path, section = _walk(model, list(error["loc"]))
    given = error.get("input")
    if error["type"] == "extra_forbidden":
        parent, key = _walk(model, list(error["loc"])[:-1])[1], path[-1]
        foreign = parent.foreign_key(str(key)) if _is_tagged(parent) else None
        if foreign is not None:  # a key of another form of this section
            path, msg = path[:-1], foreign
        else:
            what = "unknown section" if isinstance(given, dict) else "unknown key"
            near = _near_miss(parent, str(key))
            msg = f"{what} (did you mean {near}?)" if near else what
    elif error["type"] in _UNROUTED and _is_tagged(section) and isinstance(given, dict):
        key, msg = section.unrouted(given)
        path = [*path, key]
    else:
        msg = error["msg"].removeprefix("Value error, ")
        if error["type"] != "value_error" and isinstance(given, str | int | float | bool):
            msg += f" (got {shown(given)})"  # TOML's spelling: "128" is a string, 128 a number
    loc = ".".join(str(part) for part in ([prefix] if prefix else []) + path)
    return f"{loc}: {msg}" if loc else msg


def _walk(model: Any, loc: list[Any]) -> tuple[list[Any], Any]:
    """(`loc` less the form tags of tagged sections, the section class `loc` ends in, if
    known). Without `model` the path is taken as it is."""
    section, path, tag_next = model, [], _is_tagged(model)
    for part in loc:
        if tag_next and isinstance(part, str) and part in section.VARIANTS:
            section, tag_next = section.VARIANTS[part], False
            continue
        path.append(part)
        if isinstance(part, int):  # an entry of a list of sections (`[[cheat]]`)
            continue
        field = section.model_fields.get(part) if _is_model(section) else None
        section = _model_in(field.annotation) if field is not None else None
        tag_next = _is_tagged(section)
    return path, section


def _near_miss(section: Any, key: str) -> str | None:
    """The known key of `section` (of any of its forms) that `key` most resembles, if any."""
    import difflib

    if not _is_model(section):
        return None
    forms = section.VARIANTS.values() if _is_tagged(section) and section.VARIANTS else [section]
    known = dict.fromkeys(name for form in forms for name in form.model_fields)
    close = difflib.get_close_matches(key, list(known), n=1)
    return close[0] if close else None


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _is_tagged(obj: Any) -> bool:
    """Whether `obj` is a section of several forms (`trainer.config_base.Tagged`)."""
    from trainer.config_base import Tagged

    return isinstance(obj, type) and issubclass(obj, Tagged)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The section class an annotation holds (`X`, `X | None`, `list[X]`, a union of forms),
    if any."""
    if _is_model(annotation):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
