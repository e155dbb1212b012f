"""optiremat.service: the REST API over the solver (FastAPI; embedded worker processes and
SQLite, or Redis and RQ workers when ``OPTIREMAT_REDIS_URL`` is set).

Two halves: ``api`` is the HTTP layer (routes, dependencies, request models,
problems, OpenAPI), ``core`` runs the solves (settings, tasks and outcomes, the
front, the stores, the two executors and their workers). ``api`` imports
``core``, never the other way round. Never imports JAX.

Build the app with ``optiremat.service.api.main.create_app(settings)``; run it with
``optiremat serve``. Importing this package stays cheap: worker processes import
``optiremat.service.core.pool_worker`` and must not pull in the web stack.
"""
