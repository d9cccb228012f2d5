"""fastpersist's settings: defaults, ``FASTPERSIST_*`` environment variables,
``patch(**options)`` and per-call keyword arguments, in rising precedence."""
from __future__ import annotations

import dataclasses
import os
import re

ENGINES = ("auto", "io_uring", "libaio", "psync")
TRANSFERS = ("auto", "bounce", "gds")
MiB = 1 << 20
GiB = 1 << 30  # the engine's bound on buffer and request sizes (32-bit io_uring lengths)


@dataclasses.dataclass(frozen=True)
class Options:
    """How fastpersist writes and reads.

    engine: ``auto`` picks io_uring, then libaio, then psync, whichever the
        kernel accepts at run time.
    buffer_size: bytes per page-locked bounce buffer (multiple of 4096).
    num_buffers: bounce buffers (>= 2): one is filled while others are written.
    queue_depth: I/O requests in flight at most.
    request_size: bytes per I/O request (multiple of 4096).
    direct: use O_DIRECT where the filesystem accepts it.
    fsync: make the file (and its folder entry) durable before returning.
    atomic: write a temporary file and rename it over the destination, so a
        failed save leaves the previous file untouched.
    lock_memory: mlock the bounce buffers.
    max_engines: engines (each with buffer_size * num_buffers of buffers) alive
        at once per configuration in one process; more concurrent saves and
        loads wait for a free one.
    snapshot_memory: bytes of host memory save_async may hold for snapshots
        of tensors, kept for reuse from save to save; 0 (the default) means
        half of the machine's memory. A save_async that needs more than is
        free waits for earlier saves to finish; one that needs more than the
        whole bound is refused.
    load_memory_seconds: how long the memory of a fastpersist.load result
        whose tensors have all died is kept for the next load to reuse
        (at most two such mappings, none under memory pressure); 0 gives
        it back to the system at once.
    transfer: how GPU tensors move between the file and device memory:
        ``bounce`` through the engine's pinned buffers; ``gds`` GPUDirect
        Storage through cuFile: each record's 4 KiB-aligned middle moves
        between the file and device memory directly, its edges through the
        buffers (refused, with the reason, where it cannot run natively,
        unless allow_gds_compat); ``auto`` GDS where it runs natively, else
        the buffers, saying why once in the log. A file cuFile refuses goes
        through the buffers (logged once per reason, counted in
        ``fastpersist.gds.stats()``).
    read_threads: threads that read a file through the page cache at once
        (a file in the page cache, on tmpfs, or small): each preads its own
        pieces straight into their destinations, faulting fresh memory in
        as it goes; 0 (the default) picks the CPUs this process may run on,
        at least 2 and at most 8.
    allow_gds_compat: ``transfer="gds"`` may run where cuFile can only run in
        its compatibility mode (no nvidia-fs: POSIX I/O through cuFile's own
        bounce buffers), said in the log as such; ``auto`` never takes it.
    compare_replicas: a group save (``save(..., group=pg)``) checks that the
        ranks hold the same tensor values: each rank computes the CRC-32 of
        every tensor's bytes as it holds them, the ranks compare them, and a
        difference makes every rank refuse (the file would mix their values).
        Off, only the pickle and the sizes are compared. On for the group
        when any rank has it on.
    """

    engine: str = "auto"
    buffer_size: int = 16 * MiB
    num_buffers: int = 4
    queue_depth: int = 32
    request_size: int = 1 * MiB
    direct: bool = True
    fsync: bool = True
    atomic: bool = True
    lock_memory: bool = True
    max_engines: int = 4
    snapshot_memory: int = 0
    load_memory_seconds: float = 2.0
    compare_replicas: bool = True
    transfer: str = "auto"
    allow_gds_compat: bool = False
    read_threads: int = 0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"fastpersist option engine={self.engine!r}: expected one of {ENGINES}")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"fastpersist option transfer={self.transfer!r}: expected one of {TRANSFERS}")
        for name in ("buffer_size", "request_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 4096 or value > GiB:
                raise ValueError(f"fastpersist option {name}={value!r}: expected a positive multiple of 4096, "
                                 "at most 1 GiB")
        if not isinstance(self.num_buffers, int) or not 2 <= self.num_buffers <= 64:
            raise ValueError(f"fastpersist option num_buffers={self.num_buffers!r}: expected 2..64")
        if not isinstance(self.snapshot_memory, int) or self.snapshot_memory < 0:
            raise ValueError(f"fastpersist option snapshot_memory={self.snapshot_memory!r}: expected bytes >= 0 "
                             "(0: half of the machine's memory)")
        if not isinstance(self.load_memory_seconds, (int, float)) or not 0 <= self.load_memory_seconds < 1e9:
            raise ValueError(f"fastpersist option load_memory_seconds={self.load_memory_seconds!r}: expected "
                             "seconds >= 0 (0: freed load memory is given back at once)")
        if not isinstance(self.max_engines, int) or self.max_engines < 1:
            raise ValueError(f"fastpersist option max_engines={self.max_engines!r}: expected an integer >= 1")
        if not isinstance(self.read_threads, int) or not 0 <= self.read_threads <= 256:
            raise ValueError(f"fastpersist option read_threads={self.read_threads!r}: expected 0..256 "
                             "(0: the CPUs this process may run on, 2 to 8)")
        if not isinstance(self.queue_depth, int) or not 1 <= self.queue_depth <= 4096:
            raise ValueError(f"fastpersist option queue_depth={self.queue_depth!r}: expected 1..4096")
        if self.request_size > self.buffer_size:
            raise ValueError(
                f"fastpersist option request_size={self.request_size} is larger than buffer_size={self.buffer_size}"
            )

    def replace(self, **overrides) -> "Options":
        """These options with overrides (strings are parsed); self where
        nothing changes: every save and load calls this, and a 1 MB save
        takes ~2 ms, of which a rebuilt and re-checked Options was ~1.5%."""
        unknown = sorted(set(overrides) - _FIELD_TYPES.keys())
        if unknown:
            raise TypeError(f"unknown fastpersist option(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(_FIELD_TYPES))}")
        changes = {}
        for name, value in overrides.items():
            value = _coerce(name, value)
            current = getattr(self, name)
            if type(value) is not type(current) or value != current:  # True is not 1 here: __post_init__ decides
                changes[name] = value
        return dataclasses.replace(self, **changes) if changes else self


_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?)?\s*$", re.IGNORECASE)
_BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(Options)}


