"""Adapters from object storage (services/common/remote_sources.py and the worker's node-local
cache, services/worker/adapter_cache.py) against a real S3 server (``rclone serve s3``) and a
Hugging Face cache laid out as huggingface_hub lays it out, read offline.

Registration reads the config and the safetensors header by ranged reads and checks the bounds
before anything big moves; the worker's cache verifies every download against the registered
sha256, shares one download among concurrent loads, never keeps a partial or tampered download,
and stays within its byte bound, least recently used out first.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from plora.make_adapters import write_peft_adapter
from services.common.adapters import inspect_adapter, load_lora_weights
from services.common.errors import (
    AdapterSourceError,
    ConfigError,
    InvalidAdapterError,
    PoolExhaustedError,
)
from services.common.peft_config import InspectionLimits
from services.common.remote_sources import (
    REMOTE_SOURCE_REFUSED,
    HubReader,
    ObjectStoreError,
    RemoteSourceRefusedError,
    S3Reader,
    SourceAllowList,
    inspect_remote_adapter,
    parse_remote,
)
from services.common.types import ModelSpec
from services.worker.adapter_api import AdapterRef
from services.worker.adapter_cache import AdapterCache, CacheMetrics, DownloadError
from services.worker.metrics import WorkerMetrics
from services.worker.server import WorkerService
from tests.adapter_builders import claim_header, copy_adapter
from tests.s3_server import BUCKET

TINY = ModelSpec("tiny", 2, 8, 16, 2, 1, 4, 32, 64, 10000.0, 1e-6, True)
LIMITS = InspectionLimits()
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@pytest.fixture()
def s3(s3_server, monkeypatch) -> SimpleNamespace:
    """The session's S3 server, with this process's AWS_* variables pointing at it."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


def _adapter(tmp_path: Path, name: str, seed: int, rank: int = 4) -> Path:
    return write_peft_adapter(tmp_path / name, TINY, rank=rank, alpha=8.0, seed=seed)


class RecordingReader(S3Reader):
    """The real S3 reader, noting each ranged read and each full stream (and optionally
    slowing or cutting the stream: a slow link, a connection lost mid-transfer)."""

    def __init__(self, remote, delay_s: float = 0.0, cut_after: int | None = None) -> None:
        super().__init__(remote)
        self.ranges: list[tuple[str, int, int]] = []
        self.streams: list[str] = []
        self.delay_s = delay_s
        self.cut_after = cut_after

    def read(self, name: str, start: int, length: int) -> bytes:
        self.ranges.append((name, start, length))
        return super().read(name, start, length)

    def chunks(self, name: str) -> Iterator[bytes]:
        self.streams.append(name)
        for block in super().chunks(name):
            time.sleep(self.delay_s)
            if self.cut_after is not None and name == WEIGHTS:
                yield block[: self.cut_after]
                raise ObjectStoreError("the connection was reset mid-read", reason="truncated")
            yield block


# -- parsing and the allow-list ------------------------------------------------------------


def test_remote_sources_parse_to_canonical_urls() -> None:
    assert parse_remote("s3://bkt/a/b").url == "s3://bkt/a/b/"
    assert parse_remote("s3://bkt/a/b/").key(CONFIG) == "a/b/adapter_config.json"
    hf = parse_remote("hf://org/repo@v1.0/sub/dir")
    assert (hf.location, hf.revision, hf.prefix) == ("org/repo", "v1.0", "sub/dir/")
    assert hf.url == "hf://org/repo@v1.0/sub/dir/" and hf.path == "hf://org/repo/sub/dir/"
    assert parse_remote("hf://org/repo").revision is None


