"""Safe YAML loading that remembers where every node came from.

PyYAML silently keeps the last of two equal keys and forgets positions once it has built Python objects, so
this module composes the node graph itself (libyaml when present) and builds plain data from it, recording
``line:column`` for each value and each mapping key. Only the safe scalar tags are constructed: a tag that
would import or call anything is an error, never an action.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ktconvert.diagnostics import ERROR, Diagnostic
from ktconvert.errors import InputError
from ktconvert.io.files import regular_file_size

try:  # libyaml is ~10x faster; the pure-Python composer gives the same nodes
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover - depends on how PyYAML was built
    from yaml import SafeLoader as _Loader

MAX_BYTES = 4 * 1024 * 1024
"""Real rule files are a few KB; anything this large is a mistake (a dump, a model file) and is refused unread."""

Path_ = tuple  # a JSON-pointer-like path: ("3", "replace", "kwargs")


@dataclass
class Loaded:
    """Plain data plus positions: ``pos[path]`` is where a value starts, ``key_pos[path]`` where its key is."""

    data: object
    pos: dict = field(default_factory=dict)
    key_pos: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    text: str = ""

    def where(self, path: tuple, key: bool = False) -> tuple[int, int]:
        """Best known position for ``path``: the nearest recorded ancestor when the path itself has none."""
        table = self.key_pos if key else self.pos
        p = tuple(path)
        while p:
            if p in table:
                return table[p]
            if not key and p in self.key_pos:
                return self.key_pos[p]
            p = p[:-1]
        return self.pos.get((), (1, 1))


_SCALARS = yaml.constructor.SafeConstructor()


def read_text(path: Path) -> str:
    """Read a small UTF-8 text file or raise an ``InputError`` that says what the file really is."""
    size = regular_file_size(path)
    if size > MAX_BYTES:
        raise InputError(
            f"file is {size / 1e6:.1f} MB; rule and data files are small text files (limit {MAX_BYTES // (1024 * 1024)} MiB)",
            path=str(path),
            fix="point at the YAML rule file, not at a model or a dump",
        )
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", path=str(path)) from exc
    if b"\x00" in raw[:8192]:
        raise InputError("binary file, not YAML text", path=str(path), where="byte " + str(raw.index(b"\x00")),
                         fix="check-rules reads YAML rule files")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InputError(f"invalid UTF-8 at byte {exc.start}", path=str(path), where=f"{line}",
                         fix="save the file as UTF-8") from exc


def load_text(text: str, source: str = "<string>") -> Loaded:
    """Compose and build ``text``. A syntax error raises ``YamlSyntaxError`` with its position."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise YamlSyntaxError(f"{exc.problem or exc.context}", line, col) from None
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(str(exc).splitlines()[0], 1, 1) from None
    out = Loaded(data=None, text=text)
    if node is None:
        return out
    _check_expansion(node)
    out.data = _Builder(out).build(node, ())
    return out


#: Most values a document may stand for with its aliases expanded. The builder shares aliased objects, but the
#: schema validator and the checks walk the data as a tree: an alias bomb (``&a [*b, *b, ...]`` nested, in a
#: mapping or a list) would make them visit 10**N values.
MAX_EXPANDED = 1_000_000


def _check_expansion(root) -> None:
    """Count the values the document expands to, each node once (memoized), refusing past :data:`MAX_EXPANDED`
    at the node where the count first passes it. Iterative: deep nesting cannot exhaust the stack."""
    sizes: dict[int, int] = {}
    entered: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, ready = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        kids = _children(node)
        if not ready:
            if key in entered:  # a shared node already on its way (a recursive alias is the builder's error)
                continue
            entered.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in entered)
            continue
        total = 1 + sum(sizes.get(id(k), 0) for k in kids)
        if total > MAX_EXPANDED:
            raise YamlSyntaxError(f"aliases expand this document to more than {MAX_EXPANDED:,} values (an alias "
                                  "bomb?); write the values out or use fewer nested aliases",
                                  node.start_mark.line + 1, node.start_mark.column + 1)
        sizes[key] = total


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


class YamlSyntaxError(Exception):
    def __init__(self, message: str, line: int, col: int):
        self.message, self.line, self.col = message, line, col
        super().__init__(f"{line}:{col}: {message}")


class _Builder:
    def __init__(self, out: Loaded):
        self.out = out
        self.done: dict[int, object] = {}  # anchors/aliases share one object: linear work, no alias bombs
        self.active: set[int] = set()

    def build(self, node, path: tuple):
        self.out.pos.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        key = id(node)
        if key in self.done:
            return self.done[key]
        if key in self.active:
            raise YamlSyntaxError("recursive alias", node.start_mark.line + 1, node.start_mark.column + 1)
        self.active.add(key)
        try:
            value = self._build(node, path)
        finally:
            self.active.discard(key)
        self.done[key] = value
        return value

    def _build(self, node, path):
        if isinstance(node, yaml.ScalarNode):
            return self._scalar(node)
        if isinstance(node, yaml.SequenceNode):
            self._check_tag(node, "tag:yaml.org,2002:seq")
            return [self.build(child, path + (str(i),)) for i, child in enumerate(node.value)]
        self._check_tag(node, "tag:yaml.org,2002:map")
        result: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise YamlSyntaxError("merge keys (<<) are not supported in rule files; write the keys out",
                                      key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlSyntaxError("mapping keys must be plain scalars", key_node.start_mark.line + 1,
                                      key_node.start_mark.column + 1)
            k = self._scalar(key_node)
            kpos = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            child_path = path + (str(k),)
            if k in result:
                first = self.out.key_pos.get(child_path, ("?", "?"))
                self.out.problems.append(Diagnostic(
                    "KT102", ERROR, f"duplicate key {k!r} (first at line {first[0]}); upstream silently keeps the "
                    "last one", "delete or merge one of the two entries", line=kpos[0], col=kpos[1]))
            self.out.key_pos[child_path] = kpos
            self.out.pos.pop(child_path, None)
            result[k] = self.build(value_node, child_path)
        return result

    def _check_tag(self, node, expected: str) -> None:
        if node.tag != expected:
            raise YamlSyntaxError(f"unsupported tag {node.tag!r}; rule files hold plain data",
                                  node.start_mark.line + 1, node.start_mark.column + 1)

    def _scalar(self, node):
        try:
            return _SCALARS.construct_object(node, deep=True)
        except yaml.constructor.ConstructorError:
            raise YamlSyntaxError(f"unsupported tag {node.tag!r}; rule files hold plain data (nothing is imported)",
                                  node.start_mark.line + 1, node.start_mark.column + 1) from None
