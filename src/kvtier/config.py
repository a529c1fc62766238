"""kvtier's configuration primitives, validated once at the edge (CLI, YAML/JSON, vLLM extra
config): the frozen base model, byte sizes, and the parse that turns pydantic's errors into a
`ConfigError` naming the field, the value and what is allowed.

This module knows no tier: the store's config model (`StoreConfig`, `TierSettings`) lives with
the tier factory, in `kvtier.tiers.storeconfig`, and each tier's own fields in its tier
module.

Primitives: `FrozenModel` (the base of every config model), `ByteSize`, `PositiveByteSize`,
`EnvVarName`, `parse_model`, `read_config_file`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from kvtier.errors import ConfigError, FieldError, TierConfigError
from kvtier.redaction import MASK, secret_field
from kvtier.units import parse_size

ByteSize = Annotated[int, BeforeValidator(lambda v: parse_size(v, "capacity")), Field(ge=0)]
# A tier that has no "0: no bound" (a file tier of 0 bytes would store nothing, silently).
PositiveByteSize = Annotated[int, BeforeValidator(lambda v: parse_size(v, "capacity")),
                             Field(gt=0)]


def _variable_name(name: str) -> str:
    # "" would fall back to a default, or to no secret, silently; a name is what `export
    # NAME=...` takes.
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError("the name of an environment variable (letters, digits and _, not "
                         "starting with a digit), or leave it out")
    return name


# A field naming the environment variable that holds a secret.
EnvVarName = Annotated[str, AfterValidator(_variable_name)]
Model = TypeVar("Model", bound=BaseModel)


class FrozenModel(BaseModel):
    """A config model: immutable, an unknown field is an error, and so is true or false for
    a number (pydantic takes `ttl_s: true` as a TTL of 1 s; a field with a parser of its
    own, such as a `ByteSize`, says so itself)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if isinstance(value, bool) and _numeric(field.annotation) and not any(
                        isinstance(check, BeforeValidator) for check in field.metadata):
                    raise FieldError(name, value, "a number, not true or false")
        return data


def _numeric(annotation: Any) -> bool:
    """Whether a field takes numbers and no bool (`int`, `float | None`, ...)."""
    kinds = set(get_args(annotation)) or {annotation}
    return bool(kinds & {int, float}) and bool not in kinds


# The validation context of a config read by a command that only reads the tiers (`kvtier
# inspect`): a directory it may read but not write is accepted (a monitoring user, a
# read-only mount), where an engine would be refused it.
READING_ONLY = {"reading_only": True}


def reading_only(info: ValidationInfo) -> bool:
    """Whether a validator runs for a config that is only read (`READING_ONLY`)."""
    return bool(info.context and info.context.get("reading_only"))


def parse_model(model: type[Model], data: Any, where: str,
                context: dict[str, Any] | None = None) -> Model:
    """Validate `data` into `model` (with pydantic's validation `context`), turning the first
    pydantic error into a ConfigError."""
    try:
        return model.model_validate(data, context=context)
    except ConfigError as exc:  # raised by parse_size inside a validator
        raise ConfigError(f"{where}.{exc.field}", exc.value, exc.allowed) from None
    except ValidationError as exc:
        error = exc.errors()[0]
        loc, value, allowed = error["loc"], error.get("input"), error["msg"]
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, TierConfigError):  # already names its path inside the model
            raise ConfigError(f"{where}.{cause.field}", cause.value, cause.allowed) from None
        if isinstance(cause, FieldError):  # a field of the (maybe nested) model that raised it
            field = ".".join(str(part) for part in (where, *loc, cause.field))
            raise ConfigError(field, cause.value, cause.allowed) from None
        if isinstance(cause, ConfigError):
            allowed = cause.allowed
        elif isinstance(cause, ValueError):
            allowed = str(cause)
        if error["type"] == "missing":
            value, allowed = None, "a value is required here"
        field = ".".join(str(part) for part in (where, *loc))
        if error["type"] == "extra_forbidden":
            allowed = "unknown field; allowed fields: " + ", ".join(
                _settable_fields(_model_at(model, loc[:-1])))
            if secret_field(loc[-1]):  # `password: ...` where no such field is
                value = MASK
        raise ConfigError(field, value, allowed) from None



def _settable_fields(model: type[BaseModel]) -> list[str]:
    """`model`'s fields a config may set, sorted: not those typed `None`, which exist only to
    be refused with a reason (a secret inline: `encryption_secret`, an s3 tier's
    `access_key_id`), and which a typo's list of allowed fields had offered."""
    return sorted(name for name, field in model.model_fields.items()
                  if field.annotation is not type(None))

def _model_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel]:
    """The model that `loc` (a pydantic error's location of a field) lies in, inside `model`:
    a typo in a nested mapping lists that mapping's fields, not the outer model's."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            continue  # a list's index, or a mapping's key: the same model's items
        inner = _models_in(field.annotation)
        if not inner:
            break
        model = inner[0]
    return model


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation names (`Model`, `Model | None`, `list[Model]`, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def read_config_file(path: str | Path) -> Any:
    """The data in a YAML or JSON file (JSON when its name ends in .json), not yet validated.

    Raises:
        ConfigError: unreadable file or bad syntax (the message names the file).
    """
    try:
        text = Path(path).read_text()
        return json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError("config file", str(path),
                          f"a readable YAML or JSON file ({exc})") from exc
