"""Evaluation: recall suites (MQAR, passkey) and the numerics report."""
