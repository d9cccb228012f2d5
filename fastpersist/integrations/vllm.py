"""fastpersist as a vLLM load format: ``vllm serve MODEL --load-format
fastpersist``, or ``LLM(model=..., load_format="fastpersist")``.

Registered in every vLLM process (its spawned engine and workers too) by
fastpersist's entry point in the ``vllm.general_plugins`` group: nothing to
import or call. A model folder's weights are read this way:

- safetensors shards (those its ``model.safetensors.index.json`` names,
  where it has one; else every ``*.safetensors``), in file order; a model
  with none, its ``*.bin`` / ``*.pt`` files, through ``fastpersist.load``.
- Each shard is mapped as safetensors maps it: its tensors are the file's
  pages, and vLLM's ``weight_loader`` copies each into its parameter, one
  pass over every byte. A shard not in the page cache has a helper thread
  reading its pages in (MADV_POPULATE_READ) ahead of those copies, so the
  device works while vLLM copies. Measured here (2 CPUs), this beat
  reading the shard through the engine into fresh memory and copying from
  there (``cold_read="engine"``: O_DIRECT, runs of whole tensors read ahead
  on a thread of its own, at most ``read_ahead_mib`` held): the fresh
  memory costs more to fault in than the page cache costs to fill.

Every tensor handed to vLLM owns its memory (a mapping, or a chunk its
tensors keep alive): vLLM may hold tensors until a whole layer has arrived
(in-place reloads, online quantization). ``get_all_weights`` is what vLLM's
``reload_weights`` calls, so reloads in place read the same way.

Options (``model_loader_extra_config``): ``cold_read`` ("mapped" or
"engine"), ``read_ahead_mib`` (int > 0, for "engine"),
``prefault_parameters`` (bool, default False: helper threads fault the
model's untouched parameters in ahead of the copies; slower on 2 CPUs)."""
from __future__ import annotations

import json
import os
import re
import time
from typing import Iterator, Optional

LOAD_FORMAT = "fastpersist"
READ_AHEAD_MIB = 256
# helpers reading a shard not in the page cache in ahead of vLLM's copies (2 CPUs here: one did as well as
# two, 0.21 s against 0.22 for a 0.35 GB shard; 0.29 s for the engine's read-ahead into fresh memory)
COLD_READERS = 1
INDEX_FILE = "model.safetensors.index.json"
_OPTIONS = {"cold_read": str, "read_ahead_mib": int, "prefault_parameters": bool}
# files a folder may hold beside a model's weights (vLLM skips these too)
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the load format
    with vLLM's loader registry (once per process; nothing where vLLM is not
    installed)."""
    try:
        from vllm.model_executor import model_loader
    except ImportError:
        return
    if LOAD_FORMAT in getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {}):
        return
    model_loader.register_model_loader(LOAD_FORMAT)(_loader_class())


def weight_files(folder: str) -> list:
    """The weight files of a model folder, in the order they are read:
    safetensors shards (those its index names, where it has one) or, where
    there are none, its .bin / .pt files. FileNotFoundError names what is
    missing."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such model folder")
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            try:
                named = sorted(set(json.load(f)["weight_map"].values()), key=_natural)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{index}: not a safetensors index (a weight_map of names to files): {exc}") \
                    from None
        for name in named:
            if not os.path.isfile(os.path.join(folder, name)):
                raise FileNotFoundError(f"{index} names {name}, which is not in {folder}")
        return [os.path.join(folder, name) for name in named]
    names = sorted((n for n in os.listdir(folder) if n.endswith(".safetensors")), key=_natural)
    if not names:
        names = sorted((n for n in os.listdir(folder) if n.endswith((".bin", ".pt")) and not n.endswith(_NOT_WEIGHTS)),
                       key=_natural)
    if not names:
        raise FileNotFoundError(f"{folder}: no *.safetensors, *.bin or *.pt weights")
    return [os.path.join(folder, name) for name in names]


def _note(exc: BaseException, note: str) -> None:
    """Says which file (and tensor) an error met, once, in its traceback."""
    if hasattr(exc, "add_note") and not any("fastpersist" in n for n in getattr(exc, "__notes__", ())):
        exc.add_note(note)


