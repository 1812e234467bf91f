"""The one switch between attention backends, and one layer's attention against the stacked cache.

Backends (`attention_backend`):
  reference  the plain-jnp path (jaxserve/attention/reference.py), the CPU default;
  pallas     the Pallas Triton kernel (jaxserve/pallas/paged_attention.py), interpreted off GPU;
             "triton" is the same backend;
  mosaic     the Mosaic GPU kernel for Hopper (jaxserve/pallas/paged_attention_mgpu.py), jax >= 0.11,
             interpreted off GPU;
  auto       on a GPU, the first of mosaic, pallas that can run the model's dtypes and shapes AND has
             a recorded measurement on this GPU class for this shape class
             (`jaxserve.pallas.measured.MEASURED`, filled from benchmarks/RESULTS.md), else the
             reference (XLA) path; off GPU, reference. The log says why each was passed over.

A kernel that fails to compile when the engine warms up falls back along `FALLBACK` with a warning
(jaxserve/engine/llm_engine.py), never a crash.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxserve.attention import cpu_kernel
from jaxserve.attention import kv_cache as kvc
from jaxserve.attention.metadata import AttentionMetadata
from jaxserve.attention.reference import ragged_paged_attention_ref
from jaxserve.pallas import measured as measured_kernels

logger = logging.getLogger(__name__)

BACKENDS = ("reference", "pallas", "mosaic", "cpu")
ALIASES = {"triton": "pallas"}
MOSAIC_MIN_JAX = (0, 11)
# What a backend that failed to compile falls back to, in order.
FALLBACK = {"mosaic": ("pallas", "reference"), "pallas": ("reference",), "cpu": ("reference",),
            "reference": ()}


@dataclasses.dataclass(frozen=True)
class Platform:
    """What backend selection needs to know about where it runs (injectable in tests)."""
    backend: str                            # jax.default_backend(): "cpu", "gpu", "tpu"
    compute_capability: str | None = None   # CUDA "major.minor", e.g. "9.0" on H100/H200
    jax_version: tuple[int, int] = (0, 0)

    @property
    def hopper(self) -> bool:
        return self.backend == "gpu" and (self.compute_capability or "").split(".")[0] == "9"


def _version(text: str) -> tuple[int, int]:
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in text.split(".")[:2]]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def current_platform() -> Platform:
    backend = jax.default_backend()
    cc = None
    if backend == "gpu":
        cc = getattr(jax.devices()[0], "compute_capability", None)
        cc = None if cc is None else str(cc)
    return Platform(backend, cc, _version(jax.__version__))


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """The model's side of the choice: dtypes and shapes every attention call will have."""
    q_dtype: object
    kv_dtype: object
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sinks: bool = False       # a learned logit per head in the softmax denominator (gpt-oss)
    latent: bool = False      # multi-head latent attention's cache (no V pages): reference path only

    @classmethod
    def of(cls, model_config, dtype, kv_dtype, block_size: int) -> AttentionCase:
        return cls(dtype, kv_dtype, model_config.num_heads, model_config.num_kv_heads,
                   model_config.head_dim, block_size, bool(getattr(model_config, "attention_sinks", False)),
                   getattr(model_config, "mla", None) is not None)


SINKS_PROBLEM = "does not implement attention sinks (gpt-oss), which only the reference path applies"
LATENT_PROBLEM = ("has no latent-cache (multi-head latent attention, DeepSeek) layout; the reference "
                  "path serves it (attention_backend 'reference' or 'auto')")


def mosaic_problem(case: AttentionCase, platform: Platform) -> str | None:
    """Why the Mosaic GPU kernel cannot serve `case` on `platform` (None: it can). Off GPU it runs
    in Mosaic GPU's interpreter (tests); on a GPU it needs Hopper."""
    if platform.jax_version < MOSAIC_MIN_JAX:
        return (f"needs jax >= {'.'.join(map(str, MOSAIC_MIN_JAX))} (Mosaic GPU plgpu.kernel), this is "
                f"jax {'.'.join(map(str, platform.jax_version))}")
    if platform.backend == "gpu" and not platform.hopper:
        return (f"needs a Hopper GPU (compute capability 9.x, wgmma), this GPU has compute capability "
                f"{platform.compute_capability}")
    if platform.backend not in ("gpu", "cpu"):
        return f"runs on a GPU (or interpreted on CPU), not on {platform.backend}"
    from jaxserve.pallas.paged_attention_mgpu import unsupported_reason
    return unsupported_reason(case.q_dtype, case.kv_dtype, num_q_heads=case.num_q_heads,
                              num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                              block_size=case.block_size)


