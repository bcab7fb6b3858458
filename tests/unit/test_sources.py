"""Adapter sources confined to adapter roots (services/common/sources.py): every way out of a
root is refused with one message that names no path, and what passes is read from under the
root even when a symlink is swapped in after the check."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from plora.make_adapters import write_peft_adapter
from services.common import sources
from services.common.adapters import (
    adapter_dir_sha256,
    adapter_sha256,
    inspect_adapter,
    load_lora_weights,
    sha256_file,
)
from services.common.errors import AdapterSourceError, ConfigError, InvalidAdapterError
from services.common.peft_config import InspectionLimits
from services.common.sources import (
    SOURCE_REFUSED,
    Confinement,
    SourceRefusedError,
    confine,
    open_confined,
    redact,
    resolve_roots,
)
from services.common.types import ModelSpec
from services.worker.adapter_api import AdapterRef
from services.worker.metrics import WorkerMetrics
from services.worker.server import WorkerService

TINY = ModelSpec("tiny", 2, 8, 16, 2, 1, 4, 32, 64, 10000.0, 1e-6, True)


@pytest.fixture()
def tree(tmp_path: Path) -> SimpleNamespace:
    """``root/acme/good`` and ``root/bob/theirs`` (adapters under the root), ``outside/stolen``
    (an adapter outside it), resolved root list."""
    root = tmp_path / "root"
    good = write_peft_adapter(root / "acme" / "good", TINY, rank=4, alpha=8.0, seed=1)
    theirs = write_peft_adapter(root / "bob" / "theirs", TINY, rank=4, alpha=8.0, seed=2)
    stolen = write_peft_adapter(tmp_path / "outside" / "stolen", TINY, rank=4, alpha=8.0, seed=3)
    return SimpleNamespace(
        tmp=tmp_path,
        root=root,
        good=good,
        theirs=theirs,
        stolen=stolen,
        roots=resolve_roots([str(root)]),
    )


def _refused(source: str | Path, roots, tenant: str | None = None) -> str:
    with pytest.raises(SourceRefusedError) as err:
        confine(source, roots, tenant)
    return str(err.value)


def test_a_directory_under_a_root_is_its_real_path(tree) -> None:
    assert confine(tree.good, tree.roots) == Path(os.path.realpath(tree.good))
    assert confine(tree.theirs, tree.roots, "bob") == Path(os.path.realpath(tree.theirs))
    # a root given through a symlink is its target: sources under either spelling pass
    (tree.tmp / "root-link").symlink_to(tree.root)
    linked = resolve_roots([str(tree.tmp / "root-link")])
    assert linked == tree.roots
    assert confine(tree.tmp / "root-link" / "acme" / "good", linked) == confine(tree.good, linked)


def test_symlinks_that_stay_under_the_root_are_followed(tree) -> None:
    """A Hugging Face cache keeps each file as a symlink into ``blobs/``: followed, since the
    target is under the root too."""
    snap = tree.root / "acme" / "hub" / "snapshots" / "abc"
    blobs = tree.root / "acme" / "hub" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir(parents=True)
    for name in sources.ADAPTER_FILES:
        shutil.copy(tree.good / name, blobs / name)
        (snap / name).symlink_to(Path("../../blobs") / name)
    assert confine(snap, tree.roots, "acme") == Path(os.path.realpath(snap))
    manifest = inspect_adapter(snap, TINY, confinement=Confinement(tree.roots, "acme"))
    assert manifest.sha256 == inspect_adapter(tree.good, TINY).sha256


def test_every_way_out_is_refused_with_one_message_naming_no_path(tree, monkeypatch) -> None:
    """``/etc``, ``~``, ``../..``, a directory symlinked out of the root, a root directory
    holding a weights file (or a config) symlinked out of it, a missing path, a file, a
    directory without the adapter files, a FIFO in place of a file, a NUL byte, a name too
    long: all the same message, identical for a path that exists and one that does not."""
    root = tree.root / "acme"
    (root / "link-out").symlink_to(tree.stolen, target_is_directory=True)
    weights_out = root / "weights-out"
    weights_out.mkdir()
    shutil.copy(tree.good / "adapter_config.json", weights_out)
    (weights_out / "adapter_model.safetensors").symlink_to(
        tree.stolen / "adapter_model.safetensors"
    )
    config_out = root / "config-out"
    config_out.mkdir()
    shutil.copy(tree.good / "adapter_model.safetensors", config_out)
    (config_out / "adapter_config.json").symlink_to(tree.stolen / "adapter_config.json")
    empty = root / "empty"
    empty.mkdir()
    fifo = root / "fifo"
    fifo.mkdir()
    shutil.copy(tree.good / "adapter_model.safetensors", fifo)
    os.mkfifo(fifo / "adapter_config.json")  # a plain open would wait for a writer forever
    monkeypatch.chdir(tree.good)
    cases = {
        "/etc": "/etc",
        "~": "~",
        "../..": "../..",  # from root/acme/good: the root itself
        "../../..": "../../..",  # the temporary directory above the root
        "an adapter outside": tree.stolen,
        "a missing path": root / "nothing-here",
        "a missing path outside": tree.tmp / "outside" / "nothing-here",
        "a directory symlinked out": root / "link-out",
        "a weights file symlinked out": weights_out,
        "a config symlinked out": config_out,
        "a file": tree.good / "adapter_config.json",
        "no adapter files": empty,
        "a FIFO config": fifo,
        "the root itself": tree.root,
        "a NUL byte": str(tree.good) + "\0x",
        "a name too long": str(root / ("x" * 5000)),
        "empty": "",
    }
    messages = {name: _refused(source, tree.roots) for name, source in cases.items()}
    assert set(messages.values()) == {SOURCE_REFUSED}, messages
    assert str(tree.tmp) not in SOURCE_REFUSED


def test_a_tenant_registers_only_from_its_own_directory(tree) -> None:
    """With a tenant, the source must be under ``ROOT/<tenant>/``: another tenant's adapter
    and a missing path in its directory give the same refusal; so do tenant names that would
    climb out (``..``) or name no directory (empty)."""
    assert confine(tree.good, tree.roots, "acme")
    existing = _refused(tree.theirs, tree.roots, "acme")
    missing = _refused(tree.root / "bob" / "nothing", tree.roots, "acme")
    assert existing == missing == SOURCE_REFUSED
    # a link from acme's directory into bob's resolves into bob's: refused
    (tree.root / "acme" / "borrowed").symlink_to(tree.theirs, target_is_directory=True)
    assert _refused(tree.root / "acme" / "borrowed", tree.roots, "acme") == SOURCE_REFUSED
    for tenant in ("..", "", "acme/..", "."):
        assert _refused(tree.good, tree.roots, tenant) == SOURCE_REFUSED
    # no roots at all: nothing is any tenant's
    assert _refused(tree.good, (), "acme") == SOURCE_REFUSED


def test_a_symlink_swapped_in_after_the_check_is_not_followed(tree, monkeypatch) -> None:
    """The file is opened by walking down from the root with ``O_NOFOLLOW``: when a component
    is swapped for a symlink between the check (``realpath``) and the open, the open fails
    instead of reading the link's target."""
    weights = tree.good / "adapter_model.safetensors"
    checked = os.path.realpath(weights)
    assert open_confined(weights, tree.roots).read(8)
    # the attacker's swap, between the check and the open
    weights.unlink()
    weights.symlink_to(tree.stolen / "adapter_model.safetensors")
    with pytest.raises(SourceRefusedError):  # resolved now: outside
        open_confined(weights, tree.roots)
    real = os.path.realpath
    monkeypatch.setattr(sources.os.path, "realpath", lambda p, strict=False: checked)
    with pytest.raises(SourceRefusedError):  # checked before the swap: the walk refuses it
        open_confined(weights, tree.roots)
    monkeypatch.setattr(sources.os.path, "realpath", real)
    # the same for a directory of the path
    (tree.root / "acme" / "good").rename(tree.root / "acme" / "moved")
    (tree.root / "acme" / "good").symlink_to(tree.stolen, target_is_directory=True)
    monkeypatch.setattr(
        sources.os.path,
        "realpath",
        lambda p, strict=False: str(tree.roots[0] + "/acme/good/adapter_config.json"),
    )
    with pytest.raises(SourceRefusedError):
        open_confined(tree.root / "acme" / "good" / "adapter_config.json", tree.roots)


