"""The fuzzer: campaigns, the state machine, the oracle and the pytest plugin (docs/fuzzing.md)."""

__distribution__ = "kvzero-fuzz"  # checked by kvzero_fuzz.shadowing: other projects have a 'fuzz' too
