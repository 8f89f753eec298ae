"""The API's routes, one module per area: jobs, metrics and events, service."""
