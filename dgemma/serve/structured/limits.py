"""How big and how deep a request's grammar may be, checked in pure Python before llguidance sees it.

llguidance compiles grammars with recursive native code: a chain of a few thousand Lark rules or
`$ref`s overflows the stack of the thread compiling it, a segfault that takes the server down
without a log line. The server compiles grammars and runs their matchers only on threads started
with a `threads.STACK_BYTES` (64 MiB) stack, and refuses before any compile what lies above a
quarter of what crashes there (or lower, where compile time is the real bound).

scripts/grammar_limits.py measures the crash points, each attempt in a child process
(docs/server.md, "Structured output", has its table). On an AMD EPYC, llguidance 1.9.1, the
largest sizes that compiled without crashing were, on a 64 MiB thread (8 MiB main thread):
chained Lark rules 21,428 (2,656), chained Lark terminals 28,160 (3,488), a `$ref` chain 19,968
(2,489); JSON objects nested 4,352 on the main thread (the conversion of the schema to Rust),
but llguidance refuses them past 61 levels itself. Nothing else the script probes crashed
(nested Lark and regex groups, guided_choice entries, properties, tool-call parameters and
nesting): llguidance refuses it cleanly (Lark groups past 28, regex groups past 250) or its
compile time passes a second first (JSON properties: 0.38 s at 2,048, 1.6 s at 4,096).

Every check is an iterative walk (no recursion of its own to overflow) that stops at the first
limit passed, and raises `LimitError(param, message)`: the caller's 400, naming the field, the
limit and the value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# --- Lark grammars (guided_grammar) and regexes (guided_regex, guided_choice, tool patterns)
MAX_GRAMMAR_BYTES = 128 << 10  # Lark or regex text: 0.18 s to compile a literal this long, twice that at double
MAX_RULES = 8192  # rules and terminals of one Lark grammar: 0.32 s for 8,192 in a tree
MAX_RULE_DEPTH = 5000  # longest chain of rule references: a quarter of 21,428 (the crash at 64 MiB), rounded down
MAX_NESTING = 64  # nested ( [ { in Lark, ( [ in a regex: llguidance itself stops at 28 (Lark) / 250 (regex)

# --- JSON schemas (response_format json_schema, guided_json)
MAX_SCHEMA_BYTES = 256 << 10  # the schema as compact JSON, about
MAX_SCHEMA_NODES = 16384  # objects, arrays and scalars of the schema document
MAX_SCHEMA_DEPTH = 64  # nesting of the schema document (32 levels of objects); llguidance stops at 61 levels
MAX_SCHEMA_PROPERTIES = 2048  # entries of all `properties` objects together: 0.38 s to compile (4,096: 1.6 s)
MAX_REF_DEPTH = 4096  # longest chain of `$ref`s: under a quarter of 19,968 (the crash at 64 MiB)

# --- guided_choice (the choices become one regex: 16,384 short ones compile in 0.12 s)
MAX_CHOICES = 1024
MAX_CHOICE_BYTES = 64 << 10  # all choices together

# --- tool schemas (tools[].function.parameters: the chat template renders them, and a forced
# call's grammar is written from them, both recursively; the writer's Python recursion gives up
# at 166 levels of objects, see tools/grammar.py)
MAX_TOOL_DEPTH = 32  # nesting of one parameters document (16 levels of objects)
MAX_TOOL_PROPERTIES = 4096  # properties of all the request's tools together: 0.87 s to compile as a forced call
MAX_TOOL_BYTES = 256 << 10  # one function's parameters as compact JSON, about
MAX_TOOLS_BYTES = 1 << 20  # all tools of a request together


class LimitError(ValueError):
    """A grammar over a limit, or text that is not valid Unicode: a 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _over(field: str, value: int, noun: str, limit: int) -> LimitError:
    return LimitError(field, f"{field}: {value} {noun}; at most {limit} are allowed")


def text_bytes(text: str, field: str) -> int:
    """UTF-8 size of `text`; LimitError for a lone surrogate (JSON lets "\\ud800" through, UTF-8 has no such character)."""
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise LimitError(
            field,
            f"{field}: holds a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}; "
            "text must be valid Unicode",
        ) from None


