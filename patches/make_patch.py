#!/usr/bin/env python
"""Writes patches/torch-<version>-serialization.patch from the installed torch.

The patch renames torch's ``def save(`` in torch/serialization.py to
``_fastpersist_vanilla_save`` (body untouched) and puts a new ``save`` with
the same signature and docstring in front of it, which hands the call to
fastpersist (unless FASTPERSIST_SOURCE_PATCH=0 or fastpersist is missing).

    python patches/make_patch.py [--source FILE] [--torch-version X.Y.Z] [--output-dir DIR]

Apply the result in site-packages with ``patch -p1``; see patches/README.md.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib.metadata
import importlib.util
import os
import re
import sys

HEADER_OLD = "a/torch/serialization.py"
HEADER_NEW = "b/torch/serialization.py"
VANILLA = "_fastpersist_vanilla_save"
PARAMETERS = ("obj", "f", "pickle_module", "pickle_protocol",
              "_use_new_zipfile_serialization", "_disable_byteorder_record")
_DEF_SAVE = re.compile(r"^def save\(", re.MULTILINE)


class PatchError(Exception):
    """The source does not look like what this script knows how to patch."""


def installed_source() -> str:
    """Path of the installed torch/serialization.py, found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("torch is not installed")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "serialization.py")
        if os.path.isfile(path):
            return path
    raise PatchError("torch/serialization.py not found in the installed torch")


def installed_version() -> str:
    return importlib.metadata.version("torch")


def release_of(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0'."""
    return version.split("+", 1)[0]


def patch_name(version: str) -> str:
    return f"torch-{release_of(version)}-serialization.patch"


def _find_save(source: str) -> ast.FunctionDef:
    count = len(_DEF_SAVE.findall(source))
    if count != 1:
        raise PatchError(f"expected exactly one 'def save(' at the start of a line, found {count}")
    tree = ast.parse(source)
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "save"]
    if len(found) != 1:
        raise PatchError(f"expected one module-level function save, found {len(found)}")
    func = found[0]
    if func.decorator_list:
        raise PatchError("save has decorators; this script does not handle them")
    names = tuple(a.arg for a in func.args.posonlyargs + func.args.args)
    if names != PARAMETERS or func.args.vararg or func.args.kwarg or func.args.kwonlyargs:
        raise PatchError(f"save's parameters changed: expected {PARAMETERS}, found {names}")
    first = func.body[0] if func.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        raise PatchError("save has no docstring")
    return func


def patched_source(source: str) -> str:
    """The source with the new save in front of the renamed original."""
    func = _find_save(source)
    lines = source.splitlines(keepends=True)
    start = func.lineno - 1                      # 'def save(' line, 0-based
    if not lines[start].startswith("def save("):
        raise PatchError(f"line {func.lineno} does not start with 'def save('")
    doc = func.body[0]
    doc_lines = lines[doc.lineno - 1:doc.end_lineno]
    # The signature ends at the last code line before the docstring
    # (torch has comments between the two).
    end = doc.lineno - 2
    while end > start and (not lines[end].strip() or lines[end].lstrip().startswith("#")):
        end -= 1
    signature = lines[start:end + 1]
    if not signature[-1].rstrip().endswith(":"):
        raise PatchError("cannot find the end of save's signature")

    args = ", ".join(PARAMETERS)
    body = [
        "    import os as _fp_os\n",
        "\n",
        '    if _fp_os.environ.get("FASTPERSIST_SOURCE_PATCH", "1") != "0":\n',
        "        try:\n",
        "            from fastpersist.save_api import save as _fp_save\n",
        "        except ImportError:\n",
        "            pass\n",
        "        else:\n",
        f"            return _fp_save({args})\n",
        f"    return {VANILLA}({args})\n",
        "\n",
        "\n",
    ]
    new_save = signature + doc_lines + body
    renamed = "def " + VANILLA + "(" + lines[start][len("def save("):]
    result = "".join(lines[:start] + new_save + [renamed] + lines[start + 1:])
    try:
        ast.parse(result)
    except SyntaxError as exc:  # pragma: no cover - would be a bug here
        raise PatchError(f"the patched source does not parse: {exc}") from exc
    return result


def make_patch(source: str) -> str:
    new = patched_source(source)
    diff = difflib.unified_diff(source.splitlines(keepends=True), new.splitlines(keepends=True),
                                HEADER_OLD, HEADER_NEW)
    return "".join(diff)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", help="serialization.py to read (default: the installed torch's)")
    parser.add_argument("--torch-version", help="version for the file name (default: the installed torch's)")
    parser.add_argument("--output-dir", default=os.path.dirname(os.path.abspath(__file__)),
                        help="where to write the .patch (default: this script's folder)")
    args = parser.parse_args(argv)
    try:
        path = args.source or installed_source()
        version = args.torch_version or installed_version()
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        text = make_patch(source)
    except (PatchError, OSError, importlib.metadata.PackageNotFoundError) as exc:
        print(f"make_patch.py: cannot make the patch: {exc}", file=sys.stderr)
        return 1
    out = os.path.join(args.output_dir, patch_name(version))
    with open(out, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
