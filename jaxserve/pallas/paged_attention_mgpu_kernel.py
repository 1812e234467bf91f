"""The device program of the Mosaic GPU ragged paged attention: the two warpgroups' code (the
chunk issuer and the consumer), the kernel body that ties them, and the `plgpu.kernel` call with
its shared memory and barriers. The design, the contract and what each buffer holds are in
jaxserve/pallas/paged_attention_mgpu.py's docstring; that module plans the tiles, checks the
inputs and merges the splits around `call_kernel`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxserve.pallas.paged_attention import MASK_VALUE
from jaxserve.pallas.paged_attention_mgpu_sizes import CONSUMER_REGISTERS, PRODUCER_REGISTERS, idx_window

try:  # Mosaic GPU's Pallas API as used here is jax >= 0.11 (plgpu.kernel + GPU interpret mode)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    MGPU_AVAILABLE = hasattr(plgpu, "InterpretGPUParams") and hasattr(plgpu, "kernel")
except ImportError:  # pragma: no cover - depends on the installed jax
    plgpu = None
    MGPU_AVAILABLE = False


def _smem_transforms(dtype, minor: int):
    """Tiling + swizzle for an SMEM tile whose minor dimension has `minor` elements."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _columns(scale_ref):
    """A chunk's per-token scales [C] in the layout that broadcasts over score columns."""
    return plgpu.load(scale_ref, layout=plgpu.Layout.WGMMA.reduce(0))


def _widen(x, dtype):
    """fp8/int8 -> the compute dtype, exactly. Hopper converts fp8 only to f16 in hardware, so
    fp8 goes through f32 (every fp8 and int8 value is exact in f32 and in bf16)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return x.astype(dtype)


def _split_range(c_first, c_end, split, num_splits):
    """This split's chunks [c_lo, c_hi) of the tile's [c_first, c_end)."""
    per = lax.div(c_end - c_first + num_splits - 1, jnp.int32(num_splits))
    c_lo = jnp.minimum(c_first + split * per, c_end)
    return c_lo, jnp.minimum(c_lo + per, c_end)


def _chunk_issuer(bt_ref, k_ref, v_ref, scale_refs, idx_smem, k_smem, v_smem, scale_smem,
                  idx_bar, k_full, v_full, k_free, v_free, *, seq, c_lo, ppc, block_size, slots,
                  wait_free):
    """`issue(c)`: bring chunk c's page ids into SMEM when it opens a window (or is the split's
    first), wait until its slot is released (`wait_free`: from the `slots`-th chunk on), and
    issue its page copies (and scale copies) onto the slot's full barriers."""
    kh = lax.axis_index("kv_head")
    N = k_ref.shape[0]
    W = idx_smem.shape[0]
    B = block_size

    def issue(c):
        first = c * ppc                               # the chunk's first page in the table row
        base = lax.div(first, jnp.int32(W)) * W       # chunks never straddle windows

        @pl.when((c == c_lo) | (first == base))
        def _():
            plgpu.copy_gmem_to_smem(bt_ref.at[seq, pl.ds(base, W)], idx_smem, idx_bar)
            plgpu.barrier_wait(idx_bar)

        step = c - c_lo
        slot = lax.rem(step, jnp.int32(slots))
        pages = [jnp.clip(idx_smem[first - base + j], 0, N - 1) for j in range(ppc)]
        for src, dst, full, free, scales in ((k_ref, k_smem, k_full, k_free, 0),
                                             (v_ref, v_smem, v_full, v_free, 1)):
            if wait_free:
                @pl.when(step >= slots)
                def _(free=free):
                    plgpu.barrier_wait(free.at[slot])     # the slot's previous chunk is consumed

            for j, page in enumerate(pages):
                rows = pl.ds(j * B, B)
                plgpu.copy_gmem_to_smem(src.at[page, :, kh, :], dst.at[slot, rows], full.at[slot])
                if scale_refs:
                    plgpu.copy_gmem_to_smem(scale_refs[scales].at[kh, page],
                                            scale_smem[scales].at[slot, rows], full.at[slot])
    return issue


