"""jaxserve.aot.hlo_analysis: host sync points and modeled HBM bytes of optimized HLO text.

The text tests run everywhere; the compiled ones compile for an H100 from this machine (jax >=
0.11.2 with the CUDA plugin wheels) and skip where that target is unavailable."""

from __future__ import annotations

import pytest

from jaxserve.aot.hlo_analysis import host_sync_points, modeled_bytes, parse_hlo, shape_bytes, while_loops

# Operands printed without shapes (XLA as of jax 0.11), source from the stack-frame tables.
SYNCS = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

FileNames
1 "/src/model.py"

FileLocations
1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=0 end_column=0}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%fused_mul (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%param_0, %param_0)
}

%body (t: (f32[4])) -> (f32[4]) {
  %t = (f32[4]{0}) parameter(0)
  %g = f32[4]{0} get-tuple-element(%t), index=0
  %f = f32[4]{0} fusion(%g), kind=kLoop, calls=%fused_mul
  ROOT %r = (f32[4]{0}) tuple(%f)
}

%cond (t.1: (f32[4])) -> pred[] {
  %t.1 = (f32[4]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

%branch_a (x.1: (f32[4])) -> (f32[4]) {
  %x.1 = (f32[4]{0}) parameter(0)
  ROOT %w.in = (f32[4]{0}) while(%x.1), condition=%cond, body=%body, metadata={op_name="jit(f)/cond/while"}
}

%branch_b (x.2: (f32[4])) -> (f32[4]) {
  ROOT %x.2 = (f32[4]{0}) parameter(0)
}

ENTRY %main (x: f32[4], i: s32[]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %i = s32[] parameter(1)
  %tup = (f32[4]{0}) tuple(%x)
  %w = (f32[4]{0}) while(%tup), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"32"}}
  %c = (f32[4]{0}) conditional(%i, %tup, %tup), branch_computations={%branch_a, %branch_b}, metadata={op_name="jit(f)/cond" stack_frame_id=1}
  this line is not HLO (
  ROOT %out = f32[4]{0} get-tuple-element(%c), index=0
}
"""  # noqa: E501

# Operands printed with their shapes (older XLA), source_file/source_line in the metadata.
KV_WRITE = """HloModule m

%fused_dus (param_0: bf16[8,1024], param_1: bf16[1,1024], param_2: s32[]) -> bf16[8,1024] {
  %param_0 = bf16[8,1024]{1,0} parameter(0)
  %param_1 = bf16[1,1024]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = bf16[8,1024]{1,0} dynamic-update-slice(bf16[8,1024]{1,0} %param_0, bf16[1,1024]{1,0} %param_1, s32[] %param_2, s32[] %zero)
}

%fused_layer (param_0.1: f32[16,256,256], param_1.1: s32[], param_2.1: f32[256]) -> f32[256] {
  %param_0.1 = f32[16,256,256]{2,1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,256,256]{2,1,0} dynamic-slice(f32[16,256,256]{2,1,0} %param_0.1, s32[] %param_1.1, s32[] %z, /*index=3*/s32[] %z), dynamic_slice_sizes={1,256,256}
  %bc = f32[256,256]{1,0} bitcast(f32[1,256,256]{2,1,0} %ds)
  %param_2.1 = f32[256]{0} parameter(2)
  ROOT %dot = f32[256]{0} dot(f32[256,256]{1,0} %bc, f32[256]{0} %param_2.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (cache: bf16[8,1024], new: bf16[1,1024], pos: s32[], w: f32[16,256,256], h: f32[256], k: f32[4096,512]) -> (bf16[8,1024], f32[256], f32[4096,512]) {
  %cache = bf16[8,1024]{1,0} parameter(0)
  %new = bf16[1,1024]{1,0} parameter(1)
  %pos = s32[] parameter(2)
  %w = f32[16,256,256]{2,1,0} parameter(3)
  %h = f32[256]{0} parameter(4)
  %k = f32[4096,512]{1,0} parameter(5)
  %write = bf16[8,1024]{1,0} fusion(bf16[8,1024]{1,0} %cache, bf16[1,1024]{1,0} %new, s32[] %pos), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(step)/dynamic_update_slice" source_file="/src/kv.py" source_line=7}
  %layer = f32[256]{0} fusion(f32[16,256,256]{2,1,0} %w, s32[] %pos, f32[256]{0} %h), kind=kLoop, calls=%fused_layer
  %attn = f32[4096,512]{1,0} custom-call(f32[4096,512]{1,0} %k), custom_call_target="paged_attention"
  ROOT %out = (bf16[8,1024]{1,0}, f32[256]{0}, f32[4096,512]{1,0}) tuple(bf16[8,1024]{1,0} %write, f32[256]{0} %layer, f32[4096,512]{1,0} %attn)
}
"""  # noqa: E501

# Top-level in-place ops and an async collective whose start's shape holds its operand too.
TOP_LEVEL = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%sub (x: bf16[8,128]) -> (bf16[8,128]) {
  %x = bf16[8,128]{1,0} parameter(0)
  %ags = ((bf16[8,128]{1,0}), bf16[16,128]{1,0}) all-gather-start(%x), dimensions={0}
  %agd = bf16[16,128]{1,0} all-gather-done(%ags)
  ROOT %t = (bf16[16,128]{1,0}) tuple(%agd)
}

ENTRY %main (buf: f32[1024,64], upd: f32[2,64], idx: s32[2,1], a: bf16[8,128]) -> f32[1024,64] {
  %buf = f32[1024,64]{1,0} parameter(0)
  %upd = f32[2,64]{1,0} parameter(1)
  %idx = s32[2,1]{1,0} parameter(2)
  %a = bf16[8,128]{1,0} parameter(3)
  %z = s32[] constant(0)
  %sc = f32[1024,64]{1,0} scatter(%buf, %idx, %upd), update_window_dims={1}, to_apply=%add
  %dus = f32[1024,64]{1,0} dynamic-update-slice(%sc, %upd, %z, %z)
  %c = (bf16[16,128]{1,0}) call(%a), to_apply=%sub
  ROOT %cp = f32[1024,64]{1,0} copy(%dus)
}
"""

# A layer scan's GEMM reading layer i of a stacked weight in place (XLA's dynamic-slice fusion
# around a cuBLAS call), and the same weight copied out of the stack first (a Triton GEMM's way)
CUBLAS_IN_PLACE = """
HloModule m

%ds_gemm (p0: bf16[32,64,128], p1: s32[], p2: bf16[64]) -> (bf16[128], s8[4096]) {
  %p2 = bf16[64]{0} parameter(2)
  %p0 = bf16[32,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,64,128}
  %bc = bf16[64,128]{1,0} bitcast(%ds)
  ROOT %mm = (bf16[128]{0}, s8[4096]{0}) custom-call(%p2, %bc), custom_call_target="__cublas$lt$matmul"
}

%copy_layer (q0: bf16[32,64,128], q1: s32[]) -> bf16[1,64,128] {
  %q0 = bf16[32,64,128]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %d = bf16[1,64,128]{2,1,0} dynamic-slice(%q0, %q1, %z, %z), dynamic_slice_sizes={1,64,128}
}

ENTRY %main (w: bf16[32,64,128], i: s32[], x: bf16[64]) -> bf16[128] {
  %w = bf16[32,64,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[64]{0} parameter(2)
  %in_place = (bf16[128]{0}, s8[4096]{0}) fusion(%w, %i, %x), kind=kCustom, calls=%ds_gemm
  %copied = bf16[1,64,128]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%copy_layer
  %bc2 = bf16[64,128]{1,0} bitcast(%copied)
  %mm2 = (bf16[128]{0}, s8[4096]{0}) custom-call(%x, %bc2), custom_call_target="__cublas$lt$matmul"
  ROOT %r = bf16[128]{0} get-tuple-element(%in_place), index=0
}
"""


def test_shape_bytes():
    assert shape_bytes("f32[2,3]{1,0}") == 24
    assert shape_bytes("(bf16[4]{0}, s32[], /*index=2*/pred[8], token[])") == 8 + 4 + 8
    assert shape_bytes("s4[16]{0:E(4)}") == 8 and shape_bytes("f8e4m3fn[1024]") == 1024
    assert shape_bytes("f32[8,128]{1,0:T(8,128)}") == 4096 and shape_bytes("c128[2]") == 32


def test_sync_points_from_text():
    syncs = host_sync_points(SYNCS)
    assert [(s["op"], s["name"]) for s in syncs] == [("conditional", "c"), ("while", "w.in")]
    assert syncs[0]["source"] == "/src/model.py:42" and syncs[0]["computation"] == "main"
    assert syncs[1] == {"op": "while", "name": "w.in", "computation": "branch_a", "known_trip_count": None,
                        "op_name": "jit(f)/cond/while", "source": None}
    assert {w["name"]: w["known_trip_count"] for w in while_loops(SYNCS)} == {"w": 32, "w.in": None}


def test_trip_counts_and_branches_from_text():
    r = modeled_bytes(SYNCS)
    # the fusion moves 32 bytes: 32 times in the counted while, once in the unknown one (the larger branch)
    counts = {(e["name"], e["count"]) for e in r["top"]}
    assert counts == {("f", 33)} and r["total"] == 33 * 32 and r["unknown_trip_counts"] == 1


def test_in_place_and_sliced_operands_from_text():
    r = modeled_bytes(KV_WRITE)
    by_name = {e["name"]: e["bytes"] for e in r["top"]}
    assert by_name["write"] == 2 * 1024 * 2 + 4  # the update read and written, the position
    assert by_name["layer"] == 256 * 256 * 4 + 4 + 256 * 4 + 256 * 4  # one layer of w, pos, h, the result
    assert by_name["attn"] == 2 * 4096 * 512 * 4
    module = parse_hlo(KV_WRITE)
    write = module.computations["main"].by_name["write"]
    assert write.operands[1] == ("bf16[1,1024]{1,0}", "new") and module.source(write) == "/src/kv.py:7"
    paged = modeled_bytes(KV_WRITE, custom_call_bytes={"paged_attention": 1000})
    assert {e["name"]: e["bytes"] for e in paged["top"]}["attn"] == 1000
    assert paged["by_kind"]["custom-call"] == 1000 and paged["total"] == r["total"] - by_name["attn"] + 1000


def test_top_level_in_place_and_async_collective_from_text():
    r = modeled_bytes(TOP_LEVEL)
    by_name = {e["name"]: e["bytes"] for e in r["top"]}
    assert by_name == {"sc": 512 + 8 + 512, "dus": 512 + 4 + 4 + 512, "ags": 2048 + 4096, "cp": 2 * 1024 * 64 * 4}
    assert r["collectives"] == [{"name": "ags", "op": "all-gather", "dtype": "bf16", "bytes": 4096, "count": 1}]
    assert r["by_kind"] == {"fusion": 0, "custom-call": 0, "copy": 2 * 1024 * 64 * 4, "collective": 6144,
                            "other": 2 * 1032}


def test_unreadable_text_never_raises():
    for text in ("", "garbage {", SYNCS[: len(SYNCS) // 2], KV_WRITE.replace(")", ""), "ENTRY %e {\n %a = \n}"):
        host_sync_points(text), while_loops(text), modeled_bytes(text)


# --- compiled for an H100 on this machine ---------------------------------------------------------


# conftest's persistent compilation cache cannot load an executable compiled for a device this
# machine does not have; jax warns and compiles
_CACHE_WARNING = pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache")


def _compile(f, *specs, devices=1, donate=()):
    jax = pytest.importorskip("jax")
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxserve.aot.targets import get_target
    try:
        target = get_target("h100", devices)
    except ValueError as e:
        pytest.skip(f"needs jax 0.11.2 with the CUDA plugin wheels for a compile-only H100 target: {e}")
    mesh = Mesh(np.array(target.devices).reshape(devices), ("tp",))
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec or P()))
            for shape, dtype, spec in specs]
    with target.context(mesh):
        return jax.jit(f, donate_argnums=donate).lower(*args).compile().as_text()


@_CACHE_WARNING
def test_compiled_control_flow():
    import jax.numpy as jnp
    from jax import lax

    def f(x, n):
        x = lax.cond(x.sum() > 0, lambda y: jnp.sin(y) @ y, lambda y: jnp.cos(y) * 2, x)  # too big for a select
        x = lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 1.5), (0, x))[1]
        return lax.scan(lambda h, _: (jnp.tanh(h @ h), None), x, None, length=4)[0]

    text = _compile(f, ((128, 128), jnp.float32, None), ((), jnp.int32, None))
    syncs = host_sync_points(text)
    assert sorted(s["op"] for s in syncs) == ["conditional", "while"]
    assert all("test_hlo_analysis.py:" in s["source"] for s in syncs)
    assert {w["known_trip_count"] for w in while_loops(text)} == {None, 4}  # the scan does not sync
    assert modeled_bytes(text)["unknown_trip_counts"] == 1


