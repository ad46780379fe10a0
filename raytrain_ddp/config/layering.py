"""How a config is put together: layers, later wins, validated as a whole.

    schema defaults  <  jobs/<job>.yaml  <  --config FILE  <  key.sub=value overrides

Every problem is reported at once, each naming its key path, the layer the bad value came from and
what is allowed. The `model:` and `dataset:` mappings are checked against the signatures of the
recipe's `build_model` / `build_datasets`, so loading a config finds the job and reads them (from the
recipe's source where it can: no torch to import): once per command, since the config keeps the job
(its `_origin`) for everything derived from it later, and imports the recipe when a run needs it.

    >>> config = load_config("digits", overrides=["train.epochs=2"])
    >>> with_overrides(config, "train.lr=3e-4").train.lr
    0.0003
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from raytrain_ddp.config import recipe as recipes
from raytrain_ddp.config.schema import Config, ConfigError, flatten


class Layer(NamedTuple):
    source: str  # where the values came from, for error messages
    data: dict[str, Any]


@dataclass(frozen=True)
class Origin:
    """What a config was made of: the job it was validated against, the job's own layers (the
    defaults and the job's YAML) and the layers over them."""

    job: recipes.Job
    job_layers: tuple[Layer, ...]
    layers: tuple[Layer, ...] = ()

    @property
    def recipe(self) -> recipes.Recipe:
        """The job's recipe, imported on first use; a recipe that breaks the contract is a ConfigError."""
        try:
            return self.job.recipe
        except recipes.RecipeError as e:
            raise ConfigError(self.job.name, [str(e)]) from None


