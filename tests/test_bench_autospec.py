"""bench.autospec's summary: the best fixed configuration read with its choice apart from its measurement."""

import pytest

from bench.autospec import CONTROL, held_out_best, summarise, summary_line


def _call(repeat: int, rates: dict[str, float], tokens: int = 100) -> dict:
    """One call's row: each system's (seconds, tokens) at the given tokens per second."""
    return {"repeat": repeat, "auto_depth": 1.0, **{n: (tokens / r, tokens) for n, r in rates.items()}}


def test_the_best_fixed_is_chosen_on_the_other_repeats_and_rated_on_each():
    # K=3 is lucky on repeat 0 (120 tok/s) and unlucky on repeat 1 (95): pooled it beats K=1 (100 on both),
    # but the repeat that picks it is not the one that rates it.
    rows = [
        _call(0, {"auto": 100, "plain": 50, "K=1": 100, "K=3": 120}),
        _call(1, {"auto": 100, "plain": 50, "K=1": 100, "K=3": 95}),
    ]
    names = ["plain", "K=1", "K=3"]
    pooled_k3 = 200 / (100 / 120 + 100 / 95)
    assert held_out_best(rows, names) == pytest.approx(200 / (100 / 100 + 100 / 95))  # K=1 on repeat 0, K=3 on repeat 1
    s = summarise(rows, names)
    assert s["best_fixed"] == "K=3" and s["vs_best"] == pytest.approx(100 / pooled_k3)
    assert s["vs_best_held_out"] == pytest.approx(100 / held_out_best(rows, names))
    assert s["vs_best_held_out"] > 1.0 > s["vs_best"]


def test_one_repeat_has_no_held_out_reading():
    rows = [_call(0, {"auto": 100, "plain": 50, "K=1": 110}), _call(0, {"auto": 90, "plain": 50, "K=1": 100})]
    s = summarise(rows, ["plain", "K=1"])
    assert "vs_best_held_out" not in s and s["best_fixed"] == "K=1"


def test_the_printed_line_names_the_held_out_reading_and_the_control():
    rows = [_call(i, {"auto": 100, "plain": 50, "K=1": 100, CONTROL: 98}) | {"equal_to_plain": True} for i in (0, 1)]
    line = summary_line("float32", 0.0, 1, "random 1", summarise(rows, ["plain", "K=1", CONTROL], "K=1"))
    assert (
        "1.00x it chosen on the other repeats" in line
        and "control 0.98x its twin" in line
        and "OUTPUT DIFFERS" not in line
    )
    assert summarise(rows, ["plain", "K=1", CONTROL], "K=1")["control_vs_best_held_out"] == pytest.approx(0.98)
    assert "chosen on the other repeats" not in summary_line(
        "float32", 0.0, 1, "random 1", summarise(rows[:1], ["plain", "K=1"], "K=1")
    )


def test_calls_where_a_configurations_samples_ended_a_row_early_are_rated_apart():
    """At batch 4, plain decoding's (and auto's) samples ended a row early on one call: 303 tokens in the time the
    chain of 1 made 384. Over every call the chain of 1 reads 9% faster; over the calls all ran to one length, 2%."""
    even = _call(0, {"auto": 100, "plain": 100, "K=1": 102}, tokens=384)
    short = {"repeat": 0, "auto_depth": 0.0, "auto": (3.84, 303), "plain": (3.84, 303), "K=1": (3.84 * 100 / 102, 384)}
    s = summarise([even, short], ["plain", "K=1"])
    assert s["best_fixed"] == "K=1" and s["vs_best"] == pytest.approx(687 / 7.68 / (768 / (2 * 3.84 * 100 / 102)))
    assert s["vs_best_same_length"] == pytest.approx(100 / 102) and s["same_length_calls"] == 1
    assert "0.98x best on the 1 calls of one length" in summary_line("float32", 1.0, 4, "random 1", s)
    assert "vs_best_same_length" not in summarise(
        [even, even], ["plain", "K=1"]
    )  # every call of one length: nothing apart
