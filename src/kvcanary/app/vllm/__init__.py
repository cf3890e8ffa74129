"""Driving real vLLM with the canary attached: tiny local model, workloads, fault campaign.

Everything that imports vLLM does so inside functions, so importing this package (and the CLI)
never imports vLLM.
"""
