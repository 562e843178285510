"""Live migration of key groups between the instances of a keyed stage (both ends).

`MoveOut` runs at an old owner: the moving groups are frozen (no record of theirs is applied
here any more), records of theirs that are queued or still arrive are forwarded in order to the
new owner, on-demand fetches are answered key by key, and the rest of their state is pushed in
large chunks of whole groups (`keyshift.runtime.state_transfer`: SST files for RocksDB, Arrow IPC
for memory), hottest groups first. `MoveIn` runs at a new owner: records of incoming groups wait,
parked per key, until that key's state is here (pushed or fetched) and the old owner has
forwarded everything routed to it by the old epoch; forwarded records go before direct ones.
Parked records are indexed by group, so what arrives for some groups (a chunk, a fetch reply,
an old owner's last forward) looks at those groups' parked records only.
Keys that are not moving never wait. In a hand-over from checkpoints (`MigrateOut.handover`)
the new owner preloaded the groups from that checkpoint (`keyshift.runtime.handover`): the old
owner pushes only each group's changes since it, or the whole group where it does not know them
(its change marks start at another checkpoint, or the group came to it by a migration since),
saying why; fetches and forwarding work as without. See `keyshift.runtime.rescale` for the
coordinator's side. Used by `keyshift.runtime.keyed_stage`.
"""

from __future__ import annotations

import json
import logging
import queue
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import grpc
import numpy as np
import pyarrow as pa

from keyshift.runtime.protocol import (
    FetchBody,
    FetchReplyHeader,
    MigrateIn,
    MigrateOut,
    PeerUnreachable,
    parse,
)
from keyshift.runtime.records import GROUP, pack, unpack
from keyshift.runtime.stage_context import MIGRATE_SERVICE, FetchRequest, InstanceContext
from keyshift.runtime.state import KEY_COL, KeyedState
from keyshift.runtime.state_integrity import StateSeal
from keyshift.runtime.state_transfer import Chunk, export_changes, export_chunk, import_chunk
from keyshift.runtime.transport import (
    FORWARD,
    FORWARD_DONE,
    GRPC_OPTIONS,
    LEAVE,
    STATE,
    TransportError,
)

log = logging.getLogger("keyshift.migration")


class ProtocolError(RuntimeError):
    """A message that the migration protocol does not allow at this point."""


def key_list(keys: pa.Array) -> list[Any]:
    return keys.to_pylist()  # type: ignore[no-any-return]


