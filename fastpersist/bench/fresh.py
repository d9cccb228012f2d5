"""Fresh processes for the benchmarks: each measurement of a restart runs in
a process that holds none of the parent's memory, engines or allocations.
Above common and child: it starts child.main in each."""
from __future__ import annotations

import multiprocessing
import os
import sys

from . import child
from .common import BenchError


class FreshProcesses:
    """Runs one measurement per new process, as after a restart.

    The processes are forked by a multiprocessing fork server that has only
    imported torch and fastpersist: each starts with none of this process's
    memory, engines or cached allocations, and the seconds it would spend
    importing torch (which no checkpoint format changes) are not counted.
    The server is started at once, so its imports overlap the set-up."""

    def __init__(self):
        # the server and its children read the environment as it is now
        os.environ["FASTPERSIST_AUTOPATCH"] = "0"
        self._context = multiprocessing.get_context("forkserver")
        # fastpersist's modules that its saves and loads import on first use count as its import: an
        # install compiled them (pip writes their bytecode); where bytecode is not written (an editable
        # tree with PYTHONDONTWRITEBYTECODE) each child would compile them again, which no install pays
        self._context.set_forkserver_preload(["torch", "fastpersist", "fastpersist.plain_pickle",
                                              "fastpersist.gc_pause", "fastpersist.bench.child",
                                              "fastpersist.bench.common", "fastpersist.bench.models"])
        from multiprocessing import forkserver

        forkserver.ensure_running()

    def run(self, spec: dict, timeout: float = 3600) -> dict:
        receiver, sender = self._context.Pipe(duplex=False)
        process = self._context.Process(target=child.main, args=(spec, sender), daemon=True)
        process.start()
        sender.close()
        try:
            if not receiver.poll(timeout):
                process.kill()
                raise BenchError(f"a fresh process measuring {spec.get('mechanism')} took more than {timeout:.0f} s")
            try:
                result = receiver.recv()
            except EOFError:
                process.join()
                raise BenchError(f"the fresh process measuring {spec.get('mechanism')} died "
                                 f"(exit code {process.exitcode}; out of memory?)") from None
        finally:
            receiver.close()
        process.join()
        if not result.get("ok"):
            sys.stderr.write(result.get("traceback", ""))
            raise BenchError(f"{spec.get('mechanism')} failed in a fresh process: {result.get('error')}")
        return result
