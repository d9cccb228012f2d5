"""``fastpersist bench report``: a stored ``fastpersist bench ... --json``
file rendered as a table (text, or Markdown for the documentation), with the
machine, the date and the command that made it, so that every number in the
documentation traces back to a JSON file under ``benchmarks/results/``.

Pages hold generated tables between two markers, the JSON's path relative to
the page's own folder in the first::

    <!-- fastpersist bench report ../benchmarks/results/gpu-h200-2026-11-27-a.json -->
    ...generated...
    <!-- end bench report -->

``fastpersist bench report --update PAGE.md ...`` rewrites those blocks;
``--check`` says which are stale (exit code 1) and changes nothing.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Optional, Sequence

from . import common

GiB = 1 << 30
BEGIN = re.compile(r"<!-- fastpersist bench report (\S+) -->\n")
END = "<!-- end bench report -->"

# the settings each benchmark's JSON records, as the flags that set them
_FLAGS = {"size_gb": "--size", "sizes_gb": "--sizes", "repeats": "--repeats", "dtype": "--dtype",
          "device": "--device", "models": "--models", "layers": "--layers", "shard_size_gb": "--shard-size",
          "ram_device_gb": "--ram-device"}


def load(path: str) -> dict:
    """The JSON document at path; BenchError (one line) if it is missing or not a bench result."""
    try:
        with open(path, encoding="utf-8") as fh:
            document = json.load(fh)
    except OSError as exc:
        raise common.BenchError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise common.BenchError(f"{path} is not JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("results"), list) \
            or not str(document.get("benchmark", "")).startswith("fastpersist bench"):
        raise common.BenchError(f"{path} is not the JSON of a `fastpersist bench ... --json` run")
    return document


def date_of(document: dict, path: Optional[str]) -> str:
    """The run's date: recorded in the JSON (since it was), else the YYYY-MM-DD in its file name."""
    if document.get("date"):
        return str(document["date"])
    found = re.search(r"\d{4}-\d{2}-\d{2}", os.path.basename(path or ""))
    return f"{found.group(0)} (from the file name)" if found else "not recorded"


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def command_of(document: dict) -> str:
    """The command line the JSON's settings stand for."""
    parts = [document["benchmark"]]
    settings = document.get("settings") or {k: document[k] for k in ("sizes_gb", "repeats", "ram_device_gb")
                                            if k in document}
    for key, flag in _FLAGS.items():
        value = settings.get(key)
        if value is None:
            continue
        if isinstance(value, list):
            value = ",".join(_number(v) for v in value)
        parts.append(f"{flag} {_number(value)}")
    folder = (document.get("machine") or {}).get("folder")
    if folder and not settings.get("ram_device_gb"):  # a RAM device's folder was made for the run
        parts.append(f"--folder {os.path.dirname(folder.rstrip('/')) or '/'}")
    return " ".join(parts)


def context_lines(document: dict, path: Optional[str]) -> list:
    """What was measured, where and when: one line each."""
    lines = [f"date: {date_of(document, path)}", f"command: {command_of(document)}"]
    machine = document.get("machine")
    if machine:
        lines += common.machine_lines(machine)
    if document.get("device"):
        lines.append(f"device: {document['device']}")
    gds = document.get("gds")
    if gds:
        if gds.get("mode"):
            stats = gds.get("stats") or {}
            moved = (stats.get("bytes_written") or 0) + (stats.get("bytes_read") or 0)
            lines.append(f"GPUDirect Storage: cuFile in {gds['mode']}; {moved / 1e9:.2f} GB moved through cuFile; "
                         f"files that fell back to the buffers: {stats.get('fallbacks') or 'none'}")
        else:
            lines.append(f"GPUDirect Storage: not measured ({gds.get('why_not')})")
    return lines


def _columns(document: dict) -> list:
    """(header, key or function, right-aligned) for the columns this document's rows fill."""
    rows = document["results"]
    gpu = document["benchmark"] == "fastpersist bench gpu"
    reference = "× reference" if gpu else "× safetensors" if _is_safetensors(document) else "× torch"

    def present(key: str) -> bool:
        return any(row.get(key) not in (None, "-", "", {}) for row in rows)

    candidates: list = [
        ("model", "model", False), ("checkpoint", "contents", False), ("phase", "phase", False),
        ("MB", lambda r: f"{r['file_bytes'] / 1e6:.1f}" if r.get("file_bytes") else "-", True),
        ("operation", "operation", False), ("mechanism", "mechanism", False), ("engine", "engine", False),
        ("buffer MiB", lambda r: f"{r['buffer_size'] / (1 << 20):g}" if r.get("buffer_size") else "-", True),
        ("buffers", "num_buffers", True), ("queue depth", "queue_depth", True),
        ("median s", lambda r: f"{r['median_s']:.3f}", True),
        ("GB/s", lambda r: common.fmt(r.get("gb_per_s")), True),
        (reference, lambda r: common.fmt(r.get("x_vanilla")), True),
        ("× ceiling", lambda r: common.fmt(r.get("x_ceiling")), True),
        ("peak host MiB", lambda r: common.fmt(r.get("peak_host_mib"), 0), True),
        ("durable s", lambda r: common.fmt(r.get("durable_median_s"), 3), True),
    ]
    keys = {"MB": "file_bytes", "buffer MiB": "buffer_size", "median s": "median_s", "GB/s": "gb_per_s",
            "× reference": "x_vanilla", "× torch": "x_vanilla", "× safetensors": "x_vanilla", "× ceiling": "x_ceiling",
            "peak host MiB": "peak_host_mib", "durable s": "durable_median_s"}
    return [(header, get, right) for header, get, right in candidates
            if present(get if isinstance(get, str) else keys[header])]


