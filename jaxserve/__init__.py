"""jaxserve: an LLM serving engine written natively in JAX.

`from jaxserve import LLM, SamplingParams` is the offline API. Heavy modules load lazily so that
`import jaxserve` (and the host-side scheduler code) stays free of jax until it is needed.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("jaxserve.llm", "LLM"),
    "SamplingParams": ("jaxserve.sampling_params", "SamplingParams"),
    "StructuredOutputsParams": ("jaxserve.sampling_params", "StructuredOutputsParams"),
    "RequestOutput": ("jaxserve.outputs", "RequestOutput"),
    "CompletionOutput": ("jaxserve.outputs", "CompletionOutput"),
    "EngineArgs": ("jaxserve.config", "EngineArgs"),
    "LoRARequest": ("jaxserve.lora.request", "LoRARequest"),
}

__all__ = list(_LAZY) + ["__version__"]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
