"""The control protocol: every message between the coordinator, the stage instances, the hosts
and the autoscaler, each a typed model defined once here and parsed here.

Three families travel as JSON over the control calls of `keyshift.runtime.transport`:

- commands, coordinator -> instance on the `Watch` stream (`Command`: `Topology`, `Drain`,
  `Stop`, `Checkpoint`, `CheckpointComplete`, `Reroute`, `Pause`, `Resume`, `MigrateIn`,
  `MigrateOut`, `Preload`, `Abort`, `Retire`, `MovePartitions`, `OpenPartitions`,
  `Rescaling`, `Rewind`), told apart by their `type`;
- events, instance -> coordinator inside a `Report` (`Event`: `Ack` of a protocol step,
  `OutDone`, `InDone`, `Preloaded`, `Rewound`, and the checkpoint acks `SourceCheckpointAck`,
  `KeyedCheckpointAck`, `SinkCheckpointAck`);
- the bodies of the unary calls: `RegisterRequest`/`RegisterReply`, `InstanceCall` (Watch),
  `ReportRequest`, `RescaleRequest` (stage, parallelism, strategy, options) and its reply
  `RescaleReport`, `StatusReply`, `DrainReply`;
- between instances: a checkpoint `Barrier`'s body and a `Watermark`'s on a data stream, and
  a migration fetch's `FetchBody` and the `FetchReplyHeader` of its reply.

A sender builds a model and sends `message.wire()`; a receiver calls `parse`, `parse_command`
or `parse_event`, which raise `ProtocolError` naming the message and each wrong field (unknown
type, missing field, wrong type, unexpected field). Servers wrap their handlers in `handles`,
so a malformed request is refused with INVALID_ARGUMENT before any handler code runs.
`STRATEGIES`, the rescale strategies, are defined here once; the CLI, the CRD, the settings
and the coordinator derive theirs from it. Used by the coordinator, the instances and their
stage loops, the rescale and checkpoint drivers, and the operator's executor and CLI.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, get_args

import grpc
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from keyshift.runtime.transport import ControlError

Strategy = Literal["hot-first", "all-at-once", "batched", "lazy"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
DEFAULT_STRATEGY: Strategy = "hot-first"


class ProtocolError(ValueError):
    """A control message that does not fit its model; the message says which field and why."""


class Message(BaseModel):
    """A control message: strict (no coercion of "3" into 3), closed (no unknown fields)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)

    def wire(self) -> dict[str, Any]:
        """The JSON body that carries this message."""
        return self.model_dump(mode="json", by_alias=True)


# --- commands: coordinator -> instance ----------------------------------------------------------


class Topology(Message):
    """Every stage's instances (index -> data address), every keyed stage's assignment, and
    per sink which of its instances owns each output partition (`partitions`: by sink, an
    assignment of its partitions). `retired`: instances ("stage/index") that a rescale
    retired, not lost: what they sent still arrives, up to their LEAVE, and the topology
    that no longer lists them may overtake it."""

    type: Literal["topology"] = "topology"
    stages: dict[str, dict[str, str]]
    assignments: dict[str, dict[str, Any]]
    partitions: dict[str, dict[str, Any]] = {}
    retired: list[str] = []

    def addresses(self, stage: str) -> dict[int, str]:
        return {int(i): a for i, a in self.stages[stage].items()}


class Drain(Message):
    """Sources: stop taking new records; the job finishes what is in flight."""

    type: Literal["drain"] = "drain"


class Stop(Message):
    type: Literal["stop"] = "stop"
    reason: str


class Checkpoint(Message):
    """Sources: put a barrier for checkpoint `id` on every stream now."""

    type: Literal["checkpoint"] = "checkpoint"
    id: int
    previous: int | None


class CheckpointComplete(Message):
    """Sources and sinks: checkpoint `id` is complete at these positions and offsets (by
    sink, by partition)."""

    type: Literal["checkpoint_complete"] = "checkpoint_complete"
    id: int
    sources: dict[str, int]
    outputs: dict[str, dict[str, int]]


