"""The mode map (sim/mode_map.py): which fixed mode serves a prompt length and output tail best. Pure logic."""

from __future__ import annotations

from app.policy.mode_policy import MODES
from sim.mode_map import mode_map, plot


def test_each_cell_names_the_mode_that_met_most_or_answered_first_and_by_how_much(tmp_path):
    result = mode_map("cpu-tiny", 2, 2, requests=120, lengths=(128, 1900), tails=(3.0, 1.1))
    assert len(result["cells"]) == 2 and all(len(row) == 2 for row in result["cells"])
    for row in result["cells"]:
        for cell in row:
            modes, winner = cell["modes"], cell["winner"]
            assert winner in MODES and cell["margin"] >= 0
            assert all(modes[winner]["attainment"] >= m["attainment"] - 0.005 for m in modes.values())
            if cell["by"] == "ttft_p90":
                tied = [m for m in modes.values() if modes[winner]["attainment"] - m["attainment"] <= 0.005]
                assert modes[winner]["ttft_p90_ms"] == min(m["ttft_p90_ms"] for m in tied)
    # A long prompt costs a local request its TTFT against a remote prefill engine that does nothing else.
    assert result["cells"][0][1]["modes"]["local"]["ttft_p90_ms"] > result["cells"][0][1]["modes"]["pull"]["ttft_p90_ms"]
    assert mode_map("cpu-tiny", 2, 2, requests=120, lengths=(128, 1900), tails=(3.0, 1.1)) == result
    plot(result, tmp_path / "map.png")
    assert (tmp_path / "map.png").stat().st_size > 10_000
