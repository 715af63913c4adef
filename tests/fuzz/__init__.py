"""The fuzzer of issue 8: ``nox -s fuzz`` (``python -m tests.fuzz``); see run.py."""