# ------------------------------------------------------------------------------------ regexes
_REGEX_TOKEN = re.compile(r"\\.|[()\[\]]", re.DOTALL)


def regex_nesting(pattern: str) -> int:
    """Deepest nesting of groups and character classes in a regex (escapes skipped; inside a
    class, only nested classes count)."""
    depth = deepest = classes = 0
    last_open = -2  # index of the last "[" or "[^": a "]" right after it is a literal
    for m in _REGEX_TOKEN.finditer(pattern):
        tok, at = m.group(), m.start()
        if tok[0] == "\\":
            continue
        if tok == "[":
            classes += 1
            depth += 1
            last_open = at + (2 if pattern.startswith("[^", at) else 1)
        elif tok == "]" and classes and at != last_open:
            classes -= 1
            depth -= 1
        elif not classes and tok == "(":
            depth += 1
        elif not classes and tok == ")":
            depth = max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def check_regex(pattern: str, field: str) -> None:
    """A regex's size and nesting within the limits."""
    size = text_bytes(pattern, field)
    if size > MAX_GRAMMAR_BYTES:
        raise _over(field, size, "bytes", MAX_GRAMMAR_BYTES)
    nesting = regex_nesting(pattern)
    if nesting > MAX_NESTING:
        raise _over(field, nesting, "levels of nested groups", MAX_NESTING)


def check_choices(choices: list[str], field: str) -> None:
    """guided_choice: how many strings, and their bytes together."""
    if len(choices) > MAX_CHOICES:
        raise _over(field, len(choices), "choices", MAX_CHOICES)
    total = 0
    for i, choice in enumerate(choices):
        total += text_bytes(choice, f"{field}[{i}]")
        if total > MAX_CHOICE_BYTES:
            raise _over(field, sum(len(c) for c in choices), "bytes of choices", MAX_CHOICE_BYTES)


# ------------------------------------------------------------------------------------ Lark
_LARK_TOKEN = re.compile(
    r'(?P<str>"(?:[^"\\\n]|\\.)*"i?)'  # a string literal
    r"|(?P<comment>//[^\n]*)"
    r"|(?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)"  # a regex literal
    r"|(?P<open>[(\[{])|(?P<close>[)\]}])"
    r"|(?P<name>[?!]?[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<nl>\n)"
    r"|(?P<space>[ \t\r]+)"
    r"|(?P<other>[^\"/()\[\]{}A-Za-z_?!\n \t\r]+|.)",
    re.DOTALL,
)
_DEFINES = re.compile(r"[ \t]*(?:\.-?\d+)?[ \t]*:")  # after a name at a line's start: "name:" or "name.2:"


@dataclass(frozen=True)
class LarkStats:
    bytes: int
    rules: int  # rules and terminals defined
    depth: int  # longest chain of references between them (see `longest_chain`)
    nesting: int  # deepest ( [ { in the grammar, or groups in one of its regexes


def lark_stats(text: str, field: str = "grammar") -> LarkStats:
    """Size, definitions, reference depth and nesting of a Lark grammar, from its tokens (string
    and regex literals and comments skipped); LimitError only for a lone surrogate."""
    size = text_bytes(text, field)
    refs: dict[str, list[str]] = {}
    current: list[str] | None = None
    depth = nesting = 0
    line_start = True
    for m in _LARK_TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "space":
            continue
        if kind == "nl":
            line_start = True
            continue
        at_start, line_start = line_start, False
        if kind == "name":
            name = m.group().lstrip("?!")
            if at_start and _DEFINES.match(text, m.end()):
                current = refs.setdefault(name, [])
            elif current is not None:
                current.append(name)
        elif kind == "other" and at_start and m.group().startswith("%"):
            current = None  # a directive (%import, %ignore, %llguidance): no rule body
        elif kind == "open":
            depth += 1
            nesting = max(nesting, depth)
        elif kind == "close":
            depth = max(depth - 1, 0)
        elif kind == "regex":
            body = m.group()
            nesting = max(nesting, regex_nesting(body[1 : body.rindex("/")]))
    graph = {name: [r for r in targets if r in refs] for name, targets in refs.items()}
    return LarkStats(size, len(refs), longest_chain(graph), nesting)


