"""The stored program's file: an exported module and a plain description of its output, nothing that
runs code when read.

A program directory may be shared (a cluster's cache on a network disk), so whoever can write a file
there must not be able to run code in the processes that read it: no pickle. A file holds

    MAGIC, the header's length (8 bytes, little-endian), the header (JSON), the serialized export

where the header describes the output's pytree (:func:`describe_tree`). Reading parses the JSON and
hands the export's bytes to ``jax.export.deserialize``, which parses them as data. A node type is
named by its module and qualified name and must be a named tuple or dataclass defined in this
package (or a tuple, list, dict or None); its static data is JSON scalars, as many children and
static values as the type has fields. Anything else in a file, or a file that is not in this format at all, is
:class:`ProgramFileError`, and the caller exports the program anew.

What the format does not stop: whoever can write the directory can still store a valid program that
computes something else (wrong labels). A program directory is to be shared only among those who
trust each other's labels.
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import jax

MAGIC = b"pyscf-ipu program\n"
PACKAGE = __name__.rsplit(".", 1)[0]
MAX_HEADER_BYTES = 1 << 20  # an output tree's description is a few kB
MAX_DEPTH = 64  # nesting of the description's nodes and static data
_BUILTIN_NODES = {"tuple": tuple, "list": list, "dict": dict, "None": type(None)}
_JSON_SCALARS = (str, int, float, bool, type(None))


class ProgramFileError(ValueError):
    """A program file that cannot be read back as data: the program is exported anew."""


def describe_tree(treedef) -> object:
    """A JSON description of ``treedef``: "*" for a leaf, else {"type", "aux", "children"}. Raises
    :class:`TypeError` for a node type outside this package or static data that is not JSON scalars
    (nested in tuples): such a program is not stored."""
    data = treedef.node_data()
    if data is None:
        return "*"
    kind, aux = data
    return {"type": _type_name(kind), "aux": _plain(aux), "children": [describe_tree(c) for c in treedef.children()]}


def tree_of(description, depth: int = 0) -> jax.tree_util.PyTreeDef:
    """The pytree structure :func:`describe_tree` described; :class:`ProgramFileError` for anything it
    would not have written."""
    if description == "*":
        return jax.tree.structure(0)
    if depth > MAX_DEPTH:
        raise ProgramFileError("a program's output tree is nested too deep")
    if not isinstance(description, dict) or set(description) != {"type", "aux", "children"}:
        raise ProgramFileError(f"not a tree node: {description!r:.80}")
    kind = _node_type(description["type"])
    if not isinstance(description["children"], list):
        raise ProgramFileError("a tree node's children are not a list")
    children = [tree_of(child, depth + 1) for child in description["children"]]
    aux = _tuples(description["aux"])
    if kind is dict:  # its keys, one per child (jaxlib reads past the end of a shorter list)
        if not isinstance(aux, tuple) or len(set(aux)) != len(aux) or len(aux) != len(children):
            raise ProgramFileError("a dict node's keys are not one per child")
        aux = list(aux)
    elif kind in (tuple, list, type(None)):
        if aux is not None or (kind is type(None) and children):
            raise ProgramFileError(f"a {description['type']} node with static data or children it cannot have")
    elif _arity(kind) != (len(children), None if aux is None else len(aux)):  # jaxlib does not check it
        raise ProgramFileError(f"a {description['type']} node with other children or static data than its fields")
    try:
        return jax.tree_util.PyTreeDef.from_node_data_and_children(jax.tree_util.default_registry, (kind, aux),
                                                                   children)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - whatever the registry makes of a node it cannot rebuild
        raise ProgramFileError(f"a tree node of {description['type']} does not rebuild: {err}") from None


def program_bytes(serialized: bytes, out_tree) -> bytes:
    """A program file's contents: the export ``serialized`` and its output's tree ``out_tree``."""
    header = json.dumps({"out_tree": describe_tree(out_tree)}, separators=(",", ":")).encode()
    return MAGIC + len(header).to_bytes(8, "little") + header + serialized


def read_program(data: bytes):
    """(the ``jax.export.Exported``, its output's tree) of a program file's contents ``data``;
    :class:`ProgramFileError` where they are not a program file's."""
    from jax import export

    start = len(MAGIC) + 8
    if not data.startswith(MAGIC) or len(data) < start:
        raise ProgramFileError("not a program file")
    length = int.from_bytes(data[len(MAGIC) : start], "little")
    if length > MAX_HEADER_BYTES:
        raise ProgramFileError("a program file's header is too long")
    end = start + length
    try:
        header = json.loads(data[start:end])
    except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, numbers past Python's limit, too deep
        raise ProgramFileError(f"a program file's header is not JSON: {err}") from None
    if not isinstance(header, dict) or "out_tree" not in header:
        raise ProgramFileError("a program file's header lacks its output's tree")
    out_tree = tree_of(header["out_tree"])
    try:
        exported = export.deserialize(bytearray(data[end:]))
    except Exception as err:  # noqa: BLE001 - truncated, or from an incompatible jax
        raise ProgramFileError(f"a program file's module does not deserialize: {err}") from None
    return exported, out_tree


def _type_name(kind: type) -> str:
    for name, builtin in _BUILTIN_NODES.items():
        if kind is builtin:
            return name
    if not _in_package(kind.__module__):
        raise TypeError(f"a stored program's output holds a {kind.__module__}.{kind.__qualname__}, not this package's")
    return f"{kind.__module__}:{kind.__qualname__}"


def _in_package(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def _node_type(name) -> type:
    """The node type a description names: a builtin, or a class of this package (its module imported
    if need be: only this package's modules are ever imported)."""
    if not isinstance(name, str):
        raise ProgramFileError("a tree node's type is not a name")
    if name in _BUILTIN_NODES:
        return _BUILTIN_NODES[name]
    module, _, qualname = name.partition(":")
    if not qualname or not _in_package(module):
        raise ProgramFileError(f"a tree node's type {name!r:.80} is not this package's")
    try:
        kind = importlib.import_module(module)
        for part in qualname.split("."):
            kind = getattr(kind, part)
    except (ImportError, AttributeError):
        raise ProgramFileError(f"no type {name!r:.80} in this package") from None
    if not isinstance(kind, type) or (kind.__module__, kind.__qualname__) != (module, qualname):
        raise ProgramFileError(f"{name!r:.80} is not a type defined there")  # not one reached through an attribute
    return kind


def _arity(kind: type) -> tuple[int, int | None]:
    """(children, static values or None) of a node of this package's ``kind``: a named tuple, or a
    dataclass registered with ``jax.tree_util.register_dataclass`` (static fields marked so)."""
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):
        return len(kind._fields), None
    if not dataclasses.is_dataclass(kind):
        raise ProgramFileError(f"{kind.__qualname__} is neither a named tuple nor a dataclass")
    fields = dataclasses.fields(kind)
    static = sum(bool(f.metadata.get("static")) for f in fields)
    return len(fields) - static, static


def _plain(aux):
    """A node's static data as JSON: scalars, in (nested) tuples or lists, written as lists."""
    if isinstance(aux, (tuple, list)):
        return [_plain(a) for a in aux]
    if isinstance(aux, _JSON_SCALARS):
        return aux
    raise TypeError(f"a stored program's output tree holds static data of type {type(aux).__name__}")


def _tuples(aux, depth: int = 0):
    """JSON lists back to the tuples :func:`_plain` wrote; anything but scalars is refused."""
    if depth > MAX_DEPTH:
        raise ProgramFileError("a tree node's static data is nested too deep")
    if isinstance(aux, list):
        return tuple(_tuples(a, depth + 1) for a in aux)
    if isinstance(aux, _JSON_SCALARS):
        return aux
    raise ProgramFileError("a tree node's static data is not plain")
