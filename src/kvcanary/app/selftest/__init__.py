"""The fault-injection self-test campaign: inject, correlate 1:1, report."""
