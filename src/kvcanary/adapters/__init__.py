"""Engine adapters: run the canary inside third-party serving engines.

Each adapter imports its engine lazily, so importing `kvcanary` (or this package) never imports
an engine. Adapters may import `kvcanary.contract` and `kvcanary.canary` only.
"""