def _cells(document: dict) -> tuple:
    columns = _columns(document)
    body = []
    for row in document["results"]:
        body.append([str(row.get(get, "-")) if isinstance(get, str) else get(row) for _, get, _ in columns])
    return [header for header, _, _ in columns], body, [i for i, (_, _, right) in enumerate(columns) if right]


def _is_safetensors(document: dict) -> bool:
    return document["benchmark"] == "fastpersist bench safetensors"


def notes(document: dict) -> list:
    if _is_safetensors(document):
        return ["× safetensors: safetensors' time (save_file + fsync; load_file, its mmap backend; read as "
                "transformers reads: its safe_open) over this one in the same round, median over rounds; × ceiling: "
                "the raw engine's time over this one. Cold loads: each in a fresh process, the files dropped from "
                "the page cache, every byte touched."]
    if document["benchmark"] == "fastpersist bench vllm":
        return ["Seconds: the load format's `load_weights` in a fresh vLLM process (vLLM's own \"Loading weights "
                "took\" agrees where logged), or vLLM's \"Reloading and processing weights took\" for a reload in "
                "place; median over rounds. ×: vLLM's default loader's time over this one in the same round. "
                "Private memory: growth of the process's anonymous memory during the load (the parameters "
                "themselves; mapped files' pages are the page cache's). Every start's greedy tokens equal "
                "the default loader's. The plain read's row is `cat` of the same shards."]
    if document["benchmark"] == "fastpersist bench gpu":
        return ["× reference: torch's time over this one in the same round (for save_async: one device-to-host "
                "copy_ of the state), median over rounds; × ceiling: the ceiling's time over this one (saves and "
                "cold loads: the raw engine; loads from the page cache or tmpfs: parallel preads into page-locked "
                "memory, no device copy); "
                "peak host MiB: growth of the resident high-water mark during the call; durable s: until "
                "save_async's file is on disk."]
    return ["× torch: torch's time over this one in the same round, median over rounds; × ceiling: the raw "
            "engine's time over this one (1.00: as fast as the engine with no format)."]


def _vllm_cells(document: dict) -> tuple:
    """`fastpersist bench vllm`'s rows as one row per load format: its
    seconds (and × vLLM's default loader) per regime, the reload's, and the
    private memory the load grew by."""
    regimes = ("cold", "warm", "tmpfs")
    headers = ["load format"] + [f"{r} s (×)" for r in regimes] + ["reload, warm s (×)", "private memory GB"]
    found: dict = {}
    for row in document["results"]:
        operation = row["operation"]
        regime = operation.rsplit(", ", 1)[-1]
        kind = "reload" if operation.startswith("reload") else "load"
        found.setdefault(row["mechanism"], {})[kind, regime] = row

    def cell(row: Optional[dict]) -> str:
        if row is None:
            return "-"
        x = row.get("x_vanilla")
        return f"{row['median_s']:.3f}" + (f" ({x:.2f})" if x is not None else "")

    body = []
    for mechanism, rows in found.items():
        memory = max((r.get("median_anon_growth_bytes") or 0 for r in rows.values()), default=0)
        body.append([mechanism] + [cell(rows.get(("load", r))) for r in regimes]
                    + [cell(rows.get(("reload", "warm"))), f"{memory / 1e9:.2f}" if memory else "-"])
    return headers, body, list(range(1, len(headers)))


def _cells_of(document: dict) -> tuple:
    return _vllm_cells(document) if document["benchmark"] == "fastpersist bench vllm" else _cells(document)


def text(document: dict, path: Optional[str] = None) -> str:
    headers, body, right = _cells_of(document)
    return "\n".join(context_lines(document, path) + [""] + common.table(headers, body, right=right)
                     + [""] + notes(document)) + "\n"


def markdown(document: dict, path: Optional[str] = None) -> str:
    """A Markdown block: what, where and when as a list, then the table."""
    headers, body, right = _cells_of(document)
    out = [f"- {line}" for line in context_lines(document, path)]
    out += ["", "| " + " | ".join(headers) + " |",
            "| " + " | ".join("---:" if i in right else "---" for i in range(len(headers))) + " |"]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    out += [""] + notes(document)
    return "\n".join(out) + "\n"


def render_pages(pages: Sequence[str], write: bool,
                 render: Callable[[dict, str], str] = markdown) -> list:
    """Re-renders every marked block of each page from its JSON; returns the
    pages whose blocks were stale (rewritten where write is true)."""
    stale = []
    for page in pages:
        try:
            with open(page, encoding="utf-8") as fh:
                original = fh.read()
        except OSError as exc:
            raise common.BenchError(f"cannot read {page}: {exc.strerror or exc}") from None
        out, position = [], 0
        for begin in BEGIN.finditer(original):
            end = original.find(END, begin.end())
            if end < 0:
                raise common.BenchError(f"{page}: a '{begin.group(0).strip()}' with no '{END}' after it")
            source = os.path.join(os.path.dirname(page), begin.group(1))
            shown = os.path.normpath(os.path.relpath(source))
            out += [original[position:begin.end()], render(load(source), shown)]
            position = end
        out.append(original[position:])
        updated = "".join(out)
        if updated != original:
            stale.append(page)
            if write:
                with open(page, "w", encoding="utf-8") as fh:
                    fh.write(updated)
    return stale


def run(args) -> int:
    if args.update or args.check:
        pages = args.files
        stale = render_pages(pages, write=bool(args.update))
        for page in stale:
            common.echo(("rewrote " if args.update else "stale: ") + page)
        if args.check and stale:
            common.echo("run `fastpersist bench report --update` on these pages")
            return 1
        return 0
    for i, path in enumerate(args.files):
        document = load(path)
        if i:
            common.echo()
        common.echo((markdown if args.markdown else text)(document, path).rstrip("\n"))
    return 0