def check_lark(text: str, field: str) -> None:
    """A Lark grammar's size, rule count, reference depth and nesting within the limits."""
    size = text_bytes(text, field)
    if size > MAX_GRAMMAR_BYTES:  # before the scan: it is linear in this
        raise _over(field, size, "bytes", MAX_GRAMMAR_BYTES)
    stats = lark_stats(text, field)
    if stats.rules > MAX_RULES:
        raise _over(field, stats.rules, "rules", MAX_RULES)
    if stats.depth > MAX_RULE_DEPTH:
        raise _over(field, stats.depth, "levels of rule references", MAX_RULE_DEPTH)
    if stats.nesting > MAX_NESTING:
        raise _over(field, stats.nesting, "levels of nested groups", MAX_NESTING)


# ------------------------------------------------------------------------------------ graphs
def longest_chain(graph: dict[Any, list[Any]]) -> int:
    """The most nodes on a path of references, counted without recursion: strongly connected
    components (cycles: a recursive grammar) are collapsed, each weighing its size (a path may go
    through all of it), and the longest path of the acyclic rest is taken. An upper bound on how
    deep a compiler that follows references depth-first (and stops at what it has seen) goes."""
    index: dict[Any, int] = {}
    low: dict[Any, int] = {}
    component: dict[Any, int] = {}
    sizes: list[int] = []
    stack: list[Any] = []
    on_stack: set = set()
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:  # Tarjan's algorithm with an explicit stack
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            edges = graph.get(node, ())
            while i < len(edges):
                nxt = edges[i]
                i += 1
                if nxt not in index:
                    work.append((node, i))
                    work.append((nxt, 0))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                if low[node] == index[node]:
                    size = 0
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component[top] = len(sizes)
                        size += 1
                        if top == node:
                            break
                    sizes.append(size)
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    # Tarjan numbers components in reverse topological order: successors come first
    best = [0] * len(sizes)
    succ: list[set[int]] = [set() for _ in sizes]
    for node, edges in graph.items():
        for nxt in edges:
            if component[nxt] != component[node]:
                succ[component[node]].add(component[nxt])
    for c in range(len(sizes)):
        best[c] = sizes[c] + max((best[s] for s in succ[c]), default=0)
    return max(best, default=0)


# ------------------------------------------------------------------------------------ JSON schemas
@dataclass(frozen=True)
class SchemaStats:
    bytes: int  # the document as compact JSON, about
    nodes: int
    depth: int  # nesting of objects and arrays (a scalar or {} at the top: 1)
    properties: int  # entries of every `properties` object
    refs: list  # the objects holding a "$ref" string


@dataclass(frozen=True)
class SchemaLimits:
    depth: int = MAX_SCHEMA_DEPTH
    nodes: int = MAX_SCHEMA_NODES
    bytes: int = MAX_SCHEMA_BYTES
    properties: int = MAX_SCHEMA_PROPERTIES
    ref_depth: int = MAX_REF_DEPTH


TOOL_LIMITS = SchemaLimits(MAX_TOOL_DEPTH, MAX_SCHEMA_NODES, MAX_TOOL_BYTES, MAX_TOOL_PROPERTIES, MAX_REF_DEPTH)


