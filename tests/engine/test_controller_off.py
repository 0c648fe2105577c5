"""With ``entropy_target`` unset (the controller off) every global mode updates exactly as 0.4.1 did.

Compared with the figures recorded from 0.4.1 in ``tests/data/updates_0.4.1.json`` (written by
``tests/support/reference_updates.py`` at 0.4.1, commit 5810af9, before any controller code existed): per
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

RECORDED = Path(__file__).resolve().parents[1] / "data" / "updates_0.4.1.json"


def test_with_the_controller_off_every_update_equals_0_4_1_recorded_bit_for_bit(tiny_model_path):
    recorded = json.loads(RECORDED.read_text())
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
        f"nothing about the plugin. Re-record on this machine from a 0.4.1 checkout: python -m "
        f"tests.support.reference_updates tests/data/updates_0.4.1.json")
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
