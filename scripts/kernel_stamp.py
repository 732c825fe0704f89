#!/usr/bin/env python
"""A short hash of the Triton kernels' sources: which autotuning results a carried Triton cache can still serve.

  python3 scripts/kernel_stamp.py    # -> 16 hex digits on stdout

Why: Triton keys a kernel's cached autotuning results by its source (and the jitted functions it calls), so a
`.tcache/` packed before a kernel edit is stale for that kernel, and the first process on a fresh GPU machine
re-tunes every shape of it (~100-140 s a shape). Session 40 lost its first call that way: session 39 edited
kernels/trace.py after packing, and every traced kernel calls it. `scripts/triton_cache.sh` stores this stamp in the
archive when it packs and compares it when it seeds or checks. What is hashed: the text of every `@triton.jit`
function and every `tl.constexpr(...)` global in specpilot/kernels/*.py, the parts of a module Triton's own key
reads. So a comment outside them does not make the cache stale, and an edit inside one does.
"""

from __future__ import annotations

import ast
import hashlib
import sys
from pathlib import Path


def _jitted(node: ast.AST) -> bool:
    """A function whose decorators name `jit` (`@triton.jit`, `@jit`, `@triton.jit(...)`)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if (isinstance(target, ast.Attribute) and target.attr == "jit") or (
                isinstance(target, ast.Name) and target.id == "jit"):
            return True
    return False


def _constexpr_global(node: ast.AST) -> bool:
    """`NAME = tl.constexpr(...)` (a global the kernels read as a compile-time constant)."""
    value = getattr(node, "value", None) if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and value.func.attr == "constexpr")


def stamp(kernels: Path) -> str:
    """The stamp of the kernel modules in `kernels` (sorted by name; the parts in the module docstring)."""
    h = hashlib.sha256()
    for path in sorted(kernels.glob("*.py")):
        text = path.read_text()
        parts = [ast.get_source_segment(text, node) or "" for node in ast.walk(ast.parse(text))
                 if _jitted(node) or _constexpr_global(node)]
        if parts:
            h.update(path.name.encode() + b"\0" + "\0".join(parts).encode() + b"\0")
    return h.hexdigest()[:16]


def main(argv: list[str]) -> int:
    if argv:
        print("usage: kernel_stamp.py  (no arguments: the stamp of specpilot/kernels)", file=sys.stderr)
        return 2
    kernels = Path(__file__).resolve().parent.parent / "specpilot" / "kernels"
    if not kernels.is_dir():
        print(f"kernel_stamp.py: no kernels folder at {kernels.name} beside scripts/", file=sys.stderr)
        return 2
    print(stamp(kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
