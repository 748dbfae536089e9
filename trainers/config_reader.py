"""Reading a config: YAML files (stride/safe_yaml.py), `section.field=value` overrides, the model section by the
task's own Config, the one-line error for anything pydantic refuses, and docs/configuration.md, generated from the
schema's field descriptions (`python -m stride.trainers.config_reader > docs/configuration.md`, `make docs`).

Precedence: `section.field=value` on the command line > the YAML file > the schema's defaults (trainers/config.py).
Values on the command line are parsed as YAML (`train.max_steps=null`, `model.hidden_sizes=[128,64]`), then
type-checked by pydantic. Every user-fixable problem becomes a `ConfigError` whose message is one line naming the
key, the bad value and the fix.
"""

from __future__ import annotations

import re

import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from stride.errors import ConfigError, quote
from stride.safe_yaml import RefusedYAML, load_yaml, read_mapping
from stride.trainers.config import SECTIONS, Config, Section, redact

__all__ = ["from_dict", "load_config", "to_yaml"]


def _task_name(raw: dict[str, Any] | None) -> str:
    from stride.trainers.tasks import DEFAULT

    return str(((raw or {}).get("model") or {}).get("name") or DEFAULT)



def section_class(section: str, raw: dict[str, Any] | None = None) -> type[Section]:
    """The pydantic class of a section; for `model`, the Config of the task that raw's model.name selects."""
    if section != "model":
        return SECTIONS[section]
    from stride.trainers.tasks import task_class

    return task_class(_task_name(raw)).Config



def section_keys(cls: type[BaseModel]) -> list[str]:
    """The keys a section takes in YAML: each field's alias where it has one (init.from: `from` is a keyword)."""
    return [f.alias or name for name, f in cls.model_fields.items()]



def _closest(word: str, options: list[str]) -> str:
    match = difflib.get_close_matches(word, options, n=1)
    return f"did you mean {match[0]}?" if match else f"valid: {', '.join(options)}"


# Keys that moved, and where to: a config that still sets one exits 2 naming the new key.
MOVED_KEYS = {f"data.{k}": f"model.{k}" for k in ("label_column", "feature_columns", "standardize", "nan_policy")}



def _check_keys(raw: dict[str, Any], origin: str, full: dict[str, Any] | None = None) -> None:
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{origin}: unknown section {quote(section)}; {_closest(str(section), list(SECTIONS))}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{origin}: section '{section}' must be a mapping of field: value, got {quote(body)}")
        fields = section_keys(section_class(section, full if full is not None else raw))
        for key in body:
            if (moved := MOVED_KEYS.get(f"{section}.{key}")) is not None:
                raise ConfigError(f"{origin}: {section}.{key} moved to {moved} (the task's own setting); write "
                                  f"{moved}={quote(body[key])} instead")
            if key not in fields:
                where = f" for model.name {_task_name(full if full is not None else raw)}" if section == "model" else ""
                raise ConfigError(f"{origin}: unknown key {quote(f'{section}.{key}')}{where}; {_closest(str(key), fields)}")



def parse_override(item: str) -> tuple[str, str, Any]:
    """`section.field=value` -> (section, field, YAML-parsed value)."""
    key, sep, text = item.partition("=")
    section, dot, field = key.strip().partition(".")
    if not sep or not dot or not field:
        raise ConfigError(f"override {quote(item)} must look like section.field=value, e.g. train.max_steps=100")
    try:
        value = load_yaml(text) if text.strip() else None
    except RefusedYAML as e:
        raise ConfigError(f"override {quote(item)}: its value is refused: {e.problem}; {e.fix}") from None
    except yaml.YAMLError:
        value = text
    return section, field, value



def apply_overrides(raw: dict[str, Any], overrides: list[str], origin: str = "command line") -> dict[str, Any]:
    return set_values(raw, [parse_override(item) for item in overrides], origin)



