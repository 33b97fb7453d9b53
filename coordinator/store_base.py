"""The base of the coordinator's etcd store: the client (plaintext or TLS), the key names, error wrapping.

:mod:`pliant.coordinator.store` (jobs, leadership, generations) and :mod:`pliant.coordinator.store_members` (members,
heartbeats, reports) build on it. etcd's lost connections are wrapped into :class:`Unavailable` (safe to retry), its
size and space-quota errors into :class:`ResourceExhausted` (not).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import secrets
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import etcd3
import etcd3.exceptions
import etcd3.watch
import grpc

from pliant import settings
from pliant.coordinator.contract import (
    CoordinatorError,
    CorruptRecord,
    FailedPrecondition,
    Generation,
    InvalidArgument,
    JobSpec,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from pliant.coordinator.keepalive import KeepAliveStream
from pliant.coordinator.liveness import WRITES_PER_TXN, HeartbeatPump, ProgressWrite
from pliant.net import parse_host_port
from pliant.security import warrant
from pliant.security.seal import KEY_BYTES, agent_key, job_key, parse_root

__all__ = [
    "HISTORY",
    "EtcdBase",
    "EtcdObserver",
    "Fence",
    "JobKeys",
    "StrikeRecord",
    "decode",
    "etcd_call",
    "range_end",
    "read_strike",
    "token_digest",
]

logger = logging.getLogger(__name__)

HISTORY = 100  # generations kept per job for resumable watches

if not hasattr(etcd3.watch, "six"):
    # python3-etcd3 0.13.0's watch thread calls six.itervalues() without importing six, so a broken watch stream
    # never reaches its callbacks (and PrefixWatch would never re-arm). Give it the one function it uses.
    etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(d.values()))  # type: ignore[attr-defined]
_T = TypeVar("_T")


@dataclass(frozen=True)
class Fence:
    """Proof of leadership: the leader key and the create revision it had when this replica won the election."""

    key: str
    revision: int


JOINS_AT_ONCE = 128
"""Joins a replica has in etcd at once; the rest of a burst waits its turn in the replica. Thousands of Joins sent to
etcd at once queue there past their deadline, and the client then marks etcd failed for every call."""

EtcdObserver = Callable[[str, float, bool], None]
"""Called with (store operation, seconds, failed) after each store operation; used by metrics."""


def etcd_call(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Turn etcd client errors into :class:`Unavailable` naming the endpoints, and report each call's duration."""

    @functools.wraps(fn)
    def wrapper(self: EtcdBase, *args: Any, **kwargs: Any) -> _T:
        started, failed = time.perf_counter(), True
        try:
            result = fn(self, *args, **kwargs)
            failed = False
            return result
        except CoordinatorError:
            failed = False  # a domain answer (NotFound, ...): etcd itself worked
            raise
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            details = (exc.details() if callable(getattr(exc, "details", None)) else "") or ""
            if "space exceeded" in details:
                raise ResourceExhausted(
                    f"etcd refused {fn.__name__}: it is out of space (its NOSPACE alarm: only reads and deletes pass); "
                    f"free space by deleting jobs (pliant job delete JOB --force deletes one unfinished), then "
                    f"compact, defragment and disarm etcd (etcdctl compact --physical, defrag, alarm disarm), or raise "
                    f"--quota-backend-bytes"
                ) from exc
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED or "too large" in details:
                raise ResourceExhausted(
                    f"etcd refused {fn.__name__}: {details[:200]}; the request is too large or etcd's space quota is "
                    f"full (compact and defragment etcd, or raise --quota-backend-bytes); retrying will not help"
                ) from exc
            raise Unavailable(
                f"etcd at {','.join(self.endpoints)} did not answer {fn.__name__} ({code.name if code else 'error'}: "
                f"{details[:200]}); the call is safe to retry once etcd is reachable"
            ) from exc
        except (etcd3.exceptions.Etcd3Exception, ValueError) as exc:
            # etcd3 raises a bare ValueError for an endpoint it marked failed; other ValueErrors are bugs.
            if type(exc) is ValueError and "failed node" not in str(exc):
                raise
            raise Unavailable(
                f"etcd at {','.join(self.endpoints)} did not answer {fn.__name__} ({type(exc).__name__}: {exc}); "
                f"the call is safe to retry once etcd is reachable"
            ) from exc
        finally:
            if self.observer is not None:
                self.observer(fn.__name__, time.perf_counter() - started, failed)

    return wrapper