class Reroute(Message):
    """The senders to keyed stage `stage` (its upstream stage's instances): route to it by
    `assignment` from now on (after an epoch marker on every stream to it)."""

    type: Literal["reroute"] = "reroute"
    stage: str
    epoch: int
    assignment: dict[str, Any]
    keyed: dict[str, str]
    lost: list[int] = []


class Pause(Message):
    type: Literal["pause"] = "pause"
    epoch: int


class Resume(Message):
    type: Literal["resume"] = "resume"
    epoch: int


class Preload(Message):
    """A new owner, before a rescale's first step (hand-over from checkpoints): load `groups`,
    which will come to you, from completed checkpoint `checkpoint` in the background, and report
    `Preloaded`. The state stays unowned until a `MigrateIn` names the checkpoint."""

    type: Literal["preload"] = "preload"
    checkpoint: int
    groups: list[int]


class MigrateIn(Message):
    """A new owner: these groups (by old owner) come to you in `epoch`; park their records.
    `handover`: the checkpoint you preloaded them from (only the changes since come); None:
    their whole state comes, and any preloaded state of them is dropped first."""

    type: Literal["migrate_in"] = "migrate_in"
    epoch: int
    groups: dict[str, list[int]]
    peers: dict[str, str]
    handover: int | None = None


class PushOptions(Message):
    """How an old owner pushes state: keys per chunk, and an optional cap in keys per second."""

    chunk_keys: int = Field(default=32768, gt=0)
    trickle_keys_per_s: float | None = Field(default=None, gt=0)


class MigrateOut(Message):
    """An old owner: these groups (by new owner) leave in `epoch`; forward and push them."""

    type: Literal["migrate_out"] = "migrate_out"
    epoch: int
    groups: dict[str, list[int]]
    peers: dict[str, str]
    sources: int  # senders upstream of the stage: the epoch markers to wait for
    push: PushOptions = PushOptions()
    # The checkpoint the new owners preloaded the groups from: push only the changes since it
    # where this instance knows them (the whole group where it does not, saying why).
    handover: int | None = None


class PushRate(Message):
    """An old owner: push `epoch`'s state at `keys_per_s` from now on (a rescale paced to a
    latency objective)."""

    type: Literal["push_rate"] = "push_rate"
    epoch: int
    keys_per_s: float = Field(gt=0)


class Abort(Message):
    """Keyed instances: abandon `epoch`'s moves to and from `lost`; take up `adopt`'s groups."""

    type: Literal["abort"] = "abort"
    epoch: int
    lost: list[int]
    adopt: dict[str, list[int]] = {}


class Retire(Message):
    type: Literal["retire"] = "retire"


class MovePartitions(Message):
    """Sink instances: the output partitions' owners from `epoch` on (an assignment of
    partitions). An old owner writes a leaving partition until every sender's epoch marker
    is in, then closes it and reports `OutDone`; a new owner parks a coming partition's
    records until `OpenPartitions`."""

    type: Literal["move_partitions"] = "move_partitions"
    epoch: int
    owners: dict[str, Any]


class OpenPartitions(Message):
    """A sink instance: the old owners of these partitions have closed them (`epoch`): open
    them after their last record, write what is parked, and report `InDone`."""

    type: Literal["open_partitions"] = "open_partitions"
    epoch: int
    partitions: list[int]


class Rescaling(Message):
    """Keyed instances: a rescale runs (stay up), or ended (`ended`: the senders upstream
    done by then)."""

    type: Literal["rescaling"] = "rescaling"
    active: bool
    ended: list[str] = []


class Rewind(Message):
    """Every instance but a lost one's replacement (a local recovery): end the stage loop, drop
    what was in flight and go on from completed checkpoint `checkpoint` in `generation`, whose
    data streams alone are taken from now on; report `Rewound`, then wait for the topology."""

    type: Literal["rewind"] = "rewind"
    generation: int = Field(gt=0)
    checkpoint: int


