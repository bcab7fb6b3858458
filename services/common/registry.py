"""The Redis metadata registry: adapters, workers (heartbeats with TTL), placement, forecast.

Key layout (prefix ``plora`` by default; every value is JSON unless noted):

* ``{p}:adapters`` - set of registered adapter ids.
* ``{p}:adapter:{id}`` - :class:`AdapterRecord`.
* ``{p}:adapter_version:{id}`` - integer counter; never reset, so a re-registered id (even after
  a delete) always gets a higher version and stale copies are recognisable in every tier.
* ``{p}:workers`` - set of worker ids that have ever registered (pruned on graceful stop).
* ``{p}:worker:{id}`` - :class:`WorkerRecord` (last heartbeat, kept without TTL).
* ``{p}:worker_alive:{id}`` - liveness key with the heartbeat TTL: healthy while it exists.
* ``{p}:worker_lease:{id}`` - :class:`WorkerLease`: which process holds the id (TTL; renewed
  while it lives, released on a clean stop; :meth:`Registry.claim_worker_id`).
* ``{p}:model`` - the served base model's :class:`~services.common.types.ModelSpec`.
* ``{p}:placement`` - ``{adapter_id: [worker_id, ...]}`` from the predictor.
* ``{p}:gateway_starts`` - integer counter: gateways started (:meth:`Registry.next_gateway_index`).
* ``{p}:forecast`` - ``{"made_unix", "horizon_seconds", "model", "expected": {id: count}}``.
* ``{p}:predictor_state`` - bytes: the predictor's model and recent counts.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis

from services.common.errors import AdapterNotFoundError, ConfigError, PLoRAError, quoted
from services.common.types import ModelSpec

logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

#: redis-py errors meaning Redis cannot be reached now (refused, reset, timed out; its
#: ``BusyLoadingError`` and ``AuthenticationError`` are ``ConnectionError`` s): a later call may
#: succeed, so a client gets UNAVAILABLE. Other Redis errors stay INTERNAL (a bug, not an outage).
UNREACHABLE_ERRORS: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)

#: While Redis stays unreachable, the outage is logged again at most this often (seconds).
OUTAGE_LOG_EVERY_S = 30.0


class RegistryUnavailableError(PLoRAError):
    """Redis cannot be reached (UNAVAILABLE)."""

    status_code_name = "UNAVAILABLE"


def redact_url(url: str) -> str:
    """``url`` without its password (``redis://user:***@host:6379/0``), for messages and logs."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    if not password:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def url_without_password(url: str) -> str:
    """``url`` with its user and password removed (``redis://host:6379/0``), to store where
    others may read it (``plora up``'s state file); unchanged when it has none or does not
    parse."""
    try:
        parts = urlsplit(url)
        if parts.password is None and parts.username is None:
            return url
    except ValueError:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _text(raw: bytes | str) -> str:
    """A key or member Redis returned, as text: the clients are made without
    ``decode_responses``, so replies are bytes (redis-py types them ``bytes | str``)."""
    return cast(bytes, raw).decode()


def _location(client: redis.Redis) -> str:
    """Where ``client`` connects, as a URL without credentials (for messages)."""
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    db = kwargs.get("db", 0)
    if "path" in kwargs:
        return f"unix://{kwargs['path']}?db={db}"
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    return f"{scheme}://{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}/{db}"


class _Outage:
    """Turns redis-py's unreachable errors into :class:`RegistryUnavailableError` and logs an
    outage as a few lines (when it starts, every :data:`OUTAGE_LOG_EVERY_S` while it lasts,
    when it ends) however many calls fail meanwhile. Thread-safe."""

    def __init__(self, location: str) -> None:
        self.location = location
        self._lock = threading.Lock()
        self._failures = 0  # calls failed since the last success
        self._since = 0.0  # monotonic time of the first of them
        self._logged = 0.0  # monotonic time of the last warning

    def failed(self, exc: Exception) -> RegistryUnavailableError:
        """Count a failed call; the error to raise in its place."""
        reason = str(exc).rstrip(".") or type(exc).__name__
        message = (
            f"the adapter registry (Redis at {self.location}) is unreachable: {reason}; "
            "check that Redis is running"
        )
        now = time.monotonic()
        with self._lock:
            self._failures += 1
            if self._failures == 1:
                self._since = self._logged = now
                logger.warning("%s", message)
            elif now - self._logged >= OUTAGE_LOG_EVERY_S:
                self._logged = now
                logger.warning(
                    "%s (still: %d failed calls in %.0fs)",
                    message,
                    self._failures,
                    now - self._since,
                )
        return RegistryUnavailableError(message)

    def succeeded(self) -> None:
        """Note a successful call: logs the end of an outage."""
        if not self._failures:  # the common case: no lock
            return
        with self._lock:
            if self._failures:
                logger.info(
                    "the adapter registry (Redis at %s) is reachable again after %.0fs "
                    "(%d failed calls)",
                    self.location,
                    time.monotonic() - self._since,
                    self._failures,
                )
                self._failures = 0


def _guarded(
    method: Callable[Concatenate[Registry, P], T],
) -> Callable[Concatenate[Registry, P], T]:
    """Decorate a :class:`Registry` method so an unreachable Redis raises
    :class:`RegistryUnavailableError` (logged as an outage) instead of a redis-py error."""

    @functools.wraps(method)
    def wrapper(self: Registry, /, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            result = method(self, *args, **kwargs)
        except UNREACHABLE_ERRORS as exc:
            raise self._outage.failed(exc) from exc
        self._outage.succeeded()
        return result

    return wrapper


@dataclass
class AdapterRecord:
    """Registry entry of one adapter version (mirrors ``plora.v1.AdapterInfo``).

    Attributes:
        adapter_id: Registry id.
        source: Directory in PEFT layout.
        tenant_id: Owner; empty = shared.
        rank: Largest LoRA rank over the modules.
        alpha: ``lora_alpha``.
        target_modules: Projection names present.
        size_bytes: Weights' bytes in the serving dtype.
        sha256: sha256 of ``adapter_model.safetensors``.
        version: Registry version (monotonic per id).
        use_rslora: rsLoRA scaling.
        created_unix_ms: Registration time.
        num_modules: (layer, projection) modules carrying LoRA.
    """

    adapter_id: str
    source: str
    tenant_id: str = ""
    rank: int = 0
    alpha: float = 0.0
    target_modules: list[str] = field(default_factory=list)
    size_bytes: int = 0
    sha256: str = ""
    version: int = 0
    use_rslora: bool = False
    created_unix_ms: int = 0
    num_modules: int = 0

    @classmethod
    def from_json(cls, raw: str | bytes) -> AdapterRecord:
        data = json.loads(raw)
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class WorkerRecord:
    """A worker's last heartbeat.

    Attributes:
        worker_id: Stable id (``worker-0``).
        address: ``host:port`` of its gRPC server, as reachable by the gateway.
        metrics_url: Its Prometheus endpoint.
        device: ``cpu`` / ``cuda:0``.
        heartbeat_unix: Wall-clock time of the heartbeat.
        queue_length: Requests waiting to join the batch.
        running: Requests in the running batch.
        resident: Adapter ids resident in the device pool.
        loading: Adapter ids with a load into the pool in flight (demand or prefetch; not
            those waiting for room).
        room_bytes: Pool bytes a new load could take without waiting for a lease to drop (free
            plus unleased resident adapters); -1 = not reported.
        host_cached: Adapter ids whose weights are in its host cache (a load reads host
            memory, not the source).
        pool: Pool statistics (keys of ``plora.v1.PoolStats``).
        prefill_s: Recent mean prefill time per request, seconds
            (``services.worker.engine.ServiceEstimates``; 0 = not measured yet).
        cold_wait_s: Recent mean adapter wait of a cold request, seconds (0 = none yet).
        source_load_s: Recent mean time of a load from the source tier, seconds (0 = none
            yet).
        healthy: Filled in by :meth:`Registry.list_workers` from the liveness key.
    """

    worker_id: str
    address: str
    metrics_url: str = ""
    device: str = "cpu"
    heartbeat_unix: float = 0.0
    queue_length: int = 0
    running: int = 0
    resident: list[str] = field(default_factory=list)
    loading: list[str] = field(default_factory=list)
    room_bytes: int = -1
    host_cached: list[str] = field(default_factory=list)
    pool: dict[str, Any] = field(default_factory=dict)
    prefill_s: float = 0.0
    cold_wait_s: float = 0.0
    source_load_s: float = 0.0
    healthy: bool = False

    @property
    def heartbeat_age_seconds(self) -> float:
        """Seconds since the last heartbeat (wall clock)."""
        return max(0.0, time.time() - self.heartbeat_unix)

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerRecord:
        data = json.loads(raw)
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in data.items() if k in names})