class JobKeys(NamedTuple):
    """A job's keys, as a Join hands them to a member: the checkpoint key (:func:`pliant.security.seal.job_key`), the
    agent key (:func:`pliant.security.seal.agent_key`) and the public half of the control key
    (:func:`pliant.security.warrant.public_key`)."""

    checkpoint: bytes
    agent: bytes
    control: bytes


class StrikeRecord(NamedTuple):
    """A strike record as stored (:class:`pliant.coordinator.contract.Strike`): ``lifts`` counts how often its holds
    were lifted, ``missed`` says that the node's agent, a spare, could not reach every member since."""

    count: int
    address: str
    lifted: bool = False
    lifts: int = 0
    missed: bool = False

    def to_json(self) -> str:
        return json.dumps(self._asdict(), sort_keys=True)


def read_strike(key: str | bytes, raw: bytes) -> StrikeRecord:
    """The strike record ``raw``. A record that cannot be read counts as one strike at no address, which holds nobody
    back (strikes only delay a rejoin; the next strike overwrites it), with a warning."""
    try:
        record = decode(key, json.loads, raw)
        return decode(
            key,
            lambda _: StrikeRecord(
                int(record["count"]),
                str(record["address"]),
                bool(record.get("lifted")),
                int(record.get("lifts", 0)),
                bool(record.get("missed")),
            ),
            raw,
        )
    except CorruptRecord as exc:
        logger.warning("%s; counted as one strike", exc)
        return StrikeRecord(1, "")


def decode(key: str | bytes, parse: Callable[[bytes], _T], raw: bytes) -> _T:
    """Parse one etcd record with ``parse``.

    Raises:
        CorruptRecord: the record is not what pliant wrote (bad JSON, a field missing or of the wrong type).
    """
    try:
        return parse(raw)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        name = key.decode() if isinstance(key, bytes) else key
        raise CorruptRecord(
            f"etcd record {name} cannot be read ({type(exc).__name__}: {str(exc)[:200]}; value {raw[:100]!r}); its job "
            f"is skipped until the record is repaired (etcdctl put) or removed (etcdctl del {name})"
        ) from None


def range_end(prefix: str) -> bytes:
    return etcd3.utils.prefix_range_end(prefix.encode())


