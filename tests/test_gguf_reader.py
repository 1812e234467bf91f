"""The fast GGUF header parser (loader/gguf_reader.py) gives the library reader's very fields and
tensors: same parts (values and dtypes), data indices and types, for every value kind; and on the
default model it parses faster."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest

from jaxserve.default_model import default_model_path
from jaxserve.loader.gguf import read_gguf
from jaxserve.loader.gguf_reader import FastGGUFReader


def _same(path):
    slow, fast = gguf.GGUFReader(str(path)), FastGGUFReader(str(path))
    assert list(slow.fields) == list(fast.fields)
    for key, a in slow.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types), key
        assert len(a.parts) == len(b.parts), key
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), key
        if a.types:
            assert a.contents() == b.contents(), key
    assert [t.name for t in slow.tensors] == [t.name for t in fast.tensors]
    for a, b in zip(slow.tensors, fast.tensors):
        assert (a.tensor_type, list(a.shape), a.n_bytes, a.data_offset) == \
               (b.tensor_type, list(b.shape), b.n_bytes, b.data_offset)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    return fast


def test_every_value_kind_parses_as_the_library_does(tmp_path):
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("s.plain", "héllo")
    w.add_string("s.empty", "")
    w.add_uint32("u32", 7)
    w.add_int64("i64", -3)
    w.add_float32("f32", 1.5)
    w.add_float64("f64", -2.25)
    w.add_bool("b", True)
    w.add_array("a.strings", ["a", "", "ü ñ", "merges x"] * 50)
    w.add_array("a.ints", list(range(-5, 300)))
    w.add_array("a.floats", [0.5, -1.0, 3.25])
    w.add_array("a.bools", [True, False, True])
    w.add_array("a.empty", [])
    w.add_array("a.nested", [[1, 2], [3, 4, 5]])
    w.add_tensor("t.f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("t.f16", np.ones((2, 8), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fast = _same(path)
    assert fast.fields["a.strings"].contents()[:3] == ["a", "", "ü ñ"]
    assert fast.fields["a.ints"].contents()[-1] == 299


def test_the_default_model_parses_the_same_and_faster():
    path = default_model_path()
    fast = _same(path)
    assert isinstance(read_gguf(path), FastGGUFReader)
    assert len(fast.fields["tokenizer.ggml.tokens"].data) == 49152
    t = time.perf_counter()
    gguf.GGUFReader(str(path))
    slow_s = time.perf_counter() - t
    t = time.perf_counter()
    FastGGUFReader(str(path))
    fast_s = time.perf_counter() - t
    if slow_s < 0.5:
        pytest.skip(f"the library reader took only {slow_s:.2f} s here")
    assert fast_s < slow_s / 3, (fast_s, slow_s)
