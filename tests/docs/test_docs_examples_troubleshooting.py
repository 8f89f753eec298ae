"""The runnable examples of ``docs/troubleshooting.md`` (see ``docs_examples``)."""

from docs_examples import page_example_tests

test_example_runs = page_example_tests("troubleshooting.md")