@pytest.mark.parametrize(
    "source",
    [
        "s3://bkt/a/../other/",
        "s3://bkt/a//b/",
        "s3://bkt/./a/",
        "s3://BK/a/",
        "s3://bkt/a\\b/",
        "s3://bkt/a\nb/",
        "hf://org",
        "hf://org/repo@",
        "hf://org/re po",
        "hf://org/../x",
        "ftp://bkt/a/",
    ],
)
def test_malformed_remote_sources_are_refused_with_the_one_message(source: str) -> None:
    allow = SourceAllowList.parse(["s3://bkt/,hf://org/"])
    with pytest.raises(RemoteSourceRefusedError) as err:
        allow.check(source)
    assert str(err.value) == REMOTE_SOURCE_REFUSED
    assert err.value.status_code_name == "INVALID_ARGUMENT"


def test_the_allow_list_admits_only_its_prefixes_at_a_slash() -> None:
    allow = SourceAllowList.parse(["s3://models/team", "hf://org/"])
    assert allow.prefixes == ("s3://models/team/", "hf://org/")
    assert allow.check("s3://models/team/a/").url == "s3://models/team/a/"
    assert allow.check("hf://org/repo@main").revision == "main"
    for refused in (
        "s3://models/teamx/a/",  # a longer name, not under the prefix
        "s3://models/other/a/",
        "s3://models-private/team/a/",
        "hf://organization/repo",
        "hf://other/repo",
    ):
        with pytest.raises(RemoteSourceRefusedError, match="may read"):
            allow.check(refused)
    with pytest.raises(RemoteSourceRefusedError):
        SourceAllowList().check("s3://models/team/a/")  # none allowed by default
    # a tenant's sources lie under PREFIX<tenant>/
    assert allow.check("s3://models/team/acme/a/", "acme")
    for tenant in ("bob", "", "..", "a/b"):
        with pytest.raises(RemoteSourceRefusedError):
            allow.check("s3://models/team/acme/a/", tenant)


@pytest.mark.parametrize("entry", ["s3://", "ftp://x/", "s3://bkt/../x", "hf://org@main", "x"])
def test_a_malformed_allow_entry_is_a_config_error_naming_the_flag(entry: str) -> None:
    with pytest.raises(ConfigError, match="--adapter-source-allow"):
        SourceAllowList.parse([entry])


# -- registration over S3 ------------------------------------------------------------------


def test_registration_reads_the_header_by_ranged_reads_and_hashes_the_stream(s3, tmp_path) -> None:
    """The manifest (sha256 included) equals the local directory's; the weights are read by
    two ranged GETs (8 bytes, then the header) and one stream; the ETag plays no part."""
    local = _adapter(tmp_path, "a", seed=1)
    remote = parse_remote(s3.put_adapter(local))
    reader = RecordingReader(remote)
    got = inspect_remote_adapter(remote, TINY, limits=LIMITS, reader=reader)
    want = inspect_adapter(local, TINY)
    assert got == want
    weights = (local / WEIGHTS).read_bytes()
    n = int.from_bytes(weights[:8], "little")
    assert [r for r in reader.ranges if r[0] == WEIGHTS] == [(WEIGHTS, 0, 8), (WEIGHTS, 8, n)]
    assert reader.streams == [WEIGHTS]
    etag = s3.client().head_object(Bucket=BUCKET, Key=remote.key(WEIGHTS))["ETag"].strip('"')
    assert etag != hashlib.sha256(weights).hexdigest()


