"""Regression suites: a versioned set of prompts with programmatic checkers.

    name = "core"
    [[items]]
    id = "reverse-abc"
    prompt = "abc>"                          # text, or chat messages
    check = "exact"                          # the output, stripped, equals `expected`
    expected = "cba"
    [[items]]
    id = "no-apology"
    prompt = "Fix the bug"
    check = "regex"                          # `pattern` is found in the output (re.search)
    pattern = "def |return"
    [[items]]
    id = "valid-json"
    prompt = "Answer in JSON"
    check = "python"                         # `function` = "module:callable", output -> bool
    function = "mychecks:is_json"

The version is the name plus a hash of the file: a decision records which suite it ran.
"""

from __future__ import annotations

import hashlib
import importlib
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class SuiteError(ValueError):
    """The suite file is invalid; the message names the file, the item and the field."""


@dataclass(frozen=True)
class Item:
    id: str
    prompt: Any
    check: Callable[[str], bool]


@dataclass(frozen=True)
class Suite:
    name: str
    version: str
    items: tuple[Item, ...]

    def run(self, outputs: dict[str, str]) -> dict[str, bool]:
        """item id -> passed, for outputs keyed by item id (a checker that raises fails)."""
        results = {}
        for item in self.items:
            try:
                results[item.id] = bool(item.check(outputs[item.id]))
            except Exception:  # noqa: BLE001 - a user's checker must not break the gate
                results[item.id] = False
        return results


def _checker(path: Path, i: int, raw: dict[str, Any]) -> Callable[[str], bool]:
    where = f"{path}: items[{i}] ({raw.get('id', '?')})"
    kind = raw.get("check")
    if kind == "exact":
        if "expected" not in raw:
            raise SuiteError(f"{where}: check 'exact' needs `expected`")
        expected = str(raw["expected"])
        return lambda out: out.strip() == expected.strip()
    if kind == "regex":
        try:
            pattern = re.compile(raw["pattern"])
        except (KeyError, re.error) as exc:
            raise SuiteError(f"{where}: check 'regex' needs a valid `pattern` ({exc})") from None
        return lambda out: pattern.search(out) is not None
    if kind == "python":
        module, _, name = str(raw.get("function", "")).partition(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise SuiteError(f"{where}: `function` must be 'module:callable' importable here ({exc})") from None
        return fn
    raise SuiteError(f"{where}: `check` must be one of exact, regex, python (got {kind!r})")


def load_suite(path: str | Path) -> Suite:
    path = Path(path)
    try:
        raw_bytes = path.read_bytes()
        data = tomllib.loads(raw_bytes.decode())
    except FileNotFoundError:
        raise SuiteError(f"regression suite {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SuiteError(f"regression suite {path} is not valid TOML: {exc}") from None
    items, seen = [], set()
    for i, raw in enumerate(data.get("items", [])):
        if not raw.get("id") or "prompt" not in raw:
            raise SuiteError(f"{path}: items[{i}] needs `id` and `prompt`")
        if raw["id"] in seen:
            raise SuiteError(f"{path}: items[{i}]: duplicate id {raw['id']!r}")
        seen.add(raw["id"])
        items.append(Item(raw["id"], raw["prompt"], _checker(path, i, raw)))
    name = data.get("name", path.stem)
    return Suite(name, f"{name}@{hashlib.sha256(raw_bytes).hexdigest()[:12]}", tuple(items))


EMPTY = Suite("none", "none", ())