def load_config(job: str, *, config_file: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Find `job`, read its settings' schemas, layer the config files and overrides, validate everything."""
    found, job_layers = _job(job)
    layers = [Layer(str(config_file), _read_yaml(job, Path(config_file)))] if config_file else []
    return _validate(Origin(found, job_layers, (*layers, *_override_layers(job, overrides))))


def _job(job: str) -> tuple[recipes.Job, tuple[Layer, ...]]:
    """The job (its files and settings' schemas) and its own layers: the defaults and its YAML."""
    try:
        found = recipes.open_job(job)
    except recipes.RecipeError as e:
        raise ConfigError(job, [str(e)]) from None
    job_layers = [Layer("defaults", {"job": job})]
    if found.files.yaml:
        job_layers.append(Layer(str(found.files.yaml), _read_yaml(job, found.files.yaml)))
    return found, tuple(job_layers)


def with_overrides(config: Config, *overrides: str) -> Config:
    """A copy of `config` with `key.sub=value` overrides applied on top, validated."""
    origin = origin_of(config)
    return _validate(Origin(origin.job, origin.job_layers, origin.layers + _override_layers(config.job, overrides)))


def job_config(config: Config) -> Config:
    """The config of `config`'s job as its YAML sets it, before any other layer."""
    origin = origin_of(config)
    return _validate(Origin(origin.job, origin.job_layers), complete=False)


def with_data_settings(config: Config, settings: Mapping[str, Any], source: str) -> Config:
    """`config` with the settings its data decides (`{"model.num_classes": 3}`, from `source`): they
    take the place of the job's YAML and the defaults. One that a layer above them (a --config file, an
    override) sets to another value is refused, naming both. What the run decided beyond its layers
    (its resolved name and paths) is kept: only the sections of `settings` are validated anew."""
    origin = origin_of(config)
    layer = Layer(source, _nested(settings))
    data = _validate(Origin(origin.job, (*origin.job_layers, layer)), complete=False).flat()
    given = {".".join(path): above.source for above in origin.layers for path in flatten(above.data)}
    current = config.flat()
    problems = [
        f"{key}={yaml_value(current.get(key))} (from {given[key]}) disagrees with {source}, which gives "
        f"{key}={yaml_value(data[key])}: leave {key} out (the data sets it) or set {key}={yaml_value(data[key])}"
        for key in settings
        if key in given and current.get(key) != data[key]
    ]
    if problems:
        raise ConfigError(config.job, problems)
    derived = Origin(origin.job, (*origin.job_layers, layer), origin.layers)
    fresh = _validate(derived)
    updated = config.model_copy(update={section: getattr(fresh, section) for section in layer.data})
    updated._origin = derived
    return updated


def _nested(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`{"model.num_classes": 3}` as `{"model": {"num_classes": 3}}`."""
    nested: dict[str, Any] = {}
    for key, value in settings.items():
        *sections, name = key.split(".")
        inner = nested
        for section in sections:
            inner = inner.setdefault(section, {})
        inner[name] = value
    return nested


def origin_of(config: Config) -> Origin:
    """How `config` was made; for a config rebuilt from a dict (a checkpoint's), its job is found and
    read now, and the dict is the layer over the job's own."""
    if config._origin is None:
        found, job_layers = _job(config.job)
        config._origin = Origin(found, job_layers, (Layer("saved config", config.to_dict()),))
    return config._origin


def overrides_against(config: Config, base: Config) -> list[str]:
    """The `key=value` overrides that turn `base` into `config`."""
    before = base.flat()
    return [f"{key}={yaml_value(value)}" for key, value in config.flat().items() if before.get(key) != value]


def _validate(origin: Origin, complete: bool = True) -> Config:
    """The config of `origin`'s layers, every problem at once; not `complete`: a recipe keyword that
    no layer sets, and that has no default (a model's path, say), is left out instead of refused."""
    merged: dict[str, Any] = {}
    sources: dict[tuple, str] = {}
    for layer in (*origin.job_layers, *origin.layers):
        _merge(merged, layer.data, layer.source, sources, ())
    job = merged.get("job", "?")
    problems: list[str] = []
    config = None
    try:
        config = Config.model_validate(merged)
    except ValidationError as e:
        problems += [_describe(err, sources) for err in e.errors()]
    recipe_kwargs = {}
    for section, schema in (("model", origin.job.model_kwargs), ("dataset", origin.job.dataset_kwargs)):
        try:
            recipe_kwargs[section] = schema.model_validate(merged.get(section) or {}).model_dump()
        except ValidationError as e:
            errors = [err for err in e.errors() if complete or err["type"] != "missing"]
            problems += [_describe(err, sources, prefix=(section,), schema=schema) for err in errors]
            if not errors:
                defaults = {name: f.default for name, f in schema.model_fields.items() if not f.is_required()}
                recipe_kwargs[section] = defaults | (merged.get(section) or {})
    if problems:
        raise ConfigError(job, problems)
    config = config.model_copy(update=recipe_kwargs)
    config._origin = origin
    return config


def _override_layers(job: str, overrides: Sequence[str]) -> tuple[Layer, ...]:
    layers, problems = [], []
    for override in overrides:
        try:
            layers.append(Layer("command line", _parse_override(override)))
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError(job, problems)
    return tuple(layers)


def _merge(into: dict, new: Mapping, source: str, sources: dict, path: tuple) -> None:
    for key, value in new.items():
        key_path = path + (key,)
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value, source, sources, key_path)
            continue
        into[key] = _copy(value)  # a copy: a later layer merges into it, never into this layer's data
        sources[key_path] = source
        if isinstance(value, Mapping):
            sources.update((key_path + inner, source) for inner in flatten(value))


def _copy(value: Any) -> Any:
    return {k: _copy(v) for k, v in value.items()} if isinstance(value, Mapping) else value


def _describe(err: dict, sources: dict, prefix: tuple = (), schema: type[BaseModel] = Config) -> str:
    loc = prefix + tuple(str(p) for p in err["loc"])
    key = ".".join(loc)
    if not loc:  # a check across sections: the message names the keys
        return err["msg"].removeprefix("Value error, ")
    source = _source_of(loc, sources)
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[len(prefix) : -1], schema)
        hint = difflib.get_close_matches(loc[-1], allowed, n=1)
        did_you_mean = f"; did you mean '{hint[0]}'?" if hint else ""
        return f"{key}: unknown key (from {source}); allowed keys here: {', '.join(allowed) or '(none)'}{did_you_mean}"
    if err["type"] == "missing":
        return f"{key}: required, but no layer sets it"
    message = err["msg"].removeprefix("Value error, ")
    if isinstance(err.get("input"), Mapping):  # a check across a section's keys: the message names them
        return f"{key}: {message}"
    return f"{key}: {message} (got {err['input']!r}, from {source})"


def _source_of(loc: tuple, sources: dict) -> str:
    """The layer that set `loc` (or the nearest mapping above it)."""
    return next((sources[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in sources), "defaults")


def _allowed_keys(loc: tuple, schema: Any) -> list[str]:
    for part in loc:
        field = schema.model_fields.get(part) if isinstance(schema, type) and issubclass(schema, BaseModel) else None
        schema = field.annotation if field else None
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return sorted(schema.model_fields)
    return []


def _read_yaml(job: str, path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(job, [f"{path}: no such config file"])
    try:
        data = yaml.load(path.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(job, [f"{path}: not valid YAML: {e}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(job, [f"{path}: must be a mapping of keys to values, got {type(data).__name__}"])
    return data


def _parse_override(override: str) -> dict[str, Any]:
    key, sep, raw = override.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", key.strip()):
        raise ValueError(f"override {override!r}: expected key.sub=value, e.g. train.epochs=5")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ValueError(f"override {override!r}: value is not valid YAML: {e}") from None
    for part in reversed(key.strip().split(".")):
        value = {part: value}
    return value


def read_value(raw: str) -> Any:
    """A value as an override's `key=value` reads it: YAML (1.2's floats)."""
    return yaml.load(raw, Loader=_Loader)


def yaml_value(value: Any) -> str:
    """`value` as a `key=value` override writes it (a tuple as a list)."""
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` as a float (YAML 1.2), which PyYAML's 1.1 rules leave a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)
