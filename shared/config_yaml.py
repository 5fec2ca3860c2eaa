"""YAML config files parsed with a bound on size and on alias expansion.

An alias bomb ("billion laughs": each anchor lists the previous one ten times) is a few hundred
bytes that PyYAML composes into shared nodes at once, but that anything walking the result (the
command-line parser's merge and type checks, a dataclass build) expands: produce and train grew
past 5 GB. The node graph is measured before it is constructed: its size with every alias
expanded is counted in linear time, and a document past :data:`MAX_EXPANDED_NODES`, or longer
than :data:`MAX_CONFIG_CHARS`, is refused in one line. So is a list of more than
:data:`MAX_LIST_ITEMS` items: the parser's type check of a list costs the square of its length
(jsonargparse copies its state once per item: 10,000 layer ids took 31 s of CPU to be refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

import yaml

from sparkforge.shared.errors import ConfigError
from sparkforge.shared.storage import check_regular

MAX_CONFIG_CHARS: Final = 4 << 20
"""Longest config text (4 Mi characters; real configs are a few KiB)."""
MAX_EXPANDED_NODES: Final = 1_000_000
"""Most YAML nodes a config may hold once its aliases are expanded."""
MAX_LIST_ITEMS: Final = 1024
"""Most items of one YAML list in a config (layer ids, mix entries, image sources: real ones
hold tens)."""


def check_yaml(text: str, source: str) -> None:
    """Refuse ``text`` (from ``source``, named first when given) past the size or alias-expansion
    bound; malformed YAML is left to the loader, which names the line."""
    where = f"{source}: " if source else ""
    if len(text) > MAX_CONFIG_CHARS:
        raise ConfigError(f"{where}more than the {MAX_CONFIG_CHARS:,} characters a config may "
                          "hold")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return
    if node is not None and expanded_nodes(node) > MAX_EXPANDED_NODES:
        raise ConfigError(f"{where}its YAML aliases expand to more than {MAX_EXPANDED_NODES:,} "
                          "nodes (an alias bomb?); write the values out instead of nesting "
                          "aliases")
    longest = 0 if node is None else longest_list(node)
    if longest > MAX_LIST_ITEMS:
        raise ConfigError(f"{where}a list of {longest:,} items, more than the "
                          f"{MAX_LIST_ITEMS:,} one config list may hold")


def longest_list(root: yaml.Node) -> int:
    """Items of the document's longest YAML sequence (each distinct node visited once)."""
    seen: set[int] = set()
    stack, longest = [root], 0
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            longest = max(longest, len(node.value))
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(part for pair in node.value for part in pair)
    return longest


def expanded_nodes(root: yaml.Node) -> int:
    """Nodes in the document with every alias expanded (shared nodes counted per use), counted
    once per distinct node; stops early past the bound."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a recursive alias counts once (the loader refuses it anyway)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_EXPANDED_NODES:
                break
        sizes[id(node)] = total
        return total

    return size(root)


def load_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load`` of a config, within the bounds."""
    check_yaml(text, source)
    return yaml.safe_load(text)


def load_yaml_file(path: str | Path) -> Any:
    """:func:`load_yaml` of a local file, read only up to the size bound (a regular file only)."""
    check_regular(path, path)
    with Path(path).open(encoding="utf-8") as f:
        text = f.read(MAX_CONFIG_CHARS + 1)
    return load_yaml(text, str(path))


def use_bounded_yaml() -> None:
    """Make jsonargparse's YAML loader (every ``--config`` file and YAML value it parses, the
    LightningCLI's included) check the bounds first; idempotent."""
    from jsonargparse import get_loader, set_loader

    loader = get_loader("yaml")
    if getattr(loader, "bounded", False):
        return

    def load(text: str) -> Any:
        check_yaml(text, "")
        return loader(text)

    load.bounded = True  # type: ignore[attr-defined]
    set_loader("yaml", load, (yaml.YAMLError,))
