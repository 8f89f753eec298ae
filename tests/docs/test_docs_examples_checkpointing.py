"""The runnable examples of ``docs/checkpointing.md`` (see ``docs_examples``)."""

from docs_examples import page_example_tests

test_example_runs = page_example_tests("checkpointing.md")