def test_confined_reads_give_the_same_manifest_and_refuse_outside(tree) -> None:
    inside = Confinement(tree.roots)
    assert inspect_adapter(tree.good, TINY, confinement=inside) == inspect_adapter(tree.good, TINY)
    w = load_lora_weights(tree.good, TINY, adapter_id="a", version=1, confinement=inside)
    assert w.sha256 == adapter_dir_sha256(tree.good)
    with pytest.raises(SourceRefusedError):
        inspect_adapter(tree.stolen, TINY, confinement=inside)
    with pytest.raises(SourceRefusedError):
        load_lora_weights(tree.stolen, TINY, adapter_id="a", version=1, confinement=inside)


def test_the_recorded_sha256_covers_the_config(tree) -> None:
    """``sha256(sha256(config) || sha256(weights))``: a config changed after registration
    (same weights) fails the load as changed since registration."""
    config = tree.good / "adapter_config.json"
    weights = tree.good / "adapter_model.safetensors"
    sha = inspect_adapter(tree.good, TINY).sha256
    assert sha == adapter_sha256(sha256_file(config), sha256_file(weights))
    assert sha not in (sha256_file(config), sha256_file(weights))
    load_lora_weights(tree.good, TINY, adapter_id="a", version=1, expected_sha256=sha)
    config.write_text(config.read_text().replace('"lora_alpha": 8.0', '"lora_alpha": 16.0'))
    assert inspect_adapter(tree.good, TINY).sha256 != sha  # still a valid adapter
    with pytest.raises(InvalidAdapterError, match="changed since registration"):
        load_lora_weights(tree.good, TINY, adapter_id="a", version=1, expected_sha256=sha)


