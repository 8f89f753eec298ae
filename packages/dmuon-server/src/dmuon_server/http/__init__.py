"""The HTTP side of the service: routes, their dependencies, errors, middleware, views."""
