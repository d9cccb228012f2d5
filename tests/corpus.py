"""The round-trip corpus shared by the save and load tests: every dtype,
views, sharing, nesting, a model and its optimizer state."""
import io
import zipfile

import torch


def float8_dtypes():
    return [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
            if hasattr(torch, n)]


def every_dtype_tensor(dtype):
    if dtype == torch.bool:
        return torch.rand(37) > 0.5
    if dtype.is_complex:
        return torch.randn(37, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(37).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (37,), dtype=dtype)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
          torch.uint32, torch.uint64] + float8_dtypes()


def corpus():
    base = torch.randn(10, 12)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {
        "dtypes": {str(d): every_dtype_tensor(d) for d in DTYPES},
        "zero_dim": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
        "non_contiguous": base.t(),
        "offset_view": base[3:, 2:7],
        "strided": base[::2, ::3],
        "shared": [base, base[1], base.view(-1)],
        "nested": {"a": [1, (torch.arange(4), {"b": torch.ones(2, 2)})], "c": None},
        "state_dict": model.state_dict(),
        "optimizer": opt.state_dict(),
        "no_tensors": {"epoch": 7, "lr": 1e-3, "names": ["x", "y"]},
        "storage": torch.arange(6, dtype=torch.int32).untyped_storage(),
    }


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset() and a.device == b.device
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 and a.dim() else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 and b.dim() else b) \
            if a.dtype not in float8_dtypes() else torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, (torch.UntypedStorage, torch.TypedStorage)):
        a = a._untyped_storage if isinstance(a, torch.TypedStorage) else a
        b = b._untyped_storage if isinstance(b, torch.TypedStorage) else b
        assert bytes(a) == bytes(b)
    else:
        assert a == b


def rewrite_big_endian(little, big, itemsize_of):
    """Rewrites a little-endian checkpoint with Python's zipfile (sizes in the
    local headers, no padding) as a big-endian one: byteorder record "big",
    every storage byte-swapped in units of itemsize_of(record bytes)."""
    with zipfile.ZipFile(little) as src, zipfile.ZipFile(big, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                n = itemsize_of(data)
                data = b"".join(data[i:i + n][::-1] for i in range(0, len(data), n))
            dst.writestr(info.filename, data)


def torch_pickle(obj) -> bytes:
    """data.pkl as torch.save itself writes it (the original, unpatched)."""
    from fastpersist import _torch_api

    buffer = io.BytesIO()
    _torch_api.original_save()(obj, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
