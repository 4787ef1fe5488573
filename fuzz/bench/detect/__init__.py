"""The detection benchmark: every zoo entry and race-free design, every method, every seed."""
