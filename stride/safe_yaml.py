"""The one YAML loader for what a user or someone else wrote: configs, sweep files and cluster files.

yaml.safe_load builds only plain values, but it lets a key given twice in one mapping win silently (the setting a
user sees is not the one used), and it expands aliases without limit (a "billion laughs" document of a few hundred
bytes hangs the reader). `load` refuses both, and a node that contains itself, with RefusedYAML (the problem and the
fix), before building any object; a UTF-8 byte-order mark at the start is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from stride.errors import MAX_QUOTED_CHARS, quote


# YAML nodes a config may expand to, aliases counted each time they are used: a real config has hundreds; a
# "billion laughs" document of a few hundred bytes has 10^9, and building it would hang the driver.
MAX_YAML_NODES = 1_000_000



class RefusedYAML(yaml.YAMLError):
    """YAML that parses but that a config must not be: a key twice, an alias bomb, a node that contains itself."""

    def __init__(self, problem: str, fix: str, mark=None):
        super().__init__(problem)
        self.problem, self.fix, self.problem_mark = problem, fix, mark



class _ConfigLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """yaml.safe_load's loader, but a key given twice in one mapping is an error (YAML requires unique keys;
    PyYAML lets the last one win silently, so a setting the user sees in the file would not be the one used)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` overrides by design
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the constructor below says so
                continue
            if first is not key_node.start_mark:
                raise RefusedYAML(f"key {quote(key)} appears twice in one mapping (first at line {first.line + 1})",
                                  "keep only the one you mean", key_node.start_mark)
        return super().construct_mapping(node, deep)



def _expanded_nodes(node, memo: dict[int, int | None]) -> int:
    """Nodes of `node` with every alias expanded, counted without expanding (memo: id -> count, None while its
    children are being counted, which finds a node that contains itself)."""
    if id(node) in memo:
        if memo[id(node)] is None:
            raise RefusedYAML("an alias refers to a node that contains it", "remove the alias", node.start_mark)
        return memo[id(node)]
    memo[id(node)] = None
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    memo[id(node)] = total = 1 + sum(_expanded_nodes(child, memo) for child in children)
    if total > MAX_YAML_NODES:
        raise RefusedYAML(f"its aliases expand to more than {MAX_YAML_NODES} values", "write the values out, or "
                          "use fewer aliases (a config has hundreds of values)", node.start_mark)
    return total



def load_yaml(text: str) -> Any:
    """yaml.safe_load(text) for configs: refuses (RefusedYAML) duplicate keys and alias bombs, before building any
    object. A UTF-8 byte-order mark at the start is skipped."""
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_nodes(node, {})
        return loader.construct_document(node)
    except RecursionError:
        raise RefusedYAML("it nests deeper than Python can follow", "flatten it (a config nests a few levels)") from None
    except ValueError as e:  # a scalar Python refuses to convert: an integer of more than 4300 digits
        raise RefusedYAML(f"a value cannot be read ({' '.join(str(e).split())[:MAX_QUOTED_CHARS]})",
                          "write a shorter value") from None
    finally:
        loader.dispose()


def read_mapping(path: str | os.PathLike, label: str, example: str, error: type[Exception] = ValueError,
                 empty: str = "it needs at least one section") -> dict[str, Any]:
    """The mapping a YAML file holds, read with `load_yaml`. Anything else is `error` (one line naming `label`, the
    file, what is wrong and, for a missing or binary file, `example` of what to pass): the file missing, not UTF-8
    text, refused (a key twice, an alias bomb), not YAML, empty, or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{label} ({path}) does not exist; pass a YAML file such as {example}")
    try:
        raw = load_yaml(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{label} ({path}) is not a text file (byte {e.start} is not UTF-8); pass a YAML file such as "
                    f"{example}") from None
    except RefusedYAML as e:
        where = f", line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}" if e.problem_mark else ""
        raise error(f"{label} ({path}){where}: {e.problem}; {e.fix}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise error(f"{label} ({path}) is not valid YAML{where}: {getattr(e, 'problem', e)}; fix the syntax") from None
    if raw is None:
        raise error(f"{label} ({path}) is empty; {empty}")
    if not isinstance(raw, dict):
        raise error(f"{label} ({path}) must be a mapping of sections, got a {type(raw).__name__}")
    return raw
