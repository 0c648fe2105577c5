"""With ``entropy_target`` unset (the controller off) every global mode updates exactly as 0.4.1 did.

Compared with the figures recorded from 0.4.1 in ``tests/data/updates_0.4.1*.json`` (written by
``tests/support/reference_updates.py`` with 0.4.1's source, commit 5810af9, before any controller code existed;
one recording per CPU capability, the one of this machine's chosen: AVX512 on an Intel Xeon, AVX2 on an AMD
EPYC, the same masks and per-mode figures in the last bits of their own arithmetic): per
mode and micro-batch layout, the selection masks, every micro-batch's ``actor/pg_loss``, ``grad_norm`` and the
sha256 of the updated parameters, bit for bit. ``vanilla``'s update is recorded too: it goes through no
plugin code, so where it differs the machine computes floats differently from the recording machine (another
CPU kernel, thread count or torch), and the test says so instead of blaming the plugin.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ..support import reference_updates

pytestmark = pytest.mark.slow  # verl's real engine on CPU: the slow tier

RECORDINGS = sorted((Path(__file__).resolve().parents[1] / "data").glob("updates_0.4.1*.json"))


def recording_for_this_machine() -> dict:
    """The recording made on a CPU of this machine's capability (torch's ``get_cpu_capability``); none is an
    error that says how to record one, never a skip."""
    recordings = [json.loads(path.read_text()) for path in RECORDINGS]
    capability = torch.backends.cpu.get_cpu_capability()
    found = [r for r in recordings if r["machine"]["cpu_capability"] == capability]
    assert found, (f"no 0.4.1 recording for a {capability} CPU (recorded: "
                   f"{[r['machine'] for r in recordings]}); record one with 0.4.1's source, see "
                   "tests/support/reference_updates.py")
    return found[0]


def test_with_the_controller_off_every_update_equals_0_4_1_recorded_bit_for_bit(tiny_model_path):
    recorded = recording_for_this_machine()
    assert recorded["version"] == "0.4.1"
    threads = torch.get_num_threads()
    torch.set_num_threads(recorded["machine"]["threads"])  # as recorded: a reduction's split depends on it
    try:
        now = reference_updates.record(tiny_model_path)
    finally:
        torch.set_num_threads(threads)
    assert now["model_sha256"] == recorded["model_sha256"], "the tiny model builder changed: not the recorded model"
    canaries = [key for key in recorded["updates"] if key.startswith("vanilla")]
    assert canaries and all(now["updates"][key] == recorded["updates"][key] for key in canaries), (
        f"vanilla's update differs from the recording: this machine's float arithmetic is not the recording "
        f"machine's ({reference_updates.machine()} now, {recorded['machine']} then), so the comparison says "
        f"nothing about the plugin. Record this machine's with 0.4.1's source (tests/support/reference_updates.py)")
    assert set(now["updates"]) == set(recorded["updates"])
    differences = {key: [field for field in recorded["updates"][key]
                         if now["updates"][key][field] != recorded["updates"][key][field]]
                   for key in recorded["updates"]}
    assert not any(differences.values()), differences
    selected = {key: [bin(int(mask["bits"], 16)).count("1") for mask in update["masks"]]
                for key, update in recorded["updates"].items() if update["masks"]}
    assert all(count > 0 for counts in selected.values() for count in counts)  # not a comparison of empty masks
    print(f"\ncontroller off: {len(recorded['updates'])} updates equal 0.4.1's recorded masks, per-micro-batch "
          f"pg_loss, grad_norm and parameter digests bit for bit (selected tokens: {selected})")