@_CACHE_WARNING
def test_compiled_in_place_update():
    import jax.numpy as jnp
    from jax import lax

    text = _compile(lambda buf, upd, i: lax.dynamic_update_slice(buf, upd, (i, 0, 0)),
                    ((64, 4096, 128), jnp.bfloat16, None), ((1, 4096, 128), jnp.bfloat16, None),
                    ((), jnp.int32, None), donate=(0,))
    update = 4096 * 128 * 2
    assert 2 * update <= modeled_bytes(text)["total"] < 3 * update  # not the 64 MiB buffer


@_CACHE_WARNING
def test_compiled_collective_dtypes():
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def f(a, b):
        inner = lambda a, b: (lax.psum(a, "tp"), lax.psum(b, "tp"))
        return jax.shard_map(inner, in_specs=(P(None, "tp"),) * 2, out_specs=(P(), P()), check_vma=False)(a, b)

    text = _compile(f, ((64, 1024), jnp.bfloat16, P(None, "tp")), ((64, 1024), jnp.float32, P(None, "tp")),
                    devices=2)
    r = modeled_bytes(text)
    got = sorted((c["op"], c["dtype"], c["bytes"]) for c in r["collectives"])
    assert got == [("all-reduce", "bf16", 64 * 512 * 2), ("all-reduce", "f32", 64 * 512 * 4)]
    assert r["by_kind"]["collective"] == 2 * (64 * 512 * 2 + 64 * 512 * 4)


def test_a_gemm_reading_a_stacked_layer_in_place_counts_the_layer_not_the_stack_nor_its_workspace():
    by_name = {e["name"]: e["bytes"] for e in modeled_bytes(CUBLAS_IN_PLACE)["top"]}
    layer = 64 * 128 * 2
    # one layer of the stack, the index, x, and the bf16 result; the s8 workspace is scratch
    assert by_name["in_place"] == layer + 4 + 64 * 2 + 128 * 2
    # copied out first: the layer read and written, then read again by the GEMM
    assert by_name["copied"] == 2 * layer + 4 and by_name["mm2"] == 64 * 2 + layer + 128 * 2
