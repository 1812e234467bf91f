"""Model families (one file each: forward pass and weight declaration) and the registry keyed by
the checkpoint's `architectures` (`jaxserve.models.registry`)."""

from jaxserve.models.registry import SUPPORTED_ARCHITECTURES, get_model

__all__ = ["SUPPORTED_ARCHITECTURES", "get_model"]