Command = Annotated[
    Topology
    | Drain
    | Stop
    | Checkpoint
    | CheckpointComplete
    | Reroute
    | Pause
    | Resume
    | MigrateIn
    | MigrateOut
    | PushRate
    | Abort
    | Retire
    | MovePartitions
    | OpenPartitions
    | Rescaling
    | Preload
    | Rewind,
    Field(discriminator="type"),
]


# --- events: instance -> coordinator, inside a Report -------------------------------------------

AckStep = Literal[
    "migrate_in", "migrate_out", "abort", "reroute", "pause", "resume", "move_partitions"
]


class Ack(Message):
    """A protocol step done for `epoch`."""

    type: Literal["ack"] = "ack"
    step: AckStep
    epoch: int


class OutDone(Message):
    """An old owner has forwarded and pushed everything of `epoch`'s move (a sink instance: it
    has closed the partitions it hands over). `fallback`: why some groups of a hand-over went
    whole instead of as changes since the preloaded checkpoint."""

    type: Literal["out_done"] = "out_done"
    epoch: int
    stats: dict[str, float]
    fallback: str | None = None


class InDone(Message):
    """A new owner has all of `epoch`'s state in and nothing parked (a sink instance: it has
    opened the partitions it takes over and written what it parked)."""

    type: Literal["in_done"] = "in_done"
    epoch: int
    stats: dict[str, float]


class Preloaded(Message):
    """A new owner loaded a `Preload`'s groups from `checkpoint` (keys, and bytes read from
    the checkpoint store), or could not (`error`: the checkpoint is missing, corrupt or
    unreadable; nothing of it stays loaded)."""

    type: Literal["preloaded"] = "preloaded"
    checkpoint: int
    keys: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class PeerUnreachable(Message):
    """A keyed instance could not reach keyed instance `peer` (a migration fetch found it gone
    or silent): the coordinator takes the peer as lost, which is the failure's true reason."""

    type: Literal["peer_unreachable"] = "peer_unreachable"
    peer: int
    error: str


class Rewound(Message):
    """An instance has rewound to the checkpoint of `generation`'s `Rewind`: its loop ended,
    its outlets closed, its inbox takes only `generation`'s streams."""

    type: Literal["rewound"] = "rewound"
    generation: int


class SourceCheckpointAck(Message):
    """Source instance `source` (its job-wide source id) is at `position` in checkpoint `id`."""

    type: Literal["checkpoint_source"] = "checkpoint_source"
    id: int
    source: int
    position: int
    error: str | None = None


class KeyedCheckpointAck(Message):
    """The groups a keyed instance wrote for checkpoint `id` (or the storage error)."""

    type: Literal["checkpoint_keyed"] = "checkpoint_keyed"
    id: int
    error: str | None = None
    chains: dict[str, Any] = {}
    written: int = 0
    base_groups: int = 0
    delta_groups: int = 0
    seconds: float = 0.0  # from the barrier until the upload ended
    snapshot_seconds: float = 0.0  # of those, in the keyed loop (the rest ran beside it)
    # A native RocksDB checkpoint: the writer whose database holds the groups, its files by
    # local name (keyshift.runtime.checkpoint_store.database_from_json parses them), and the
    # bytes of SST files an earlier checkpoint stored.
    writer: str | None = None
    database: dict[str, Any] | None = None
    reused: int = 0
    # The instance's event-time watermark when it aligned (none: it has none yet).
    watermark: int | None = None


class SinkCheckpointAck(Message):
    """A sink instance's output log end for checkpoint `id` in each partition it owns (by
    partition; none for a function sink), or the error."""

    type: Literal["checkpoint_sink"] = "checkpoint_sink"
    id: int
    offsets: dict[str, int] = {}
    error: str | None = None


