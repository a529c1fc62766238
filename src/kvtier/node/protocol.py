"""The messages between an engine and its node (`kvtier node`), and their framing.

One request, at most one reply (a streamed `Borrow`'s in parts, `Lent.more`), on a Unix stream
socket: each message is msgspec's MessagePack of a tagged struct behind a 4-byte big-endian
length. Every request of a load or a store
carries all of that step's chunks (a `Borrow` of a request's hit, a `Reserve` of a step's
stores): control round trips are per step, never per chunk. `Release`, `Touch`, `Commit`
and `Describe` get no reply (the engine never waits for them). Chunk bytes never cross the
socket: offsets name them in the node's shared-memory slab (`Welcome.shm_path`). A load of
chunks whose slots the engine knows takes no round trip at all: it holds their slots by a
lock in the slab's file (`kvtier.tiers.shmslab.SlabReader`) and tells the node (`Touch`).

Primitives: the messages, `Meta`, `send`, `receive_request`, `receive_reply`, `HELD`,
`SKIPPED`, `SEND`, `RAM_TIER`, `BELOW_TIER`, `MAX_KEYS`.
"""

from __future__ import annotations

import socket
import struct
from typing import Annotated

import msgspec

from kvtier.core.keys import KEY_BYTES, ChunkKey
from kvtier.core.retention import ChunkMeta
from kvtier.errors import NodeUnavailable

# `Reserved.offsets` values that are not offsets: the node holds the chunk already (stored),
# took no slot for it and nothing else would store it (not stored), or has no RAM slot for it
# (declined by admission, full) but its tiers below RAM take it: the engine sends the bytes
# with its `Commit` (a copy over the socket, where a slot costs none).
HELD, SKIPPED, SEND = -1, -2, -3
# The two tiers an engine sees in node mode (its load costs, counters, lookups): the node's
# RAM, read in place, and every tier below it, read by the node.
RAM_TIER, BELOW_TIER = "node", "node-below"
MAX_FRAME = 64 << 20  # bytes: far above any control message (a frame past it is garbage)
_LENGTH = struct.Struct(">I")
_PIECE = 1 << 20  # bytes a frame is read by: memory follows the bytes that came, not a header
# A chunk's key on the wire: a message with a key of another length is refused as it decodes.
Key = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
# The most chunks one message names (a Lookup's, Borrow's, Reserve's or Touch's keys, a
# Describe's chunks): one prompt of 16.7M tokens at the default 256 tokens a chunk (1M at 16),
# past any served model's context. An engine never sends more (`NodeStore` cuts its lists
# here: the chunks past it miss). A longer list is refused as it decodes and the connection
# closed: any user of the node's group may send one, and a Borrow of 2 million keys (a
# frame's 64 MiB holds 3 million) kept a thread of the node busy for 85 s submitting reads,
# a Reserve for 24 s (tests/node/test_node_key_bounds.py).
MAX_KEYS = 1 << 16
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]


class Meta(msgspec.Struct, array_like=True):
    """A `ChunkMeta` on the wire."""

    tenant: str | None = None
    retain_until: float | None = None
    expires_at: float | None = None
    parent: Key | None = None

    @classmethod
    def of(cls, meta: ChunkMeta) -> Meta:
        return cls(meta.tenant, meta.retain_until, meta.expires_at, meta.parent)

    def chunk_meta(self) -> ChunkMeta:
        return ChunkMeta(self.tenant, self.retain_until, self.expires_at,
                         None if self.parent is None else ChunkKey(self.parent))


Metas = Annotated[list[Meta], msgspec.Meta(max_length=MAX_KEYS)]  # a meta a key


class Hello(msgspec.Struct, tag=True):
    """An engine's first message on a connection: the layout (KVLayout's fields) and model of
    the chunks it moves; the node answers `Welcome`, or `Refused`."""

    layout: dict[str, object]
    model: str
    fingerprint: str
    weight_files: int
    engine: str  # who is asking (host:pid:tag: client.default_engine_name), for logs and status
    # It reads each lent slot's stamp again after its copy (`Lent.stamps`): only then may
    # the node take a lending of its back (`NodeConfig.lease_timeout_s`); an engine of an
    # older kvtier (False) would copy a slot given to another chunk as its own.
    stamps: bool = False


