"""Static checks of the source tree, read with `ast` (nothing is imported) and, for the paths docs
name, as text: used by tests/test_layout.py.

Each check returns a list of readable findings ("file:line: what is wrong"); an empty list passes.
They take the tree's root as an argument, so tests/test_layout.py also runs them on small made-up
trees, to see each one fail on a deliberate bad example.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _parsed(path: Path, mtime_ns: int) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def parse(path: Path) -> ast.Module:
    """The file's syntax tree (parsed once while the file is unchanged: the checks share them)."""
    return _parsed(path, path.stat().st_mtime_ns)


def python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def files_of_tests(tests: Path) -> list[Path]:
    return [p for p in python_files(tests) if p.name.startswith("test_")]


def module_file(root: Path, name: str) -> Path | None:
    """The source file of module `name` under `root` (a module or a package's __init__), or None."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _where(root: Path, path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"


def _absolute(root: Path, path: Path, node: ast.ImportFrom) -> str:
    """The module an ImportFrom reads from, relative imports resolved against `path`'s package."""
    if not node.level:
        return node.module or ""
    package = module_name(root, path).split(".")
    if path.name != "__init__.py":
        package.pop()
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


# ------------------------------------------------------------------------------------ (a) test files import no test file
def tests_importing_tests(root: Path = ROOT, tests: Path | None = None) -> list[str]:
    tests = tests or root / "tests"
    found = []
    for path in python_files(tests):
        tree = parse(path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names if node.level]
            for name in names:
                if any(part.startswith("test_") for part in name.split(".")):
                    found.append(f"{_where(root, path, node)}: imports the test file {name}")
    return found


# ------------------------------------------------------------------------------------ (c) patches target the defining module
def defined_names(tree: ast.Module) -> set[str]:
    """Names a module binds itself at its top level (def, class, assignment; inside top-level
    if/try/with blocks too). Names it imports are not among them."""
    names: set[str] = set()

    def bind(target: ast.AST) -> None:
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                bind(element)
        elif isinstance(target, ast.Starred):
            bind(target.value)

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    bind(target)
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                bind(stmt.target)
            elif isinstance(stmt, (ast.For, ast.AsyncFor)):
                bind(stmt.target)
                visit(stmt.body + stmt.orelse)
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                visit(stmt.body)
            elif isinstance(stmt, (ast.If, ast.While)):
                visit(stmt.body + stmt.orelse)
            elif isinstance(stmt, ast.Try):
                visit(stmt.body + stmt.orelse + stmt.finalbody + [s for h in stmt.handlers for s in h.body])

    visit(tree.body)
    for node in ast.walk(tree):  # `global name` in a function that assigns it defines it here too
        if isinstance(node, ast.Global):
            names.update(node.names)
    return names


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _module_aliases(root: Path, path: Path, tree: ast.AST) -> dict[str, str]:
    """Local names bound to modules of the tree by the file's imports (anywhere in it)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(root, path, node)
            for a in node.names:
                full = f"{base}.{a.name}"
                if module_file(root, full):
                    aliases[a.asname or a.name] = full
    return aliases


def _split_target(root: Path, dotted: str) -> tuple[str, str] | None:
    """ "pkg.mod.name(.attr...)" -> ("pkg.mod", "name"): the longest prefix that is a module of the tree."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if module_file(root, ".".join(parts[:cut])):
            return ".".join(parts[:cut]), parts[cut]
    return None


def patch_targets(root: Path, path: Path, tree: ast.AST) -> list[tuple[ast.AST, str, str]]:
    """(call, module, name) for each monkeypatch.setattr/delattr, mock.patch and mock.patch.object
    whose target is a module of the tree, given as a module object or as a dotted string."""
    aliases = _module_aliases(root, path, tree)
    targets = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = _dotted(node.func) or ""
        last = func.split(".")[-1]
        if last not in ("setattr", "delattr", "patch", "object") or func in ("setattr", "delattr"):
            continue
        if last == "object" and not func.endswith("patch.object"):
            continue
        first = node.args[0]
        name_arg = node.args[1] if len(node.args) > 1 else None
        string_name = isinstance(name_arg, ast.Constant) and isinstance(name_arg.value, str)
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and (last == "patch" or not string_name):
            split = _split_target(root, first.value)  # "pkg.mod.name": the string form
            if split:
                targets.append((node, *split))
        elif string_name and last != "patch":
            dotted = _dotted(first)
            if dotted is None:
                continue
            head, *rest = dotted.split(".")
            if head not in aliases:
                continue
            module = ".".join([aliases[head], *rest])
            if module_file(root, module):
                targets.append((node, module, name_arg.value))
    return targets


