"""With ``entropy_target`` unset (the controller off) every global mode updates exactly as 0.4.1 did.

Both sides are made here, at test time, by ``tests/support/reference_updates.py``: one fresh interpreter with
0.4.1's source (commit 5810af9, before any controller code existed, extracted from this repository's history) and
one with the source under test, the same script, one thread each, on this machine. Per mode and micro-batch layout
the selection masks, every micro-batch's ``actor/pg_loss``, ``grad_norm`` and the sha256 of the updated parameters
must be equal bit for bit. Premise: the same computation on the same inputs on one machine, whatever its CPU (no
recording from another machine is read). ``vanilla`` goes through no plugin code: its equality shows the two
interpreters compute floats alike, so a difference in a global mode is the plugin's.
"""

from __future__ import annotations

import json

import pytest

from ..support import reference_updates

pytestmark = pytest.mark.slow  # verl's real engine on CPU: the slow tier


def _record_both(tmp_path) -> tuple[dict, dict]:
    """(0.4.1's figures, the source under test's figures), made concurrently in two fresh interpreters."""
    old_source = reference_updates.extract_source(reference_updates.SOURCE_0_4_1, str(tmp_path))
    runs = {name: (reference_updates.record_in_subprocess(source, str(tmp_path / f"{name}.json")),
                   tmp_path / f"{name}.json")
            for name, source in (("0.4.1", old_source), ("now", str(reference_updates.REPOSITORY / "src")))}
    figures = {}
    for name, (process, path) in runs.items():
        output, _ = process.communicate()
        assert process.returncode == 0, f"recording with the {name} source failed:\n{output[-4000:]}"
        figures[name] = json.loads(path.read_text())
    return figures["0.4.1"], figures["now"]


def test_with_the_controller_off_every_update_equals_0_4_1_bit_for_bit(tmp_path):
    old, now = _record_both(tmp_path)
    assert old["version"] == "0.4.1", f"the extracted source ran as {old['version']}, not 0.4.1"
    assert now["version"] != "0.4.1"
    assert now["model_sha256"] == old["model_sha256"], "the tiny model builder changed: not 0.4.1's model"
    assert set(now["updates"]) == set(old["updates"])
    canaries = [key for key in old["updates"] if key.startswith("vanilla")]
    assert canaries and all(now["updates"][key] == old["updates"][key] for key in canaries), (
        "vanilla's update differs between two interpreters on one machine: the comparison says nothing about the "
        f"plugin ({now['machine']} against {old['machine']})")
    differences = {key: [field for field in old["updates"][key] if now["updates"][key][field] != old["updates"][key][field]]
                   for key in old["updates"]}
    assert not any(differences.values()), differences
    selected = {key: [bin(int(mask["bits"], 16)).count("1") for mask in update["masks"]]
                for key, update in old["updates"].items() if update["masks"]}
    assert len(selected) == 6 and all(count > 0 for counts in selected.values() for count in counts)  # real masks
    print(f"\ncontroller off: {len(old['updates'])} updates equal 0.4.1's (made here, {now['machine']['cpu']}, "
          f"{now['machine']['cpu_capability']}) in masks, per-micro-batch pg_loss, grad_norm and parameter digests "
          f"bit for bit (selected tokens: {selected})")


def test_a_checkout_without_the_history_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(reference_updates, "REPOSITORY", tmp_path)  # no .git here
    with pytest.raises(reference_updates.HistoryMissing, match="clone the repository with its history"):
        reference_updates.extract_source(reference_updates.SOURCE_0_4_1, str(tmp_path))
