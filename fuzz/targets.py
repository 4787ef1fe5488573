"""Every default simulator campaign as a plain Hypothesis test, for Hypothesis's own tools.

``pytest fuzz`` runs each campaign through :func:`~fuzz.engine.campaigns.run_campaign`, with its
profile's seed, budget and trace file. This module offers the same campaigns in the form every
Hypothesis tool understands: one module-level ``unittest.TestCase`` per campaign, the
``.TestCase`` of its state machine (:func:`~fuzz.engine.machine.machine_for`), named after the
campaign id (``single_buffer-tiny-sim-k-torch-shard0`` -> ``single_buffer_tiny_sim_k_torch_shard0``).
HypoFuzz recognises a stateful test by its ``runTest._hypothesis_state_machine_class`` and fuzzes
it for as long as it runs, keeping what it finds in Hypothesis's example database::

    pip install 'kvzero-fuzz[fleet]'     # hypofuzz
    hypothesis fuzz --no-dashboard -n 2 -- fuzz/targets.py -k "ring and tiny"
    python -m pytest fuzz/targets.py -k "single_buffer_tiny_sim"   # once each, as plain tests

Settings: the quick profile's example count and step count, no deadline, the health checks off
as in a campaign (all but ``nested_given``: HypoFuzz declines a test that suppresses it), and
everything else, the database included, left to the active Hypothesis profile, so HypoFuzz can
bring its own database (it declines a test whose database differs from the default).

The self-check campaigns are here too (``expect == "finds"``: the racy designs, the zoo and the
two caller faults), and their TestCase FAILS when run: the fuzzer finds the planted race, which
is the point; HypoFuzz reports it as a failure with the shrunk program. Under ``pytest fuzz``
the same finding passes the self-check. Race-free campaigns must stay clean.

This file is not collected by ``pytest fuzz`` (its name does not match ``test_*.py``); name it
to run it.
"""

from __future__ import annotations

import unittest

from hypothesis import HealthCheck, settings

from fuzz.engine.campaigns import PROFILES, default_campaigns
from fuzz.engine.machine import machine_for

PROFILE = PROFILES["quick"]
# HypoFuzz skips a test that suppresses nested_given (nested @given has no defined meaning for it).
HEALTH_CHECKS_OFF = [check for check in HealthCheck if check is not HealthCheck.nested_given]


def class_name(campaign_id: str) -> str:
    """A campaign id as a Python identifier: ``zoo.ring_overrun-tiny-sim-shard0`` ->
    ``zoo_ring_overrun_tiny_sim_shard0``."""
    name = "".join(c if c.isalnum() else "_" for c in campaign_id)
    return name if name[:1].isalpha() else f"campaign_{name}"


def campaign_test_cases() -> dict[str, type[unittest.TestCase]]:
    """One TestCase per runnable default simulator campaign, by class name, sorted."""
    cases: dict[str, type[unittest.TestCase]] = {}
    for campaign, skipped in default_campaigns(["sim"]):
        if skipped is not None:
            continue
        name = class_name(campaign.id)
        machine = machine_for(campaign.config, campaign.id, database_key=campaign.database_key)
        cases[name] = type(name, (machine.TestCase,), {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"Campaign {campaign.id} (expect {campaign.expect}).",
            "settings": settings(
                max_examples=PROFILE.max_examples,
                stateful_step_count=PROFILE.steps,
                deadline=None,
                suppress_health_check=HEALTH_CHECKS_OFF,
            ),
        })
    return cases


globals().update(campaign_test_cases())
