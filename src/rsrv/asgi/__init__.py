"""Small HTTP endpoints on trio: a plain ASGI app and hypercorn to serve it.

The admin endpoints of the worker, the gateway and the node supervisor are built on it.
"""

from rsrv.asgi._app import (
    NOT_FOUND,
    PROMETHEUS,
    PlainApp,
    Response,
    admin_app,
    answer_lifespan,
    json_response,
    request_path,
    serve_http,
)

__all__ = [
    "NOT_FOUND",
    "PROMETHEUS",
    "PlainApp",
    "Response",
    "admin_app",
    "answer_lifespan",
    "json_response",
    "request_path",
    "serve_http",
]