def _natural(name: str) -> list:
    """model-2-of-10 before model-10-of-10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def weights(files: list, read_ahead_mib: int = READ_AHEAD_MIB, log=None, where: Optional[list] = None,
            cold_read: str = "mapped", device=None) -> Iterator:
    """(name, tensor) of every tensor of the files, file after file and in
    file order within each; log(message, *args), where given, is told how
    each file was read; where, a list, is set to [file, name] of the tensor
    handed out last (for the consumer's errors); cold_read: how a shard not
    in the page cache is read ("mapped" or "engine").

    device: a GPU (a torch.device) puts safetensors shards' tensors there,
    read_ahead_mib of them at a time (read_pipeline.read_pieces: staged
    through page-locked buffers by parallel readers where the shard is in
    the page cache, the engine's buffers where not); else CPU tensors."""
    for path in files:
        started, nbytes, mode = time.perf_counter(), os.path.getsize(path), None
        try:
            if path.endswith(".safetensors") and device is not None and device.type != "cpu":
                mode, tensors = _device_tensors(path, device, read_ahead_mib << 20)
            elif path.endswith(".safetensors"):
                mode, tensors = _safetensors_tensors(path, read_ahead_mib << 20, cold_read)
            else:
                mode, tensors = "fastpersist.load", _torch_file_tensors(path)
            for name, tensor in tensors:
                if where is not None:
                    where[:] = [path, name]
                yield name, tensor
        except Exception as exc:  # noqa: BLE001 - noted and raised
            _note(exc, f"(while fastpersist read {path})")
            raise
        if log is not None:
            seconds = time.perf_counter() - started
            log("fastpersist: %s: %.2f GB %s in %.2f s (%.2f GB/s, vLLM's copies into parameters included)",
                os.path.basename(path), nbytes / 1e9, mode, seconds, nbytes / 1e9 / max(seconds, 1e-9))


def _safetensors_tensors(path: str, read_ahead_bytes: int, cold_read: str = "mapped"):
    """(how the file is read, its (name, tensor) pairs in file order). The
    file is mapped here, by its descriptor, which is closed before any
    tensor is handed out; the engine reads it where cold_read says so or
    where it cannot be mapped that way (no /proc)."""
    from .. import read_pipeline
    from .. import safetensors as fast_st

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        header = fast_st.Header.read(fd, path, size)  # a sound file, or SafetensorsFileError naming it
        cached = read_pipeline.is_cached(fd, size)
        mapped = None if not cached and cold_read == "engine" else fast_st._mapped_load_file(fd, path, header, size)
    finally:
        os.close(fd)
    if mapped is None:
        return "read by the engine", _read_tensors(path, header, read_ahead_bytes)
    if cached:
        return "mapped (in the page cache)", _handed_out(header, mapped, 0)
    return "mapped, read ahead from the device", _handed_out(header, mapped, COLD_READERS)


def _device_tensors(path: str, device, window_bytes: int):
    """(how the file is read, its (name, tensor) pairs in file order, on
    device). The tensors are read a window at a time (runs of tensors of at
    most window_bytes; a larger one alone): each window's tensors are
    allocated on the device and filled by one read_pipeline.read_pieces,
    then handed out; the consumer's copies out of them run on its stream,
    and their memory goes back to the device's allocator as it drops them.
    Device memory: a window beyond the model's."""
    import torch

    from .. import device_io, read_pipeline
    from .. import safetensors as fast_st
    from ..options import current_options

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        header = fast_st.Header.read(fd, path, size)
        options = current_options()
        staged = read_pipeline.through_page_cache(fd, size, options)
    except BaseException:
        os.close(fd)
        raise
    mode = f"onto {device}, " + ("staged through page-locked buffers (in the page cache)" if staged else
                                 "read by the engine (not in the page cache)")

    def tensors():
        try:
            for window in _windows(header, window_bytes):
                out = {name: torch.empty(header.entries[name].shape, dtype=header.entries[name].dtype,
                                         device=device) for name in window}
                pieces = [device_io.Piece(header.data_start + header.entries[name].begin,
                                          header.entries[name].nbytes, device_io.byte_view(out[name].untyped_storage()))
                          for name in window if header.entries[name].nbytes]
                if pieces:
                    lo = min(p.offset for p in pieces)
                    hi = max(p.offset + p.nbytes for p in pieces)
                    try:
                        read_pipeline.read_pieces(fd, path, size, options, pieces, offset=lo, nbytes=hi - lo)
                    except EOFError:
                        raise fast_st.SafetensorsFileError(f"{path}: the file ended before its {size} bytes were "
                                                           "read (did it shrink while being read?)") from None
                del pieces  # their views would keep every tensor of the window alive after the consumer's copy
                for name in window:
                    yield name, out.pop(name)
        finally:
            os.close(fd)

    return mode, tensors()


def _windows(header, window_bytes: int):
    """The header's tensor names, in file order, in runs of at most
    window_bytes (a larger tensor alone)."""
    window, held = [], 0
    for name, entry in header.entries.items():
        if window and held + entry.nbytes > window_bytes:
            yield window
            window, held = [], 0
        window.append(name)
        held += entry.nbytes
    if window:
        yield window


def _handed_out(header, mapped: dict, readers: int):
    """A mapped file's tensors in file order (the header's entries are);
    with readers (> 0), helper threads read the mapping's pages in ahead of
    the consumer (MADV_POPULATE_READ: from the device where not cached)."""
    import contextlib

    from ..fileio import prefaulting

    extents = [(t.data_ptr(), header.entries[name].begin, t.nbytes) for name, t in mapped.items() if t.nbytes]
    with prefaulting(extents, readers, read_only=True) if readers else contextlib.nullcontext():
        for name in header.entries:
            yield name, mapped.pop(name)


def _read_tensors(path: str, header, read_ahead_bytes: int):
    """The file's tensors read by fastpersist.safetensors.safe_open (the
    engine, O_DIRECT where not cached), runs of them read ahead on its
    reader thread, at most read_ahead_bytes held."""
    from .. import safetensors as fast_st

    with fast_st.safe_open(path, framework="pt") as opened:
        opened.read_ahead_bytes = read_ahead_bytes
        for name in header.entries:
            yield name, opened.get_tensor(name)


def _torch_file_tensors(path: str):
    from ..load import load

    state = load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict of tensors")
    for name in list(state):
        tensor = state.pop(name)
        if hasattr(tensor, "data_ptr"):
            yield name, tensor


def _parameter_extents(model) -> list:
    """(address, order, nbytes) of the model's CPU parameters and buffers,
    in their order (roughly the checkpoint's), for fileio.prefaulting."""
    extents, seen, at = [], set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.device.type != "cpu" or not tensor.numel():
            continue
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in seen:
            continue
        seen.add(address)
        extents.append((address, at, storage.nbytes()))
        at += storage.nbytes()
    return extents


def _model_device(model):
    """The GPU the model's parameters are on, else None (CPU tensors)."""
    for tensor in model.parameters():
        return tensor.device if tensor.device.type == "cuda" else None
    return None


def _loader_class():
    """The BaseModelLoader subclass (made where vLLM is importable)."""
    import contextlib

    from vllm.logger import init_logger
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from ..fileio import prefaulting

    # under "vllm.": its handlers and format, as vLLM's own loaders log
    logger = init_logger("vllm.model_executor.model_loader.fastpersist")

    class FastPersistModelLoader(BaseModelLoader):
        """vLLM's ``fastpersist`` load format (see the module's docstring)."""

        def __init__(self, load_config):
            super().__init__(load_config)
            extra = dict(load_config.model_loader_extra_config or {})
            unknown = sorted(set(extra) - set(_OPTIONS))
            if unknown:
                raise ValueError(f"load format {LOAD_FORMAT!r}: unknown model_loader_extra_config keys {unknown}; "
                                 f"it takes {sorted(_OPTIONS)}")
            for key, kind in _OPTIONS.items():
                value = extra.get(key)
                if key not in extra or (kind is bool and isinstance(value, bool)) or \
                        (kind is int and isinstance(value, int) and not isinstance(value, bool) and value > 0) or \
                        (kind is str and value in ("mapped", "engine")):
                    continue
                expected = {bool: "True or False", int: "an int > 0", str: "'mapped' or 'engine'"}[kind]
                raise ValueError(f"load format {LOAD_FORMAT!r}: {key}={value!r}: expected {expected}")
            self.read_ahead_mib = extra.get("read_ahead_mib", READ_AHEAD_MIB)
            self.cold_read = extra.get("cold_read", "mapped")
            self.prefault_parameters = extra.get("prefault_parameters", False)

        def _folder(self, model_config) -> str:
            name = getattr(model_config, "model_weights", None) or model_config.model
            if os.path.isdir(name):
                return name
            # a Hub id: resolved as vLLM resolves it (the local cache where offline)
            from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

            return download_weights_from_hf(name, self.load_config.download_dir,
                                            ["*.safetensors", "*.json", "*.bin", "*.pt"], model_config.revision)

        def _files(self, model_config) -> list:
            return weight_files(self._folder(model_config))

        def download_model(self, model_config) -> None:
            self._files(model_config)

        def get_all_weights(self, model_config, model) -> Iterator:
            yield from weights(self._files(model_config), self.read_ahead_mib, logger.info, cold_read=self.cold_read,
                               device=_model_device(model))

        def load_weights(self, model, model_config) -> None:
            files = self._files(model_config)
            started = time.perf_counter()
            prefault = prefaulting(_parameter_extents(model)) if self.prefault_parameters else \
                contextlib.nullcontext()
            where: list = []
            try:
                with prefault:
                    loaded = model.load_weights(weights(files, self.read_ahead_mib, logger.info, where,
                                                        self.cold_read, _model_device(model)))
            except Exception as exc:  # noqa: BLE001 - noted and raised: which tensor of which file vLLM refused
                if where:
                    _note(exc, f"(the tensor {where[1]!r} of {where[0]}, read by fastpersist)")
                raise
            logger.info("Loading weights took %.2f seconds", time.perf_counter() - started)
            if model_config.quantization is None and loaded is not None:
                missing = {name for name, _ in model.named_parameters()} - set(loaded)
                if missing:
                    raise ValueError(f"Following weights were not initialized from checkpoint: {sorted(missing)} "
                                     f"(read by fastpersist from {', '.join(files)})")

    return FastPersistModelLoader


__all__ = ["LOAD_FORMAT", "register", "weight_files", "weights"]
