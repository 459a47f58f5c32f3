"""The commands run from any working directory: ``python -m eagle_jax`` finds the bundled pair beside the
package, every console script is installed and answers ``--help`` outside the repository, and the
repository's ``python -m train.<name>`` / ``python -m serve`` wrappers still run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_jax import bundled

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = (
    "eagle-jax",
    "eagle-jax-train",
    "eagle-jax-export",
    "eagle-jax-regenerate",
    "eagle-jax-vocab-map",
    "eagle-jax-eval",
    "eagle-jax-serve",
    "eagle-jax-fetch",
)
WRAPPERS = ("train.ttt", "train.export", "train.regenerate", "train.vocab_map", "train.eval", "serve")


def run_all(commands: list[list[str]], cwd: Path, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Runs the commands side by side (each is mostly interpreter start-up and imports)."""
    procs = [
        subprocess.Popen(c, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands
    ]
    return [subprocess.CompletedProcess(c, p.wait(timeout), p.communicate()[0], None) for c, p in zip(commands, procs)]


@pytest.mark.skipif(
    not bundled.available(),
    reason="bundled pair not built (python -m workshop.pretrain_target && python -m workshop.bundle)",
)
def test_main_job_uses_the_bundled_pair_from_any_directory(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "eagle_jax", "--max-new-tokens", "24"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "class Tokenizer:" in out.stdout  # the prompt and its completion are printed
    assert "acceptance length:" in out.stdout and "tokens/s" in out.stdout
    assert f"bundled target {bundled.ASSETS / 'target'}" in out.stdout
    assert f"bundled EAGLE-3.1 drafter {bundled.ASSETS / 'drafter-eagle3.1'}" in out.stdout
    assert "RANDOM" not in out.stdout and "meaningless" not in out.stdout
    assert "output vs plain output: identical" in out.stdout


def test_console_scripts_installed_and_run_outside_the_repository(tmp_path):
    paths = {name: shutil.which(name) for name in SCRIPTS}
    assert all(paths.values()), f"not on PATH (pip install -e .): {[n for n, p in paths.items() if p is None]}"
    for res in run_all([[paths[name], "--help"] for name in SCRIPTS], tmp_path):
        assert res.returncode == 0 and "usage:" in res.stdout, f"{res.args}: {res.stdout[-2000:]}"


def test_repository_wrappers_still_run():
    for res in run_all([[sys.executable, "-m", module, "--help"] for module in WRAPPERS], REPO):
        assert res.returncode == 0 and "usage:" in res.stdout, f"{res.args}: {res.stdout[-2000:]}"


def test_paths_resolve_against_the_repository_not_the_working_directory(tmp_path, monkeypatch):
    from eagle_jax.cli.ttt import recipe_path
    from eagle_jax.serving.server import read_profile

    monkeypatch.chdir(tmp_path)
    profile = read_profile(bundled.config_path("serve/bundled.yaml"))
    assert Path(profile["target"]) == bundled.ASSETS / "target"
    assert Path(profile["drafter"]) == bundled.ASSETS / "drafter-eagle3.1"
    assert recipe_path("configs/train/tiny.yaml") == str(bundled.CONFIGS / "train" / "tiny.yaml")
    (tmp_path / "configs" / "train").mkdir(parents=True)
    (tmp_path / "configs" / "train" / "tiny.yaml").write_text("run_dir: mine\n")
    assert recipe_path("configs/train/tiny.yaml") == "configs/train/tiny.yaml"  # the working directory's wins

    # A user's profile: local paths relative to its folder, Hub ids kept as ids, 'none' kept.
    (tmp_path / "models" / "t").mkdir(parents=True)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "mine.yaml").write_text("target: ../models/t\ndrafter: org/drafter\ntokenizer: none\nslots: 2\n")
    mine = read_profile(tmp_path / "p" / "mine.yaml")
    assert mine == {"target": str(tmp_path / "models" / "t"), "drafter": "org/drafter", "tokenizer": "none", "slots": 2}


def test_missing_bundle_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(bundled, "ASSETS", tmp_path / "assets")
    monkeypatch.setattr(bundled, "CONFIGS", tmp_path / "configs")
    assert not bundled.available()
    for accessor in (bundled.target_dir, bundled.drafter_dir, bundled.tokenizer_dir, bundled.manifest_path):
        with pytest.raises(bundled.BundleNotFound, match="editable install"):
            accessor()
    with pytest.raises(bundled.BundleNotFound, match="no config at"):
        bundled.config_path("serve/bundled.yaml")
    with pytest.raises(bundled.BundleNotFound, match=r"no bundled drafter 'eagle4'"):
        bundled.drafter_dir("eagle4")
