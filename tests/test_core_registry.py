"""The tree-core registry: SGL_TREE_CORE resolution, compatibility check, fallback and logs."""

from __future__ import annotations

import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest

import sglite.core as core_registry
from sglite.version import __version__


@pytest.fixture(autouse=True)
def fresh_registry():
    core_registry._reset_for_tests()
    yield
    core_registry._reset_for_tests()


def _break_native(monkeypatch, module):
    def fake_import():
        if module is None:
            raise ImportError("No module named 'sglite._core'")
        return module

    monkeypatch.setattr(core_registry, "_import_native", fake_import)


def test_default_is_python(monkeypatch):
    monkeypatch.delenv("SGL_TREE_CORE", raising=False)
    backend = core_registry.load()
    assert backend.name == "python"
    info = core_registry.describe()
    assert info == {
        "backend": "python",
        "requested": "python",
        "reason": None,
        "version": __version__,
    }


def test_unknown_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SGL_TREE_CORE", "fortran")
    with pytest.raises(ValueError, match="unknown tree core 'fortran'.*python, rust, auto"):
        core_registry.load()


def test_rust_without_native_module_falls_back_with_warning(monkeypatch, caplog):
    monkeypatch.setenv("SGL_TREE_CORE", "rust")
    _break_native(monkeypatch, None)
    with caplog.at_level(logging.INFO, logger="sglite.core"):
        backend = core_registry.load()
    assert backend.name == "python"
    info = core_registry.describe()
    assert info["backend"] == "python" and info["requested"] == "rust"
    assert "could not be imported" in info["reason"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and "could not be imported" in warnings[0].getMessage()


def test_auto_fallback_logs_info(monkeypatch, caplog):
    _break_native(monkeypatch, None)
    with caplog.at_level(logging.INFO, logger="sglite.core"):
        backend = core_registry.load("auto")
    assert backend.name == "python"
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert infos and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_version_mismatch_is_its_own_reason(monkeypatch):
    fake = types.SimpleNamespace(__version__="0.0.0-other")
    _break_native(monkeypatch, fake)
    core_registry.load("rust")
    reason = core_registry.describe()["reason"]
    assert "version '0.0.0-other'" in reason and __version__ in reason


def test_unsupported_configuration_is_its_own_reason(monkeypatch):
    fake = types.SimpleNamespace(
        __version__=__version__,
        SUPPORTED_EVICTION_POLICIES=("lru",),
        MAX_PAGE_SIZE=64,
        **{n: object() for n in core_registry._EXPORTS},
    )
    _break_native(monkeypatch, fake)
    core_registry.load("rust", eviction_policy="lfu")
    assert "eviction policy 'lfu'" in core_registry.describe()["reason"]
    core_registry.load("rust", page_size=128)
    assert "page size 128" in core_registry.describe()["reason"]
    backend = core_registry.load("rust", page_size=16, eviction_policy="lru")
    assert backend.name == "rust" and core_registry.describe()["reason"] is None


def test_versions_agree():
    cargo = (Path(__file__).resolve().parents[1] / "Cargo.toml").read_text()
    assert f'version = "{__version__}"' in cargo


def test_rust_backend_reported_when_built():
    """SGL_TREE_CORE=rust in a clean interpreter reports rust (when the module is built)."""
    mod, reason = core_registry._check_native(None, None)
    if mod is None:
        pytest.skip(reason)
    code = "import sglite.core as c; c.load(); print(c.describe()['backend'])"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"SGL_TREE_CORE": "rust", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "rust"