class Welcome(msgspec.Struct, tag=True):
    shm_path: str  # the layout's RAM slab, mapped by the engine
    shm_bytes: int
    chunk_bytes: int
    generation: str  # changes when the node restarts (the slab is a new file)
    node: str  # the node's name (its host, unless configured)
    # The node publishes KV events of its tiers (`--events-endpoint`): the scheduler sends
    # it a `Describe` of each step's stores (an older node's Welcome lacks it: False).
    events: bool = False
    # The node's tiers, fastest first (the first its RAM, whose slab this is): where tiers
    # below RAM exist, the scheduler asks for them off its thread (`Lookup.ram_only`).
    tiers: list[str] = msgspec.field(default_factory=list)


class Refused(msgspec.Struct, tag=True):
    """The node cannot serve the request (a layout it has no room for, a bad message)."""

    reason: str


class Lookup(msgspec.Struct, tag=True):
    """Which `keys` the node holds. `ram_only`: in its RAM tier only (an index lookup, no
    I/O: the answer the scheduler's thread may wait for); else in any tier, those below RAM
    asked with one batch each (a remote store's round trips)."""

    keys: Keys
    ram_only: bool = False


class Found(msgspec.Struct, tag=True):
    held: list[bool]


class Borrow(msgspec.Struct, tag=True):
    """Lend `keys` in order until the first miss, promoting chunks below RAM into RAM;
    `budget_s`: the engine's budget for this load (its recompute's time): reads not landed by
    then are abandoned and the run ends there (None: the store's read deadline only).
    `stream`: answered in parts as the chunks land (`Lent.more`), so that the engine copies
    the first while the node reads the rest; else one `Lent` once every read has ended."""

    keys: Keys
    metas: Metas
    budget_s: float | None = None
    stream: bool = False

    def __post_init__(self) -> None:
        _a_meta_a_key(self.keys, self.metas)


def _a_meta_a_key(keys: list[bytes], metas: list[Meta]) -> None:
    """Raises ValueError (a message refused as it decodes): not one meta a key."""
    if len(metas) != len(keys):
        raise ValueError(f"{len(metas)} metas for {len(keys)} keys")


class Lent(msgspec.Struct, tag=True):
    """The chunks of a `Borrow`, in order; a streamed one's in parts, each part the chunks
    that landed since the last (`more`: another part follows; the last part carries the
    lease and the failed tier)."""

    lease: int  # ends with `Release`, or with the engine's connection
    offsets: list[int]  # of the part's keys in the slab, or SEND: its bytes in `data`
    tiers: list[str]  # the node's tier that held each
    failed_tier: str | None  # the tier that failed the read of the key after the last lent
    # The bytes of the chunks at SEND offsets, in order: read from a tier below RAM where RAM
    # had no slot for them (full, every slot lent), a copy over the socket.
    data: list[bytes] = msgspec.field(default_factory=list)
    more: bool = False
    # Each offset's slot stamp as lent (`kvtier.tiers.shmslab.SlotStamps`; -1 at SEND): the
    # engine reads it again once its copy is done, a node that took the lending back
    # (`NodeConfig.lease_timeout_s`) may have given the slot to another chunk since. Empty
    # from a node of an older kvtier (which takes nothing back).
    stamps: list[int] = msgspec.field(default_factory=list)


class Release(msgspec.Struct, tag=True):
    lease: int


class Touch(msgspec.Struct, tag=True):
    """The engine read these chunks in place in the slab without a `Borrow` (it held their
    slots' locks: `kvtier.tiers.shmslab.SlabReader`): recent for the node's policy, as a
    borrow is. No reply."""

    keys: Keys


class Reserve(msgspec.Struct, tag=True):
    """Slots for a step's stores, one per key (or HELD / SKIPPED / SEND)."""

    keys: Keys
    metas: Metas

    def __post_init__(self) -> None:
        _a_meta_a_key(self.keys, self.metas)


