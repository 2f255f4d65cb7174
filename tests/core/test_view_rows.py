"""``FieldSchema.view_rows``, which every adapter's get uses to turn a field's bytes into its values:
a field cut from a shared buffer (a pooled slab, a packed object) gets a storage of its own over
exactly its bytes, without a copy, and keeps the buffer from going back to the pool while it lives."""

from __future__ import annotations

import gc
import io

import torch

from dataplane._host.bufpool import BufferPool
from dataplane.schema import schema_of

F32 = schema_of("dense", torch.float32, (4,))
BF16 = schema_of("jagged", torch.bfloat16, ())
I64 = schema_of("dense", torch.int64, ())


def test_fields_of_one_slab_own_their_storage_without_a_copy() -> None:
    pool = BufferPool(64 << 20, min_bytes=1)
    slab, at = pool.slab({"a": 1 << 20, "b": 2 << 20, "c": 1 << 20})
    assert slab is not None
    sizes = {"a": (F32, (1 << 20) // 16), "b": (BF16, (1 << 20)), "c": (I64, (1 << 20) // 8)}
    values = {f: s.view_rows(slab[at[f] : at[f] + rows * s.row_nbytes], rows) for f, (s, rows) in sizes.items()}
    for f, v in values.items():
        assert v.data_ptr() == slab.data_ptr() + at[f]  # the slab's bytes, not a copy
        assert v.untyped_storage().data_ptr() == v.data_ptr() and v.untyped_storage().nbytes() == v.nbytes
        v.fill_(len(f))
    saved = io.BytesIO()
    torch.save(values, saved)  # one storage viewed as three dtypes would raise here
    saved.seek(0)
    back = torch.load(saved)
    assert all(torch.equal(back[f], values[f]) for f in values)
    one = io.BytesIO()
    torch.save(values["a"], one)
    assert one.tell() < values["a"].nbytes + 4096  # its own bytes, not the whole slab


def test_a_kept_field_keeps_its_slab_out_of_the_pool() -> None:
    pool = BufferPool(64 << 20, min_bytes=1)
    slab, at = pool.slab({"a": 1 << 20, "b": 1 << 20})
    assert slab is not None
    a = F32.view_rows(slab[at["a"] : at["a"] + (1 << 20)], (1 << 20) // 16)
    b = I64.view_rows(slab[at["b"] : at["b"] + (1 << 20)], (1 << 20) // 8)
    a.fill_(1.5)
    b.fill_(7)
    nbytes = slab.numel()
    del slab, b
    gc.collect()
    hits = pool.hits
    for _ in range(3):  # while ``a`` lives, the slab is not lent again: every other buffer is new
        other = pool.empty(nbytes)
        other.fill_(0xFF)
        del other
        gc.collect()
    assert pool.hits == hits + 2  # the first was a new slab, then reused twice; never ``a``'s
    assert bool((a == 1.5).all())
    ptr = a.data_ptr()
    del a
    gc.collect()
    first, second = pool.empty(nbytes), pool.empty(nbytes)  # now the slab is idle again
    assert ptr - at["a"] in (first.data_ptr(), second.data_ptr())


def test_empty_and_whole_buffers() -> None:
    slab = torch.zeros(4096, dtype=torch.uint8)
    empty = F32.view_rows(slab[64:64], 0)
    assert empty.shape == (0, 4) and empty.untyped_storage().nbytes() == 0  # names no one's storage
    whole = torch.zeros(64, dtype=torch.uint8)
    v = I64.view_rows(whole, 8)
    assert v.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # its own already: a plain view
