"""Config machinery: typed sections read from one YAML file per experiment, with `key=value` overrides.

Every field has help text (``field_help``) and is type-checked when loaded: an unknown key or a value of
the wrong type is a ``ConfigError`` that names the key and the file. Each package keeps its sections beside
its code, as TRL keeps a trainer's config next to the trainer (`infer.config`: models, sampling, runtime,
benchmark, Ray; `inputs.records`: the trace/problem source; `data_gen.config`: data generation;
`train.config`: probes, verifiers, evaluation, tracking, and `ExperimentConfig`, which assembles them all
and which only the CLIs and `train.pipeline` hold). Library functions below `train` take the sections
they read.
"""
from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


def opt(default: Any, help: str, **kw) -> Any:
    """A dataclass field with help text (shown by `--help-config`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def opt_from(owner: type, name: str, help: str | None = None) -> Any:
    """A config field whose default is dataclass `owner`'s field `name` (the library's default, written once there;
    a tuple becomes a list), with `help` or, where `owner` has one, its field's help."""
    spec = next((f for f in dataclasses.fields(owner) if f.name == name), None)
    if spec is None:
        raise TypeError(f"{owner.__name__} has no field {name!r}")
    if spec.default is not dataclasses.MISSING:
        default = spec.default
    elif spec.default_factory is not dataclasses.MISSING:
        default = spec.default_factory()
    else:
        raise TypeError(f"{owner.__name__}.{name} has no default")
    text = help if help is not None else spec.metadata.get("help")
    if text is None:
        raise TypeError(f"{owner.__name__}.{name} has no help text: pass one")
    return opt(list(default) if isinstance(default, tuple) else default, text)


def section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


def check_device(value: Any, key: str) -> None:
    """ConfigError unless `value` names a torch device the way the configs do."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:(0|[1-9]\d*))?", str(value)):
        raise ConfigError(f"{key}: {value!r} is not a device; use auto, cpu, cuda, cuda:N or mps")


def check_positive(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if value is not None and value < 1:
        raise ConfigError(f"{type(obj).__name__}.{name} must be >= 1, got {value}")


# ----------------------------------------------------------------------------- loading
def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors, options = [], [a for a in args if a is not type(None)]
        for arg in options:
            try:
                return _coerce(value, arg, key, where)
            except ConfigError as err:
                errors.append(str(err))
        if len(errors) > 1:  # name every accepted form (bool | Literal["auto"]: "a bool or one of ['auto']")
            forms = [f"one of {list(get_args(a))}" if get_origin(a) is Literal
                     else f"{'an' if _type_name(a)[0] in 'aeiou' else 'a'} {_type_name(a)}" for a in options]
            raise ConfigError(f"{key}: {value!r} is not {' or '.join(forms)} (in {where})")
        raise ConfigError(errors[0] if errors else f"{key}: bad value in {where}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)} (in {where})")
        return value
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r} (in {where})")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping (in {where})")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a section (mapping), got {value!r} (in {where})")
        return build(tp, value, where, prefix=key + ".")
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as text
        try:
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool) or tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r} (in {where})")
    if not isinstance(value, tp):
        # YAML reads `layers: 7` as a number (and 010 as 8): text must be quoted, in the shell twice
        quote = (f"; write it quoted: {key.rsplit('.', 1)[-1]}: '{value}' in the YAML, {key}=\"'{value}'\" on the "
                 "command line") if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool) else ""
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r} (in {where}){quote}")
    return value


def build(cls: type, values: dict, where: str = "<dict>", prefix: str = "") -> Any:
    """Instantiate dataclass `cls` from a (nested) dict, checking every key and type."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in values if k not in names]
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]} in {where}; "
                          f"valid keys of {prefix.rstrip('.') or 'the top level'}: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], prefix + k, where) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{err} (in {where})") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` → (["a", "b"], value); the value is read as YAML (numbers, bools, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. data.num_samples=8)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:  # not YAML (e.g. a path with a colon): keep the text
        value = raw
    return key.strip().split("."), value


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part} is not a section")
    node[path[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML keeps the last: a second `data:` section
    would silently drop the first)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` (merged below, later keys winning)
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):  # (the parent's error says what is wrong)
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}): YAML would keep the second only; merge them", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def load_yaml(cls: type, path: str | Path | None = None, overrides: Sequence[str] = (), *,
              other_sections: Sequence[str] = ()):
    """Dataclass `cls` from a YAML file (or its defaults when path is None) with `key=value` overrides.
    The whole experiment config (probe-train's) is `train.config.load_config`.

    other_sections: top-level sections the file may hold that `cls` does not read (probe-bench skips the data
    and training sections of the shared experiment YAML); they are dropped unread. Any other unknown key, a
    misspelt section included, is still an error, and an override must name a key of `cls`."""
    tree: dict = {}
    where = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            tree = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
        if tree is None:  # (a copy that failed, a file of comments): not the defaults, silently
            raise ConfigError(f"{path} holds no settings; name the sections to set, or leave out --config for the "
                              "built-in defaults")
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        where = str(path)
    tree = {k: v for k, v in tree.items() if k not in other_sections}
    for text in overrides:
        keys, value = parse_override(text)
        if keys[0] in other_sections:
            raise ConfigError(f"override {text!r}: this command reads only the keys "
                              f"{sorted(f.name for f in dataclasses.fields(cls))}; {keys[0]} is not one of them")
        _set_path(tree, keys, value)
    if overrides:
        where += f" + overrides {list(overrides)}"
    return build(cls, _expand_home(tree), where)


def _expand_home(value):
    """'~/x' as the home folder's x, in every setting: a path written so in the YAML, or after `key=` where the
    shell does not expand it, would otherwise be checked as one path and opened as another ('./~/x')."""
    if isinstance(value, dict):
        return {k: _expand_home(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_home(v) for v in value]
    if isinstance(value, str) and value.startswith("~/"):
        return os.path.expanduser(value)
    return value


def check_folder(path: str | Path, what: str) -> None:
    """A folder the job will write: neither it nor any parent may be a file."""
    path = Path(path).expanduser()
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"{what}: {p} is a file, not a folder; choose another {what}")


def to_dict(cfg: Any, sections: Sequence[str] | None = None) -> dict:
    """The config as plain data; sections: only these fields of it."""
    if sections is None:
        return dataclasses.asdict(cfg)
    return {name: dataclasses.asdict(getattr(cfg, name)) for name in sections}


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`key.sub: old -> new` for every setting that differs between two configs as dicts (nested sections
    followed down; a key one side lacks reads as None)."""
    diffs = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) or isinstance(b, dict):
            if a != b:
                diffs += config_diff(a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {},
                                     f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return diffs


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def field_help(cls: type, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(key, help, default) for every field, nested sections flattened with dots."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(field_help(tp, prefix + f.name + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((prefix + f.name, f.metadata.get("help", ""), default))
    return rows


def format_help(cls: type) -> str:
    return "\n".join(f"  {k:34s} {h}  [default: {d!r}]" for k, h, d in field_help(cls))