def _consumer(meta_smem, q_ref, o_out, lse_out, q_smem, k_smem, v_smem, o_smem, lse_smem,
              scale_smem, widened, p_smem, q_bar, k_full, v_full, k_free, v_free, *, seq_ok,
              p0, nq, window, c_lo, c_hi, gp, sm_scale, soft_cap, windowed, slots, in_place,
              issue=None):
    """Compute warpgroup: QK, online softmax, PV per chunk; normalised useful rows out.
    `issue` (single-warpgroup form only): this warpgroup also issues the copies, one chunk
    ahead, and releases nothing (no other warpgroup waits)."""
    del meta_smem, seq_ok
    release = plgpu.barrier_arrive if issue is None else (lambda _: None)
    kh, i, split = lax.axis_index("kv_head"), lax.axis_index("tile"), lax.axis_index("split")
    Qs, R, D = q_smem.shape
    C = k_smem.shape[1]
    cdt = q_smem.dtype
    quantized = widened is not None

    for h in range(Qs):                 # one copy per part: TMA strides at most 5 dimensions
        plgpu.copy_gmem_to_smem(q_ref.at[kh, i, h], q_smem.at[h], q_bar)
    plgpu.barrier_wait(q_bar)

    layout = plgpu.Layout.WGMMA
    row = plgpu.broadcasted_iota(jnp.int32, (R, C), 0, layout=layout)
    col = plgpu.broadcasted_iota(jnp.int32, (R, C), 1, layout=layout)
    row_tok = lax.div(row, jnp.int32(gp))                   # token index of each row in the tile
    row_pos = p0 + row_tok
    row_ok = row_tok < nq

    def body(c, carry):
        acc, m, l = carry
        slot = lax.rem(c - c_lo, jnp.int32(slots))
        if issue is not None:               # single warpgroup: the next chunk's copies first
            pl.when(c + 1 < c_hi)(lambda: issue(c + 1))
        plgpu.barrier_wait(k_full.at[slot])
        k_op = k_smem.at[slot]
        if quantized:                       # fp8/int8 -> compute dtype is exact; scales later
            widened[0][...] = _widen(k_smem.at[slot][...], cdt)
            k_cols = _columns(scale_smem[0].at[slot])
            plgpu.commit_smem()
            release(k_free.at[slot])                         # the raw slot is free again
            k_op = widened[0]

        def qk(acc_ref):
            for h in range(Qs):             # f32 q: q_hi.k + q_lo.k, f32 accumulation
                plgpu.wgmma(acc_ref, q_smem.at[h], k_op.T)
            return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((R, C), jnp.float32))                 # [R, C] f32
        if not quantized:
            release(k_free.at[slot])                         # the wgmma has read K
        else:                               # q.(k * s_k) = (q.k) * s_k: scale score columns
            s = s * lax.broadcast_in_dim(k_cols, (R, C), [1])
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = c * C + col
        mask = row_ok & (kpos <= row_pos)                   # row_pos < kv_len on real rows
        if windowed:
            mask = mask & (kpos > row_pos - window)
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_new, (R, C), [0])), 0.0)
        l = alpha * l + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, (R, D), [0])
        plgpu.barrier_wait(v_full.at[slot])
        v_op = v_smem.at[slot]
        if quantized:                       # p @ (v * s_v) = (p * s_v) @ v: scale P columns
            widened[1][...] = _widen(v_smem.at[slot][...], cdt)
            p = p * lax.broadcast_in_dim(_columns(scale_smem[1].at[slot]), (R, C), [1])
            plgpu.commit_smem()
            release(v_free.at[slot])
            v_op = widened[1]
        p_hi = p.astype(cdt)
        p_parts = [p_hi] + ([(p - p_hi.astype(jnp.float32)).astype(cdt)] if Qs == 2 else [])

        if in_place:                        # P from registers into the carried accumulator
            def pv(acc_ref):
                for part in p_parts:
                    plgpu.wgmma(acc_ref, part, v_op)
            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        else:                               # interpreter: P via SMEM, fresh accumulator
            for h, part in enumerate(p_parts):
                p_smem[h] = part
            plgpu.commit_smem()

            def pv(acc_ref):
                for h in range(Qs):
                    plgpu.wgmma(acc_ref, p_smem.at[h], v_op)
                return acc_ref[...]
            acc = acc + pl.run_scoped(pv, plgpu.ACC((R, D), jnp.float32))
        if not quantized:
            release(v_free.at[slot])                         # the wgmma has read V
        return acc, m_new, l

    if issue is not None:
        pl.when(c_lo < c_hi)(lambda: issue(c_lo))
    reduced = layout.reduce(1)
    init = (plgpu.layout_cast(jnp.zeros((R, D), jnp.float32), layout),
            plgpu.layout_cast(jnp.full((R,), MASK_VALUE, jnp.float32), reduced),
            plgpu.layout_cast(jnp.zeros((R,), jnp.float32), reduced))
    acc, m, l = lax.fori_loop(c_lo, c_hi, body, init)

    seen = l > 0.0                          # rows with no visible key in this split: o = 0
    l_safe = jnp.where(seen, l, 1.0)
    o = acc / lax.broadcast_in_dim(l_safe, (R, D), [0])
    lse_smem[...] = jnp.where(seen, m + jnp.log(l_safe), MASK_VALUE)
    o_hi = o.astype(o_smem.dtype)
    o_smem[0] = o_hi
    if Qs == 2:
        o_smem[1] = (o - o_hi.astype(jnp.float32)).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_out.at[kh, i, split])
    # Only the useful rows nq * Gp leave, through a ladder of power-of-two TMA boxes (their sizes
    # must be static): 64, 32, ..., 1 rows, each taken when its bit is set in the row count.
    useful = nq * gp
    start, size = 0, R
    while size:
        @pl.when(useful & size != 0)
        def _(start=start, size=size):
            for h in range(Qs):
                plgpu.copy_smem_to_gmem(o_smem.at[h, pl.ds(start, size)],
                                        o_out.at[kh, i, split, h, pl.ds(start, size)])
        start = start + (useful & size)
        size //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _attention_kernel(tile_meta_ref, bt_ref, q_ref, k_ref, v_ref, *refs, sm_scale, block_size,
                      gp, num_splits, soft_cap, windowed, slots, quantized, in_place,
                      warp_specialized):
    # GMEM: tile_meta_ref [NT, 8] int32; bt_ref [S, M'] (padded); q_ref [K, NT, Qs, R, D];
    #       k_ref/v_ref [N, B, K, D]; ks_ref/vs_ref [K, N, B] f32 (quantized only);
    #       o_out [K, NT, P, Qs, R, D] bf16; lse_out [K, NT, P, R] f32.
    refs = list(refs)
    scale_refs = (refs.pop(0), refs.pop(0)) if quantized else ()
    o_out, lse_out, q_smem, k_smem, v_smem, o_smem, lse_smem, meta_smem, idx_smem = refs[:9]
    meta_bar, q_bar, idx_bar, k_full, v_full, k_free, v_free = refs[9:16]
    extra = refs[16:]
    scale_smem = widened = p_smem = None
    if quantized:
        ks_smem, vs_smem, k_cmp, v_cmp, *extra = extra
        scale_smem, widened = (ks_smem, vs_smem), (k_cmp, v_cmp)
    if not in_place:
        p_smem, = extra
    C = k_smem.shape[1]
    ppc = C // block_size
    copies = functools.partial(
        _chunk_issuer, bt_ref, k_ref, v_ref, scale_refs, idx_smem, k_smem, v_smem, scale_smem,
        idx_bar, k_full, v_full, k_free, v_free, ppc=ppc, block_size=block_size, slots=slots)
    wg = lax.axis_index("wg") if warp_specialized else 0

    @pl.when(wg == (1 if warp_specialized else 0))
    def _():                        # the memory warpgroup brings the tile's metadata row in
        plgpu.copy_gmem_to_smem(tile_meta_ref.at[lax.axis_index("tile")], meta_smem, meta_bar)

    plgpu.barrier_wait(meta_bar)    # both warpgroups read it
    seq, p0, nq = meta_smem[0], meta_smem[1], meta_smem[2]
    c_lo, c_hi = _split_range(meta_smem[3], meta_smem[4], lax.axis_index("split"), num_splits)
    consume = functools.partial(
        _consumer, meta_smem, q_ref, o_out, lse_out, q_smem, k_smem, v_smem, o_smem, lse_smem,
        scale_smem, widened, p_smem, q_bar, k_full, v_full, k_free, v_free, seq_ok=None, p0=p0,
        nq=nq, window=meta_smem[5], c_lo=c_lo, c_hi=c_hi, gp=gp, sm_scale=sm_scale,
        soft_cap=soft_cap, windowed=windowed, slots=slots, in_place=in_place)
    if not warp_specialized:        # one warpgroup issues one chunk ahead and computes
        consume(issue=copies(seq=seq, c_lo=c_lo, wait_free=False))
        return

    @pl.when(wg == 0)
    def _():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        consume()

    @pl.when(wg == 1)
    def _():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        pl.loop(c_lo, c_hi)(copies(seq=seq, c_lo=c_lo, wait_free=True))