def _coerce(name: str, value):
    """Turns strings (from the environment) into the option's type."""
    kind = _FIELD_TYPES[name]
    if not isinstance(value, str) or kind == "str":
        return value
    if kind == "bool":
        try:
            return _BOOLS[value.strip().lower()]
        except KeyError:
            raise ValueError(f"fastpersist option {name}={value!r}: expected 1/0, true/false, yes/no or on/off") from None
    if kind == "float":
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"fastpersist option {name}={value!r}: expected a number") from None
    match = _SIZE.match(value)
    if not match:
        raise ValueError(f"fastpersist option {name}={value!r}: expected an integer, optionally with K, M or G")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[(match.group(2) or "")[:1].lower()]
    return int(match.group(1)) * scale


_patched_options: "Options | None" = None  # set by patching.patch()


def current_options() -> Options:
    """Options of the last patch(), else the environment's."""
    return _patched_options if _patched_options is not None else from_environment()


def set_patched_options(options: "Options | None") -> None:
    global _patched_options
    _patched_options = options


_VARIABLES = {name: "FASTPERSIST_" + name.upper() for name in _FIELD_TYPES}
_from_environment: dict = {}  # {the variables' values: Options}, the last few
_ENCODED_VARIABLES = tuple(map(os.environ.encodekey, _VARIABLES.values()))  # the keys of os.environ._data
_from_raw_environment: dict = {}  # {the variables' encoded values, as os.environ holds them: Options}


def from_environment(environ=os.environ) -> Options:
    """Defaults overridden by FASTPERSIST_<OPTION> variables (read on every
    call: a program may set them between saves)."""
    raw = getattr(environ, "_data", None)
    if environ is os.environ and type(raw) is dict:
        # os.environ keeps its live values in _data, by encoded name: one dict
        # lookup per variable instead of os.environ.get's encode and decode
        # (20 of a 1 MB save's ~3000 us); unchanged variables find their Options
        cached = _from_raw_environment.get(tuple(map(raw.get, _ENCODED_VARIABLES)))
        if cached is not None:
            return cached
    overrides = {}
    for name, variable in _VARIABLES.items():
        value = environ.get(variable)
        if value is not None and value != "":
            overrides[name] = value
    key = tuple(overrides.items())
    options = _from_environment.get(key)
    if options is None:
        options = Options().replace(**overrides)  # raises for a bad value, every time it is met
        if len(_from_environment) >= 8:
            _from_environment.clear()
        _from_environment[key] = options
    if environ is os.environ and type(raw) is dict:
        if len(_from_raw_environment) >= 8:
            _from_raw_environment.clear()
        _from_raw_environment[tuple(map(raw.get, _ENCODED_VARIABLES))] = options
    return options
