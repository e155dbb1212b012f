"""optiremat.service: the REST API over the solver (FastAPI, worker processes, SQLite).

Never imports JAX. Build the app with ``service.main.create_app(settings)``; run it
with ``optiremat serve``. Importing this package stays cheap: worker processes
import ``service.worker`` and must not pull in the web stack.
"""
