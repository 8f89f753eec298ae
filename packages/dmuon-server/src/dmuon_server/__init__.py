"""dmuon-server: a job controller that launches DMuon training and streams its metrics.

The server never imports torch or ``dmuon``: it knows the recipe by its command line and
its metrics file only. Build the ASGI app with :func:`dmuon_server.app.create_app`, or run
the ``dmuon-server`` console script (:mod:`dmuon_server.cli`).
"""

__version__ = "0.1.0"
