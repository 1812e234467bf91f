"""The aiohttp app (routes, SSE, auth) and Prometheus metrics rendering."""
