"""`gguf.GGUFReader` with the same fields and tensors, parsed ~15x faster.

The library reader slices its `np.memmap` once or more per value, and each slice of a memmap
runs Python code (`memmap.__array_finalize__`); a tokenizer's vocabulary and merges are ~100k
strings plus ~50k token types, each parsed as its own field part: ~6 s of every start-up with the
default model. Here the slices are of a plain ndarray view of the same mapping (no copy), and
arrays of strings or scalars are walked in one loop. The result is the library's own
`ReaderField`s (same parts, dtypes, data indices and types) and `ReaderTensor`s, whose `data` is
a plain ndarray view of the file mapping instead of a memmap.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFValueType


class FastGGUFReader(GGUFReader):
    def _plain(self) -> np.ndarray:
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
        return plain

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = self._plain()[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        itype = GGUFValueType(int(raw_itype[0]))
        alen = self._get(orig_offs + 4, np.uint64)
        n = int(alen[0])
        offs = orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        if itype == GGUFValueType.STRING:
            u8, dt = self._plain(), np.dtype(np.uint64).newbyteorder(self.byte_order)
            order = "little" if dt.byteorder == "<" or (dt.byteorder == "=" and np.little_endian) else "big"
            raw, idxs = memoryview(u8), []
            for _ in range(n):
                length = int.from_bytes(raw[offs:offs + 8], order)
                parts.append(u8[offs:offs + 8].view(dt))
                idxs.append(len(parts))
                parts.append(u8[offs + 8:offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, idxs, _types(itype, n)
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:      # arrays of arrays: the library's general walk
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, n)
        parts += [values[i:i + 1] for i in range(n)]
        return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), _types(itype, n)


def _types(itype: GGUFValueType, n: int) -> list[GGUFValueType]:
    """The library's `types` of an array field: the item type only when there is an item."""
    return [GGUFValueType.ARRAY] + ([itype] if n else [])
