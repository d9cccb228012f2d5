"""zlib's CRC-32 of bytes that stay in device memory, computed with torch
ops on their device: GPUDirect Storage moves a record's bytes between the
file and a GPU without them passing through the host, where the engine
computes every other CRC.

CRC-32 is linear over GF(2) once its initial and final inversions are set
aside: the register that a message leaves, starting from zero, is the XOR
of what each byte alone leaves, and a byte followed by k zero bytes leaves
``PER_POSITION[k][byte]``. So a block of BLOCK bytes is one gather from that
table and an XOR reduction. The blocks of a chunk combine the same way: a
block's register advanced past the zeros of the blocks after it is a 32x32
bit matrix applied a byte at a time, so a second table (per block position
in the chunk, per byte lane) makes it one more gather and XOR reduction:
a chunk is about 35 tensor ops, whatever its size. Leading zero bytes leave
the zero register alone, which pads every message to whole blocks. Chunks
and the inversions are combined on the host. Work per byte is a few memory accesses: on a GPU far
faster than the storage the bytes go to; here, on the CPU, the same ops are
what the tests check against zlib.

Temporary device memory: about 12 bytes per byte of a chunk (CHUNK bytes at
a time: ~100 MiB), plus 12 MiB of tables per device. Where the device has
not that much free, the chunk is copied to the host and the engine's CRC
takes it (crc32's fallback).
"""
from __future__ import annotations

import functools
import threading

BLOCK = 4096
CHUNK = 8 << 20  # bytes reduced at once: bounds the temporary memory (~100 MiB)
_POLY = 0xEDB88320  # zlib's reflected polynomial
_MASK = 0xFFFFFFFF

_lock = threading.Lock()
_tables: dict = {}  # device -> (per-position table, offsets); ("blocks", blocks, device) -> block table


def _byte_table() -> list:
    """The classic one-byte table: the register after one byte v, from zero."""
    table = []
    for v in range(256):
        r = v
        for _ in range(8):
            r = (r >> 1) ^ (_POLY if r & 1 else 0)
        table.append(r)
    return table


_BYTE_TABLE = _byte_table()


def _advance_one_zero(r: int) -> int:
    return _BYTE_TABLE[r & 0xFF] ^ (r >> 8)


# -- 32x32 bit matrices over GF(2): a list of the 32 images of the unit vectors

def _apply(matrix: list, x: int) -> int:
    out, bit = 0, 0
    while x:
        if x & 1:
            out ^= matrix[bit]
        x >>= 1
        bit += 1
    return out


def _multiply(a: list, b: list) -> list:
    """a after b."""
    return [_apply(a, column) for column in b]


_ONE_ZERO = [_advance_one_zero(1 << bit) for bit in range(32)]


@functools.lru_cache(maxsize=256)
def zeros_matrix(nbytes: int) -> tuple:
    """The matrix that advances a register past nbytes zero bytes."""
    result = [1 << bit for bit in range(32)]
    power = _ONE_ZERO
    while nbytes:
        if nbytes & 1:
            result = _multiply(power, result)
        nbytes >>= 1
        if nbytes:
            power = _multiply(power, power)
    return tuple(result)


def advance(register: int, nbytes: int) -> int:
    """The register after nbytes zero bytes."""
    return _apply(list(zeros_matrix(nbytes)), register & _MASK)


def _position_table(device):
    """(BLOCK * 256,) int32: entry (BLOCK - 1 - i) * 256 + v is what byte v
    at index i of a block leaves in the register by the block's end."""
    import torch

    with _lock:
        cached = _tables.get(device)
        if cached is not None:
            return cached
        rows = torch.empty((BLOCK, 256), dtype=torch.int64)
        row = torch.tensor(_BYTE_TABLE, dtype=torch.int64)
        byte_table = row.clone()
        for k in range(BLOCK):  # row k: byte then k zeros
            rows[k] = row
            row = byte_table[row & 0xFF] ^ (row >> 8)
        rows = rows.flip(0)  # index i of a block is followed by BLOCK - 1 - i zeros
        flat = torch.where(rows >= 1 << 31, rows - (1 << 32), rows).to(torch.int32).reshape(-1).to(device)
        offsets = (torch.arange(BLOCK, dtype=torch.int32) * 256).to(device)
        _tables[device] = (flat, offsets)
        return flat, offsets


