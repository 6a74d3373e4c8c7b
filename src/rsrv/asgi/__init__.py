"""Small HTTP endpoints on trio: a plain ASGI app and hypercorn to serve it.

The admin endpoints of the worker and of the node supervisor are built on it.
"""

from rsrv.asgi._app import NOT_FOUND, PlainApp, Response, serve_http

__all__ = ["NOT_FOUND", "PlainApp", "Response", "serve_http"]