def test_bounds_are_checked_before_the_weights_are_downloaded(s3, tmp_path) -> None:
    """A header claiming more than the bound, and an adapter larger than every pool, are
    refused from the ranged reads alone: the weights are never streamed."""
    local = _adapter(tmp_path, "a", seed=2)
    huge = claim_header(copy_adapter(local, tmp_path / "huge"), LIMITS.max_header_bytes + 1)
    reader = RecordingReader(parse_remote(s3.put_adapter(huge)))
    with pytest.raises(InvalidAdapterError, match="safetensors header of"):
        inspect_remote_adapter(reader.remote, TINY, limits=LIMITS, reader=reader)
    assert reader.ranges == [(CONFIG, 0, (local / CONFIG).stat().st_size), (WEIGHTS, 0, 8)]
    assert reader.streams == []

    reader = RecordingReader(parse_remote(s3.put_adapter(local)))
    with pytest.raises(PoolExhaustedError, match="largest worker pool holds 100"):
        inspect_remote_adapter(reader.remote, TINY, limits=LIMITS, reader=reader, max_bytes=100)
    assert reader.streams == []

    small = InspectionLimits(max_config_bytes=64)
    reader = RecordingReader(parse_remote(s3.put_adapter(local)))
    with pytest.raises(InvalidAdapterError, match="at most 64 are accepted"):
        inspect_remote_adapter(reader.remote, TINY, limits=small, reader=reader)
    assert reader.ranges == [] and reader.streams == []

    capped = InspectionLimits(max_lora_rank=2)
    with pytest.raises(InvalidAdapterError, match="largest LoRA rank 2"):
        inspect_remote_adapter(reader.remote, TINY, limits=capped)


def test_missing_objects_and_buckets_are_refused_like_a_disallowed_source(s3, tmp_path) -> None:
    local = _adapter(tmp_path, "a", seed=3)
    s3.put_object("only-config/adapter_config.json", (local / CONFIG).read_bytes())
    for source in (
        f"s3://{BUCKET}/nothing-here/",
        "s3://no-such-bucket/a/",
        f"s3://{BUCKET}/only-config/",
    ):
        with pytest.raises(RemoteSourceRefusedError) as err:
            inspect_remote_adapter(parse_remote(source), TINY, limits=LIMITS)
        assert str(err.value) == REMOTE_SOURCE_REFUSED


def test_wrong_credentials_are_refused_and_an_unreachable_store_is_unavailable(
    s3, tmp_path, monkeypatch
) -> None:
    remote = parse_remote(s3.put_adapter(_adapter(tmp_path, "a", seed=4)))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "not-a-known-key")
    with pytest.raises(RemoteSourceRefusedError):
        inspect_remote_adapter(remote, TINY, limits=LIMITS)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: refused
    with pytest.raises(ObjectStoreError) as err:
        inspect_remote_adapter(remote, TINY, limits=LIMITS)
    assert err.value.status_code_name == "UNAVAILABLE" and "AWS_ENDPOINT_URL" in str(err.value)


# -- the worker's cache ----------------------------------------------------------------------


class Counts(CacheMetrics):
    """Cache callbacks that count."""

    def __init__(self) -> None:
        super().__init__()
        self.hits = self.misses = self.downloads = self.evictions = self.bytes = 0
        self.failures: list[str] = []
        self.on_hit = lambda: self._add("hits")
        self.on_miss = lambda: self._add("misses")
        self.on_download = lambda s: self._add("downloads")
        self.on_evict = lambda: self._add("evictions")
        self.on_bytes = lambda n: self._add("bytes", n)
        self.on_failure = self.failures.append
        self._lock = threading.Lock()

    def _add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)


def _registered(s3, tmp_path: Path, name: str, seed: int) -> tuple[Path, str, str]:
    """An adapter uploaded and inspected: its local copy, source URL and sha256."""
    local = _adapter(tmp_path, name, seed=seed)
    source = s3.put_adapter(local)
    sha = inspect_remote_adapter(parse_remote(source), TINY, limits=LIMITS).sha256
    return local, source, sha


def _disk(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name != ".lock")