class MoveOut:
    """The old owner's side of one epoch's move."""

    def __init__(
        self,
        ctx: InstanceContext,
        state: KeyedState,
        command: MigrateOut,
        seal: StateSeal,
        left_at: int | None,
        marks_since: int | None,
    ) -> None:
        """`marks_since`: the checkpoint since which the state's change marks run (None: not
        known); a hand-over from another checkpoint pushes whole groups."""
        self.ctx = ctx
        self.state = state
        self.seal = seal
        # The old owner's watermark as the move started: its windows up to it fired here.
        self.left_at = left_at
        self.stats = ctx.metrics.migration_stats()
        self.epoch = command.epoch
        self.sources = command.sources
        groups = ctx.spec.max_key_groups
        self.target = np.full(groups, -1, dtype=np.int32)
        for dst, moving in command.groups.items():
            self.target[np.asarray(moving, dtype=np.int64)] = int(dst)
        self.outlets = {int(dst): ctx.outlet(command.peers[dst]) for dst in command.groups}
        self.outbox: dict[int, deque[tuple[bytes, bytes | pa.RecordBatch]]] = {
            d: deque() for d in self.outlets
        }
        self.unreachable: set[int] = set()
        self.chunk_keys = command.push.chunk_keys
        self.trickle = command.push.trickle_keys_per_s
        hits = state.group_hits()
        moving_groups = np.flatnonzero(self.target >= 0)
        self.push_order = list(moving_groups[np.argsort(-hits[moving_groups], kind="stable")])
        state.index_groups(moving_groups.tolist())
        self.sizes = state.group_sizes()
        self.pushed = np.zeros(groups, dtype=bool)
        self.fetched: set[Any] = set()
        self.markers: set[str] = set()
        self.forward_done = False
        self.pushed_keys_budget = 0.0
        self.started = self.last_push = time.monotonic()
        self.stats["groups_out"] += len(moving_groups)
        self.changes_only = np.zeros(groups, dtype=bool)  # groups pushed as their changes
        self.fallback = self._handover(command.handover, marks_since, moving_groups)

    def _handover(
        self, checkpoint: int | None, marks_since: int | None, moving: np.ndarray
    ) -> str | None:
        """Which moving groups go as their changes since `checkpoint`; why others go whole."""
        if checkpoint is None:
            return None
        me = f"{self.ctx.stage}/{self.ctx.index}"
        if marks_since != checkpoint:
            since = "no checkpoint" if marks_since is None else f"checkpoint {marks_since}"
            return (
                f"{me} knows its changes since {since}, not since checkpoint {checkpoint}: "
                f"its {len(moving)} key groups went whole"
            )
        self.changes_only[moving] = True
        came = sorted(self.state.changes(()).restored & set(moving.tolist()))
        if not came:
            return None
        self.changes_only[came] = False
        return (
            f"{len(came)} key groups came to {me} by a migration after checkpoint {checkpoint}: "
            "they went whole"
        )

    def leaving(self, groups: np.ndarray) -> np.ndarray:
        """A mask of the records whose group is frozen here."""
        result: np.ndarray = self.target[groups] >= 0
        return result

    def tell(self, kind: bytes, payload: bytes) -> None:
        """A message for every new owner, before anything this move sends them."""
        for dst in self.outlets:
            self._send(dst, kind, payload)

    def _send(self, dst: int, kind: bytes, payload: bytes | pa.RecordBatch) -> None:
        """Queue a message for a new owner and send what credits allow. Never blocks: two
        instances may be moving groups to each other, and blocked sends would deadlock them."""
        self.outbox[dst].append((kind, payload))
        self.flush()

    def flush(self) -> None:
        for dst, queued in self.outbox.items():
            try:
                while queued and self.outlets[dst].try_send(queued[0][1], kind=queued[0][0]):
                    queued.popleft()
            except TransportError as exc:
                # The new owner died: hold on, the coordinator will give its groups back.
                if dst not in self.unreachable:
                    log.warning("new owner %s/%d unreachable: %s", self.ctx.stage, dst, exc)
                self.unreachable.add(dst)

    def forward(self, batch: pa.RecordBatch, groups: np.ndarray) -> None:
        """Hand the records of moving groups to their new owners, in the order received."""
        targets = self.target[groups]
        for dst in np.unique(targets).tolist():
            part = batch.filter(pa.array(targets == dst))
            self._send(dst, FORWARD, part)
            self.stats["records_forwarded"] += part.num_rows

    def marker(self, sender: str, body: bytes | None) -> None:
        """A source's MARKER for this epoch, or its END (body None): either way nothing routed
        by the old epoch can still come from it."""
        epoch = json.loads(body)["epoch"] if body is not None else self.epoch
        if epoch < self.epoch:
            return
        # A later epoch's marker (a recovery rerouted past this move) ends this one too.
        self.markers.add(sender)
        if len(self.markers) >= self.sources and not self.forward_done:
            done = json.dumps({"epoch": self.epoch}).encode()
            for dst in self.outlets:
                self._send(dst, FORWARD_DONE, done)
            self.forward_done = True

    def fetch(self, request: FetchRequest) -> None:
        """Answer a new owner's fetch: the keys' state, or why there is none."""
        keys = request.body.keys
        groups = np.asarray(request.body.groups, dtype=np.int64)
        in_transit = [k for k, g in zip(keys, groups.tolist(), strict=True)
                      if self.pushed[g] or k in self.fetched]  # fmt: skip
        wanted = [k for k, g in zip(keys, groups.tolist(), strict=True)
                  if not self.pushed[g] and k not in self.fetched]  # fmt: skip
        snapshot = self.state.snapshot_keys(wanted)
        found = key_list(snapshot.column(KEY_COL))
        self.state.drop_keys(found)
        self.fetched.update(wanted)
        absent = sorted(set(wanted) - set(found), key=repr)
        header = FetchReplyHeader(in_transit=in_transit, absent=absent)
        request.reply = self.seal.seal(pack(header.wire(), snapshot))
        request.done.set()
        self.stats["fetches"] += 1
        self.stats["keys_fetched_out"] += len(found)
        self.stats["bytes_out"] += snapshot.nbytes

    def pace(self, keys_per_s: float) -> None:
        """A new push rate from the coordinator pacing this move to a latency objective."""
        self.trickle = keys_per_s

    def push_some(self) -> bool:
        """Push the next chunk of state, if any is left and the strategy's rate allows."""
        if not self.push_order or any(self.outbox.values()):
            return False  # one chunk in flight at a time keeps the outbox small
        now = time.monotonic()
        if self.trickle is not None:
            self.pushed_keys_budget = min(
                self.pushed_keys_budget + (now - self.last_push) * float(self.trickle),
                float(self.chunk_keys),
            )
            self.last_push = now
            if self.pushed_keys_budget < min(self.chunk_keys, 1):
                return False
        chunk: list[int] = []
        keys = 0
        limit = self.chunk_keys if self.trickle is None else max(1, int(self.pushed_keys_budget))
        while self.push_order and (not chunk or keys + self.sizes[self.push_order[0]] <= limit):
            group = int(self.push_order.pop(0))
            chunk.append(group)
            keys += int(self.sizes[group])
        self.pushed[chunk] = True
        by_dst: dict[int, list[int]] = {}
        for group in chunk:
            by_dst.setdefault(int(self.target[group]), []).append(group)
        for dst, groups in by_dst.items():
            changes = [g for g in groups if self.changes_only[g]]
            whole = [g for g in groups if not self.changes_only[g]]
            if changes:
                self._push(dst, *export_changes(self.state, changes))
                self.stats["groups_changes"] += len(changes)
            if whole:
                self._push(dst, *export_chunk(self.state, whole, bulk=self.seal.authenticated))
                if self.fallback is not None:
                    self.stats["groups_whole"] += len(whole)
        self.state.drop_groups(chunk)
        if not self.push_order:
            self.stats["ms_out"] = round((time.monotonic() - self.started) * 1000)
        self.stats["groups_pushed"] += len(chunk)
        return True

    def _push(self, dst: int, payload: bytes, sent: Chunk) -> None:
        self._send(dst, STATE, self.seal.seal(payload))
        self.stats["keys_out"] += sent.keys
        self.stats["bytes_out"] += sent.nbytes
        self.pushed_keys_budget -= sent.keys

    def push_for(self, seconds: float) -> None:
        """Push chunks while the streams take them (their credits keep several in flight), for
        at most `seconds`, so that records of groups not moving wait no longer than that."""
        deadline = time.monotonic() + seconds
        while self.push_some() and time.monotonic() < deadline:
            pass

    def abandon(self, lost: set[int]) -> np.ndarray:
        """New owners died: their groups stay here (minus what was already handed over).
        Returns the mask of groups this instance owns again."""
        back = np.isin(self.target, list(lost)) & (self.target >= 0)
        self.target[back] = -1
        self.push_order = [g for g in self.push_order if not back[g]]
        for dst in lost & set(self.outlets):
            self.outbox.pop(dst, None)
            self.outlets.pop(dst).abort()
        return back

    def done(self) -> bool:
        return self.forward_done and not self.push_order and not any(self.outbox.values())

    def close(self) -> None:
        for outlet in self.outlets.values():
            outlet.finish(kind=LEAVE)


