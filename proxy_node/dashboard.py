"""The control plane's live dashboard: `GET /ui`, a static page that polls the debug views.

Everything the page needs ships in the package (proxy_node/ui/): no CDN, no build
step. The page reads only `/debug/instance_loads` and `/debug/reservations` through
relative URLs, so it works behind a reverse proxy that mounts the node under a path.
"""

from __future__ import annotations

from importlib.resources import files

from aiohttp import web
from aiohttp.typedefs import Handler

UI_PACKAGE = "proxy_node"
# route -> (file in proxy_node/ui, content type)
ASSETS: dict[str, tuple[str, str]] = {
    "/ui": ("dashboard.html", "text/html"),
    "/ui/dashboard.js": ("dashboard.js", "text/javascript"),
    "/ui/dashboard.css": ("dashboard.css", "text/css"),
}
# The page may talk to its own origin only; a stray external reference fails loudly
# in the browser instead of leaking the operator's view to a third party.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Small files, and a stale page after an upgrade would poll views it misreads.
    "Cache-Control": "no-cache",
}


def add_dashboard_routes(app: web.Application) -> None:
    """Add `GET /ui` and its assets to an app (read once, served from memory)."""
    ui = files(UI_PACKAGE).joinpath("ui")
    for path, (name, content_type) in ASSETS.items():
        body = ui.joinpath(name).read_bytes()
        app.router.add_get(path, _static_handler(body, content_type))
    # `/ui/` would resolve the page's relative URLs one level too deep.
    app.router.add_get("/ui/", _redirect_to_ui)


def _static_handler(body: bytes, content_type: str) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(
            body=body, content_type=content_type, charset="utf-8", headers=SECURITY_HEADERS
        )

    return handler


async def _redirect_to_ui(request: web.Request) -> web.Response:
    # Relative, so a path prefix added by a reverse proxy survives.
    raise web.HTTPFound("../ui")