def _printable(key: str, limit: int = 40) -> str:
    """A key as a message may show it: lone surrogates escaped, long keys cut."""
    text = key if key.isascii() else key.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _path(parts: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{_printable(p)}" for p in parts).lstrip(".")


def _checked_bytes(text: str, field: str, path: tuple) -> int:
    """text_bytes, the error naming where in the document the text is."""
    try:
        return text_bytes(text, field)
    except LimitError as e:
        where = _path(path)
        raise LimitError(
            field, str(e).replace(f"{field}:", f"{field}: the text at {where}" if where else f"{field}:", 1)
        ) from None


def schema_stats(schema: Any, field: str, limits: SchemaLimits = SchemaLimits()) -> SchemaStats:
    """Walk a JSON document iteratively: its size, nodes, depth and properties, every string
    (keys too) checked for lone surrogates; LimitError at the first limit passed."""
    size = nodes = deepest = properties = 0
    refs: list[dict] = []
    work: list[tuple[Any, int, tuple]] = [(schema, 1, ())]
    while work:
        value, depth, path = work.pop()
        nodes += 1
        if nodes > limits.nodes:
            raise _over(field, nodes, "schema values (or more)", limits.nodes)
        if depth > limits.depth:
            raise _over(field, depth, "levels of nesting (or more)", limits.depth)
        deepest = max(deepest, depth)
        if isinstance(value, dict):
            size += 2 + max(len(value) - 1, 0)
            for key, sub in value.items():
                if not isinstance(key, str):
                    key = str(key)
                size += _checked_bytes(key, field, path + (key,)) + 3
                work.append((sub, depth + 1, path + (key,)))
            props = value.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                if properties > limits.properties:
                    raise _over(field, properties, "properties (or more)", limits.properties)
            if isinstance(value.get("$ref"), str):
                refs.append(value)
        elif isinstance(value, list):
            size += 2 + max(len(value) - 1, 0)
            work.extend((sub, depth + 1, path + (i,)) for i, sub in enumerate(value))
        elif isinstance(value, str):
            size += _checked_bytes(value, field, path) + 2
        else:
            size += len(str(value))
        if size > limits.bytes:
            raise _over(field, size, "bytes (or more)", limits.bytes)
    return SchemaStats(size, nodes, deepest, properties, refs)


def _pointer(schema: Any, ref: str) -> Any:
    """The node a local JSON pointer ("#/$defs/a") names, or None."""
    if not ref.startswith("#"):
        return None
    node = schema
    if ref in ("#", "#/"):
        return node
    if not ref.startswith("#/"):
        return None  # an anchor
    from urllib.parse import unquote

    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def ref_depth(schema: Any, refs: list[dict]) -> int:
    """The longest chain of `$ref`s a compiler may follow from the top of `schema`.

    Scopes are the top and every node a `$ref` names; a scope leads to each scope a `$ref` inside
    it names (and to the scopes nested in it). Refs this cannot resolve (anchors, `$id`s, other
    documents) each count as one more link, wherever they are: an upper bound."""
    targets: dict[int, Any] = {id(schema): schema}
    unresolved: set[str] = set()
    names: dict[int, int] = {}  # id of an object holding a $ref -> id of what it names
    for holder in refs:
        target = _pointer(schema, holder["$ref"])
        if isinstance(target, (dict, list)):
            targets[id(target)] = target
            names[id(holder)] = id(target)
        elif target is None:
            unresolved.add(holder["$ref"])
    graph: dict[int, list[int]] = {t: [] for t in targets}
    work: list[tuple[Any, int]] = [(schema, id(schema))]
    seen: set[int] = set()
    while work:  # each node belongs to its nearest enclosing scope
        node, scope = work.pop()
        if id(node) in targets and id(node) != scope:
            graph[scope].append(id(node))
            scope = id(node)
        if (id(node), scope) in seen:
            continue
        seen.add((id(node), scope))
        if isinstance(node, dict):
            if id(node) in names:
                graph[scope].append(names[id(node)])
            work.extend((sub, scope) for sub in node.values())
        elif isinstance(node, list):
            work.extend((sub, scope) for sub in node)
    return longest_chain(graph) - 1 + len(unresolved)


def check_schema(schema: Any, field: str, limits: SchemaLimits = SchemaLimits()) -> SchemaStats:
    """A JSON schema within the limits: size, values, depth, properties, `$ref` chain; its stats."""
    stats = schema_stats(schema, field, limits)
    if stats.refs:
        chain = ref_depth(schema, stats.refs)
        if chain > limits.ref_depth:
            raise _over(field, chain, "levels of $ref", limits.ref_depth)
    return stats
