"""The real-Miles tier's harness for the miles-rl 0.0.2 wheel: stand-ins, launches, rollout runs.

Only the demo and the tests import it; docs/testing.md says what the tier runs.
"""