def select_backend(name: str, case: AttentionCase | None = None,
                   platform: Platform | None = None,
                   measured: tuple[measured_kernels.Measurement, ...] = measured_kernels.MEASURED) -> str:
    """`attention_backend` -> "reference", "pallas", "mosaic" or "cpu" for this case and platform
    ("auto" never answers "cpu": the engine turns the CPU's "reference" into it, `cpu_backend`).
    Raises ValueError for an unknown name, or for "mosaic" where it cannot run (the reason named).
    `measured`: the table of GPU measurements `auto` may pick from (injectable in tests)."""
    name = ALIASES.get(name, name)
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"attention_backend must be 'auto', {', '.join(map(repr, BACKENDS + tuple(ALIASES)))}; "
                         f"got {name!r}")
    if name == "cpu":
        problem = cpu_kernel.problem(None if case is None else case.kv_dtype, case is not None and case.latent,
                                     (platform or current_platform()).backend)
        if problem:
            raise ValueError(f"attention_backend='cpu': the CPU attention kernel {problem}")
        return name
    if case is not None and case.sinks and name != "reference":
        if name != "auto":
            raise ValueError(f"attention_backend={name!r}: the {name} kernel {SINKS_PROBLEM}; use 'reference' "
                             "or 'auto'")
        logger.info("attention_backend auto: the reference path (the kernels %s)", SINKS_PROBLEM)
        return "reference"
    if case is not None and case.latent:
        if name in ("pallas", "mosaic"):
            raise ValueError(f"attention_backend={name!r}: the {name} kernel {LATENT_PROBLEM}")
        if name == "auto" and (platform or current_platform()).backend == "gpu":
            logger.info("attention_backend auto: the reference path (the kernels %s)", LATENT_PROBLEM)
        return "reference"
    if name in ("reference", "pallas"):
        return name
    platform = platform or current_platform()
    problem = "no attention case given" if case is None else mosaic_problem(case, platform)
    if name == "mosaic":
        if problem:
            raise ValueError(f"attention_backend='mosaic': the Mosaic GPU kernel {problem}")
        return name
    if platform.backend != "gpu":
        return "reference"
    q_dtype, head_dim = (None, None) if case is None else (case.q_dtype, case.head_dim)
    reasons = []
    for kernel in ("mosaic", "pallas"):
        if kernel == "mosaic" and problem:
            reasons.append(f"mosaic: the kernel {problem}")
            continue
        m = measured_kernels.find(f"attention/{kernel}", platform.compute_capability, q_dtype, head_dim,
                                  table=measured)
        if m is not None:
            if reasons:
                logger.info("attention_backend auto: %s, not %s", kernel, "; ".join(reasons))
            return kernel
        reasons.append(measured_kernels.why_not(f"attention/{kernel}", platform.compute_capability,
                                                q_dtype, head_dim, table=measured))
    logger.warning("attention_backend auto: the XLA reference path (%s); --attention-backend "
                   "pallas or mosaic asks for a kernel anyway", "; ".join(reasons))
    return "reference"


def resolve_backend(name: str) -> str:
    """`select_backend` without a case (for callers that know no model)."""
    return select_backend(name)


def _kernel(backend: str):
    if backend == "reference":
        return ragged_paged_attention_ref
    if backend == "dense":     # differentiable, for training (jaxserve/training); not a serving choice
        from jaxserve.attention.dense import dense_paged_attention
        return dense_paged_attention
    if backend == "mosaic":
        from jaxserve.pallas import paged_attention_mgpu
        return paged_attention_mgpu.ragged_paged_attention_mgpu
    from jaxserve.pallas import paged_attention
    return paged_attention.ragged_paged_attention


def cpu_backend(selected: str, asked: str, dtype: str, devices: int, case: AttentionCase) -> str:
    """The engine's attention backend: `selected` (select_backend's answer to `asked`), except
    that "auto" on one CPU device with `--dtype auto` runs attention through the CPU kernel ("cpu")
    where it serves the case (f32 or int8 KV pages, no latent cache) and builds here; `--dtype float32`
    keeps the reference path's numbers, and models with attention sinks (gpt-oss) keep it too
    (the kernel applies sinks, `--attention-backend cpu`, but auto has not been measured there)."""
    if selected == "cpu" and devices != 1:
        raise ValueError(f"attention_backend='cpu': the CPU attention kernel runs on one device, not {devices} "
                         "(tensor parallelism takes 'reference' or 'auto')")
    if selected != "reference" or asked != "auto" or dtype != "auto" or devices != 1 or case.sinks:
        return selected
    problem = cpu_kernel.problem(case.kv_dtype, case.latent, current_platform().backend)
    if problem is None:
        logger.info("attention: the CPU kernel (backend 'cpu')")
        return "cpu"
    if current_platform().backend == "cpu":
        logger.info("attention: the reference path, not the CPU attention kernel: %s", problem)
    return selected


def paged_attention(q, cache: kvc.KVCache, layer, meta: AttentionMetadata, *, backend: str,
                    sm_scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, sinks: jax.Array | None = None
                    ) -> tuple[jax.Array, kvc.KVCache]:
    """One layer's attention: q [T, H, D] against layer `layer` of the stacked cache; `sinks`
    [H] (gpt-oss; reference path only: `select_backend` refuses the kernels for such models).
    Returns the output and the cache to carry on with (see `return_pages`)."""
    n = cache.num_blocks
    meta = dataclasses.replace(meta, block_tables=meta.block_tables + layer * n)
    scales = {}
    if cache.quantized:
        scales = dict(k_scale=kvc.layer_view(cache.k_scale),
                      v_scale=None if cache.latent else kvc.layer_view(cache.v_scale))
    args = (q, kvc.layer_view(cache.k), None if cache.latent else kvc.layer_view(cache.v), meta)
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, **scales)
    if cache.latent and backend not in ("reference", "cpu"):
        raise ValueError(f"attention backend {backend!r} {LATENT_PROBLEM}")
    if backend not in ("reference", "cpu"):
        if sinks is not None:
            raise ValueError(f"attention backend {backend!r} {SINKS_PROBLEM}")
        # the kernels take fp8 pages (a uint8 `codes` pool exists only on CPU: interpret mode)
        args = (q, kvc.as_values(args[1], cache.codes), kvc.as_values(args[2], cache.codes), meta)
        return _kernel(backend)(*args, **opts), cache
    out, (k, v, ks, vs) = ragged_paged_attention_ref(*args, **opts, return_pages=True,
                                                     page_codes=cache.codes, sinks=sinks,
                                                     cpu_kernel=backend == "cpu")
    shape, scale_shape = cache.k.shape, cache.k.shape[:-1]
    return out, kvc.KVCache(k.reshape(shape), None if v is None else v.reshape(shape),
                            None if ks is None else ks.reshape(scale_shape),
                            None if vs is None else vs.reshape(scale_shape), cache.codes)
