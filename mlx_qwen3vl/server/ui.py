"""The playground page (GET /): plain HTML, JS and CSS shipped in the package (static/), no build
step and nothing fetched from elsewhere. It holds no data: it calls this server's own API
(/v1/models, /v1/ground, /v1/chat/completions) from the user's browser, with the API key the
user types when the server has one. Served under a strict Content-Security-Policy (no inline
script or style, nothing from another origin, not framable) with nosniff."""

from importlib import resources

from starlette.responses import Response
from starlette.routing import Route

FILES = {"/": ("index.html", "text/html"), "/ui/app.js": ("app.js", "text/javascript"),
         "/ui/style.css": ("style.css", "text/css")}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


def routes():
    """GET routes for the page's three files, read once from the package."""
    static = resources.files(__package__).joinpath("static")
    out = []
    for path, (name, kind) in FILES.items():
        body = static.joinpath(name).read_bytes()

        async def serve(request, body=body, kind=kind):
            return Response(body, media_type=kind, headers=HEADERS)

        out.append(Route(path, serve, methods=["GET"]))
    return out