def _worker(roots: tuple[str, ...]) -> SimpleNamespace:
    """What :meth:`WorkerService._load_adapter` reads of its worker."""
    return SimpleNamespace(
        spec=TINY,
        dtype=torch.float32,
        confinement=Confinement(roots) if roots else None,
        metrics=WorkerMetrics(),
        config=SimpleNamespace(adapter_roots=roots, inspection_limits=InspectionLimits()),
    )


def _refused_count(worker: SimpleNamespace) -> float:
    value = worker.metrics.registry.get_sample_value("plora_worker_adapter_source_refused_total")
    return value or 0.0


def test_a_worker_refuses_a_record_pointing_outside_its_roots(tree) -> None:
    """A registry record edited to point at ``/etc`` or at an adapter outside the roots (with
    that adapter's own sha256) is refused, counted, and answered FAILED_PRECONDITION naming
    the adapter and no path."""
    worker = _worker(tree.roots)
    good = inspect_adapter(tree.good, TINY)
    assert WorkerService._load_adapter(worker, AdapterRef("a", 1, str(tree.good), 0, good.sha256))
    stolen = inspect_adapter(tree.stolen, TINY)
    for source in (str(tree.stolen), "/etc", str(tree.root / "acme" / "nothing")):
        with pytest.raises(AdapterSourceError) as err:
            WorkerService._load_adapter(worker, AdapterRef("a", 2, source, 0, stolen.sha256))
        assert err.value.status_code_name == "FAILED_PRECONDITION"
        assert "'a' (v2) can no longer be loaded" in str(err.value)
        assert source not in str(err.value) and str(tree.tmp) not in str(err.value)
    assert _refused_count(worker) == 3


def test_a_config_changed_after_registration_fails_its_load_naming_the_adapter(tree) -> None:
    worker = _worker(tree.roots)
    ref = AdapterRef("acme/cfg", 4, str(tree.good), 0, inspect_adapter(tree.good, TINY).sha256)
    config = tree.good / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 8.0', '"lora_alpha": 16.0'))
    with pytest.raises(AdapterSourceError) as err:
        WorkerService._load_adapter(worker, ref)
    assert err.value.status_code_name == "FAILED_PRECONDITION"
    assert "'acme/cfg' (v4)" in str(err.value) and "changed since registration" in str(err.value)
    assert str(tree.good) not in str(err.value)
    assert _refused_count(worker) == 0  # under the roots: a changed file, not a refusal


def test_resolve_roots_refuses_what_is_not_a_directory(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    for bad in ([str(tmp_path / "missing")], [str(tmp_path / "file")], [""]):
        with pytest.raises(ConfigError, match="--adapter-root / PLORA_ADAPTER_ROOTS"):
            resolve_roots(bad)
    assert resolve_roots([str(tmp_path), str(tmp_path) + "/"]) == (os.path.realpath(tmp_path),)


def test_redact_removes_the_source_in_both_spellings(tmp_path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    message = f"{tmp_path}/real/adapter_model.safetensors is broken; '{tmp_path}/link' too"
    out = redact(message, tmp_path / "link")
    assert str(tmp_path) not in out
    assert out == "<source>/adapter_model.safetensors is broken; '<source>' too"
