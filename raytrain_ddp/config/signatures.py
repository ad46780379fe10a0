"""A recipe's `build_model` / `build_datasets` signatures read from its source, without importing it.

Their keyword arguments are the config's `model.*` and `dataset.*` keys. Importing a recipe costs
seconds (torch, torchvision, Ray Data), so `--print-config` and every config check read the two
signatures with `ast` instead: each annotation and default is evaluated in a namespace of what the
recipe imports from `typing`, `pydantic`, `annotated_types`, `collections.abc` and `pathlib`, and of
its top-level immutable constants written as literals (`TOP_K = 10`). Where anything is not that simple (a
name bound another way or twice, a decorator, a signature changed after the `def`), `read` returns
None and the caller imports the recipe: the result is always the imported module's signature.
"""

from __future__ import annotations

import ast
import builtins
import inspect
from pathlib import Path
from typing import Any

FUNCTIONS = ("build_model", "build_datasets")
# Modules cheap to import whose names may appear in a signature; the recipe's other imports are not run.
SIMPLE_MODULES = ("typing", "typing_extensions", "pydantic", "annotated_types", "collections.abc", "pathlib")


class _NotSimple(Exception):
    """The signature cannot be read without running the module."""


def read(recipe: Path) -> dict[str, inspect.Signature] | None:
    """`{"build_model": Signature, "build_datasets": Signature}` of the recipe file, or None where
    only importing it tells."""
    try:
        tree = ast.parse(recipe.read_text(), filename=str(recipe))
        namespace = _namespace(tree)
        # Without `from __future__ import annotations`, a quoted annotation (`x: "int"`) is evaluated.
        postponed = any(
            isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
            for n in tree.body
        )
        return {name: _signature(_function(tree, name), namespace, unquote=not postponed) for name in FUNCTIONS}
    except (_NotSimple, SyntaxError, OSError, NameError, AttributeError, TypeError, ValueError, ImportError):
        return None


def defines(recipe: Path, function: str) -> bool:
    """Whether the recipe file defines `function` at its top level (read, not imported); True where
    its source cannot be parsed, so that the caller imports it and finds out."""
    try:
        tree = ast.parse(recipe.read_text(), filename=str(recipe))
    except (SyntaxError, OSError, ValueError):
        return True
    return any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function for node in tree.body)


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Every statement that runs at import: the module's, and those nested in its if/try/with/for blocks."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        found.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                todo.append(child)
            elif isinstance(child, (ast.ExceptHandler, ast.match_case)):
                todo += child.body
    return found


def _bound_names(node: ast.stmt) -> list[str]:
    """The names a top-level statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        if any(alias.name == "*" for alias in node.names):
            raise _NotSimple("a star import")
        return [alias.asname or alias.name.split(".")[0] for alias in node.names]
    expressions = [child for child in ast.iter_child_nodes(node) if not isinstance(child, ast.stmt)]
    return [  # nested statements are visited apart (_top_level)
        n.id
        for child in expressions
        for n in ast.walk(child)
        if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))
    ]


def _namespace(tree: ast.Module) -> dict[str, Any]:
    """Names bound exactly once at top level, by an import from a simple module or a literal."""
    statements = _top_level(tree)
    counts: dict[str, int] = {}
    for node in statements:
        for name in _bound_names(node):
            counts[name] = counts.get(name, 0) + 1
    # A builtin the module rebinds (a function named `format`, say) must not be read as the builtin.
    namespace: dict[str, Any] = {"__builtins__": {k: v for k, v in vars(builtins).items() if k not in counts}}
    for node in tree.body:  # only unconditional statements
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            continue
        modules = [node.module] if isinstance(node, ast.ImportFrom) else None
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        if modules is not None:
            if not getattr(node, "level", 0) and all(m in SIMPLE_MODULES for m in modules):
                exec(compile(ast.Module([node], []), "<recipe imports>", "exec"), namespace)  # noqa: S102
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                try:
                    value = ast.literal_eval(node.value)
                    hash(value)  # immutable: no later statement can have changed it
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    continue  # not a literal: a name the signature cannot use
                namespace[targets[0].id] = value
    return {name: value for name, value in namespace.items() if name == "__builtins__" or counts.get(name) == 1}


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    """The module's one plain `def name`, mentioned by no other statement that runs at import."""
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    bindings = sum(name in _bound_names(node) for node in _top_level(tree))
    if len(defs) != 1 or bindings != 1 or defs[0].decorator_list:
        raise _NotSimple(f"{name}: not one undecorated def")
    for node in _top_level(tree):
        if node is defs[0] or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node is not defs[0] and (node.name == name or _mentions(node.decorator_list, name)):
                raise _NotSimple(f"{name}: bound or wrapped elsewhere")
            continue
        if _mentions([node], name):
            raise _NotSimple(f"{name}: changed at import")
    return defs[0]


def _mentions(nodes: list[ast.AST], name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for node in nodes for n in ast.walk(node))


def _signature(fn: ast.FunctionDef, namespace: dict[str, Any], unquote: bool) -> inspect.Signature:
    args = fn.args
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    kinds = [inspect.Parameter.POSITIONAL_ONLY] * len(args.posonlyargs) + [
        inspect.Parameter.POSITIONAL_OR_KEYWORD
    ] * len(args.args)
    params = [
        _parameter(arg, kind, default, namespace, unquote)
        for arg, kind, default in zip(positional, kinds, defaults, strict=True)
    ]
    if args.vararg:
        params.append(_parameter(args.vararg, inspect.Parameter.VAR_POSITIONAL, None, namespace, unquote))
    params += [
        _parameter(arg, inspect.Parameter.KEYWORD_ONLY, default, namespace, unquote)
        for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg:
        params.append(_parameter(args.kwarg, inspect.Parameter.VAR_KEYWORD, None, namespace, unquote))
    return inspect.Signature(params)


def _parameter(
    arg: ast.arg, kind: Any, default: ast.expr | None, namespace: dict[str, Any], unquote: bool
) -> inspect.Parameter:
    empty = inspect.Parameter.empty
    annotation = arg.annotation
    if unquote and isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return inspect.Parameter(
        arg.arg,
        kind,
        default=empty if default is None else _evaluate(default, namespace),
        annotation=empty if annotation is None else _evaluate(annotation, namespace),
    )


def _evaluate(node: ast.expr, namespace: dict[str, Any]) -> Any:
    """An annotation or a default, evaluated as the imported module's `def` would."""
    return eval(compile(ast.Expression(node), "<recipe signature>", "eval"), dict(namespace))  # noqa: S307
