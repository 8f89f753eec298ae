"""The runnable examples of ``docs/training.md`` (see ``docs_examples``)."""

from docs_examples import page_example_tests

test_example_runs = page_example_tests("training.md")
