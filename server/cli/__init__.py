"""The `jaxserve` console script."""
