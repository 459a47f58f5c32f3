"""Test order for the two-worker run (pyproject addopts): xdist hands whole files to whichever worker
is free, in collection order, so the longest files go first and no long file is left to start last."""

LONGEST_FIRST = (
    "tests/test_expert_parallel.py",
    "tests/test_mla_training.py",
    "tests/test_training.py",
    "tests/test_serving.py",
    "tests/test_serve.py",
    "tests/test_tensor_parallel.py",
    "tests/test_exact_mode.py",
    "parity_tests/test_ttt_parity.py",
    "parity_tests/test_drafter_parity.py",
    "parity_tests/test_target_parity.py",
    "parity_tests/test_deepseek_parity.py",
    "tests/test_engine.py",
    "tests/test_bf16_fidelity.py",
    "tests/test_autospec.py",
    "parity_tests/test_mla_drafter_parity.py",
    "tests/test_deepseek_engine.py",
)


def pytest_collection_modifyitems(items) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: file order kept within
