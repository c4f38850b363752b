"""The explicit model-name table: one served model, plus aliases that are `current` or `deprecated`.

Rules (the seeds' advice: renames are explicit and announced, never silent):

- A request names a model; the name must be the served name or an alias in the table. Anything
  else gets 404 ``model_not_found`` whose message lists the valid names. Nothing is rerouted by
  guessing (no prefix matching, no case folding, no fallback to the default).
- A ``current`` alias is served like the served name.
- A ``deprecated`` alias is still served, but announced: the response carries the header
  ``x-cedlm-model-deprecated: <alias> -> <served name>`` and a ``warning`` field in the JSON body
  (the first chunk of a stream).
- The response's ``model`` is exactly the name the client asked for.

Defaults (see ``default_served_name`` / ``DEFAULT_ALIASES``): the shipped default model is served
as ``cedlm-small`` (the preset it was trained from), a preset ``P`` as ``cedlm-P``, a checkpoint
directory under its directory name; ``cedlm`` is a current alias of whatever is served. There are
no deprecated aliases by default: they exist for renames, and the CLI adds them with
``--alias OLD=deprecated``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_NAME = "cedlm-small"
DEFAULT_ALIASES: dict[str, str] = {"cedlm": "current"}
STATUSES = ("current", "deprecated")
DEPRECATION_HEADER = "x-cedlm-model-deprecated"


class ModelNotFound(LookupError):
    def __init__(self, name, valid: list[str]):
        self.name, self.valid = name, valid
        super().__init__(f"The model {name!r} does not exist. Valid model names: {', '.join(valid)}")


def default_served_name(model) -> str:
    """The served name for `cedlm serve --model MODEL` (None = the shipped default model)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    from cedlm.config.presets import PRESETS
    if isinstance(model, str) and model in PRESETS:
        return f"cedlm-{model}" if model in ("tiny", "small") else model
    return Path(str(model)).resolve().name


def parse_alias(spec: str) -> tuple[str, str]:
    """``NAME`` / ``NAME=current`` / ``NAME=deprecated`` -> (name, status)."""
    name, _, status = spec.partition("=")
    name, status = name.strip(), (status.strip() or "current")
    if not name:
        raise ValueError(f"alias: empty name in {spec!r}")
    if status not in STATUSES:
        raise ValueError(f"alias: status {status!r} in {spec!r} is not one of {STATUSES}")
    return name, status


@dataclass(frozen=True)
class Resolved:
    requested: str          # what the client asked for (echoed as the response's `model`)
    served: str             # the served model it names
    status: str             # "current" | "deprecated"

    @property
    def deprecated(self) -> bool:
        return self.status == "deprecated"

    @property
    def header(self) -> str:
        return f"{self.requested} -> {self.served}"

    @property
    def warning(self) -> str | None:
        if not self.deprecated:
            return None
        return (f"model {self.requested!r} is a deprecated alias of {self.served!r}; "
                f"it is served, but use {self.served!r}")


class AliasTable:
    def __init__(self, served_name: str, aliases: dict[str, str] | None = None):
        if not served_name:
            raise ValueError("served_model_name: must not be empty")
        self.served_name = served_name
        self.aliases: dict[str, str] = {}
        for name, status in (DEFAULT_ALIASES if aliases is None else aliases).items():
            if status not in STATUSES:
                raise ValueError(f"alias: status {status!r} of {name!r} is not one of {STATUSES}")
            if name == served_name:
                continue          # the served name is always current
            self.aliases[name] = status

    @classmethod
    def from_cli(cls, served_name: str, specs: list[str] | None) -> "AliasTable":
        table = dict(DEFAULT_ALIASES)
        for spec in specs or []:
            name, status = parse_alias(spec)
            table[name] = status
        return cls(served_name, table)

    def names(self) -> list[str]:
        return [self.served_name, *self.aliases]

    def describe(self) -> list[str]:
        out = [self.served_name]
        for name, st in self.aliases.items():
            out.append(name if st == "current" else f"{name} (deprecated, use {self.served_name})")
        return out

    def resolve(self, name: str | None) -> Resolved:
        if name is None:                      # OpenAI requires `model`; like vLLM, default to the served one
            return Resolved(self.served_name, self.served_name, "current")
        if name == self.served_name:
            return Resolved(name, self.served_name, "current")
        if name in self.aliases:
            return Resolved(name, self.served_name, self.aliases[name])
        raise ModelNotFound(name, self.describe())
