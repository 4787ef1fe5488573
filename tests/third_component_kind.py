"""A third kind of component, declared from outside the fuzzer's core and driven by it unedited.

Run as a script (tests/test_component_kinds.py does): it adds a "toucher" to
fuzz.engine.component.COMPONENT_KINDS before the core's modules load, then checks that the
episode's config, the op table, the episode and the state machine take it as they take an
offloader, and that what its code raises is filed under its own name. Prints OK.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis.stateful import initialize, rule, run_state_machine_as_test

from fuzz.engine import component


class TouchSide:
    """Calls the code under test (``config.toucher``: "calm" or "raises") on a live block."""

    noun = "the toucher"
    keeps_cache_tensors = False

    def __init__(self, core: component.CallerCore) -> None:
        self.core = core

    def ops(self) -> dict:
        return {"touch": self.touch}

    def touch(self, block: int, stream: int = 0) -> None:
        group = self.core.groups[0]
        self.core.check_live(group, block, "touch")
        with self.core.component_call(group, f"touch({block})"):
            if self.core.config.toucher == "raises":
                raise RuntimeError(f"block {block} touched too hard")

    def warmup(self) -> None: ...
    def holding(self, block: int) -> None: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...
    def release(self) -> None: ...
    def abandon(self) -> None: ...


component.COMPONENT_KINDS["toucher"] = component.ComponentKind(
    f"{__name__}:TouchSide", f"{__name__}:TouchPart", {"touch": (("block",), {"stream": 0})},
    options={"grip": ("soft", "firm")})

from fuzz.engine.episode import EpisodeConfig, run_ops  # noqa: E402  (after the kind is declared)
from fuzz.engine.machine import machine_for  # noqa: E402
from fuzz.engine.machine import BLOCKS  # noqa: E402
from fuzz.engine.ops import check_op  # noqa: E402
from fuzz.engine.signature import RAISED_KINDS  # noqa: E402
from fuzz.trace import TRACE_VERSION, TraceError, load_trace  # noqa: E402


class TouchPart:
    """Its rules beside the caller's: start, and touch a live block."""

    @initialize()
    def start(self) -> None:
        self.disabled = frozenset()
        self._apply(op="start")

    @rule(block=BLOCKS)
    def touch_block(self, block) -> None:
        if self._usable(block):
            self._apply(op="touch", block=block.block)


assert EpisodeConfig(toucher="calm").grip == "soft"
for bad, said in [({"grip": "loose"}, "grip='loose'; choose 'soft' or 'firm'"),
                  ({"offloader": "x.py:make", "zeroers": 2}, "zeroers=2: an episode with offloader= set holds one KV cache"),
                  ({"offloader": "x.py:make", "toucher": "calm"},
                   "offloader= and toucher= are set; an episode drives one component beside the zeroer")]:
    try:
        EpisodeConfig(**bad)
    except ValueError as error:
        assert str(error) == said, error
    else:
        raise AssertionError(f"{bad} was taken")
assert check_op({"op": "touch", "block": 1}) == ("touch", {"block": 1, "stream": 0})
ops = [{"op": "start"}, {"op": "allocate", "n": 1}, {"op": "touch", "block": 1}]
assert run_ops(EpisodeConfig(toucher="calm"), ops) == []
(found,) = run_ops(EpisodeConfig(toucher="raises"), ops)
assert found.kind == "toucher raised", found
assert found.message.startswith("toucher raised at step 3 in touch(1): RuntimeError: block 1 touched too hard"), found.message
# With two caches the call is labelled by its cache too, and still filed under the kind.
(found,) = run_ops(EpisodeConfig(toucher="raises", zeroers=2), ops)
assert found.kind == "toucher raised" and " in cache 0: touch(1): " in found.message, found.message
assert "toucher raised" in RAISED_KINDS
# A trace naming a value its kind does not take is the user's to fix (exit 2), named in one line.
with tempfile.TemporaryDirectory() as folder:
    trace = Path(folder) / "toucher.json"
    trace.write_text(json.dumps({"version": TRACE_VERSION, "config": {"toucher": "calm", "grip": "loose"}, "ops": ops}))
    try:
        load_trace(trace)
    except TraceError as error:
        assert str(error) == f"{trace}: field 'config': grip='loose'; choose 'soft' or 'firm'", error
    else:
        raise AssertionError("a trace with grip='loose' was taken")
machine = machine_for(EpisodeConfig(toucher="calm"), "toucher campaign")
assert hasattr(machine, "touch_block") and hasattr(machine, "allocate_blocks"), machine.__mro__
run_state_machine_as_test(machine, settings=settings(max_examples=20, database=None, deadline=None))
print("OK")
