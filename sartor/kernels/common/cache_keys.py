"""Triton cache keys that are the same in every process, so the kernels an engine carries are the
ones its first run looks up.

A Triton function's cache key hashes its source, the keys of the functions it calls and the
`constexpr` globals it uses, its callees' included. Triton 3.6 merges a callee's globals into the
caller's *before* it computes the callee's key, so a callee hashed for the first time through its
caller contributes no globals: the caller's key then depends on which functions this process
happened to hash first. The build (which compiles hundreds of tactics) and a process that only
loads the engine hash in different orders, so the kernels an engine carries can miss in a fresh
process (docs/decisions/0027-settled-triton-cache-keys.md).

`settle_cache_keys(globals())` at the end of each kernel module hashes its Triton functions callees
first, as Triton 3.8 does by itself: every key is then complete, and the same in every process.
"""
from __future__ import annotations

import ast


def _jit_function_type():
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    return JITFunction


def _resolve(node: ast.AST, namespace: dict):
    """The object a Name or a dotted Attribute chain in a kernel's body names, or None."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, namespace)
        return getattr(base, node.attr, None) if base is not None else None
    return None


def _callees(fn, jit_type) -> list:
    """The Triton functions `fn`'s body names (calls, or functions passed along), in source order."""
    namespace = dict(fn.__globals__)
    found, seen = [], set()
    for node in ast.walk(fn.parse()):
        if isinstance(node, (ast.Name, ast.Attribute)):
            value = _resolve(node, namespace)
            if isinstance(value, jit_type) and value is not fn and id(value) not in seen:
                seen.add(id(value))
                found.append(value)
    return found


def _settle(fn, jit_type, visiting: set) -> None:
    if fn.hash is not None or id(fn) in visiting:
        return
    visiting.add(id(fn))
    for callee in _callees(fn, jit_type):
        _settle(callee, jit_type, visiting)
    fn.cache_key  # noqa: B018 (computed and kept by Triton: callees first, so every key is complete)


def settle_cache_keys(namespace: dict) -> int:
    """Hash every compiled (not interpreted) Triton function defined in `namespace`, callees
    first. Returns how many functions have a key afterwards."""
    jit_type = _jit_function_type()
    if jit_type is None:
        return 0
    module = namespace.get("__name__")
    functions = [v for v in namespace.values() if isinstance(v, jit_type) and getattr(v, "__module__", None) == module]
    for fn in functions:
        _settle(fn, jit_type, set())
    return sum(fn.hash is not None for fn in functions)
