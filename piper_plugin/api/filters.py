"""Tag filters: how directives select regions and nodes.

A filter is a comma-separated list of ``key=value`` terms, all of which must hold. Keys are
tag names (``PP``, ``EP``, free-form tags) or the node attributes ``kind``, ``mb``, ``stage``,
``region``, ``rank``; values are fnmatch patterns (``PP=*``, ``kind=B*``). ``*`` selects
everything. A term without ``=`` is a pattern over printable node keys (``2F0``, ``*SEND*``).
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Iterable

from piper_plugin.ir.graph import Region
from piper_plugin.ir.nodes import Node

__all__ = ["Filter", "parse_filter", "NODE_KEYS"]

NODE_KEYS = ("kind", "mb", "stage", "region", "rank")


@dataclass(frozen=True)
class Filter:
    text: str
    terms: tuple[tuple[str, str], ...]
    key_patterns: tuple[str, ...]

    @property
    def tag_names(self) -> set[str]:
        return {k for k, _ in self.terms if k not in NODE_KEYS}

    def matches_region(self, region: Region) -> bool:
        if self.key_patterns:
            return False
        for key, pattern in self.terms:
            if key == "region":
                value: Any = region.name
            elif key == "stage":
                value = region.stage
            elif key in NODE_KEYS:
                return False
            elif key in region.tags:
                value = region.tags[key]
            else:
                return False
            if not fnmatch.fnmatchcase(str(value), pattern):
                return False
        return True

    def matches_node(self, node: Node, rank_of: dict[str, int]) -> bool:
        if self.key_patterns and not any(fnmatch.fnmatchcase(node.key, p) for p in self.key_patterns):
            return False
        for key, pattern in self.terms:
            if key == "kind":
                value: Any = node.kind.value
            elif key == "mb":
                value = node.microbatch
            elif key == "stage":
                value = node.stage
            elif key == "region":
                value = node.region
            elif key == "rank":
                value = rank_of.get(node.region)
            elif key in node.tags:
                value = node.tags[key]
            else:
                return False
            if not fnmatch.fnmatchcase(str(value), pattern):
                return False
        return True


def parse_filter(text: str) -> Filter:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"a filter is a non-empty string such as 'PP=0' or 'EP=experts', got {text!r}")
    terms: list[tuple[str, str]] = []
    keys: list[str] = []
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            raise ValueError(f"empty term in filter {text!r}")
        if term == "*":
            continue
        if "=" in term:
            key, _, value = term.partition("=")
            if not key.strip() or not value.strip():
                raise ValueError(f"term {term!r} of filter {text!r} needs both a tag and a value, e.g. PP=0")
            terms.append((key.strip(), value.strip()))
        else:
            keys.append(term)
    return Filter(text=text, terms=tuple(terms), key_patterns=tuple(keys))


def known_tags(regions: Iterable[Region]) -> set[str]:
    return {t for r in regions for t in r.tags}
