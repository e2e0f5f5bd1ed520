"""Composing dflash/conf/ with Hydra into the typed schemas of dflash/config/schema.py, strictly.

`register()` puts the schemas in Hydra's ConfigStore; `check_overrides` refuses a command-line key the schema
does not name before Hydra composes anything; `to_object` turns a composed config into its typed object
(`check_schema` first: a key the schema does not name, `+key=value` included, is refused with the nearest
key); `compose(overrides)` does all of it outside a Hydra job (the Python API, the benches). `CONF_DIR` is
the package's own dflash/conf/, so an installed copy composes the same presets as a clone.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, get_type_hints

from dflash.config.schema import EvalConfig
from dflash.util.errors import ConfigError


def register() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="eval_schema", node=EvalConfig)


def _dataclass_of(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp  # type: ignore[return-value]
    inner = [a for a in getattr(tp, "__args__", ()) if dataclasses.is_dataclass(a)]  # Optional[Schema]
    return inner[0] if inner else None


def unknown_keys(tree: dict[str, Any], schema: type, prefix: str = "") -> list[tuple[str, list[str]]]:
    """Keys of a composed config (a plain dict) that its schema does not name -> [(dotted key, the keys the schema has
    there)]."""
    hints, names = get_type_hints(schema), [f.name for f in dataclasses.fields(schema)]
    out = []
    for k, v in tree.items():
        if k not in names:
            out.append((prefix + k, names))
        elif isinstance(v, dict) and (sub := _dataclass_of(hints[k])) is not None:
            out += unknown_keys(v, sub, f"{prefix}{k}.")
    return out


def _unknown_key_error(bad: list[tuple[str, list[str]]]) -> ConfigError:
    key, names = bad[0]
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], names, n=1)
    where = key.rsplit(".", 1)[0] + "." if "." in key else ""
    hint = f" (did you mean {where}{near[0]}?)" if near else ""
    more = f"; also {', '.join(k for k, _ in bad[1:])}" if len(bad) > 1 else ""
    return ConfigError(
        f"{key} is not a config key{hint}{more}. The keys {'of ' + where[:-1] if where else 'at the top'} are: "
        f"{', '.join(names)} "
        "(schema: dflash/config/schema.py; it is strict: `+key=value` cannot add a key either)"
    )


def check_schema(cfg: Any, schema: type = EvalConfig) -> None:
    """Refuse keys the schema does not name (a `+key=value` typo would otherwise be carried and ignored)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    tree.pop("hydra", None)  # type: ignore[union-attr]
    bad = unknown_keys(tree, schema)  # type: ignore[arg-type]
    if bad:
        raise _unknown_key_error(bad)


GLOBAL_GROUPS = (
    "suite",
)  # dflash/conf/ groups at @package _global_: they set hydra.* (a sweep's parameters), no key of the schema


def check_overrides(args: list[str], schema: type = EvalConfig) -> None:
    """Refuse command-line overrides of keys the schema does not name, before Hydra composes anything
    (its own message would suggest `+key=...`, which the strict schema refuses too)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in args if "=" in a and not a.startswith("-")])
    except Exception:
        return  # malformed: Hydra says what is wrong with it
    tree: dict[str, Any] = {}
    for o in parsed:
        parts = o.key_or_group.split(".")
        if parts[0] == "hydra" or "/" in o.key_or_group or o.package or o.key_or_group in GLOBAL_GROUPS:
            continue
        node = tree
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}  # (a group choice `drafter=init` left None here)
            node = node[part]
        node.setdefault(parts[-1], None)
    bad = unknown_keys(tree, schema)
    if bad:
        raise _unknown_key_error(bad)


def to_container(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]


def to_object(cfg: Any, schema: type = EvalConfig) -> Any:
    """The composed Hydra config as its typed schema object (resolved, checked: an unknown key, a
    ??? left unset, an interpolation that fails or a value a schema's __post_init__ refuses raises
    ConfigError)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    check_schema(cfg, schema)
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(
            f"{e.full_key} has no value (??? in dflash/conf/): pass {e.full_key}=... on the command line"
        ) from e
    except OmegaConfBaseException as e:
        raise ConfigError(str(e).strip()) from e


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: list[str], config_name: str = "config", schema: type = EvalConfig) -> Any:
    """dflash/conf/<config_name>.yaml composed with `overrides` outside a Hydra job (the benches) -> its typed
    schema object; a key the schema does not name or a value Hydra cannot compose raises ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    check_overrides(overrides, schema)
    register()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from e
    return to_object(cfg, schema)
