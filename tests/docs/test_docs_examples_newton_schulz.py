"""The runnable examples of ``docs/newton-schulz.md`` (see ``docs_examples``)."""

from docs_examples import page_example_tests

test_example_runs = page_example_tests("newton-schulz.md")
