"""The fuzzer engine: op records, the episode that executes them, the oracle that judges them, the
Hypothesis state machine that draws them, and the campaigns that run it."""