CheckpointAck = SourceCheckpointAck | KeyedCheckpointAck | SinkCheckpointAck
CHECKPOINT_ACKS = (SourceCheckpointAck, KeyedCheckpointAck, SinkCheckpointAck)
Event = Annotated[
    Ack
    | OutDone
    | InDone
    | Preloaded
    | PeerUnreachable
    | Rewound
    | SourceCheckpointAck
    | KeyedCheckpointAck
    | SinkCheckpointAck,
    Field(discriminator="type"),
]


@dataclass(frozen=True)
class Reported:
    """An event as the coordinator keeps it: with the instance that reported it."""

    stage: str
    index: int
    event: Event

    @property
    def instance(self) -> str:
        return f"{self.stage}/{self.index}"


def checkpoint_of(reported: Reported) -> int | None:
    """The checkpoint a reported event acks, if it is a checkpoint ack."""
    event = reported.event
    return event.id if isinstance(event, CHECKPOINT_ACKS) else None


# --- unary call bodies ---------------------------------------------------------------------------


class RegisterRequest(Message):
    stage: str
    index: int
    data_address: str
    metrics_address: str = ""
    pid: int = 0


class StandbyRequest(Message):
    """A pre-started instance of a keyed stage offering itself (the `Standby` stream): it waits,
    owning nothing and counted nowhere, until a scale-out gives it an index. A pinned one (a
    StatefulSet pod, whose ordinal is its identity) takes only `index`: at once when the stage
    wants that index already, else when a scale-out reaches it."""

    stage: str
    pid: int = 0
    index: int | None = Field(default=None, ge=0)


class StandbyAssignment(Message):
    """The one message of a standby's `Standby` stream: the index it now registers as."""

    index: int


class StandbyStatus(Message):
    pid: int
    index: int | None = None  # given by a scale-out, not yet registered under it


class RegisterReply(Message):
    """The job spec (as JSON: every process runs the coordinator's definition), the
    checkpoint to restore from after a crash, the instance's identity, and the generation
    whose data streams it takes (a local recovery's replacement joins the one after it)."""

    job: dict[str, Any]
    restore: int | None
    identity: dict[str, str]
    generation: int = 0


class InstanceCall(Message):
    """Who a call speaks for, with the identity that proves it (Watch's body)."""

    stage: str
    index: int
    # Checked by the coordinator, not here: a missing or malformed identity is refused as
    # unauthenticated (and counted so), like a forged one.
    identity: Any = None


class ReportRequest(InstanceCall):
    """The heartbeat: counters, and the protocol steps done since the last report."""

    stats: dict[str, Any] = {}
    metrics_address: str = ""
    group_hits: dict[str, int] | None = None
    events: list[Event] = []
    finished: bool = False
    error: str | None = None


class RescaleRequest(Message):
    """Rescale `stage` to `parallelism` instances, moving state by `strategy` with `options`
    (checked against the strategy's options by the coordinator)."""

    stage: str
    parallelism: int
    strategy: Strategy = DEFAULT_STRATEGY
    options: dict[str, float] = {}


class HandoverReport(Message):
    """A rescale's hand-over from checkpoints: the checkpoint the new owners preloaded (None:
    none was), what they read of it, the bytes the switch itself moved (chunks of changes,
    whole groups that fell back, fetches), and why it fell back to a direct transfer (of
    everything, or of some groups), if it did."""

    checkpoint: int | None
    preloaded_keys: int = 0
    preloaded_bytes: int = 0
    preload_seconds: float = 0.0
    switch_bytes: int = 0
    delta_groups: int = 0
    whole_groups: int = 0
    fallback: str | None = None


class PacingReport(Message):
    """A rescale paced to `max_latency_ms`: the worst sink p99 seen while state moved (None: no
    record reached a sink), whether it stayed within the objective, and the push rates used
    (keys/s per old owner, in order)."""

    objective_ms: float
    worst_p99_ms: float | None
    met: bool | None
    keys_per_s: list[float]


