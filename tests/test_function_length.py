"""No function of `elastic/`, `templates/` or `bench/` is longer than MAX_LINES lines.

A function's length is `end_lineno - lineno + 1` of its `def` (decorators not counted; a
nested function counts for itself and inside its parent). One kind of function is exempt: an
argparse declaration, whose length is only the number of options it declares. The rule is in
`is_argparse_declaration`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("elastic", "templates", "bench")
MAX_LINES = 80

ARGPARSE_CALLS = frozenset(
    {"add_argument", "add_parser", "add_subparsers", "add_argument_group", "add_mutually_exclusive_group",
     "set_defaults"}
)
"""Methods of argparse's parsers, subparser actions and groups that only declare."""
DECLARATION_SHARE = 0.9
"""Share of an argparse declaration's statements that must be declaring calls."""


@dataclass(frozen=True, kw_only=True)
class FunctionLength:
    """One function definition and its length."""

    path: str
    """File, relative to the repository root."""
    name: str
    """Qualified name inside the file (`Class.method`, `outer.inner`)."""
    line: int
    """Line of its `def`."""
    lines: int
    """end_lineno - lineno + 1."""
    exempt: bool
    """Whether it is an argparse declaration."""


def _declared_with(stmt: ast.stmt) -> str | None:
    """m when `stmt` is `x.m(...)` or `y = x.m(...)` (also annotated) with m in ARGPARSE_CALLS, else None."""
    value = stmt.value if isinstance(stmt, ast.Expr | ast.Assign | ast.AnnAssign) else None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ARGPARSE_CALLS:
        return value.func.attr
    return None


def is_argparse_declaration(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """The exemption: at least DECLARATION_SHARE of the function's top-level statements (its
    docstring not counted) are declaring calls (`_declared_with`), and at least one of them
    declares an option or a subcommand (`add_argument` or `add_parser`)."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    methods = [m for m in map(_declared_with, body) if m is not None]
    declares = "add_argument" in methods or "add_parser" in methods
    return declares and len(methods) >= DECLARATION_SHARE * len(body)


def function_lengths(source: str, path: str) -> list[FunctionLength]:
    """Every function and method defined in `source`, nested ones included."""
    out: list[FunctionLength] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                out.append(FunctionLength(path=path, name=prefix + child.name, line=child.lineno,
                                          lines=child.end_lineno - child.lineno + 1,
                                          exempt=is_argparse_declaration(child)))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename=path), "")
    return out


def _repo_functions() -> list[FunctionLength]:
    return [
        f
        for root in ROOTS
        for file in sorted((REPO / root).rglob("*.py"))
        for f in function_lengths(file.read_text(), file.relative_to(REPO).as_posix())
    ]


def test_no_function_is_too_long() -> None:
    too_long = [
        f"{f.path}:{f.line} {f.name} is {f.lines} lines"
        for f in _repo_functions()
        if f.lines > MAX_LINES and not f.exempt
    ]
    assert not too_long, f"functions over {MAX_LINES} lines (split them along their seams):\n" + "\n".join(too_long)


def _function(name: str, body: list[str]) -> str:
    return f"def {name}(parser, sub):\n" + "".join(f"    {line}\n" for line in body)


def test_the_rule_on_examples() -> None:
    """Long argparse declarations are exempt; long code, or declarations mixed with more than
    one statement in ten of other code, is not; lengths count the `def` line to the last line."""
    options = [f"parser.add_argument('--o{i}', type=int, default={i})" for i in range(90)]
    declaration = _function("declare", ['"""Declare the options."""', "p = sub.add_parser('run')", *options,
                                        "parser.set_defaults(func=print)"])
    mixed = _function("mixed", [*options, *(f"x{i} = {i}" for i in range(11))])
    code = _function("code", [f"x{i} = {i}" for i in range(90)])
    nested = "class C:\n" + "".join(f"    {line}\n" for line in _function("m", ["def inner():", "    return 1"]).splitlines())
    found = {
        f.name: f
        for src in (declaration, mixed, code, nested)
        for f in function_lengths(src, "example.py")
    }
    assert (found["declare"].lines, found["declare"].exempt) == (94, True)
    assert (found["mixed"].lines, found["mixed"].exempt) == (102, False)
    assert (found["code"].lines, found["code"].exempt) == (91, False)
    assert (found["C.m"].lines, found["C.m.inner"].lines) == (3, 2)
    assert not found["C.m"].exempt
