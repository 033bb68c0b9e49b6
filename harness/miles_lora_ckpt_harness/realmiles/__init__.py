"""The real-Miles tier's harness for the miles-rl 0.0.2 wheel: its stand-ins, launches and data-source runs.

Only the demo and the tests import it; docs/testing.md says what the tier runs.
"""
