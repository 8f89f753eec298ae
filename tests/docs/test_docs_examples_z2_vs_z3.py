"""The runnable examples of ``docs/z2-vs-z3.md`` (see ``docs_examples``)."""

from docs_examples import page_example_tests

test_example_runs = page_example_tests("z2-vs-z3.md")
