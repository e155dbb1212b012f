"""The HTTP layer over ``core``: routes, dependencies, request models, problems, OpenAPI."""
