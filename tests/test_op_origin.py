"""Whose a queued op is comes from its origin, never from its label (kvdevice/runtime/op_origin.py).

A queued op that raises as it runs is the code under test's finding only when that code queued it;
its label is text the code itself chooses (a kernel it names ``write``, an annotation of its own), so
an op whose label reads like the caller's is still the code's, and one of the harness's whose label
reads like the code's call is still the harness's.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from fuzz.engine.episode import CodeUnderTestRaised, Episode, EpisodeConfig, run_ops
from fuzz.engine.harness_error import HarnessError
from kvdevice.runtime import make_runtime
from kvdevice.runtime.op_origin import HARNESS, OpOrigin, failed_op
from zeroer.protocol import Capabilities

ROOT = Path(__file__).resolve().parent.parent
SPEC = "tests/test_op_origin.py"
OFFLOADER = "examples/engine_offloaders.py:store_after_compute_event"


class NamesItsKernelWrite:
    """A runtime-API zeroer whose kernel is called ``write``, as the caller's own writes are, and
    raises as it runs (lazily, at the caller's next synchronisation)."""

    capabilities = Capabilities(api="runtime")

    def __init__(self, cache, runtime) -> None:
        self.rt = runtime

    def zero_block_ids(self, block_ids) -> None:
        ids = [int(b) for b in block_ids]
        if not ids:
            return

        def run() -> None:
            raise RuntimeError(f"planted: the zero kernel of {ids} fails as it runs")

        self.rt.launch(run, name="write", blocks_written=ids)

    def warmup(self, num_blocks: int) -> None:
        pass


def _fails() -> None:
    raise RuntimeError("planted: the harness's own op fails as it runs")


@contextlib.contextmanager
def _started(config: EpisodeConfig) -> Iterator[Episode]:
    """An episode past its start op, abandoned however the test ends."""
    episode = Episode(config)
    try:
        episode.apply({"op": "start"})
        yield episode
    finally:
        episode.abandon()


def test_an_op_carries_whose_code_queued_it_and_its_label_keeps_the_call():
    rt = make_runtime("sim")
    with rt.annotate(owner="zeroer"), rt.annotate("my.zero_block_ids#1([3])"):
        stamp = rt.launch(_fails, name="write")
        assert rt.origin == OpOrigin("zeroer", "my.zero_block_ids#1([3])")
    with rt.annotate("step 2 write_block", owner=HARNESS), rt.annotate(owner="offloader"):
        assert rt.origin == OpOrigin("offloader", "step 2 write_block")  # naming the owner keeps the call
    assert rt.origin == OpOrigin(None, None)  # outside every annotation nobody said
    assert stamp.label == "write#1 on stream 'main' (my.zero_block_ids#1([3]))"
    with pytest.raises(RuntimeError, match="^planted") as raised:
        rt.synchronize()
    assert failed_op(raised.value) == (stamp.label, OpOrigin("zeroer", "my.zero_block_ids#1([3])"))
    assert raised.value.__notes__ == [f"while running {stamp.label}"]  # the words for people stay
    rt.close()


def test_an_op_of_the_zeroer_labelled_like_the_callers_write_is_the_zeroers_finding():
    ops = [{"op": "start"}, {"op": "allocate", "n": 1, "stream": 0}]
    (finding,) = run_ops(EpisodeConfig(zeroer=f"{SPEC}:NamesItsKernelWrite"), ops)
    assert finding.kind == "zeroer raised", finding
    assert finding.message.startswith(
        "zeroer raised at step 2 in its queued op write#"), finding.message
    assert "RuntimeError: planted: the zero kernel of [1] fails as it runs" in finding.message


def test_an_op_of_the_harness_labelled_like_the_zeroers_call_is_a_harness_error():
    with _started(EpisodeConfig(zeroer="reference")) as episode:
        with episode.rt.annotate("reference.zero_block_ids#9([1])"):  # the zeroer's words, the harness's op
            episode.rt.launch(_fails, name="zero_kernel")
        with pytest.raises(HarnessError, match=r"^harness error at step 1 in the harness's queued op zero_kernel#\d+ "
                                               r"on stream 'main' \(reference\.zero_block_ids#9\(\[1\]\)\), not a finding"):
            episode.device_work(episode.rt.synchronize)


def test_an_op_of_the_harness_labelled_like_the_offloaders_call_is_a_harness_error():
    with _started(EpisodeConfig(offloader=OFFLOADER)) as episode:
        with episode.rt.annotate(f"{OFFLOADER}.store#1([1])"):  # the offloader's spec in its label
            episode.rt.launch(_fails, name="copy")
        with pytest.raises(HarnessError, match=r"^harness error at step 1 in the harness's queued op copy#"):
            episode.device_work(episode.rt.synchronize)
        assert not any(f.kind == "offloader raised" for f in episode.findings), episode.findings


def test_an_op_the_offloader_queued_in_its_call_is_its_own():
    with _started(EpisodeConfig(offloader=OFFLOADER)) as episode:
        with episode.component_call(episode.groups[0], "store(9, [1], [1])"):
            episode.rt.launch(_fails, name="write")  # named as the caller's writes are
        with pytest.raises(CodeUnderTestRaised) as raised:
            episode.device_work(episode.rt.synchronize)
        assert raised.value.finding.kind == "offloader raised", raised.value.finding
        assert raised.value.finding.message.startswith("offloader raised at step 1 in its queued op write#")


# -- read from the tree: the modules that decide blame never read it from text ----------------------
BLAME_MODULES = ("fuzz/engine/episode.py", "fuzz/engine/component.py", "fuzz/engine/offload.py",
                 "fuzz/engine/harness_error.py", "kvdevice/runtime/op_origin.py")
TEXT_METHODS = {"startswith", "endswith", "removeprefix", "removesuffix"}
TEXT_NAMES = {"label", "origin", "what", "call", "note", "notes", "text", "message"}


def text_matching(source: str) -> list[str]:
    """Where ``source`` decides something by reading text: a prefix or suffix test, a substring test
    of an f-string or on a label-like name, or a look at an exception's ``__notes__``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TEXT_METHODS:
            found.append(f"line {node.lineno}: .{node.func.attr}(...)")
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            right = node.comparators[0]
            if isinstance(node.left, ast.JoinedStr) or (isinstance(right, ast.Name) and right.id in TEXT_NAMES):
                found.append(f"line {node.lineno}: a substring test")
        elif isinstance(node, ast.Constant) and node.value == "__notes__":
            found.append(f"line {node.lineno}: reads __notes__")
    return found


@pytest.mark.parametrize("path", BLAME_MODULES)
def test_no_blame_module_reads_whose_an_op_is_from_text(path):
    assert text_matching((ROOT / path).read_text()) == []


def test_the_text_matching_finder_finds_what_the_old_blame_did():
    old = '''
notes = [n for n in getattr(error, "__notes__", ()) if n.startswith("while running ")]
if origin.startswith(_HARNESS_OPS) or f"({spec}" not in origin:
    pass
'''
    assert sorted(text_matching(old)) == ["line 2: .startswith(...)", "line 2: reads __notes__",
                                          "line 3: .startswith(...)", "line 3: a substring test"]