def _interpret_params(interpret):
    """True -> default GPU interpret mode; an InterpretGPUParams (e.g. detect_races=True) as
    given; False -> compiled."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def padded_block_tables(block_tables, pages_per_chunk: int):
    """Block table columns padded with page 0 to a whole number of `idx_window`s past the last
    chunk any tile can reach, so every early copy of a window is in bounds (padded ids are
    masked keys)."""
    M = block_tables.shape[1]
    W = idx_window(pages_per_chunk)
    padded = W * -(-(M + pages_per_chunk) // W)
    return jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - M)))


def call_kernel(q_tiles, tile_meta, block_tables, k_cache, v_cache, k_scale, v_scale, *, gp,
                 sm_scale, soft_cap, windowed, kv_chunk, num_splits, slots, interpret,
                 ws_interpret=False):
    """Run the grid; returns normalised partials o [K, NT, P, Qs, R, D] bf16 (only useful rows
    written) and lse [K, NT, P, R] f32."""
    K, nt, Qs, R, D = q_tiles.shape
    B = k_cache.shape[1]
    cdt = q_tiles.dtype
    kvdt = k_cache.dtype
    quantized = k_scale is not None
    in_place = not interpret
    # Interpret mode runs each warpgroup as its own XLA CPU computation whose blocking barrier
    # callbacks hold a thread of XLA's CPU pool: on a 2-core machine the two warpgroups (and the
    # grid loop's own callback) exhaust it and deadlock (seen, jax 0.11.2). So the interpreter
    # runs the single-warpgroup form unless asked (`warp_specialized=True`, machines with more
    # cores); compiled kernels are always warp-specialised.
    warp_specialized = not interpret or ws_interpret
    P = num_splits
    ppc = kv_chunk // B
    bt = padded_block_tables(block_tables, ppc)
    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale, block_size=B, gp=gp, num_splits=P,
        soft_cap=soft_cap, windowed=windowed, slots=slots, quantized=quantized,
        in_place=in_place, warp_specialized=warp_specialized)
    arrivals = ppc * (2 if quantized else 1)                # one per page copy (+ its scales)
    scratch = [
        plgpu.SMEM((Qs, R, D), cdt, transforms=_smem_transforms(cdt, D)),
        plgpu.SMEM((slots, kv_chunk, D), kvdt, transforms=_smem_transforms(kvdt, D)),
        plgpu.SMEM((slots, kv_chunk, D), kvdt, transforms=_smem_transforms(kvdt, D)),
        plgpu.SMEM((Qs, R, D), cdt),        # no tiling: the row ladder slices any row count
        plgpu.SMEM((R,), jnp.float32),
        plgpu.SMEM((8,), jnp.int32),
        plgpu.SMEM((idx_window(ppc),), jnp.int32),
        plgpu.Barrier(num_arrivals=1),                       # meta
        plgpu.Barrier(num_arrivals=Qs),                      # q
        plgpu.Barrier(num_arrivals=1),                       # page-id window
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=slots),    # k_full
        plgpu.Barrier(num_arrivals=arrivals, num_barriers=slots),    # v_full
        plgpu.Barrier(num_arrivals=1, num_barriers=slots),           # k_free (compute wg)
        plgpu.Barrier(num_arrivals=1, num_barriers=slots),           # v_free
    ]
    operands = [tile_meta, bt, q_tiles, k_cache, v_cache]
    if quantized:
        # [K, N, B]: a page's B scales of one kv head contiguous, as a TMA copy needs
        operands += [k_scale.transpose(2, 0, 1), v_scale.transpose(2, 0, 1)]
        scratch += [plgpu.SMEM((slots, kv_chunk), jnp.float32),
                    plgpu.SMEM((slots, kv_chunk), jnp.float32),
                    plgpu.SMEM((kv_chunk, D), cdt, transforms=_smem_transforms(cdt, D)),
                    plgpu.SMEM((kv_chunk, D), cdt, transforms=_smem_transforms(cdt, D))]
    if not in_place:
        scratch.append(plgpu.SMEM((Qs, R, kv_chunk), cdt, transforms=_smem_transforms(cdt, kv_chunk)))
    out_type = (jax.ShapeDtypeStruct((K, nt, P, Qs, R, D), cdt),
                jax.ShapeDtypeStruct((K, nt, P, R), jnp.float32))
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(K, nt, P),
        grid_names=("kv_head", "tile", "split"),
        **(dict(num_threads=2, thread_name="wg") if warp_specialized else {}),
        compiler_params=plgpu.CompilerParams(),
        interpret=_interpret_params(interpret))
    return call(*operands)