def misdirected_patches(root: Path = ROOT, tests: Path | None = None, package: str = "dgemma") -> list[str]:
    """Patches on a module of `package` that does not define the name itself (it imports it, or
    it has no such name): the code that reads the name from its defining module never sees them."""
    tests = tests or root / "tests"
    found = []
    sources: dict[str, set[str]] = {}
    for path in python_files(tests):
        tree = parse(path)
        for node, module, name in patch_targets(root, path, tree):
            if module != package and not module.startswith(package + "."):
                continue
            if module not in sources:
                source = module_file(root, module)
                sources[module] = defined_names(parse(source))
            if name not in sources[module]:
                found.append(f"{_where(root, path, node)}: patches {module}.{name}, which {module} does not define")
    return found


# ------------------------------------------------------------------------------------ (e) import cycles
def import_graph(root: Path = ROOT, package: str = "dgemma") -> dict[str, set[str]]:
    """module -> the package's modules it imports (module level and inside functions; not under
    `if TYPE_CHECKING:`). `from a import b` counts as importing a.b where that is a module, else a."""
    graph: dict[str, set[str]] = {}
    for path in python_files(root / package):
        name = module_name(root, path)
        tree = parse(path)
        skipped = {
            id(n)
            for stmt in ast.walk(tree)
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test)
            for s in stmt.body
            for n in ast.walk(s)
        }
        edges = graph.setdefault(name, set())
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(root, path, node)
                candidates = [f"{base}.{a.name}" if module_file(root, f"{base}.{a.name}") else base for a in node.names]
            else:
                continue
            for candidate in candidates:
                if (
                    (candidate == package or candidate.startswith(package + "."))
                    and module_file(root, candidate)
                    and candidate != name
                ):
                    edges.add(candidate)
    return graph


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


