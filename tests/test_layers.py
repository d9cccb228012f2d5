"""The package's import arrows point one way: no module imports, at the top
or inside a function, one that imports it back (directly or around a
circle). Read from the code itself, so a new arrow the wrong way fails here."""
import ast
import pathlib

import fastpersist

PACKAGE = pathlib.Path(fastpersist.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, modules: set) -> set:
    """The package's modules that path imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant):  # importlib.import_module(".save", __package__)
            target = node.args[0].value
            targets = [f"{package}{target}" if target.startswith(".") else target]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != "fastpersist":
                found.add(target)
    return found


def graph() -> dict:
    files = [p for p in PACKAGE.rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def test_no_import_cycles():
    edges = graph()
    assert "fastpersist.atomic_write" in edges["fastpersist.distributed"]  # the reader sees imports at all
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_save_stack_is_layered():
    edges = graph()
    assert "fastpersist.async_save" not in edges["fastpersist.save"]
    assert "fastpersist.distributed" not in edges["fastpersist.save"]
    assert "fastpersist.cli" not in edges["fastpersist.bench.common"]
    for module in ("fastpersist._engine", "fastpersist.fileio", "fastpersist.torch_format"):
        assert not {m for m in edges[module] if m.startswith(("fastpersist.save", "fastpersist.load",
                                                              "fastpersist.patching", "fastpersist.cli"))}, module


def test_the_read_pipeline_and_the_atomic_write_know_no_format():
    """Every format reads through read_pipeline and writes through
    atomic_write; neither knows a format, nor what loads or saves them."""
    edges = graph()
    for module in ("fastpersist.read_pipeline", "fastpersist.atomic_write"):
        assert not {m for m in edges[module] if m.startswith(("fastpersist.save", "fastpersist.load",
                                                              "fastpersist.torch_format", "fastpersist.safetensors",
                                                              "fastpersist.dcp", "fastpersist._torch_api"))}, module


def test_safetensors_reads_and_writes_through_the_neutral_layers():
    """safetensors reads through read_pipeline and writes through atomic_write,
    and imports neither torch loads, torch saves nor the torch format."""
    edges = graph()["fastpersist.safetensors"]
    assert {"fastpersist.read_pipeline", "fastpersist.atomic_write"} <= edges
    assert not edges & {"fastpersist.load", "fastpersist.save", "fastpersist.torch_format", "fastpersist._torch_api"}