def _apply_all(matrix: list, x):
    """The matrix applied to every 32-bit value of an int64 tensor."""
    out = x.new_zeros(x.shape)
    for bit, column in enumerate(matrix):
        out ^= ((x >> bit) & 1) * column
    return out


def _block_shift_table(device):
    """(BLOCKS_PER_CHUNK * 1024,) int32: entry k * 1024 + q * 256 + v is the
    register v << 8q advanced past (BLOCKS_PER_CHUNK - 1 - k) blocks of
    zeros, so a chunk's block registers combine in one gather and an XOR
    reduction (a chunk of m blocks uses rows BLOCKS_PER_CHUNK - m on)."""
    import torch

    key = ("blocks", CHUNK // BLOCK, device)
    with _lock:
        table = _tables.get(key)
        if table is not None:
            return table
        blocks = CHUNK // BLOCK
        # columns[t][bit]: the unit register 1 << bit advanced past t blocks; doubled up from t = 0
        columns = torch.tensor([[1 << bit for bit in range(32)]], dtype=torch.int64)
        while columns.shape[0] < blocks:
            step = list(zeros_matrix(columns.shape[0] * BLOCK))
            columns = torch.cat([columns, _apply_all(step, columns)])
        columns = columns[:blocks].flip(0).view(blocks, 4, 8)  # row k: past blocks - 1 - k blocks
        values = torch.arange(256, dtype=torch.int64)
        rows = torch.zeros((blocks, 4, 256), dtype=torch.int64)
        for bit in range(8):
            rows ^= ((values >> bit) & 1) * columns[:, :, bit:bit + 1]
        rows = torch.where(rows >= 1 << 31, rows - (1 << 32), rows)
        table = _tables[key] = rows.to(torch.int32).reshape(-1).to(device)
        return table


def _xor_reduce(values):
    """XOR of every element of a 1-D int32 tensor, as a 0-d tensor."""
    import torch

    n = values.numel()
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:  # zeros change no XOR
        values = torch.cat([values, values.new_zeros(width - n)])
    while width > 1:
        width //= 2
        values = values[:width] ^ values[width:]
    return values[0]


def _register(chunk) -> int:
    """The register a chunk of at most CHUNK uint8 bytes leaves, from zero."""
    import torch

    table, offsets = _position_table(chunk.device)
    n = chunk.numel()
    pad = -n % BLOCK
    if pad:  # leading zeros leave the zero register as it is
        chunk = torch.cat([torch.zeros(pad, dtype=torch.uint8, device=chunk.device), chunk])
    blocks = chunk.view(-1, BLOCK)
    index = blocks.to(torch.int32).add_(offsets)  # int32 indices: half the memory of int64 ones
    values = table.index_select(0, index.view(-1)).view(blocks.shape)  # (blocks, BLOCK) int32
    del index
    width = BLOCK
    while width > 1:
        width //= 2
        values = values[:, :width] ^ values[:, width:]
    registers = values.reshape(-1)  # block j's register, from zero
    m = registers.numel()
    # each block's register advanced past the blocks after it, all at once
    rows = torch.arange(CHUNK // BLOCK - m, CHUNK // BLOCK, dtype=torch.int32, device=chunk.device) * 1024
    lanes = torch.arange(4, dtype=torch.int32, device=chunk.device)
    index = rows[:, None] + lanes[None, :] * 256 + ((registers[:, None] >> (lanes[None, :] * 8)) & 0xFF)
    shifted = _block_shift_table(chunk.device).index_select(0, index.view(-1))
    return int(_xor_reduce(shifted).item()) & _MASK


def crc32(data, crc: int = 0) -> int:
    """zlib.crc32(bytes of data, crc) for a 1-D uint8 tensor on any device,
    computed there. Synchronizes with the device's current stream. A chunk
    the device has no memory for is copied to the host and checksummed
    there (the engine's CRC) instead of failing the save or load."""
    import torch

    if data.dim() != 1 or data.element_size() != 1:
        raise ValueError("device_crc.crc32 takes a 1-D tensor of bytes")
    for start in range(0, data.numel(), CHUNK):
        chunk = data[start:start + CHUNK]
        n = chunk.numel()
        try:
            # zlib's register starts at ~crc and is inverted at the end
            crc = ((_register(chunk) ^ advance(crc ^ _MASK, n)) ^ _MASK) & _MASK
        except torch.OutOfMemoryError:
            from . import _engine

            host = chunk.cpu()
            crc = _engine.crc32(_engine.memory_at(host.data_ptr(), n), crc)
    return crc & _MASK