def test_a_download_is_verified_cached_and_then_hit(s3, tmp_path) -> None:
    local, source, sha = _registered(s3, tmp_path, "a", seed=5)
    counts = Counts()
    cache = AdapterCache(tmp_path / "cache", 1 << 20, LIMITS, counts)
    with cache.pinned(parse_remote(source), sha) as path:
        weights = load_lora_weights(path, TINY, adapter_id="a", version=1, expected_sha256=sha)
    want = load_lora_weights(local, TINY, adapter_id="a", version=1)
    for key, module in want.modules.items():
        assert torch.equal(weights.modules[key].lora_a, module.lora_a)
        assert torch.equal(weights.modules[key].lora_b, module.lora_b)
    with cache.pinned(parse_remote(source), sha):
        pass
    size = sum((local / n).stat().st_size for n in (CONFIG, WEIGHTS))
    assert (counts.misses, counts.hits, counts.downloads, counts.bytes) == (1, 1, 1, size)
    assert _disk(tmp_path / "cache") == [sha] and cache.size_bytes == size
    cache.close()
    again = AdapterCache(tmp_path / "cache", 1 << 20, LIMITS)  # a restart keeps its entries
    assert again.entries() == [sha] and again.size_bytes == size
    with pytest.raises(ConfigError, match="in use by another worker"):
        AdapterCache(tmp_path / "cache", 1 << 20, LIMITS)
    again.close()


