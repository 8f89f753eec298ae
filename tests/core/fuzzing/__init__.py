"""A randomized differential suite: generated models and distributed runs against one process.

`cases` describes and draws a case (hypothesis), `models` builds its model, `worker` runs
one phase of it on every rank of a `pool`, `oracle` trains the plain model on the global
batch in one process and compares, `runner` ties them together, `property` is the
hypothesis property; ``python -m fuzzing`` (``make fuzz``) runs it for a time budget.
"""