def set_values(raw: dict[str, Any], parsed: list[tuple[str, str, Any]], origin: str = "command line") -> dict[str, Any]:
    """A copy of `raw` with each (section, field, value) set; a dotted field (early_stopping.min_delta) sets one
    key of a section-valued key. Unknown keys are refused (ConfigError), naming the closest."""
    merged = {k: dict(v or {}) for k, v in raw.items()}
    for section, field, value in parsed:  # model.name first: the task it picks decides the valid model.* keys
        if (section, field) == ("model", "name"):
            merged.setdefault("model", {})["name"] = value
    for section, field, value in parsed:
        key, _, inner = field.partition(".")
        _check_keys({section: {key: value}}, origin, merged)
        body = merged.setdefault(section, {})
        body[key] = _set_inner(section_class(section, merged), f"{section}.{key}", body.get(key), inner, value,
                               origin) if inner else value
    return merged



def _inner_section(cls: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The section class a key holds (train.early_stopping: EarlyStoppingSection), or None for a plain value."""
    info = next((f for name, f in cls.model_fields.items() if key in (name, f.alias)), None)
    args = (info.annotation, *typing.get_args(info.annotation)) if info else ()
    return next((t for t in args if isinstance(t, type) and issubclass(t, BaseModel)), None)



def _set_inner(cls: type[BaseModel], where: str, current: Any, path: str, value: Any, origin: str) -> dict[str, Any]:
    """`where.path=value` (train.early_stopping.min_delta=0.01): one key of a section-valued key set, the others
    kept as the YAML had them (a null or absent section starts empty and takes its defaults)."""
    inner = _inner_section(cls, where.rpartition(".")[2])
    if inner is None:
        raise ConfigError(f"{origin}: {where} is a value, not a section with keys of its own; set it whole, e.g. "
                          f"{where}=<value>")
    key, _, rest = path.partition(".")
    keys = section_keys(inner)
    if key not in keys:
        raise ConfigError(f"{origin}: unknown key {quote(f'{where}.{key}')}; {_closest(key, keys)}")
    out = dict(current) if isinstance(current, dict) else {}
    out[key] = _set_inner(inner, f"{where}.{key}", out.get(key), rest, value, origin) if rest else value
    return out



def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    return read_mapping(path, "--config", "trainers/configs/char_gpt.yaml", ConfigError,
                        "it needs at least the sections you change, e.g. 'model: {name: mlp}'")


def build_config(raw: dict[str, Any], origin: str = "config") -> Config:
    _check_keys(raw, origin)
    # The model section is validated by the task's own Config, then handed to Config as that instance.
    try:
        model = section_class("model", raw).model_validate(raw.get("model") or {})
    except ValidationError as e:
        raise ConfigError(describe_validation_error(e, raw, prefix="model")) from None
    try:
        return absolute_paths(Config.model_validate(dict(raw, model=model)))
    except ValidationError as e:
        raise ConfigError(describe_validation_error(e, raw)) from None



def _is_path_field(annotation: Any) -> bool:
    return annotation is Path or (typing.get_origin(annotation) in (typing.Union, types.UnionType)
                                  and Path in typing.get_args(annotation))



def absolute_paths(cfg: Config) -> Config:
    """Every field typed Path (or Path | None), in every section and a task's own Config, made absolute against
    the working directory where the config is loaded: the driver's, where the user wrote it. Workers (Ray, other
    nodes, `ray job submit`) run elsewhere; they rebuild the config from the driver's dict, where the paths are
    already absolute, so this is a no-op there."""
    for name in type(cfg).model_fields:
        section = getattr(cfg, name)
        for field, info in type(section).model_fields.items():
            value = getattr(section, field)
            if _is_path_field(info.annotation) and isinstance(value, Path) and not value.is_absolute():
                object.__setattr__(section, field, Path(os.path.abspath(value.expanduser())))
                section.model_fields_set.add(field)  # a resolved default travels to the workers as set here
                cfg.model_fields_set.add(name)
    return cfg



def _list_item_error(err: dict, raw: dict[str, Any]) -> str | None:
    """An error inside an entry of a list of sections (optim.groups, data.train): names the entry and its key,
    data.train[1].weight, and what the entry's keys are."""
    loc = err["loc"]
    if len(loc) < 4 or not isinstance(loc[2], int) or loc[0] not in SECTIONS:
        return None
    section, field, index, sub = loc[:4]
    items = raw.get(section, {}).get(field) if isinstance(raw.get(section), dict) else None
    item = items[index] if isinstance(items, list) and index < len(items) else None
    value = item.get(sub) if isinstance(item, dict) else None
    info = section_class(section, raw).model_fields.get(field)
    lists = [a for a in ((info.annotation, *typing.get_args(info.annotation)) if info else ()) if typing.get_origin(a) is list]
    entry = next((t for a in lists for t in typing.get_args(a) if isinstance(t, type) and issubclass(t, BaseModel)), None)
    key, msg = f"{section}.{field}[{index}].{sub}", err["msg"].removeprefix("Value error, ")
    keys = ", ".join(entry.model_fields) if entry else "?"
    if err["type"] == "extra_forbidden":
        return f"{key} is not a key of a {section}.{field} entry (its keys: {keys}); fix or remove it"
    if err["type"] == "missing":
        return f"{section}.{field}[{index}] has no {sub}; every entry needs one (its keys: {keys})"
    if msg.startswith("Input should be"):
        msg = "must be " + msg.removeprefix("Input should be ")
    described = entry.model_fields[sub].description if entry and sub in entry.model_fields else None
    return f"{key} ({quote(value)}) {msg}" + ("" if "; use " in msg else f"; fix that entry ({described})" if described
                                             else "; fix that entry")