def test_the_cache_keeps_its_byte_bound_least_recently_used_out_first(s3, tmp_path) -> None:
    adapters = [_registered(s3, tmp_path, f"a{i}", seed=10 + i) for i in range(3)]
    size = sum((adapters[0][0] / n).stat().st_size for n in (CONFIG, WEIGHTS))
    counts = Counts()
    cache = AdapterCache(tmp_path / "cache", 2 * size + size // 2, LIMITS, counts)
    (_, s0, h0), (_, s1, h1), (_, s2, h2) = adapters
    for source, sha in ((s0, h0), (s1, h1), (s0, h0)):  # a0 used last
        with cache.pinned(parse_remote(source), sha):
            pass
    with cache.pinned(parse_remote(s2), h2):
        pass
    assert cache.entries() == [h0, h2]  # a1, least recently used, left
    assert _disk(tmp_path / "cache") == sorted([h0, h2])
    assert cache.size_bytes == 2 * size <= cache.max_bytes and counts.evictions == 1
    # an entry being read is never removed: pinned a0 and a2 both stay while a1 comes in
    with cache.pinned(parse_remote(s0), h0), cache.pinned(parse_remote(s2), h2):
        with cache.pinned(parse_remote(s1), h1) as path:
            assert (path / WEIGHTS).is_file() and cache.size_bytes == 3 * size
    assert cache.size_bytes <= cache.max_bytes and len(cache.entries()) == 2
    # an adapter larger than the whole cache is refused, not downloaded
    tiny = AdapterCache(tmp_path / "tiny", size - 1, LIMITS, counts)
    with pytest.raises(DownloadError, match="more than this worker's whole adapter cache"):
        with tiny.pinned(parse_remote(s0), h0):
            pass
    assert counts.failures == ["too_large"] and _disk(tmp_path / "tiny") == []


def test_concurrent_loads_share_one_download(s3, tmp_path) -> None:
    _, source, sha = _registered(s3, tmp_path, "a", seed=20)
    counts = Counts()
    readers: list[RecordingReader] = []

    def slow(remote):
        readers.append(RecordingReader(remote, delay_s=0.3))
        return readers[-1]

    cache = AdapterCache(tmp_path / "cache", 1 << 20, LIMITS, counts, reader_factory=slow)
    paths: list[Path] = []
    barrier = threading.Barrier(8)

    def load() -> None:
        barrier.wait()
        with cache.pinned(parse_remote(source), sha) as path:
            paths.append(path)

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(paths) == 8 and len(set(paths)) == 1
    assert counts.downloads == 1 and len(readers) == 1 and readers[0].streams == [WEIGHTS]
    assert counts.misses == 8 and counts.hits == 0


def test_a_partial_download_never_becomes_an_entry(s3, tmp_path) -> None:
    _, source, sha = _registered(s3, tmp_path, "a", seed=21)
    counts = Counts()
    cut = AdapterCache(
        tmp_path / "cache",
        1 << 20,
        LIMITS,
        counts,
        reader_factory=lambda remote: RecordingReader(remote, cut_after=100),
    )
    for _ in range(2):  # a failure is not remembered: the next load tries again
        with pytest.raises(DownloadError, match="reset mid-read") as err:
            with cut.pinned(parse_remote(source), sha):
                pass
        assert err.value.status_code_name == "FAILED_PRECONDITION"
    assert counts.failures == ["truncated", "truncated"] and counts.downloads == 0
    assert _disk(tmp_path / "cache") == [] and cut.entries() == []
    cut.close()
    # a crash mid-download leaves a temporary directory: the next start removes it (and
    # leaves alone what is not the cache's, should the directory be shared with other files)
    (tmp_path / "cache" / ".tmp-0123-4567").mkdir()
    (tmp_path / "cache" / ".tmp-0123-4567" / WEIGHTS).write_bytes(b"partial")
    (tmp_path / "cache" / "model.gguf").write_bytes(b"not an entry")
    assert _disk(tmp_path / "cache") == [".tmp-0123-4567", "model.gguf"]
    restarted = AdapterCache(tmp_path / "cache", 1 << 20, LIMITS)
    assert _disk(tmp_path / "cache") == ["model.gguf"] and restarted.entries() == []
    restarted.close()


def _worker(tmp_path: Path, allow: str) -> SimpleNamespace:
    """What :meth:`WorkerService._load_adapter` reads of its worker, with a real cache."""
    metrics = WorkerMetrics()
    config = SimpleNamespace(
        adapter_roots=(),
        adapter_source_allow=SourceAllowList.parse([allow]).prefixes,
        inspection_limits=InspectionLimits(max_lora_rank=None),
    )
    worker = SimpleNamespace(
        spec=TINY,
        dtype=torch.float32,
        confinement=None,
        metrics=metrics,
        config=config,
        source_allow=SourceAllowList(config.adapter_source_allow),
    )
    worker.adapter_cache = WorkerService._open_adapter_cache(
        worker,
        SimpleNamespace(
            cache_dir=str(tmp_path),
            adapter_cache_dir=str(tmp_path / "cache"),
            adapter_cache_bytes=1 << 20,
            worker_id="w",
            inspection_limits=config.inspection_limits,
        ),
    )
    worker._load_remote = lambda ref, what: WorkerService._load_remote(worker, ref, what)
    return worker


def _sample(worker: SimpleNamespace, name: str, **labels: str) -> float:
    return worker.metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_a_tampered_object_fails_its_load_with_failed_precondition_and_is_never_cached(
    s3, tmp_path
) -> None:
    local, source, sha = _registered(s3, tmp_path, "a", seed=22)
    worker = _worker(tmp_path, f"s3://{BUCKET}/")
    weights = bytearray((local / WEIGHTS).read_bytes())
    weights[-4:] = b"\x00\x00\x80\x3f"  # one value changed; same size, still a valid file
    s3.put_object(parse_remote(source).key(WEIGHTS), bytes(weights))
    for _ in range(2):
        with pytest.raises(AdapterSourceError) as err:
            WorkerService._load_adapter(worker, AdapterRef("t", 3, source, 0, sha))
        assert err.value.status_code_name == "FAILED_PRECONDITION"
        assert "'t' (v3) can no longer be loaded" in str(err.value)
        assert "changed since registration" in str(err.value)
        assert str(tmp_path) not in str(err.value)
    assert _disk(tmp_path / "cache") == [] and worker.adapter_cache.entries() == []
    failed = "plora_worker_adapter_download_failures_total"
    assert _sample(worker, failed, reason="checksum") == 2
    assert _sample(worker, "plora_worker_adapter_cache_misses_total") == 2

    # the same bytes as registered again load (and are cached)
    s3.put_object(parse_remote(source).key(WEIGHTS), (local / WEIGHTS).read_bytes())
    loaded = WorkerService._load_adapter(worker, AdapterRef("t", 3, source, 0, sha))
    assert loaded.sha256 == sha and worker.adapter_cache.entries() == [sha]
    assert _sample(worker, "plora_worker_adapter_download_seconds_count") == 1
    assert _sample(worker, "plora_worker_adapter_download_bytes_total") > 0


def test_a_worker_refuses_a_remote_source_it_does_not_allow(s3, tmp_path) -> None:
    _, source, sha = _registered(s3, tmp_path, "a", seed=23)
    worker = _worker(tmp_path, "s3://some-other-bucket/")
    with pytest.raises(AdapterSourceError, match="not one this worker may read") as err:
        WorkerService._load_adapter(worker, AdapterRef("r", 1, source, 0, sha))
    assert BUCKET not in str(err.value)
    assert _sample(worker, "plora_worker_adapter_source_refused_total") == 1
    assert _disk(tmp_path / "cache") == []


# -- hf:// against a local Hub cache, offline -------------------------------------------------


def _hub_cache(root: Path, repo: str, files: dict[str, bytes], commit: str, ref: str) -> None:
    """Lay ``files`` out as huggingface_hub's cache does: content-addressed blobs,
    ``snapshots/<commit>/`` of relative symlinks to them, ``refs/<ref>`` holding the commit."""
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "blobs").mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / ref).write_text(commit)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (base / "blobs" / blob).write_bytes(data)
        link = base / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(base / "blobs" / blob, link.parent))


