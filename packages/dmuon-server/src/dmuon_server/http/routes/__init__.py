"""The API's routes, one module per resource: jobs, artifacts, metrics and events, service."""