class MoveIn:
    """The new owner's side of one epoch's move."""

    def __init__(
        self,
        ctx: InstanceContext,
        state: KeyedState,
        command: MigrateIn,
        apply: Callable[[pa.RecordBatch], None],
        seal: StateSeal,
        preloaded: bool = False,
    ) -> None:
        """`preloaded`: the incoming groups are here as `command.handover`'s checkpoint had
        them; the old owners' chunks and fetch replies replace that state."""
        self.ctx = ctx
        self.state = state
        self.preloaded = preloaded
        self.apply = apply
        self.seal = seal
        self.stats = ctx.metrics.migration_stats()
        self.epoch = command.epoch
        groups = ctx.spec.max_key_groups
        self.source_of = np.full(groups, -1, dtype=np.int32)
        for src, incoming in command.groups.items():
            self.source_of[np.asarray(incoming, dtype=np.int64)] = int(src)
        self.complete = np.zeros(groups, dtype=bool)
        self.old_owners = {int(src) for src in command.groups}
        self.forward_done: set[int] = set()
        self.arrived: set[Any] = set()
        self.requested: dict[Any, int] = {}  # fetched keys -> their groups
        self.awaiting: set[Any] = set()  # fetched, reply not yet here
        self.awaiting_from: dict[int, set[Any]] = {}
        self.lost: set[int] = set()
        self.unreachable: set[int] = set()  # old owners a fetch found gone, reported once
        # Parked records by whether they were forwarded (they go first), by arrival number; which
        # parked batches hold records of each group, so that what arrives for some groups looks
        # at their records only; and the parked keys.
        self.parked: dict[bool, dict[int, pa.RecordBatch]] = {True: {}, False: {}}
        self.parked_in: dict[bool, dict[int, set[int]]] = {True: {}, False: {}}
        self.parked_keys: dict[bool, Counter[Any]] = {True: Counter(), False: Counter()}
        self.arrivals = 0
        self.replies: queue.Queue[tuple[int, dict[Any, int], bytes | Exception]] = queue.Queue()
        self.channels = {
            int(src): ctx.security.channel(command.peers[src], GRPC_OPTIONS)
            for src in command.groups
        }
        self.key_field = ctx.spec.keyed_step(ctx.stage).stage.key_by
        self.started = time.monotonic()
        self.stats["groups_in"] += int((self.source_of >= 0).sum())

    def pending(self, groups: np.ndarray) -> np.ndarray:
        """A mask of the records whose group moves here in this epoch: until the move is done
        they all go through `receive`, which keeps each key's records in order."""
        result: np.ndarray = self.source_of[groups] >= 0
        return result

    def _has_state(self, batch: pa.RecordBatch, groups: np.ndarray) -> np.ndarray:
        keys = key_list(batch.column(self.key_field))
        known = np.fromiter(map(self.arrived.__contains__, keys), dtype=bool, count=len(keys))
        # A fetched key's reply may come after its group's last pushed chunk: until then the
        # key is not here, though its group is complete.
        awaited = np.fromiter(map(self.awaiting.__contains__, keys), dtype=bool, count=len(keys))
        result: np.ndarray = (
            known | (self.complete[groups] & ~awaited) | (self.source_of[groups] < 0)
        )
        return result

    def _ready(self, batch: pa.RecordBatch, forwarded: bool) -> np.ndarray:
        groups = batch.column(GROUP).to_numpy()
        ready = self._has_state(batch, groups)
        if not forwarded:
            done = np.fromiter(
                (o in self.forward_done for o in self.source_of[groups].tolist()),
                dtype=bool,
                count=len(groups),
            )
            ready &= done | (self.source_of[groups] < 0)
        return ready

    def receive(self, batch: pa.RecordBatch, forwarded: bool) -> None:
        """Records of incoming groups: apply the ready ones, park the rest per key."""
        # A key with parked records must not be overtaken by its newer ones; a direct record
        # also waits behind its key's parked forwarded records.
        blocking = [self.parked_keys[True]] if forwarded else list(self.parked_keys.values())
        ready = self._ready(batch, forwarded) & ~self._mask(batch, blocking)
        if ready.all():
            self.apply(batch)
            return
        if ready.any():
            self.apply(batch.filter(pa.array(ready)))
        waiting = batch.filter(pa.array(~ready))
        self.arrivals += 1
        self.parked[forwarded][self.arrivals] = waiting
        for group in np.unique(waiting.column(GROUP).to_numpy()).tolist():
            self.parked_in[forwarded].setdefault(group, set()).add(self.arrivals)
        self.parked_keys[forwarded].update(key_list(waiting.column(self.key_field)))
        self.stats["records_parked"] += waiting.num_rows
        self._request(waiting)

    def _mask(self, batch: pa.RecordBatch, key_sets: list[Counter[Any]]) -> np.ndarray:
        mask = np.zeros(batch.num_rows, dtype=bool)
        column: list[Any] | None = None
        for keys in key_sets:
            if keys:
                column = column if column is not None else key_list(batch.column(self.key_field))
                mask |= np.fromiter(map(keys.__contains__, column), dtype=bool, count=len(column))
        return mask

    def _request(self, waiting: pa.RecordBatch) -> None:
        groups = waiting.column(GROUP).to_numpy()
        keys = key_list(waiting.column(self.key_field))
        has = self._has_state(waiting, groups)
        by_owner: dict[int, dict[Any, int]] = {}
        for key, group, present in zip(keys, groups.tolist(), has.tolist(), strict=True):
            if present or key in self.requested:
                continue
            self.requested[key] = group
            self.awaiting.add(key)
            self.awaiting_from.setdefault(int(self.source_of[group]), set()).add(key)
            by_owner.setdefault(int(self.source_of[group]), {})[key] = group
        for owner, wanted in by_owner.items():
            self._fetch(owner, wanted)

    def _fetch(self, owner: int, wanted: dict[Any, int]) -> None:
        """Ask `owner` for `wanted` (key -> group). No deadline here: the old owner's handler
        has one, and only it knows whether the state was handed over before it gave up (a
        lost reply to a served fetch would be lost state). A dead owner fails the call
        UNAVAILABLE; a hung one is the coordinator's to find by its silence."""
        body = FetchBody(epoch=self.epoch, keys=list(wanted), groups=list(wanted.values()))
        call = self.channels[owner].unary_unary(f"/{MIGRATE_SERVICE}/Fetch", None, None)
        future = call.future(json.dumps(body.wire()).encode())
        future.add_done_callback(partial(self._fetched, owner, wanted))
        self.stats["fetch_requests"] += 1

    def _fetched(self, owner: int, wanted: dict[Any, int], future: Any) -> None:
        try:
            self.replies.put((owner, wanted, future.result()))
        except grpc.RpcError as exc:
            self.replies.put((owner, wanted, exc))

    def handle_replies(self) -> None:
        changed: set[int] = set()
        while True:
            try:
                owner, wanted, reply = self.replies.get_nowait()
            except queue.Empty:
                break
            if isinstance(reply, Exception):
                self._fetch_failed(owner, wanted, reply)
                continue
            what = f"fetch reply from {self.ctx.stage}/{owner}"
            body, snapshot = unpack(self.seal.open(reply, what))
            header = parse(FetchReplyHeader, body)
            got: list[Any] = []
            if snapshot is not None and snapshot.num_rows:
                got = key_list(snapshot.column(KEY_COL))
            if self.preloaded:
                # The old owner's state of these keys now (none for the absent ones) replaces
                # what the checkpoint had.
                self.state.drop_keys([*got, *header.absent])
            if got:
                assert snapshot is not None
                self.state.restore(snapshot)
                self.stats["keys_fetched"] += snapshot.num_rows
                self.stats["bytes_in"] += snapshot.nbytes
            self.arrived.update(got, header.absent)
            # Keys already pushed come with their group's chunk, which completes the group.
            self.awaiting.difference_update(got, header.absent, header.in_transit)
            for key in (*got, *header.absent, *header.in_transit):
                changed.add(self.requested[key])
        if changed:
            self.release(changed)

    def _fetch_failed(self, owner: int, wanted: dict[Any, int], error: Exception) -> None:
        """An old owner too busy to serve the fetch in time handed nothing over: ask again. One
        that cannot be reached is gone (or going): that is for the coordinator to act on, with
        that instance lost as the reason; its keys stay parked until the coordinator aborts
        the move or stops the job. Any other failure is this move's."""
        peer = f"{self.ctx.stage}/{owner}"
        code = error.code() if isinstance(error, grpc.Call) else None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            log.info("fetch from %s not served in time; asking again", peer)
            self.stats["fetch_retries"] += 1
            self._fetch(owner, {k: g for k, g in wanted.items() if k in self.awaiting})
            return
        if code != grpc.StatusCode.UNAVAILABLE:
            raise ProtocolError(f"fetch from {peer} failed: {error}")
        if owner in self.unreachable or owner in self.lost:
            return
        self.unreachable.add(owner)
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        log.warning("fetch from %s failed, it is unreachable: %s", peer, details)
        self.ctx.emit(PeerUnreachable(peer=owner, error=f"a state fetch failed: {details}"))

    def state_chunk(self, body: bytes, sender: str) -> None:
        opened = self.seal.open(body, f"state chunk from {sender}")
        # A fetched key's reply holds newer state than any chunk of its group (the old owner
        # dropped it when it served the fetch, but its deletion may still be in the changes).
        chunk = import_chunk(self.state, opened, sender, self.arrived if self.preloaded else None)
        self.stats["keys_in"] += chunk.keys
        self.stats["bytes_in"] += chunk.nbytes
        # The group is complete: its keys need no entry in `arrived` (a key fetched meanwhile
        # waits for its reply, which says the key was in transit).
        self.complete[np.asarray(chunk.groups, dtype=np.int64)] = True
        if "ms_in" not in self.stats and self.complete[self.source_of >= 0].all():
            self.stats["ms_in"] = round((time.monotonic() - self.started) * 1000)
        self.release(chunk.groups)

    def forwarding_done(self, sender: str) -> None:
        owner = int(sender.rsplit("/", 1)[1])
        self.forward_done.add(owner)
        self.release(np.flatnonzero(self.source_of == owner).tolist())

    def release(self, groups: Iterable[int]) -> None:
        """Apply parked records of `groups` (whose state or forwarding just changed) whose keys
        are now ready: forwarded ones first, in order. Other groups' records are not looked at:
        nothing changed for them."""
        changed = np.fromiter(groups, dtype=np.int64)
        for forwarded in (True, False):
            index = self.parked_in[forwarded]
            numbers = sorted(set().union(*(index.get(g, ()) for g in changed.tolist())))
            # Once one record of a key stays parked, its later records stay too; direct
            # records also stay behind their key's forwarded records.
            stuck: Counter[Any] = Counter()
            behind = [] if forwarded else [self.parked_keys[True]]
            for number in numbers:
                batch = self.parked[forwarded][number]
                in_changed = np.isin(batch.column(GROUP).to_numpy(), changed)
                ready = in_changed & self._ready(batch, forwarded)
                ready &= ~self._mask(batch, [stuck, *behind])
                if ready.any():
                    self._unpark(forwarded, number, batch, ready)
                waiting = batch.filter(pa.array(in_changed & ~ready))
                stuck.update(key_list(waiting.column(self.key_field)))

    def _unpark(
        self, forwarded: bool, number: int, batch: pa.RecordBatch, ready: np.ndarray
    ) -> None:
        """Apply the ready records of one parked batch and keep the rest parked, indexed."""
        applied = batch.filter(pa.array(ready))
        self.apply(applied)
        parked_keys = self.parked_keys[forwarded]
        for key in key_list(applied.column(self.key_field)):
            parked_keys[key] -= 1
            if not parked_keys[key]:
                del parked_keys[key]
        rest = batch.filter(pa.array(~ready))
        left = set(np.unique(rest.column(GROUP).to_numpy()).tolist())
        if rest.num_rows:
            self.parked[forwarded][number] = rest
        else:
            del self.parked[forwarded][number]
        index = self.parked_in[forwarded]
        for group in np.unique(applied.column(GROUP).to_numpy()).tolist():
            if group not in left:
                index[group].discard(number)
                if not index[group]:
                    del index[group]

    def abandon(self, lost: set[int]) -> None:
        """Old owners died: what they had not handed over is gone; their groups start empty
        here, and their parked records apply to that."""
        dead = np.isin(self.source_of, list(lost)) & (self.source_of >= 0)
        self.complete[dead] = True
        self.lost |= lost
        self.forward_done |= lost & self.old_owners
        for owner in lost:
            self.awaiting.difference_update(self.awaiting_from.pop(owner, set()))
        self.release(np.flatnonzero(dead).tolist())

    def parked_records(self) -> int:
        return sum(b.num_rows for batches in self.parked.values() for b in batches.values())

    def done(self) -> bool:
        incoming = self.source_of >= 0
        return (
            bool(self.complete[incoming].all())
            and not self.awaiting
            and self.forward_done >= self.old_owners
            and not self.parked[True]
            and not self.parked[False]
        )

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