class Reserved(msgspec.Struct, tag=True):
    lease: int
    offsets: list[int]


class Commit(msgspec.Struct, tag=True):
    """Reserved slot `index` of `lease` filled (stored from now on), or not (`filled` False:
    given back). `reply`: answered once done, and so every commit sent before it on the
    connection: the last of a step's, so that the engine reports its chunks stored only once
    any engine's next lookup finds them (`Answer(False)`: no slot of this connection's, as a
    restarted node's, nothing done: not stored; a node before this answered True). `data`:
    the chunk's bytes for a SEND slot (none in the slab)."""

    lease: int
    index: int
    filled: bool
    reply: bool = False
    data: bytes | None = None


class Described(msgspec.Struct, array_like=True):
    """A chunk as a KV event describes it (`kvtier.tiers.eventfacts.ChunkInfo` and its key)."""

    key: Key
    parent: Key | None
    token_ids: bytes  # little-endian int32
    lora_name: str | None = None
    cache_salt: str | None = None


class Describe(msgspec.Struct, tag=True):
    """The chunks a step plans to store, for the node's KV events (it knows no token ids);
    sent by the scheduler when `Welcome.events`, no reply."""

    chunks: Annotated[list[Described], msgspec.Meta(max_length=MAX_KEYS)]


class Retain(msgspec.Struct, tag=True):
    key: Key
    meta: Meta


class Flush(msgspec.Struct, tag=True):
    """Wait until the writes behind RAM are done (at most `timeout_s`)."""

    timeout_s: float | None


class Status(msgspec.Struct, tag=True):
    pass


class MeasureLinks(msgspec.Struct, tag=True):
    """The links of the node's tiers below RAM as the node measured them (`NodeLinks`: each
    tier's best of its last measures), answered as an `Answer` of {tier: [round trip s,
    bytes a second]} (empty until its first measure ends): the engine's prior for a load from
    below the node's RAM before one is timed."""


class Answer(msgspec.Struct, tag=True):
    """A plain answer: a count, a flag, or a status document."""

    value: object


Request = (Hello | Lookup | Borrow | Release | Touch | Reserve | Commit | Retain | Flush
           | Status | Describe | MeasureLinks)
Reply = Welcome | Refused | Found | Lent | Reserved | Answer
_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


def send(sock: socket.socket, message: Request | Reply) -> None:
    """Write one framed message. Raises OSError (the peer is gone, a timeout)."""
    body = _encoder.encode(message)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def receive_request(sock: socket.socket) -> Request | None:
    """The next request; None when the engine closed the connection.

    Raises:
        OSError: the connection broke; msgspec.ValidationError / DecodeError: garbage.
    """
    body = _read_frame(sock)
    if body is None:
        return None
    request: Request = _requests.decode(body)
    return request


def receive_reply(sock: socket.socket) -> Reply:
    """The node's reply. Raises NodeUnavailable (closed, broken, timed out, garbage)."""
    try:
        body = _read_frame(sock)
        if body is None:
            raise NodeUnavailable("the node closed the connection")
        reply: Reply = _replies.decode(body)
        return reply
    except (OSError, msgspec.MsgspecError, ValueError) as exc:
        raise NodeUnavailable(str(exc) or type(exc).__name__) from exc


def _read_frame(sock: socket.socket) -> bytes | None:
    head = _read_exactly(sock, _LENGTH.size)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME:
        raise ValueError(f"a frame of {length} bytes (at most {MAX_FRAME})")
    body = _read_exactly(sock, length)
    if body is None:
        raise ConnectionResetError("the connection closed mid-message")
    return body


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes, or None at a clean end of stream before the first byte. Read in pieces
    of at most `_PIECE` bytes: a buffer of the length a header announced, allocated at once,
    let any peer hold a frame's bound of the node's memory a connection by sending a header
    and nothing more (tests/node/test_node_frame_memory.py)."""
    pieces: list[bytes] = []
    got = 0
    while got < size:
        piece = sock.recv(min(size - got, _PIECE))
        if not piece:
            if got == 0:
                return None
            raise ConnectionResetError("the connection closed mid-message")
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