def _read_text(path: str) -> str:
    """A small /proc file's text, stripped; empty when it cannot be read (off Linux)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of
    ``/proc/<pid>/stat``): with the pid, it names one process, since a pid is reused only by
    a later process. None when no such process is visible here (or off Linux)."""
    stat = _read_text(f"/proc/{pid}/stat")
    if not stat:
        return None
    try:  # the command name (field 2) is in parentheses and may hold spaces or ')'
        return int(stat.rpartition(")")[2].split()[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    """Who a process is, as far as another process can check it.

    Attributes:
        hostname: The host (the pod name under Kubernetes, the container id under Docker).
        pid: Process id, in its PID namespace.
        boot_id: The kernel's boot id (``/proc/sys/kernel/random/boot_id``; shared by every
            container on a host); empty off Linux.
        pid_namespace: The PID namespace (``pid:[4026531836]``); empty off Linux.
        start_ticks: When the process started (:func:`process_start_ticks`); 0 = unknown.
    """

    hostname: str
    pid: int
    boot_id: str = ""
    pid_namespace: str = ""
    start_ticks: int = 0

    @classmethod
    def current(cls) -> ProcessIdentity:
        """This process's identity."""
        try:
            namespace = os.readlink("/proc/self/ns/pid")
        except OSError:
            namespace = ""
        pid = os.getpid()
        return cls(
            hostname=socket.gethostname(),
            pid=pid,
            boot_id=_read_text("/proc/sys/kernel/random/boot_id"),
            pid_namespace=namespace,
            start_ticks=process_start_ticks(pid) or 0,
        )

    def ended(self) -> bool:
        """Whether this process provably no longer runs, as seen from a process that
        :meth:`sees` it: its pid names no process, or one started at another time. A process
        whose start cannot be read (``/proc`` mounted ``hidepid``) counts as running unless
        signal 0 finds no such pid."""
        if self.pid <= 0:
            return False
        ticks = process_start_ticks(self.pid)
        if ticks is not None:
            return ticks != self.start_ticks
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # EPERM: a process of another user has that pid
            return False
        return False

    def sees(self, other: ProcessIdentity) -> bool:
        """Whether ``other``'s process, if it still ran, would be visible to this one: the
        same kernel boot and PID namespace (the same host, or the same container)."""
        return bool(
            self.boot_id
            and self.pid_namespace
            and other.start_ticks
            and (self.boot_id, self.pid_namespace) == (other.boot_id, other.pid_namespace)
        )


@dataclass
class WorkerLease:
    """The claim of one process on a worker id (``{p}:worker_lease:{id}``).

    Attributes:
        worker_id: The id claimed.
        token: Random, one per claim: only the holder renews or releases the lease.
        address: ``host:port`` the holder advertises (the port is 0 until its server binds).
        holder: The holding process.
        claimed_unix: Wall-clock time of the claim.
        renewed_unix: Wall-clock time of the last renewal.
        renewals: Renewals so far; every renewal changes the stored value, which is how a
            claimant sees that the holder lives.
    """

    worker_id: str
    token: str
    address: str
    holder: ProcessIdentity
    claimed_unix: float = 0.0
    renewed_unix: float = 0.0
    renewals: int = 0

    def to_json(self) -> str:
        """The stored value."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, worker_id: str, raw: str | bytes) -> WorkerLease:
        """A stored lease; one that does not parse reads as an unknown holder (never
        provably gone)."""
        try:
            data = json.loads(raw)
            holder = ProcessIdentity(**data.pop("holder"))
            names = cls.__dataclass_fields__.keys()
            return cls(holder=holder, **{k: v for k, v in data.items() if k in names})
        except (ValueError, TypeError, KeyError, AttributeError):
            return cls(worker_id, "", "?", ProcessIdentity("?", 0))

    def describe(self) -> str:
        """The holder for a message: ``pid 12 on host 'h', serving at 10.0.0.5:50061 (lease
        renewed 0.4 s ago)``."""
        age = max(0.0, time.time() - self.renewed_unix)
        return (
            f"pid {self.holder.pid} on host {self.holder.hostname!r}, serving at "
            f"{self.address} (lease renewed {age:.1f} s ago)"
        )


class WorkerIdInUseError(PLoRAError):
    """Another live process holds the worker id this one claims (ALREADY_EXISTS)."""

    status_code_name = "ALREADY_EXISTS"


def connect(url: str, timeout: float = 5.0) -> redis.Redis:
    """Open a Redis client and check it answers.

    Args:
        url: ``redis://host:port/db`` or ``unix:///path/to/socket``.
        timeout: Socket connect/read timeout in seconds.

    Raises:
        RegistryUnavailableError: Redis does not answer PING, with the URL and what to do.
        ConfigError: the URL is malformed.
    """
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=timeout, socket_timeout=timeout, health_check_interval=30
        )
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL {redact_url(url)!r}: {exc}") from exc
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RegistryUnavailableError(
            f"cannot reach Redis at {redact_url(url)} ({exc}); start Redis or set "
            "PLORA_REDIS_URL / --redis-url to a reachable server"
        ) from exc
    return client


#: KEYS = (the record's key, the id index); ARGV = (record JSON, its version, adapter id).
#: Writes the record unless the stored one has a newer version; 1 if written, else 0.
_PUT_IF_NEWER = """
local stored = redis.call('GET', KEYS[1])
if stored then
  local ok, rec = pcall(cjson.decode, stored)
  if ok and type(rec) == 'table' and tonumber(rec['version'])
      and tonumber(rec['version']) > tonumber(ARGV[2]) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[3])
return 1
"""

#: KEYS = (a lease key,); ARGV = (the holder's token, the new value, TTL in ms). Renews the
#: lease if the token holds it (1), claims it again if it is gone (2: it expired while the holder
#: could not renew, or Redis lost it), or leaves it to the process that holds it now (0).
_RENEW_LEASE = """
local stored = redis.call('GET', KEYS[1])
if stored then
  local ok, rec = pcall(cjson.decode, stored)
  if not (ok and type(rec) == 'table' and rec['token'] == ARGV[1]) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
if stored then
  return 1
end
return 2
"""

#: KEYS = (a lease key,); ARGV = (the holder's token,). Deletes the lease if the token holds it.
_RELEASE_LEASE = """
local stored = redis.call('GET', KEYS[1])
if not stored then
  return 0
end
local ok, rec = pcall(cjson.decode, stored)
if ok and type(rec) == 'table' and rec['token'] == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

#: KEYS = (a lease key,); ARGV = (the value expected, the new value, TTL in ms). Replaces the
#: lease only if it still holds the value expected (1), else leaves it (0).
_REPLACE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
  return 1
end
return 0
"""

#: Seconds between two looks at a held lease while a claim waits for it to change or expire.
CLAIM_POLL_S = 0.05


class Registry:
    """Typed access to the keys above. Thread-safe (redis-py pools connections).

    Every method raises :class:`RegistryUnavailableError` (UNAVAILABLE, naming the Redis URL
    without its password) when Redis cannot be reached, and logs the outage once rather than
    per call; the next call tries again (redis-py reconnects), so callers recover by
    themselves when Redis is back.

    Args:
        client: An open client (:func:`connect`).
        prefix: Prefix of every key.
    """

    def __init__(self, client: redis.Redis, prefix: str = "plora") -> None:
        self.client = client
        self.prefix = prefix
        self._outage = _Outage(_location(client))
        self._put_if_newer = client.register_script(_PUT_IF_NEWER)
        self._renew_lease = client.register_script(_RENEW_LEASE)
        self._release_lease = client.register_script(_RELEASE_LEASE)
        self._replace_lease = client.register_script(_REPLACE_LEASE)

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    @_guarded
    def ping(self) -> None:
        """Check that Redis answers (RegistryUnavailableError if not)."""
        self.client.ping()

    # -- adapters -------------------------------------------------------------------------

    @_guarded
    def next_adapter_version(self, adapter_id: str) -> int:
        """Reserve the next version number of ``adapter_id`` (monotonic, never reused)."""
        return int(self.client.incr(self._k("adapter_version", adapter_id)))

    @_guarded
    def put_adapter(self, record: AdapterRecord) -> bool:
        """Write (or replace) an adapter record and index it, atomically, unless the stored
        record has a newer version: of two registrations of one id racing, the one that
        reserved the later version wins whichever writes last (workers that saw it would
        refuse the older one as superseded).

        Returns:
            Whether ``record`` was written (False: a newer version is registered).
        """
        written = self._put_if_newer(
            keys=[self._k("adapter", record.adapter_id), self._k("adapters")],
            args=[json.dumps(asdict(record)), record.version, record.adapter_id],
        )
        return bool(written)

    @_guarded
    def get_adapter(self, adapter_id: str) -> AdapterRecord:
        """Return the current record.

        Raises:
            AdapterNotFoundError: no adapter with that id is registered.
        """
        raw = self.client.get(self._k("adapter", adapter_id))
        if raw is None:
            raise AdapterNotFoundError(
                f"adapter {quoted(adapter_id)} is not registered; register it with RegisterAdapter "
                "(plora adapters register) or check ListAdapters"
            )
        return AdapterRecord.from_json(raw)

    @_guarded
    def list_adapters(self) -> list[AdapterRecord]:
        """Every registered adapter, sorted by id."""
        ids = sorted(_text(x) for x in self.client.smembers(self._k("adapters")))
        if not ids:
            return []
        raws = self.client.mget([self._k("adapter", i) for i in ids])
        return [AdapterRecord.from_json(r) for r in raws if r is not None]

    @_guarded
    def delete_adapter(self, adapter_id: str) -> AdapterRecord:
        """Remove an adapter (its version counter stays).

        Raises:
            AdapterNotFoundError: not registered.
        """
        record = self.get_adapter(adapter_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self._k("adapter", adapter_id))
        pipe.srem(self._k("adapters"), adapter_id)
        pipe.hdel(self._k("placement"), adapter_id)
        pipe.execute()
        return record

    # -- workers --------------------------------------------------------------------------

    @_guarded
    def heartbeat(
        self,
        record: WorkerRecord,
        ttl_seconds: float,
        model: tuple[ModelSpec, str] | None = None,
    ) -> bool:
        """Publish a worker's status and refresh its liveness key (TTL), in one round trip.

        Args:
            record: The worker's status.
            ttl_seconds: Lifetime of the liveness key.
            model: ``(spec, serving_dtype)``: the served base model's shape and the workers'
                serving dtype (``float32``), published with every heartbeat (a Redis that came
                back empty learns it at the next one). The gateway validates adapters against
                the shape and sizes them in that dtype (:meth:`get_model_spec`).

        Returns:
            Whether the registry held the worker's record before this heartbeat (False at the
            first one, and after Redis lost its data: nothing else removes a live worker's
            record).
        """
        record.heartbeat_unix = time.time()
        data = asdict(record)
        data.pop("healthy", None)
        pipe = self.client.pipeline(transaction=True)
        pipe.exists(self._k("worker", record.worker_id))
        pipe.set(self._k("worker", record.worker_id), json.dumps(data))
        pipe.set(self._k("worker_alive", record.worker_id), "1", px=int(ttl_seconds * 1000))
        pipe.sadd(self._k("workers"), record.worker_id)
        if model is not None:
            spec, serving_dtype = model
            pipe.set(
                self._k("model"), json.dumps({**spec.to_dict(), "serving_dtype": serving_dtype})
            )
        return bool(pipe.execute()[0])

    @_guarded
    def deregister_worker(self, worker_id: str) -> None:
        """Remove a worker on graceful stop."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self._k("worker", worker_id), self._k("worker_alive", worker_id))
        pipe.srem(self._k("workers"), worker_id)
        pipe.execute()

    @_guarded
    def list_workers(self) -> list[WorkerRecord]:
        """Every known worker with ``healthy`` set from its liveness key, sorted by id. A
        worker that is not healthy lists no ``resident`` adapters: its last heartbeat's list
        is no longer served from (a dead worker's pool is gone, a restarted one starts empty),
        so status, ``GetAdapter`` and the per-worker gauges never show it as resident."""
        ids = sorted(_text(x) for x in self.client.smembers(self._k("workers")))
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for i in ids:
            pipe.get(self._k("worker", i))
            pipe.exists(self._k("worker_alive", i))
        out = pipe.execute()
        workers = []
        for n, _ in enumerate(ids):
            raw, alive = out[2 * n], out[2 * n + 1]
            if raw is None:
                continue
            rec = WorkerRecord.from_json(raw)
            rec.healthy = bool(alive)
            if not rec.healthy:
                rec.resident = []
            workers.append(rec)
        return workers

    # -- worker ids -----------------------------------------------------------------------

    @_guarded
    def claim_worker_id(
        self,
        worker_id: str,
        address: str,
        ttl_seconds: float,
        renew_every_s: float,
        identity: ProcessIdentity | None = None,
    ) -> WorkerLease:
        """Claim ``worker_id`` for this process, atomically (``SET NX PX``), before it serves.

        The rule, so that no two live processes ever serve under one id:

        * A free id (no lease) is claimed at once.
        * A held lease is watched: its holder renews it every ``renew_every_s``
          (:class:`WorkerLeaseKeeper`), each renewal changing the stored value. A change seen
          proves a live holder, and the claim is refused, naming it (within about
          ``renew_every_s``). A lease that expires unrenewed (its holder died, froze or lost
          Redis ``ttl_seconds`` ago) is claimed; a frozen holder that wakes finds its lease
          taken and stops (:meth:`renew_worker_lease`). So an id comes back to a restarted
          instance within ``ttl_seconds`` of its old process's last renewal.
        * Sooner when the old holder is provably gone: a lease whose holder ran in the same
          kernel boot and PID namespace as this process (the same host, or the same
          container) and whose pid no longer names that process (none, or one started at
          another time) is taken over at once (``plora up`` restarting a worker). A restarted
          container or a re-created StatefulSet pod has a new PID namespace and waits out the
          old lease (``ttl_seconds``, 5 s by default).

        Args:
            worker_id: The id.
            address: ``host:port`` this process advertises (port 0 before it binds), shown to
                a process refused the id.
            ttl_seconds: Lifetime of the lease unless renewed (the heartbeat's TTL).
            renew_every_s: How often the holder renews (the heartbeat interval).
            identity: This process (default :meth:`ProcessIdentity.current`).

        Returns:
            The lease: renew it every ``renew_every_s`` and release it on a clean stop.

        Raises:
            WorkerIdInUseError: a live process holds the id; the message names it.
            RegistryUnavailableError: Redis cannot be reached.
        """
        me = identity or ProcessIdentity.current()
        key = self._k("worker_lease", worker_id)
        ttl_ms = max(1, int(ttl_seconds * 1000))
        token = secrets.token_hex(16)
        watched: bytes | None = None  # the holder's value being watched for a renewal
        watched_since = 0.0
        while True:
            now = time.time()
            lease = WorkerLease(worker_id, token, address, me, now, now)
            if self.client.set(key, lease.to_json(), nx=True, px=ttl_ms):
                return lease
            raw = cast("bytes | None", self.client.get(key))
            if raw is None:  # expired or released just now: claim it
                continue
            holder = WorkerLease.from_json(worker_id, raw)
            if watched is not None and raw != watched:  # renewed, or claimed anew: live
                raise WorkerIdInUseError(self._in_use(worker_id, holder))
            if watched is None:
                if me.sees(holder.holder) and holder.holder.ended():
                    if self._replace_lease(keys=[key], args=[raw, lease.to_json(), ttl_ms]):
                        logger.info(
                            "worker id %s: took it over from pid %d on this host, which is gone",
                            worker_id,
                            holder.holder.pid,
                        )
                        return lease
                    continue  # it changed meanwhile: look again
                watched, watched_since = raw, time.monotonic()
                logger.info(
                    "worker id %s is held by %s; waiting up to %.1f s to see it renewed "
                    "(refused) or expire (claimed)",
                    worker_id,
                    holder.describe(),
                    ttl_seconds + renew_every_s,
                )
            elif time.monotonic() - watched_since > ttl_seconds + renew_every_s:
                # neither renewed nor expired: a lease without a TTL, not one of ours
                raise WorkerIdInUseError(self._in_use(worker_id, holder))
            time.sleep(CLAIM_POLL_S)

    @staticmethod
    def _in_use(worker_id: str, holder: WorkerLease) -> str:
        return (
            f"worker id {worker_id!r} is in use by a live worker: {holder.describe()}; stop "
            "that worker, or give this one another --worker-id / PLORA_WORKER_ID (leave it "
            "unset for a unique one)"
        )

    @_guarded
    def renew_worker_lease(self, lease: WorkerLease, ttl_seconds: float) -> bool:
        """Renew a lease this process claimed (its ``renewals`` and ``renewed_unix`` move on;
        its ``address`` is stored as it is now); a lease that expired or that Redis lost is
        claimed again if nobody else took the id meanwhile.

        Returns:
            False when another process holds the id now (this one was frozen or cut off from
            Redis past the lease's TTL and was taken over): it must stop serving under it.
        """
        lease.renewals += 1
        lease.renewed_unix = time.time()
        held = self._renew_lease(
            keys=[self._k("worker_lease", lease.worker_id)],
            args=[lease.token, lease.to_json(), max(1, int(ttl_seconds * 1000))],
        )
        if held == 2:
            logger.warning(
                "worker id %s: its lease was gone (expired or lost by Redis) and is claimed again",
                lease.worker_id,
            )
        return bool(held)

    @_guarded
    def release_worker_lease(self, lease: WorkerLease) -> bool:
        """Give the id up on a clean stop (another process may claim it at once).

        Returns:
            Whether the lease was this process's to release.
        """
        key = self._k("worker_lease", lease.worker_id)
        return bool(self._release_lease(keys=[key], args=[lease.token]))

    @_guarded
    def get_worker_lease(self, worker_id: str) -> WorkerLease | None:
        """Who holds ``worker_id`` now, or None when nobody does."""
        raw = self.client.get(self._k("worker_lease", worker_id))
        return None if raw is None else WorkerLease.from_json(worker_id, raw)

    # -- model, placement, forecast, predictor state ---------------------------------------

    @_guarded
    def get_model_spec(self) -> tuple[ModelSpec, str] | None:
        """``(spec, serving_dtype)`` of the served base model, or None before any worker started."""
        raw = self.client.get(self._k("model"))
        if raw is None:
            return None
        data = json.loads(raw)
        return ModelSpec.from_dict(data), str(data.get("serving_dtype", "float32"))

    @_guarded
    def next_gateway_index(self) -> int:
        """A number for a gateway that starts: 0 for the first started on this registry, then
        1, 2, ... (never reused). Gateways in front of the same workers start their routing's
        tie-break rotation there (:class:`~services.common.routing.RoutingState`)."""
        return int(self.client.incr(self._k("gateway_starts"))) - 1

    @_guarded
    def note_cold_route(self, adapter_id: str, worker_id: str, ttl_s: float) -> None:
        """Record that a gateway just sent ``adapter_id``, resident nowhere, to ``worker_id``
        (so its load starts there), for ``ttl_s`` seconds: until the worker's heartbeats show
        the load. Other gateways read it with :meth:`cold_route` and join that load instead
        of starting a second copy elsewhere."""
        self.client.set(
            self._k(f"cold_route:{adapter_id}"), worker_id, px=max(1, int(ttl_s * 1000))
        )

    @_guarded
    def cold_route(self, adapter_id: str) -> str | None:
        """The worker a gateway sent ``adapter_id`` to within the last :meth:`note_cold_route`
        lifetime, or None."""
        raw = self.client.get(self._k(f"cold_route:{adapter_id}"))
        return None if raw is None else _text(raw)

    @_guarded
    def set_placement(self, placement: dict[str, list[str]]) -> None:
        """Replace the placement map ``adapter_id -> [worker_id, ...]``."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self._k("placement"))
        if placement:
            pipe.hset(
                self._k("placement"), mapping={k: json.dumps(v) for k, v in placement.items()}
            )
        pipe.execute()

    @_guarded
    def get_placement(self) -> dict[str, list[str]]:
        """The placement map (empty when no predictor has published one)."""
        raw = self.client.hgetall(self._k("placement"))
        return {_text(k): json.loads(v) for k, v in raw.items()}

    @_guarded
    def set_forecast(
        self,
        expected: dict[str, float],
        horizon_seconds: float,
        model: str,
        ttl_seconds: float = 30,
    ) -> None:
        """Publish the latest forecast (expires so a dead predictor's forecast is not used)."""
        payload = {
            "made_unix": time.time(),
            "horizon_seconds": horizon_seconds,
            "model": model,
            "expected": expected,
        }
        self.client.set(self._k("forecast"), json.dumps(payload), px=int(ttl_seconds * 1000))

    @_guarded
    def get_forecast(self) -> dict[str, Any] | None:
        """The latest forecast payload, or None (no predictor, or it stopped publishing)."""
        raw = self.client.get(self._k("forecast"))
        return None if raw is None else json.loads(raw)

    @_guarded
    def save_predictor_state(self, blob: bytes) -> None:
        """Persist the predictor's model and recent counts."""
        self.client.set(self._k("predictor_state"), blob)

    @_guarded
    def load_predictor_state(self) -> bytes | None:
        """The persisted predictor state, or None."""
        return cast("bytes | None", self.client.get(self._k("predictor_state")))


class WorkerLeaseKeeper:
    """Keeps a claimed worker id (:meth:`Registry.claim_worker_id`): renews its lease every
    ``renew_every_s`` in a daemon thread until :meth:`release` or :meth:`stop`.

    While Redis cannot be reached the renewals fail quietly (the registry logs the outage) and
    are tried again; once another process is found holding the id, ``on_lost`` is called once,
    from the keeper's thread, and renewals end: the process must stop serving under the id.

    Args:
        registry: The registry the lease is in.
        lease: The claimed lease.
        ttl_seconds: Lifetime of each renewal.
        renew_every_s: Seconds between renewals (below ``ttl_seconds``).
        on_lost: Called with the holder's lease (or None when it is gone again) when the id
            was taken over.
    """

    def __init__(
        self,
        registry: Registry,
        lease: WorkerLease,
        ttl_seconds: float,
        renew_every_s: float,
        on_lost: Callable[[WorkerLease | None], None],
    ) -> None:
        self.registry = registry
        self.lease = lease
        self.ttl_seconds = ttl_seconds
        self.renew_every_s = renew_every_s
        self.on_lost = on_lost
        self.lost = False
        self._lock = threading.Lock()  # one renewal or release at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-lease", daemon=True)

    def start(self) -> WorkerLeaseKeeper:
        """Start renewing."""
        self._thread.start()
        return self

    def set_address(self, address: str) -> None:
        """Name ``address`` in the lease (once the server bound its port), stored by a renewal
        now (or, while Redis cannot be reached, by the next one)."""
        self.lease.address = address
        try:
            self.renew()
        except RegistryUnavailableError:  # logged by the registry; the thread renews later
            pass

    def renew(self) -> bool:
        """Renew the lease now.

        Returns:
            False when the id was lost (``on_lost`` has been called) or the keeper stopped.

        Raises:
            RegistryUnavailableError: Redis cannot be reached (try again later).
        """
        with self._lock:
            if self._stop.is_set() or self.lost:
                return False
            if self.registry.renew_worker_lease(self.lease, self.ttl_seconds):
                return True
            self.lost = True
            self._stop.set()
        holder = self.registry.get_worker_lease(self.lease.worker_id)
        self.on_lost(holder)
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                self.renew()
            except RegistryUnavailableError:  # logged by the registry as an outage
                continue
            except Exception as exc:  # noqa: BLE001 - keep renewing; the next may succeed
                logger.warning(
                    "renewing the lease of worker id %s failed: %s", self.lease.worker_id, exc
                )

    def stop(self) -> None:
        """Stop renewing without releasing (the lease expires after ``ttl_seconds``)."""
        with self._lock:
            self._stop.set()

    def release(self) -> None:
        """Stop renewing and give the id up at once (a clean stop). Never raises: a lease
        that cannot be released expires after ``ttl_seconds``."""
        with self._lock:
            if self.lost:  # not this process's any more
                return
            self._stop.set()
            try:
                self.registry.release_worker_lease(self.lease)
            except Exception as exc:  # noqa: BLE001 - it expires by itself
                logger.warning(
                    "could not release worker id %s (it expires in %.0f s): %s",
                    self.lease.worker_id,
                    self.ttl_seconds,
                    exc,
                )
