"""detokbench gc-pauses: both policies measured over the same stream, each in a
process of its own, with what each collected and when."""

from __future__ import annotations

import json

from detokbench import gc_pauses
from detokd import gc_policy


def test_gc_pauses_measures_both_policies_over_the_same_stream(tmp_path, capsys) -> None:
    out = tmp_path / "gc.json"
    assert gc_pauses.main(["--batch", "512", "--lifetime", "8", "--steps", "40", "--rounds", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m detokbench gc-pauses --batch 512")
    passes = result["passes"]
    assert [p["policy"] for p in passes] == ["detokd", "clock", "clock", "detokd"]  # alternated
    for p in passes:
        assert p["starts"] == 512 + 512 * (40 - 8) // 8  # every slot's first start, then B/L per steady step
        assert p["rows_delivered"] == sum(40 - s * 8 // 512 for s in range(512))  # every slot's rows from its first step
        assert len(p["pauses_ms"]) == p["collections"] > 0
        assert p["pause_ms"]["max"] == max(p["pauses_ms"])
    for p in passes:
        if p["policy"] == "detokd":  # one every STARTS starts at least
            assert p["collections"] >= p["starts"] // gc_policy.STARTS
        else:  # one a second, and the one after the last frame
            assert p["collections"] <= p["seconds"] + 2
    table = capsys.readouterr().out
    assert "| detokd |" in table and "| clock |" in table
