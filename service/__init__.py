"""optiremat.service: the REST API over the solver (FastAPI; embedded worker processes and
SQLite, or Redis and RQ workers when ``OPTIREMAT_REDIS_URL`` is set).

Never imports JAX. Build the app with ``optiremat.service.api.main.create_app(settings)``; run it
with ``optiremat serve``. Importing this package stays cheap: worker processes
import ``optiremat.service.core.worker`` and must not pull in the web stack.
"""
