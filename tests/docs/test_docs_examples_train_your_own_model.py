"""The runnable examples of ``docs/train-your-own-model.md`` (see ``docs_examples``)."""

from docs_examples import page_example_tests

test_example_runs = page_example_tests("train-your-own-model.md")