def _nested_section_error(err: dict, raw: dict[str, Any]) -> str | None:
    """An error inside a section-valued key (train.early_stopping): names the key inside it, with the value."""
    loc = [str(p) for p in err["loc"]]
    if len(loc) < 3 or loc[0] not in SECTIONS:
        return None
    inner = _inner_section(section_class(loc[0], raw), loc[1])
    if inner is not None and err["type"] == "extra_forbidden":
        return (f"{'.'.join(loc[:3])} is not a key of {loc[0]}.{loc[1]} (its keys: {', '.join(inner.model_fields)}); "
                f"fix or remove it")
    if inner is None or loc[2] not in inner.model_fields:
        return None
    given = raw.get(loc[0], {}).get(loc[1]) if isinstance(raw.get(loc[0]), dict) else None
    value = given.get(loc[2]) if isinstance(given, dict) else None
    key, msg = ".".join(loc[:3]), err["msg"].removeprefix("Value error, ")
    if err["type"] == "literal_error":
        msg = msg.replace("Input should be", "must be one of")
    elif msg.startswith("Input should be"):
        msg = "must be " + msg.removeprefix("Input should be ")
    if "; use " in msg:
        return f"{key} ({quote(value)}) {msg}"
    return f"{key} ({quote(value)}) {msg}; set {key}=<value> ({inner.model_fields[loc[2]].description})"