class SubscaleReport(Message):
    """One subscale of a rescale: its old and new owners, epoch, groups, phase, the bytes its
    new owners took in (once done), when it started (seconds after the rescale did) and how
    long it ran (or has run so far)."""

    sources: list[int]
    destinations: list[int]
    epoch: int
    groups: int
    phase: str
    bytes: int = 0
    started: float = 0.0
    seconds: float = 0.0


class SubscalesReport(Message):
    """A rescale's subscales: how many, how many done and running, and some of them (the
    running ones, then the latest done; at most `keyshift.runtime.rescale.SUBSCALES_SHOWN`)."""

    count: int
    done: int
    running: int
    shown: list[SubscaleReport]


class RescaleReport(Message):
    """A rescale as the coordinator reports it: in Rescale's reply and in Status. Its `phase`
    is `queued` while it waits for another stage's rescale to end (then `started` is when it
    was queued), `replaced` once a later request of its stage took its place in the queue, else
    the driver's phase (ending `done` or `failed`)."""

    incarnation: str
    id: int
    stage: str
    # "from" and "to" on the wire ("from" is a Python keyword).
    from_parallelism: int = Field(validation_alias="from", serialization_alias="from")
    to_parallelism: int = Field(validation_alias="to", serialization_alias="to")
    strategy: Strategy
    options: dict[str, float]
    phase: str
    started: float
    finished: float | None
    duration: float
    error: str | None
    epoch: int | None
    groups_to_move: int
    groups_moved: int
    steps: int
    progress: dict[str, float]
    # MB/s of state at each end of the moves (out, in); None until that end finished one.
    mb_per_s: dict[str, float | None] = Field(default_factory=dict)
    replaced: int | None = None  # the id of the queued request of its stage it replaced
    handover: HandoverReport | None = None
    pacing: PacingReport | None = None
    subscales: SubscalesReport | None = None


class InstanceStatus(Message):
    """One instance in a Status reply: where it is, and its latest report's counters."""

    index: int
    address: str
    metrics: str
    pid: int
    finished: bool
    retiring: bool
    stats: dict[str, Any]


StageRole = Literal["source", "keyed", "sink"]


class StageStatus(Message):
    name: str
    role: StageRole  # what the stage's instances run (a job may have several sinks)
    parallelism: int  # instances registered now
    desired: int  # instances the coordinator wants (a host keeps 0..desired-1 running)
    instances: list[InstanceStatus]
    standbys: list[StandbyStatus] = []  # waiting, or taken and not yet registered


class StatusReply(Message):
    """The coordinator's Status: the job's phase, every stage and instance, the rescale
    running, those queued behind it (in the order they start) and the latest ended ones,
    checkpoints and recoveries."""

    job: str
    incarnation: str
    phase: str
    errors: list[str]
    epoch: int
    uptime: float
    stages: list[StageStatus]
    rescale: RescaleReport | None
    queued: list[RescaleReport] = []
    lost: list[str]
    rescales: list[RescaleReport]
    checkpoints: dict[str, Any] | None
    restored_from: int | None
    recoveries: dict[str, Any]
    # A local recovery under way: the lost instances the hosts start again (by name, the pid
    # of the lost process: one that still runs, hung, is stopped first).
    replacing: dict[str, int] = {}
    # Why a failed job is not to be recovered again: the restart strategy gave up on a loss
    # the coordinator would have recovered locally (the hosts restart it no more).
    gave_up: str | None = None


class DrainReply(Message):
    phase: str


class Empty(Message):
    """The body of calls that carry nothing (Status's request, Shutdown's)."""


# --- between instances: checkpoint barriers and migration fetches -------------------------------


class Barrier(Message):
    """A BARRIER's body on a data stream: checkpoint `id`, on top of `previous` (the last one
    completed, which a keyed instance's deltas build on)."""

    id: int
    previous: int | None


