"""`/docs` (Swagger UI) and `/redoc` (ReDoc): interactive pages over `/openapi.json`, as FastAPI
(and so vLLM) serves them, with the viewers' scripts from the jsDelivr CDN. Neither page is in the
OpenAPI document itself (FastAPI leaves them out too), so the schema fuzzer never calls them."""

from __future__ import annotations

from aiohttp import web

OPENAPI_URL = "/openapi.json"
_CDN = "https://cdn.jsdelivr.net/npm"

SWAGGER_UI = f"""<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<title>jaxserve API - Swagger UI</title>
<link type="text/css" rel="stylesheet" href="{_CDN}/swagger-ui-dist@5/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{_CDN}/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>
const ui = SwaggerUIBundle({{
    url: '{OPENAPI_URL}',
    dom_id: '#swagger-ui',
    layout: 'BaseLayout',
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
}})
</script>
</body>
</html>
"""

REDOC = f"""<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>jaxserve API - ReDoc</title>
<style>body {{ margin: 0; padding: 0; }}</style>
</head>
<body>
<noscript>ReDoc requires Javascript to function. Please enable it to browse the documentation.</noscript>
<redoc spec-url="{OPENAPI_URL}"></redoc>
<script src="{_CDN}/redoc@2/bundles/redoc.standalone.js"></script>
</body>
</html>
"""


async def swagger_ui(request: web.Request) -> web.Response:
    return web.Response(text=SWAGGER_UI, content_type="text/html")


async def redoc(request: web.Request) -> web.Response:
    return web.Response(text=REDOC, content_type="text/html")


def add_docs_routes(app: web.Application) -> None:
    app.router.add_get("/docs", swagger_ui)
    app.router.add_get("/redoc", redoc)
