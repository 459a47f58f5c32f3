"""bench.gpu on the CPU: its speed rows on the bundled pair (greedy output equal to plain decoding's, the
acceptance a chain can reach) and the parity run's summary line."""

import json

from bench import gpu


def test_speed_rows_check_their_output_against_plain_decoding(tmp_path):
    out = tmp_path / "gpu.json"
    results = gpu.main(
        [
            "--no-parity",
            "--batch",
            "1",
            "2",
            "--ks",
            "2",
            "--max-new",
            "8",
            "--batch1-prompts",
            "2",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    rows = {(r["batch"], r["config"]): r for r in results["speed"]}
    assert set(rows) == {(1, "plain"), (1, "K=2"), (2, "plain"), (2, "K=2")}
    for (batch, config), r in rows.items():
        assert r["rows_equal_to_plain"] == "2/2"
        assert r["tok_s"] > 0 and len(r["passes_tok_s"]) == 1
        if config == "plain":
            assert r["speedup"] == 1.0 and r["acceptance_length"] is None
        else:
            assert 1.0 <= r["acceptance_length"] <= 3.0
    assert json.loads(out.read_text())["speed"] == results["speed"]


def test_the_parity_summary_is_pytests_counts_line():
    lines = [
        "....F",
        "FAILED parity_tests/x.py::t[cuda-a]",
        "=== 1 failed, 4 passed, 1 error in 75.09s (0:01:15) ===",
        "  warnings.warn(pytest.PytestUnraisableExceptionWarning(msg))",
    ]
    assert gpu.pytest_summary(lines) == "1 failed, 4 passed, 1 error in 75.09s (0:01:15)"
    assert gpu.pytest_summary(["50 skipped in 22.33s"]) == "50 skipped in 22.33s"