class WatermarkHold(Message):
    """An old owner of a move of its keyed stage (assignment `epoch`) tells the stages it feeds:
    the windows of the groups it hands over fire at their new owners (`until`, indexes), whose
    results may come later than any watermark the stage has sent; wait for each new owner's
    release before going past this one's watermark."""

    epoch: int
    until: list[int]


class Watermark(Message):
    """A WATERMARK's body on a data stream: the sender emits no record with an event time
    below `watermark` (epoch µs; none before its first record), unless late; `idle`: it has
    emitted nothing for its idle timeout, so receivers do not wait for it until it emits
    again (keyshift.runtime.watermarks). A keyed instance's may also carry a `hold` (it starts
    moving groups away) or a `release` (the epoch whose groups it has taken in, their windows
    fired and sent before this message)."""

    watermark: int | None
    idle: bool = False
    hold: WatermarkHold | None = None
    release: int | None = None


class FetchBody(Message):
    """A new owner asks the old owner of `epoch`'s move for these keys' state (keyshift.Migrate
    Fetch); `groups[i]` is `keys[i]`'s key group."""

    epoch: int
    keys: list[int | str]
    groups: list[int]


class FetchReplyHeader(Message):
    """The header of a Fetch reply, before the state found: the keys the old owner holds no
    state of (`absent`), and those already on their way in a pushed chunk (`in_transit`)."""

    in_transit: list[int | str]
    absent: list[int | str]


# --- parsing, in one place ----------------------------------------------------------------------

M = TypeVar("M", bound=Message)
_COMMAND: TypeAdapter[Command] = TypeAdapter(Command)
_EVENT: TypeAdapter[Event] = TypeAdapter(Event)
_STRATEGY: TypeAdapter[Strategy] = TypeAdapter(Strategy)


def _describe(what: str, exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        problems.append(f"{where}: {error['msg']}" if where else error["msg"])
    return f"malformed {what}: " + "; ".join(problems)


def parse(model: type[M], body: Any) -> M:
    """`body` (decoded JSON) as a `model`; ProtocolError saying what is wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ProtocolError(_describe(model.__name__, exc)) from None


def parse_command(body: Any) -> Command:
    try:
        return _COMMAND.validate_python(body)
    except ValidationError as exc:
        raise ProtocolError(_describe("command", exc)) from None


def parse_event(body: Any) -> Event:
    try:
        return _EVENT.validate_python(body)
    except ValidationError as exc:
        raise ProtocolError(_describe("event", exc)) from None


def parse_strategy(name: Any) -> Strategy:
    """`name` as one of STRATEGIES; ProtocolError naming them otherwise."""
    try:
        return _STRATEGY.validate_python(name)
    except ValidationError as exc:
        raise ProtocolError(_describe("strategy", exc)) from None


def running_rescale(status: Mapping[str, Any]) -> RescaleReport | None:
    """The rescale a Status reply shows running, if any."""
    running = status.get("rescale")
    return None if running is None else parse(RescaleReport, running)


def queued_rescales(status: Mapping[str, Any]) -> list[RescaleReport]:
    """The rescales a Status reply shows waiting behind the running one, in the order they
    start."""
    return [parse(RescaleReport, r) for r in status.get("queued", [])]


def finished_rescales(status: Mapping[str, Any]) -> list[RescaleReport]:
    """The finished rescales a Status reply lists (the latest ones, oldest first)."""
    return [parse(RescaleReport, r) for r in status.get("rescales", [])]


def handles(
    model: type[M], handler: Callable[[M], Message | Mapping[str, Any]]
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A JSON control handler that parses its request as `model` first (a malformed one is
    refused with INVALID_ARGUMENT) and sends a Message reply as its wire form."""

    def call(body: dict[str, Any]) -> dict[str, Any]:
        try:
            request = parse(model, body)
        except ProtocolError as exc:
            raise ControlError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        reply = handler(request)
        return reply.wire() if isinstance(reply, Message) else dict(reply)

    return call
