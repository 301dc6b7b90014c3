"""pytest plugin asserting parity against goldens (registered through the pytest11 entry point)."""