# ------------------------------------------------------------------------------------ (f) scheme names outside quant/
def scheme_names(root: Path = ROOT, package: str = "dgemma") -> set[str]:
    """The schemes the table names: the first argument (or `name=`) of each `Scheme(...)` call in
    `<package>/quant/schemes.py` that is a string literal."""
    names = set()
    for node in ast.walk(parse(root / package / "quant" / "schemes.py")):
        if not isinstance(node, ast.Call) or (_dotted(node.func) or "").split(".")[-1] != "Scheme":
            continue
        given = [node.args[0]] if node.args else [k.value for k in node.keywords if k.arg == "name"]
        names.update(a.value for a in given if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return names


def scheme_name_literals(root: Path = ROOT, package: str = "dgemma", inside: str = "quant") -> list[str]:
    """Code of `package` outside `<package>/<inside>/` that decides by a scheme's name written as a
    string literal, instead of reading quant/schemes.py's table. What counts, a scheme name being
    a string literal equal to a name of `scheme_names` (read from the AST, nothing imported):

    - a comparison with one: an operand of `==`, `!=`, `in`, `not in`, `is`, ... that is the
      literal, or a tuple / list / set literal holding it (`scheme == "int4"`,
      `s in ("fp8", "int8")`, `"nvfp4" != s`);
    - a `case` pattern that is one (`case "int4":`, `case "fp8" | "int8":`);
    - a dict keyed by one (`{"int4": 0}`, `dict(int4=0)`): a lookup by name is a comparison;
    - the list of schemes written out: a tuple / list / set literal holding two or more
      (`choices=["fp8", "int8"]`, `(None, "fp8", "int8")`).

    Not counted: one scheme name used as a value (`quantize(w, "int4")`, `["--quantization",
    "int4"]`), names inside docstrings, f-strings and comments, and any other string. quant/ holds
    the table and each scheme's maths, so it may name schemes; tests and scripts are not checked."""
    names = scheme_names(root, package)

    def named(node: ast.AST) -> list[str]:
        """The scheme names `node` is, or a collection literal of which it holds."""
        if isinstance(node, ast.Constant) and node.value in names:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
        return []

    found = []
    for path in python_files(root / package):
        if (root / package / inside) in path.parents:
            continue
        counted: set[int] = set()  # literals a comparison reported already (ast.walk: parents first)
        here = []
        for node in ast.walk(parse(path)):
            what = None
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                hits = [n for o in operands for n in named(o)]
                counted.update(id(o) for o in operands)
                what = f"compares with {', '.join(map(repr, hits))}" if hits else None
            elif isinstance(node, ast.MatchValue) and named(node.value):
                what = f"matches {node.value.value!r}"
            elif isinstance(node, ast.Dict) and (keys := [n for k in node.keys if k for n in named(k)]):
                what = f"keys a dict by {', '.join(map(repr, keys))}"
            elif isinstance(node, ast.Call) and _dotted(node.func) == "dict":
                keys = [k.arg for k in node.keywords if k.arg in names]
                what = f"keys a dict by {', '.join(map(repr, keys))}" if keys else None
            elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in counted:
                listed = named(node)
                what = f"writes out the schemes {', '.join(map(repr, listed))}" if len(listed) > 1 else None
            if what:
                here.append((node.lineno, f"{_where(root, path, node)}: {what}: read quant/schemes.py's table instead"))
        found += [line for _, line in sorted(here)]
    return found


# ---------------------------------------------------------------------------------- (g) no private name across modules
def _private(name: str) -> bool:
    """`_name` is private; a dunder (`__version__`, `__all__`) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _of_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def private_imports(root: Path = ROOT, package: str = "dgemma") -> list[str]:
    """Modules of `package` that use another module's private name: a name that belongs to one
    module is public where it is shared (or moves to the module that uses it). What counts, read
    from the AST (nothing imported), anywhere in a module of `package` (functions and
    `if TYPE_CHECKING:` blocks too):

    - `from X import _name` (or `from X import a, _b`), relative or absolute, X another module of
      `package` (a package's `__init__` is a module of its own: `from .sub import _x` in it counts);
    - `X._name` where X is bound to another module of `package` by an import (`from . import cpu`
      then `cpu._swap_in`, `import pkg.a as a` then `a._f`, `pkg.a._f`).

    A private name starts with `_` and is not a dunder (`__version__`, `__all__`, `__file__` are
    fine); a private module (`from . import _impl`) counts like any private name. Not counted:
    private names of other packages (`torch._dynamo`), attributes of objects that are not modules
    (`module._modules`, `self._x`), `getattr(m, "_x")`. tests/ and scripts/ are not checked: tests
    may pin and patch internals (the patch check above asks them to patch a private helper where
    it is defined), and scripts are tools that measure them."""
    found = []
    for path in python_files(root / package):
        tree = parse(path)
        here = module_name(root, path)
        aliases = _module_aliases(root, path, tree)
        lines = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(root, path, node)
                names = [a.name for a in node.names if _private(a.name)]
                if names and _of_package(source, package) and source != here:
                    lines.append((node.lineno, f"{_where(root, path, node)}: imports {', '.join(names)} from {source}"))
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                dotted = _dotted(node.value)
                head, *rest = (dotted or "").split(".")
                if head not in aliases:
                    continue
                module = ".".join([aliases[head], *rest])
                if _of_package(module, package) and module != here and module_file(root, module):
                    lines.append((node.lineno, f"{_where(root, path, node)}: reads {node.attr} of {module}"))
        found += [line for _, line in sorted(lines)]
    return found


# ------------------------------------------------------------------------------------ (h) every path a doc names exists
# Files of other projects that docs and comments cite (with the project named beside them).
OTHER_PROJECTS = frozenset({"utils/_validators.py", "utils/_http.py", "transformers/cli/serving/utils.py"})

# a word ending in one of the suffixes (`named_paths` keeps those with a slash), not part of a longer word or path
PATH = re.compile(r"(?<![\w/.:@<>{}$*~-])((?:\.\.?/)*\.?[\w*][\w.*-]*(?:/[\w.*-]+)*\.(?:py|md|json|toml|sh))(?![\w/-])")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")


def _docstrings(body: list[ast.stmt]) -> Iterator[ast.Constant]:
    """The docstrings of the definitions in a body, nested ones too (statements only: no expression
    is walked)."""
    for stmt in body:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if ast.get_docstring(stmt, clean=False) is not None:
                yield stmt.body[0].value
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list):
                yield from _docstrings([s for s in inner if isinstance(s, ast.AST)])


def _written(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a person wrote in the file for people: all of a Markdown file; the
    comments and docstrings (module, class, function) of a Python file."""
    text = path.read_text()
    if path.suffix == ".md":
        return [(1, text)]
    if "/" not in text or not PATH.search(text):  # nothing to read: spares tokenizing most files
        return []
    texts = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            texts.append((token.start[0], token.string))
    tree = parse(path)
    module = [tree.body[0].value] if ast.get_docstring(tree, clean=False) is not None else []
    texts += [(docstring.lineno, docstring.value) for docstring in module + list(_docstrings(tree.body))]
    return texts


def named_paths(path: Path) -> list[tuple[int, str]]:
    """(line, path) for each path of this repo `path`'s text names (see `stale_paths`)."""
    found = []
    for line, text in _written(path):
        for match in PATH.finditer(text):
            named = match.group(1)
            if "/" not in named:
                continue
            folders = [f for f in named.split("/")[:-1] if f not in (".", "..")]
            host = bool(folders) and "." in folders[0].lstrip(".")
            if named in OTHER_PROJECTS or host or any(PLACEHOLDER.fullmatch(f) for f in folders):
                continue
            found.append((line + text.count("\n", 0, match.start()), named))
    return found


def _exists(root: Path, bases: list[Path], named: str) -> bool:
    for base in bases:
        candidate = (base / named).resolve()
        if not candidate.is_relative_to(root):
            continue
        relative = candidate.relative_to(root).as_posix()
        if ("*" in relative and any(root.glob(relative))) or (root / relative).exists():
            return True
    return False


def _same_name(root: Path, name: str) -> list[str]:
    """Files named `name` in dgemma/, tests/, scripts/ or docs/: where a stale path's file may have moved."""
    if "*" in name:
        return []
    folders = [root / folder for folder in ("dgemma", "tests", "scripts", "docs")]
    return sorted(
        p.relative_to(root).as_posix() for f in folders for p in f.rglob(name) if "__pycache__" not in p.parts
    )


def stale_paths(root: Path = ROOT) -> list[str]:
    """Paths that README.md, a doc under docs/, or a comment or docstring of a module in dgemma/,
    tests/ or scripts/ names, and that do not exist. What counts as a path: a word with a slash
    that ends in .py, .md, .json, .toml or .sh (`dgemma/engine/runner.py`, `engine/runner.py`,
    `kernels/cpu.py`, `../docs/server.md`, `tests/parallel/checks_*.py` as a glob, a test id's
    file before its `::`). It exists when it names a file (or a glob matches one) resolved against
    the repo's root, dgemma/, tests/, docs/, or the folder of the file that names it or any folder
    above it (a comment under dgemma/serve/ may leave out the `dgemma/serve/` in front).

    Not counted: URLs and absolute paths (`https://host/a/b.py`, `/openapi.json`, `github.com/a/b.py`:
    a path that starts after `/`, `:` or `@`, or whose first folder has a dot in its name),
    placeholders (a folder in capitals, `DIR/config.json`, `OUT/adapter_config.json`, or one
    written with `<>`, `{}`, `$`, `~`: `<package>/quant/schemes.py`), a file in the folder an
    option names (`--out/gpu_check.json`), files of other projects (`OTHER_PROJECTS`), string
    literals in code, and other file types. Hub ids (owner/name) end in none of those suffixes."""
    root = root.resolve()
    sources = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    sources += [p for folder in ("dgemma", "tests", "scripts") for p in python_files(root / folder)]
    found = []
    for source in sources:
        if not source.is_file():
            continue
        bases = [root, root / "dgemma", root / "tests", root / "docs"]
        bases += [folder for folder in source.parents if folder.is_relative_to(root)]
        for line, named in named_paths(source):
            if _exists(root, bases, named):
                continue
            elsewhere = _same_name(root, named.split("/")[-1])
            hint = f" (now {' or '.join(elsewhere)}?)" if elsewhere else ""
            found.append(f"{source.relative_to(root)}:{line}: names {named}, which does not exist{hint}")
    return found


# ------------------------------------------------------------------------------------ (i) no module over 600 lines
MAX_MODULE_LINES = 600  # the house rule (docs/architecture.md, issue 53): a module over it splits along a seam

# TEMPORARY, to be deleted: modules over MAX_MODULE_LINES whose split is under way, each with its line
# count when it was listed (a ceiling: it may shrink, not grow) and why it waits.
LONG_MODULES_FOR_NOW: dict[str, int] = {}  # (triton_quant.py, 658 at 7c486bb: split, kernels/triton_decode.py)


def line_count(path: Path) -> int:
    """Lines as `wc -l` counts them: newline characters (a last line without one is not counted)."""
    return path.read_bytes().count(b"\n")


def long_modules(
    root: Path = ROOT,
    package: str = "dgemma",
    limit: int = MAX_MODULE_LINES,
    for_now: Mapping[str, int] = LONG_MODULES_FOR_NOW,
) -> list[str]:
    """Modules of `package` (its .py files) over `limit` lines, counted as `wc -l` counts them; a
    module `for_now` lists (a path from the root) may keep up to its listed count while its split
    is under way, and no more."""
    found = []
    for path in python_files(root / package):
        name = path.relative_to(root).as_posix()
        lines = line_count(path)
        if name in for_now and lines > max(limit, for_now[name]):
            found.append(f"{name}: {lines} lines, more than the {for_now[name]} it was allowed for now")
        elif name not in for_now and lines > limit:
            found.append(f"{name}: {lines} lines, over {limit}: split it along a seam (one concern a module)")
    return found