@pytest.fixture()
def hub(tmp_path, monkeypatch) -> SimpleNamespace:
    """A Hub cache holding ``acme/tiny-lora`` (commit ``c0ffee...``, branch ``main``, with
    the adapter at the top and a second one under ``v2/``), read offline."""
    from huggingface_hub import constants

    first = _adapter(tmp_path, "first", seed=30)
    second = _adapter(tmp_path, "second", seed=31)
    files = {name: (first / name).read_bytes() for name in (CONFIG, WEIGHTS)}
    files |= {f"v2/{name}": (second / name).read_bytes() for name in (CONFIG, WEIGHTS)}
    commit = "c0ffee" + "0" * 34
    cache = tmp_path / "hub"
    _hub_cache(cache, "acme/tiny-lora", files, commit, "main")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return SimpleNamespace(first=first, second=second, commit=commit)


def test_hf_sources_are_read_from_the_offline_hub_cache(hub, tmp_path) -> None:
    for source, local in (
        ("hf://acme/tiny-lora", hub.first),
        ("hf://acme/tiny-lora@main", hub.first),
        (f"hf://acme/tiny-lora@{hub.commit}", hub.first),
        ("hf://acme/tiny-lora/v2", hub.second),
    ):
        remote = parse_remote(source)
        assert HubReader(remote).offline
        assert inspect_remote_adapter(remote, TINY, limits=LIMITS) == inspect_adapter(local, TINY)
    for missing in ("hf://acme/other", "hf://acme/tiny-lora@v9", "hf://acme/tiny-lora/v3"):
        with pytest.raises(RemoteSourceRefusedError):
            inspect_remote_adapter(parse_remote(missing), TINY, limits=LIMITS)


def test_an_hf_adapter_downloads_into_the_cache_and_loads(hub, tmp_path) -> None:
    worker = _worker(tmp_path, "hf://acme/")
    sha = inspect_adapter(hub.second, TINY).sha256
    loaded = WorkerService._load_adapter(
        worker, AdapterRef("h", 1, "hf://acme/tiny-lora/v2", 0, sha)
    )
    want = load_lora_weights(hub.second, TINY, adapter_id="h", version=1)
    assert loaded.sha256 == sha and worker.adapter_cache.entries() == [sha]
    for key, module in want.modules.items():
        assert torch.equal(loaded.modules[key].lora_b, module.lora_b)
    with pytest.raises(AdapterSourceError, match="changed since registration"):
        other = inspect_adapter(hub.first, TINY).sha256  # a record whose digest is not v2's
        WorkerService._load_adapter(worker, AdapterRef("h", 2, "hf://acme/tiny-lora/v2", 0, other))
    assert worker.adapter_cache.entries() == [sha]
