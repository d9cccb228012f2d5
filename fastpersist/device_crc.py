"""zlib's CRC-32 of bytes that stay in device memory, computed with torch
ops on their device: GPUDirect Storage moves a record's bytes between the
file and a GPU without them passing through the host, where the engine
computes every other CRC.

CRC-32 is linear over GF(2) once its initial and final inversions are set
aside: the register that a message leaves, starting from zero, is the XOR
of what each byte alone leaves, and a byte followed by k zero bytes leaves
``PER_POSITION[k][byte]``. So a block of BLOCK bytes is one gather from that
table and an XOR reduction; blocks combine pairwise in a tree, the left one
advanced past the right one's zeros by a 32x32 bit matrix (applied a byte
at a time, four table lookups). Leading zero bytes leave the zero register
alone, which pads every message to whole blocks. The inversions are applied
on the host at the end. Work per byte is a few memory accesses: on a GPU far
faster than the storage the bytes go to; here, on the CPU, the same ops are
what the tests check against zlib.

Temporary device memory: about 12 bytes per byte of a chunk (CHUNK bytes at
a time: ~100 MiB), plus a 4 MiB table per device.
"""
from __future__ import annotations

import functools
import threading

BLOCK = 4096
CHUNK = 8 << 20  # bytes reduced at once: bounds the temporary memory (~100 MiB)
_POLY = 0xEDB88320  # zlib's reflected polynomial
_MASK = 0xFFFFFFFF

_lock = threading.Lock()
_tables: dict = {}  # device -> (per-position table, flat offsets)


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


def _signed(values: list) -> list:
    return [v - (1 << 32) if v >= 1 << 31 else v for v in values]


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


@functools.lru_cache(maxsize=64)
def _shift_rows(nbytes: int) -> tuple:
    """Four 256-entry rows: row q, entry v, is the register v << 8q
    advanced past nbytes zeros (the matrix applied a byte at a time)."""
    matrix = list(zeros_matrix(nbytes))
    return tuple(tuple(_signed([_apply(matrix, v << (8 * q)) for v in range(256)])) for q in range(4))


def _shift_table(nbytes: int, device):
    import torch

    key = (nbytes, device)
    with _lock:
        table = _tables.get(key)
        if table is None:
            table = _tables[key] = torch.tensor(_shift_rows(nbytes), dtype=torch.int32).to(device)
        return table


def _advance_all(registers, nbytes: int):
    """Every register (int32 tensor) advanced past nbytes zeros."""
    table = _shift_table(nbytes, registers.device)
    out = table[0][registers & 0xFF]
    for q in range(1, 4):
        out ^= table[q][(registers >> (8 * q)) & 0xFF]
    return out


def _register(chunk) -> int:
    """The register a chunk of uint8 bytes leaves, from zero."""
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
    registers = values.reshape(-1)
    span = BLOCK
    while registers.numel() > 1:
        if registers.numel() % 2:  # one more leading zero block
            registers = torch.cat([registers.new_zeros(1), registers])
        pairs = registers.view(-1, 2)
        registers = _advance_all(pairs[:, 0].contiguous(), span) ^ pairs[:, 1]
        span *= 2
    return int(registers.item()) & _MASK


def crc32(data, crc: int = 0) -> int:
    """zlib.crc32(bytes of data, crc) for a 1-D uint8 tensor on any device,
    computed there. Synchronizes with the device's current stream."""
    if data.dim() != 1 or data.element_size() != 1:
        raise ValueError("device_crc.crc32 takes a 1-D tensor of bytes")
    for start in range(0, data.numel(), CHUNK):
        chunk = data[start:start + CHUNK]
        n = chunk.numel()
        # zlib's register starts at ~crc and is inverted at the end
        crc = (_register(chunk) ^ advance(crc ^ _MASK, n)) ^ _MASK
    return crc & _MASK