def describe_validation_error(e: ValidationError, raw: dict[str, Any], prefix: str | None = None) -> str:
    err = e.errors()[0]
    if prefix is None and (item := _list_item_error(err, raw) or _nested_section_error(err, raw)) is not None:
        return item
    loc = ([prefix] if prefix else []) + [str(p) for p in err["loc"] if not str(p).isdigit()]
    # pydantic reports the failing member of a union ("int", "literal['auto']"): keep section.field only.
    loc = loc[:2]
    key = ".".join(loc)
    value: Any = raw
    for part in loc:
        value = value.get(part) if isinstance(value, dict) else None
    if key == "tracking.mlflow_uri" and isinstance(value, str):  # its password never reaches a log
        value = redact(value)
    elif isinstance(value, str) and "://" in value:  # nor any URI's user:password@ part (a bucket's keys)
        value = re.sub(r"(//)[^/@]*@", r"\1***@", value)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] in ("literal_error",):
        msg = msg.replace("Input should be", "must be one of")
    elif msg.startswith("Input should be"):
        msg = "must be " + msg.removeprefix("Input should be ")
    if not key:  # a check across sections: its message names the keys
        return msg if msg.partition(".")[0] in SECTIONS else f"config: {msg}"
    if msg.startswith(key):
        return msg
    if "; use " in msg:  # our own validators already say how to fix it
        return f"{key} ({quote(value)}) {msg}"
    field = section_class(loc[0], raw).model_fields.get(loc[1]) if len(loc) == 2 and loc[0] in SECTIONS else None
    hint = f" ({field.description})" if field is not None and field.description else ""
    if err["type"] in ("missing", "too_long") and field is not None and typing.get_origin(field.annotation) is tuple:
        # A tuple of the wrong length: pydantic names the missing item ("Field required"), not the length.
        n = len(typing.get_args(field.annotation))
        example = list(field.default) if isinstance(field.default, tuple) else "<value>"
        return f"{key} ({quote(value)}) needs {n} values, not {len(value) if isinstance(value, list) else 1}; set {key}={example}{hint}"
    return f"{key} ({quote(value)}) {msg}; set {key}=<value>{hint}"



def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    raw = read_yaml(path) if path is not None else {}
    _check_keys(raw, str(path))
    return build_config(apply_overrides(raw, list(overrides)), origin=str(path or "config"))



def from_dict(d: dict[str, Any]) -> Config:
    """Workers rebuild the driver's resolved config from its dict (importing the task it names)."""
    return build_config(d, origin="config")



def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.full_dict(), sort_keys=False)



def _default_text(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return ""
    return json_text(value)



def json_text(value: Any) -> str:
    import json

    return json.dumps(list(value) if isinstance(value, tuple) else value)



def _rows(prefix: str, cls: type[BaseModel]) -> list[str]:
    return [f"| `{prefix}.{f.alias or name}` | `{_default_text(f)}` | {f.description or ''} |"
            for name, f in cls.model_fields.items()]



def reference_markdown() -> str:
    """docs/configuration.md: every key of every section and of each built-in task, with default and description.
    Regenerate with `make docs`; tests/test_config.py fails when the file is stale."""
    from stride.trainers.tasks import BUILTIN, task_class

    out = ["# Configuration reference", "",
           "Generated from the pydantic field descriptions in `trainers/config.py` and the built-in tasks' `Config` "
           "classes by `make docs` (`python -m stride.trainers.config_reader`); a test fails when it is stale.", "",
           "Precedence: `section.field=value` on the command line > the YAML file > these defaults. Values on the "
           "command line are parsed as YAML (`train.max_steps=null`, `model.hidden_sizes=[128,64]`). A key inside a "
           "section-valued key is set alone, the others kept: `train.early_stopping.min_delta=0.01`.", ""]
    for section, cls in SECTIONS.items():
        out += [f"## `{section}`", "", cls.__doc__.strip() if section == "model" else "", "",
                "| key | default | description |", "|---|---|---|", *_rows(section, cls), ""]
        if section == "model":
            for name in BUILTIN:
                task = task_class(name).Config
                rows = [r for r in _rows("model", task) if not r.startswith("| `model.name`")]
                out += [f"### `model.name: {name}`", "", *(["| key | default | description |", "|---|---|---|"] + rows), ""]
            out += ["A task of your own (`model.name: \"<module>:<Class>\"`) adds the fields of its `Config`: "
                    "see [writing-a-task.md](writing-a-task.md).", ""]
    return "\n".join(line for i, line in enumerate(out) if line or (i and out[i - 1])) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(reference_markdown())