def token_digest(token: str) -> str:
    """What etcd stores of a join token: its SHA-256 (the token is 256 random bits, so no slow hash is needed)."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class EtcdBase:
    """The etcd client, the key names and the helpers every store operation shares.

    Args:
        endpoints: etcd client URLs or host:port strings.
        prefix: root of every key.
        timeout_s: per-request deadline.
        observer: called with (operation, seconds, failed) after each operation (metrics).
        credentials: gRPC channel credentials for etcd over TLS (a client certificate when etcd runs with
            ``--client-cert-auth``); None: plaintext.
        membership_lease_s: TTL of a member's etcd lease: the longest control-plane outage its membership survives.
            Liveness itself is judged by the leader from the lease's age against the job's heartbeat TTL (see
            :mod:`pliant.coordinator.policy`).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str = settings.ETCD_KEY_ROOT,
        timeout_s: float = 5.0,
        observer: EtcdObserver | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        membership_lease_s: float = 3600.0,
        seal_root: bytes | None = None,
    ) -> None:
        self.observer = observer
        self._seal_root = (
            seal_root  # the sealing secret (pliant.security.seal); None: the one in etcd, read or made once
        )
        self.membership_lease_s = membership_lease_s
        self._specs: dict[str, tuple[JobSpec, int]] = {}  # job -> (spec, create revision of its key)
        self._bound: dict[int, tuple[str, str]] = {}  # lease id -> (job, node) whose member key it was seen holding
        self._token_digests: dict[str, str] = {}  # job -> join token digest last read (Join's txn re-checks it)
        self._job_keys: dict[str, JobKeys] = {}  # job -> its keys (any RPC thread may write one: the same value)
        self.timeout_s = timeout_s
        self._keepalive = KeepAliveStream(self._keepalive_target)  # the members' heartbeats
        # The replica's own leases (its leadership) on a stream of their own: a keepalive queued behind thousands of
        # members' would let the leader's lease expire under load, and every replica would step down in turn.
        self._own_keepalive = KeepAliveStream(self._keepalive_target)
        self._joining = threading.BoundedSemaphore(JOINS_AT_ONCE)  # Joins with their etcd calls in flight
        self._pump = HeartbeatPump(self._keepalive, self.write_progress, self._leases_lost, timeout_s=timeout_s)
        if not endpoints:
            raise InvalidArgument("no etcd endpoint given; pass --etcd http://HOST:PORT[,...]")
        self.endpoints = tuple(endpoints)
        self.prefix = prefix.rstrip("/")
        eps = []
        for url in self.endpoints:
            host, port = parse_host_port(url, what="etcd endpoint")
            if url.startswith("https://") and credentials is None:
                raise InvalidArgument(
                    f"etcd endpoint {url} is https but no etcd TLS files were given; pass "
                    f"--etcd-cacert/--etcd-cert/--etcd-key (or --etcd-tls-dir)"
                )
            secure = credentials is not None
            eps.append(etcd3.Endpoint(host, port, secure=secure, creds=credentials, time_retry=0.5))
        self.client = etcd3.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout_s, failover=True)
        self.tx = self.client.transactions

    def close(self) -> None:
        self._pump.close()
        self._keepalive.close()
        self._own_keepalive.close()
        self.client.close()

    # -- keys ----------------------------------------------------------------------------------------------------------

    @property
    def leader_key(self) -> str:
        return f"{self.prefix}/leader"

    @property
    def jobs_prefix(self) -> str:
        return f"{self.prefix}/jobs/"

    def job_key(self, job: str, *parts: str) -> str:
        return "/".join((f"{self.prefix}/jobs/{job}", *parts))

    def index_key(self, job: str) -> str:
        return f"{self.prefix}/index/{job}"

    def progress_key(self, job: str, node: str = "") -> str:
        return f"{self.prefix}/progress/{job}/{node}"

    def history_key(self, job: str, number: int) -> str:
        return self.job_key(job, "generations", f"{number:012d}")

    @property
    def seal_root_key(self) -> str:
        return f"{self.prefix}/seal-root"

    @etcd_call
    def seal_root(self) -> bytes:
        """The control plane's sealing secret (:mod:`pliant.security.seal`): the one configured, else the one in etcd,
        which the first replica to need it creates."""
        if self._seal_root is None:
            made = secrets.token_hex(KEY_BYTES)
            ok, responses = self._txn(
                [self.tx.create(self.seal_root_key) == 0],
                [self.tx.put(self.seal_root_key, made)],
                [self.tx.get(self.seal_root_key)],
            )
            root = parse_root(made if ok else responses[0][0][0].decode())
            if not root:
                raise FailedPrecondition(
                    f"etcd key {self.seal_root_key} does not hold a {KEY_BYTES}-byte sealing root; restore it from a "
                    f"backup (checkpoints sealed with it load only with it) or delete it to make a new one"
                )
            self._seal_root = root
        return self._seal_root

    def job_keys(self, job: str) -> JobKeys:
        """``job``'s keys, derived from the sealing root once per job and kept (they depend on nothing else)."""
        keys = self._job_keys.get(job)
        if keys is None:
            root = self.seal_root()
            keys = JobKeys(job_key(root, job), agent_key(root, job), warrant.public_key(root, job))
            if len(self._job_keys) > 10_000:  # jobs come and go: forget them all now and then
                self._job_keys.clear()
            self._job_keys[job] = keys
        return keys

    def warrant(self, generation: Generation) -> str:
        """The control plane's warrant of ``generation`` (:func:`pliant.security.warrant.sign`)."""
        world = warrant.World(generation.job_id, generation.incarnation, generation.number, generation.created_at)
        return warrant.sign(self.seal_root(), world)

    def _txn(self, compare: list[Any], success: list[Any], failure: list[Any] | None = None) -> tuple[bool, list[Any]]:
        return self.client.transaction(compare=compare, success=success, failure=failure or [])

    def _prefix_get(self, prefix: str) -> Any:
        return self.tx.get(prefix, range_end(prefix))

    def _keepalive_target(self) -> tuple[str, grpc.ChannelCredentials | None]:
        """The etcd endpoint the client uses now (the first one not failed), for a keepalive stream.

        Raises:
            etcd3.exceptions.NoServerAvailableError: every endpoint failed lately.
        """
        self.client.channel  # noqa: B018 (picks an endpoint not failed)
        endpoint = self.client.endpoint_in_use
        return endpoint.netloc, endpoint.credentials if endpoint.secure else None

    @etcd_call
    def refresh_lease(self, lease_id: int, own: bool = False) -> float:
        """Refresh a lease over a shared keep-alive stream and return its TTL: the members' stream, or with ``own``
        the one of this replica's own leases (its leadership), which no member's heartbeat ever queues behind.

        Raises:
            NotFound: the lease expired or was revoked.
        """
        ttl = (self._own_keepalive if own else self._keepalive).refresh(lease_id, self.timeout_s)
        if ttl <= 0:
            raise NotFound("the lease expired or was revoked")
        return float(ttl)

    @etcd_call
    def write_progress(self, writes: Sequence[ProgressWrite]) -> None:
        """Write a batch of progress keys, one transaction per :data:`~pliant.coordinator.liveness.WRITES_PER_TXN`.
        A transaction etcd refuses (one of its leases is gone) is retried key by key, and a key whose lease is gone is
        dropped with it."""
        for start in range(0, len(writes), WRITES_PER_TXN):
            chunk = writes[start : start + WRITES_PER_TXN]
            try:
                self._txn([], [self.tx.put(w.key, w.value, lease=w.lease_id) for w in chunk])
            except grpc.RpcError as exc:
                if exc.code() is not grpc.StatusCode.NOT_FOUND:  # etcd: "requested lease not found"
                    raise
                for w in chunk:
                    try:
                        self.client.put(w.key, w.value, lease=w.lease_id)
                    except grpc.RpcError as one:
                        if one.code() is not grpc.StatusCode.NOT_FOUND:
                            raise

    def _leases_lost(self, lease_ids: list[int]) -> None:
        """The heartbeat pump found these leases gone: the next heartbeat of each is checked against etcd."""
        for lease_id in lease_ids:
            self._bound.pop(lease_id, None)

    def members_deleted(self, keys: list[str]) -> None:
        """The member keys ``keys`` were deleted (a leave, an eviction, a lapsed lease, the job's deletion): the next
        heartbeat of each of their nodes is checked against etcd, and fails NotFound."""
        gone: set[tuple[str, str]] = set()
        for key in keys:
            job, _, node = key[len(self.jobs_prefix) :].partition("/members/")
            gone.add((job, node))
        leases = [lease for lease, owner in list(self._bound.items()) if owner in gone]
        for lease_id in leases:
            self._bound.pop(lease_id, None)
        self._pump.forget(leases)

    def forget_heartbeats(self) -> None:
        """Check every member's next heartbeat against etcd (the member watch re-armed: it may have missed deletes)."""
        self._pump.forget()

    def is_member_key(self, key: str) -> bool:
        """Whether ``key`` is a job's member key (``jobs/<job>/members/<node>``)."""
        return key.startswith(self.jobs_prefix) and "/members/" in key

    def _revoke_quietly(self, lease_id: int) -> None:
        try:
            self.client.revoke_lease(lease_id)
        except (etcd3.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            logger.debug("revoking lease %x failed (it expires by itself): %s", lease_id, exc)

    def _current(self, job: str) -> tuple[Generation | None, int]:
        """The current generation and the mod revision of its key (NotFound for an unknown job)."""
        key = self.job_key(job, "generation")
        value, meta = self.client.get(key)
        if value is None:
            self.read_job(job)  # NotFound for an unknown job
            return None, 0
        return decode(key, Generation.from_json, value), meta.mod_revision
