"""A finding's signature (fuzz/engine/signature.py): two traces of one bug share it, two bugs do not.

The findings are real: programs of different lengths, geometries and cache counts replayed on the
simulator through the same episode the fuzzer runs (``run_ops``), against the engine-style zeroers
of ``examples/engine_zeroers.py``, the zoo and a raising zeroer. A few rules that no built-in
zeroer exercises (two zeroer instances racing each other, value findings on two geometries) are
checked on findings written by hand in the words the harness uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fuzz.engine.episode import EpisodeConfig, run_ops
from fuzz.engine.oracle import Finding
from fuzz.engine.signature import Signature, finding_signature, violation_signature, zeroer_label
from fuzz.engine.violation import ZeroerViolation

ROOT = Path(__file__).resolve().parents[1]
ENGINE = "examples/engine_zeroers.py:"

START = {"op": "start", "in_flight": 1}
TWO_CALLS = [START, {"op": "allocate", "n": 1}, {"op": "allocate", "n": 1}]  # the shortest race
# Another program of the same race: other in-flight depth, streams, sizes, a write between the calls.
LONGER = [{"op": "start", "in_flight": 2}, {"op": "allocate", "n": 3, "stream": 1}, {"op": "write", "block": 2, "stream": 1},
          {"op": "allocate", "n": 2, "stream": 2}]
# The race within the second of two zeroers of one runtime (an x2 campaign).
IN_CACHE_1 = [START, {"op": "allocate", "n": 1, "cache": 1}, {"op": "allocate", "n": 2, "cache": 1, "stream": 2}]


def signature_of(spec: str, ops: list[dict], geometry: str = "tiny", zeroers: int = 1, **config) -> Signature:
    config = EpisodeConfig(zeroer=spec, geometry=geometry, zeroers=zeroers, **config)
    findings = run_ops(config, ops)
    assert findings, f"{spec} on {geometry}: the program showed nothing"
    signature = violation_signature(ZeroerViolation(findings, ops, config))
    assert signature is not None
    return signature


def test_two_traces_of_a_racy_engine_zeroer_on_two_geometries_share_a_signature():
    spec = ENGINE + "single_pinned_buffer"
    short = signature_of(spec, TWO_CALLS, "tiny")
    longer = signature_of(spec, LONGER, "ratio2")
    in_second_zeroer = signature_of(spec, IN_CACHE_1, "tiny", zeroers=2)
    assert short == longer == in_second_zeroer
    assert str(short) == (
        "hazard | engine_zeroers.py:single_pinned_buffer | host write to pinned host buffer pN of the zeroer "
        "(torch.empty(pin_memory=True)) by the host code of engine_zeroers.py:single_pinned_buffer.zero_block_ids "
        "between the start of the call and Tensor.copy_ while copy_ (h2d) on a caller stream "
        "(engine_zeroers.py:single_pinned_buffer.zero_block_ids) may not have read it yet")


def test_the_traces_of_a_built_in_race_share_a_signature_whatever_blocks_streams_and_slots_they_used():
    first = signature_of("single_buffer", TWO_CALLS, kernel="torch")
    other = signature_of("single_buffer", LONGER, "mixed_dtypes", kernel="torch")
    assert first == other and first.kind == "hazard" and "#" not in first.site and "[" not in first.site


def test_two_different_bugs_have_different_signatures():
    pinned = signature_of(ENGINE + "single_pinned_buffer", TWO_CALLS)
    side_stream = signature_of(ENGINE + "side_stream_copy_no_record", TWO_CALLS)
    assert pinned != side_stream and pinned.key != side_stream.key
    assert "stream 'zeroer-N'" in side_stream.site  # the zeroer's own stream stays apart from the caller's
    # Two zoo entries with the same kind of hazard (a host write under a queued copy) are two bugs.
    zoo_single = signature_of("zoo.single_buffer", TWO_CALLS)
    zoo_unprotected = signature_of("zoo.unprotected_staging", TWO_CALLS)
    assert zoo_single != zoo_unprotected and zoo_single.kind == zoo_unprotected.kind == "hazard"


def test_a_caller_fault_is_part_of_the_bug():
    finding = Finding("hazard", None, "hazard at step 3: block 1: read#4 on stream 's1' (step 3 read_block) reads it "
                                      "and zero_reference#2 on stream 'main' (...) writes it", caller_fault=True)
    ours = finding_signature(finding, zeroer="reference", geometry="tiny", caller_fault="no-zero-wait")
    other = finding_signature(finding, zeroer="reference", geometry="tiny", caller_fault="no-free-fence")
    assert ours != other and "caller fault no-zero-wait" in str(ours)


def test_a_raise_is_the_same_bug_at_the_same_line_whatever_the_ids_and_another_bug_elsewhere():
    raising = f"{ROOT}/tests/bad_zeroers.py:RaisingZeroer"
    one = signature_of(raising, TWO_CALLS[:2])
    other = signature_of(raising, [START, {"op": "allocate", "n": 3, "stream": 2}], "ratio2")
    assert one == other and one.kind == "zeroer raised"
    assert one.zeroer == "bad_zeroers.py:RaisingZeroer"  # not where the checkout lies
    assert one.site.startswith("zero_block_ids raised RuntimeError at ") and one.site.endswith("bad_zeroers.py:41")


def test_a_value_finding_records_no_code_location_so_it_is_one_bug_per_geometry():
    def finding(block: int, where: str) -> Finding:
        return Finding("non-zero after zeroing", block,
                       f"non-zero after zeroing: block {block}, segment 0, word 0 (32 of 32 words differ) at {where}: "
                       f"expected 0 (zeroed), observed 0xffffffff (NaN poison: stale bytes never zeroed). History: "
                       f"step 2 allocate_blocks: zero_block_ids([{block}]) on stream 0")

    at_read = finding_signature(finding(6, "step 14 read_block on stream 2"), zeroer="zoo.stale_table", geometry="tiny")
    at_end = finding_signature(finding(1, "the end of the episode"), zeroer="zoo.stale_table", geometry="tiny")
    elsewhere = finding_signature(finding(1, "the end of the episode"), zeroer="zoo.stale_table", geometry="ratio2")
    assert at_read == at_end and at_read != elsewhere
    assert str(at_read) == "non-zero after zeroing | zoo.stale_table | on tiny | expected zeroed, observed NaN poison"
    stamp = Finding("clobbered", 3, "cache 1: clobbered: block 3, segment 0, word 0 (1 of 32 words differ) at the end of "
                                    "the episode: expected 0x10000102 (stamp of owner 1, write 2), observed 0 (zeroed). "
                                    "History: ...")
    assert finding_signature(stamp, zeroer="ring", geometry="tiny").site == "expected stamp, observed zeroed"


def test_a_real_value_finding_keeps_its_geometry():
    config = EpisodeConfig(zeroer="zoo.ratio_ignored", geometry="ratio2")
    findings = run_ops(config, [START, {"op": "allocate", "n": 1}])
    signature = violation_signature(ZeroerViolation(findings, [], config))
    assert str(signature) == "non-zero after zeroing | zoo.ratio_ignored | on ratio2 | expected zeroed, observed NaN poison"


def test_one_zeroer_instance_is_the_single_campaign_and_two_racing_each_other_stay_apart():
    def hazard(first: int, second: int) -> Signature:
        message = (f"hazard at step 3: host write to pinned host buffer p{second + 1} of zeroer {second} by "
                   f"mine.py:make[{second}].zero_block_ids#4([2]) while copy#3 on stream 'main' "
                   f"(mine.py:make[{first}].zero_block_ids#2([1])) may not have read it yet")
        return finding_signature(Finding("hazard", None, message), zeroer="mine.py:make", geometry="tiny")

    within_1, within_0, across, across_the_other_way = hazard(1, 1), hazard(0, 0), hazard(0, 1), hazard(1, 0)
    assert within_0 == within_1 != across == across_the_other_way  # instances are named in order of appearance
    assert "of the zeroer by mine.py:make.zero_block_ids" in within_0.site
    assert "of zeroer A by mine.py:make[A].zero_block_ids while copy on a caller stream (mine.py:make[B]" in across.site


@pytest.mark.parametrize("spec, label", [("/home/me/engine/zeroers.py:make", "zeroers.py:make"),
                                         ("examples/engine_zeroers.py:pinned_ring", "engine_zeroers.py:pinned_ring"),
                                         ("my_pkg.zeroers:make", "my_pkg.zeroers:make"), ("ring", "ring")])
def test_the_zeroer_is_named_without_where_the_checkout_lies(spec, label):
    assert zeroer_label(spec) == label


def test_a_finding_read_back_from_a_trace_file_has_the_signature_it_had():
    config = EpisodeConfig(zeroer="single_buffer", kernel="torch")
    finding = run_ops(config, TWO_CALLS)[0]
    stored = {"kind": finding.kind, "block": finding.block, "message": finding.message,
              "caller_fault": finding.caller_fault, "details": finding.details, "where": finding.where}
    assert finding_signature(stored, zeroer="single_buffer", geometry="tiny") == \
        finding_signature(finding, zeroer="single_buffer", geometry="tiny")
