"""What every job-file section shares (`Section`), and `Tagged`: the base of a section whose
form depends on a key, validated as a pydantic discriminated union of one class per form
(`[model]` by `family`: trainer/config_model.py; `[outer]` by its exchange rule:
trainer/config_outer.py). A key of another form is then an unknown key of this one, not a
hand-kept exclusion list; `trainer.config_errors.one_line` names it with the form's own
words (`Tagged.foreign_key`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    model_serializer,
)

from trainer.config_dump import recorded

__all__ = ["Section", "Tagged", "dispatch", "shown"]


class Section(BaseModel):
    """A job-file section: unknown keys refused, and strict types: a string is never read as
    a number or a boolean, nor a number as a boolean (`d_model = "128"`, `nesterov = "yes"`
    and `nesterov = 1` are errors). An integer is still a valid float (`lr = 1`); inf and nan
    are not. Its dump is what a run records, and so what the config CID hashes:
    `trainer.config_dump.recorded` is the one definition."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    #: The section's name in a job file, for `recorded` ("outer.compression": a subsection).
    SECTION: ClassVar[str] = ""

    @model_serializer(mode="wrap")
    def _recorded(self, handler: SerializerFunctionWrapHandler) -> Any:
        return recorded(self, handler(self))


#: Each Tagged base's discriminated union, registered by `dispatch`.
_UNIONS: dict[type, TypeAdapter[Any]] = {}


class Tagged(Section):
    """The base of the forms of one section. Each form (a subclass) names its `TAG`; the
    base's `VARIANTS` maps every tag to its form. Calling the base (`ModelConfig(**fields)`,
    `ModelConfig.model_validate(data)`) validates through the union and gives the form the
    data names; calling a form validates that form alone."""

    TAG: ClassVar[str] = ""
    VARIANTS: ClassVar[dict[str, type[Tagged]]] = {}

    def __new__(cls, *args: Any, **data: Any) -> Self:
        union = _UNIONS.get(cls)
        if union is not None:  # the base: the form the data names (then its __init__ runs again, harmlessly)
            return union.validate_python(data)
        return super().__new__(cls)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        union = _UNIONS.get(cls)
        if union is not None:
            return union.validate_python(obj, **kwargs)
        return super().model_validate(obj, **kwargs)

    @classmethod
    def tag_of(cls, data: Any) -> str:
        """The tag of the form `data` (a dict or a form) names: the union's discriminator.
        A tag that is no form's makes the union's error, which `unrouted` explains."""
        raise NotImplementedError

    @classmethod
    def unrouted(cls, data: Any) -> tuple[str, str]:
        """(key, what is wrong with it) for `data` whose tag names no form."""
        raise NotImplementedError

    @classmethod
    def foreign_key(cls, key: str) -> str | None:
        """Why `key`, a field of another form, is refused in this one (None: no form has it)."""
        owners = [tag for tag, form in cls.VARIANTS.items() if key in form.model_fields]
        return cls.foreign_message(key, owners[0]) if owners else None

    @classmethod
    def foreign_message(cls, key: str, owner: str) -> str:
        """The one-line reason for `key`, a field of the form `owner` only."""
        return f"{key} is not a field of {cls.TAG} (it is one of {owner})"


def dispatch(base: type[Tagged], union: Any) -> None:
    """Make `base` validate through `union` (the Annotated discriminated union of its forms)."""
    forms = [form for form in base.__subclasses__() if form.TAG]
    base.VARIANTS = {form.TAG: form for form in forms}
    _UNIONS[base] = TypeAdapter(union)


def shown(value: Any) -> str:
    """A value as TOML spells it (`"128"` a string, 128 a number), cut at 60 characters."""
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
