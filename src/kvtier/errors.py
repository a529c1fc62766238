"""Every exception kvtier raises, each a `KVTierError`.

Every public function says which of these it raises. Failures of I/O on a cache tier are
returned as data (a miss, a dropped write) and counted; these exceptions are for the caller's
mistakes (`ConfigError`), for chunks that fail verification (`CorruptChunk` and its kinds,
which the tiers turn into misses), for requests kvtier does not cache, and for the operator
tools' servers.

Primitives: `KVTierError`, `ConfigError`, `TierConfigError`, `NotEnoughMemory`,
`TierUnavailable`, `DirectoryInUse`, `LinkTimeout`, `CorruptChunk`, `CodecFailure`,
`AuthFailure`, `KeyNotHeld`, `UncacheableRequest`, `HostBufferRaced`, `WarmupError`,
`ServerError`, `GcStopped`.
"""

from typing import Any

from kvtier.redaction import redact_text, redact_value


class KVTierError(Exception):
    """Base class of all kvtier errors."""


# -- configuration ---------------------------------------------------------------------------
class ConfigError(KVTierError, ValueError):
    """A configuration value is invalid.

    The message names the field, the value given and what is allowed. Credentials in the
    value or the explanation (a URL's password, `?password=`) are masked (kvtier.redaction):
    these messages are printed and logged.
    """

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = redact_value(value)
        self.allowed = redact_text(allowed)
        super().__init__(f"invalid config {field}={self.value!r}: {self.allowed}")


class TierConfigError(ConfigError):
    """A tier entry's ConfigError, whose `field` is already its path inside the store's
    config (e.g. "tiers.0.disk.path"): the store config's parser prefixes it with where the
    store config came from and nothing else."""


class FieldError(ConfigError):
    """A ConfigError a model's own check raises (a check across fields, or of a value before
    the fields' own), naming one of that model's fields: `kvtier.config.parse_model` names it
    by the model's place in the config (a pydantic ValueError there names the whole model)."""


class NotEnoughMemory(ConfigError):
    """A benchmark's size option asks for more memory than the machine has available now:
    refused before anything is allocated (kvtier.tools.bench.headroom), where the run ended
    in an allocation error's traceback or the OOM killer. `field` is the option."""

    def __init__(self, field: str, value: object, needed_bytes: int, available_bytes: int,
                 allowed: str) -> None:
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        super().__init__(field, value, allowed)


# -- tiers and chunks ------------------------------------------------------------------------
class TierUnavailable(KVTierError):
    """A tier cannot serve right now (directory unwritable, server down, ...)."""


class DirectoryInUse(TierUnavailable, OSError):
    """A disk tier's directory is owned by another open disk tier (another kvtier process,
    or one of this process not closed): raised when the tier is opened, in one line naming
    the directory, the owner's pid and the remedy (kvtier.tiers.files.owner). An OSError
    too, as a directory a tier cannot use is elsewhere (`open_store`'s callers)."""


class NodeUnavailable(TierUnavailable):
    """The node's cache (`kvtier node`) did not answer in time, is down, stopped or
    restarting, or answered nonsense: the engine misses (kvtier.node.client)."""


class LinkTimeout(KVTierError):
    """A measure of a tier's link found its deadline passed between two of its steps (it
    stops there; the tier gives no estimate: kvtier.tiers.links)."""


class CorruptChunk(KVTierError):
    """Stored chunk data failed verification (magic, version, layout, key, size or checksum).
    The tier that read it removes it and reports a miss.

    `file_id`: (st_dev, st_ino, st_ctime_ns) of the chunk file that failed, where a file
    tier read one (`kvtier.tiers.files.filetree.file_id`): that file is the one removed, never
    a good copy another writer placed at its path since
    (tests/faults/test_corrupt_copy_replaced.py)."""

    def __init__(self, *args: object, file_id: tuple[int, int, int] | None = None) -> None:
        super().__init__(*args)
        self.file_id = file_id


class UnreadableChunk(KVTierError, OSError):
    """A chunk file a tier opened failed to read (EIO: a bad sector, a lost device): an
    OSError with the errno raised, and the `file_id` of the file read, so that a tier
    dropping it drops that file only, never a copy stored at its path since (as
    `CorruptChunk`)."""

    def __init__(self, cause: OSError, file_id: tuple[int, int, int]) -> None:
        super().__init__(cause.errno, cause.strerror)
        self.file_id = file_id


class CodecFailure(CorruptChunk):
    """A chunk's codec is unknown to this reader, or its bytes did not decode to the payload
    the header describes (kvtier.core.codecs)."""


class AuthFailure(CorruptChunk):
    """A sealed chunk that failed authentication under its key: tampered bytes or header
    (kvtier.core.sealing)."""


class KeyNotHeld(AuthFailure):
    """A sealed chunk under a key this reader does not hold (its tenant unknown to this
    process, another tenant's, another secret's): not proof of tampering — another reader
    may hold the key — so the chunk is a miss and is kept."""


# -- requests --------------------------------------------------------------------------------
class UncacheableRequest(KVTierError):
    """The request's KV depends on something kvtier cannot encode deterministically (an
    input kind the chunk keys do not cover): the request is served without kvtier."""


class RequestFieldError(KVTierError, ValueError):
    """A field of a client's request that kvtier reads is malformed (a `cache_control`
    marker): the server answers 400 with this message, which names the field by its path in
    the request body, the value and what is allowed."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {field}={value!r}: {allowed}")


# -- the test devices -----------------------------------------------------------------------
class HostBufferRaced(KVTierError):
    """The CPU stand-in device (kvtier.testing.standin) found a host buffer changed between the
    `run` that queued a device read or write of it and the stream's turn to do it: on a GPU
    the DMA would have moved the wrong bytes (a spare refilled, a slot reused, or a host read
    or write before the copy's event)."""

    def __init__(self, op: str, access: str, shape: tuple[int, ...], dtype: object) -> None:
        self.op = op
        self.access = access  # "read" or "write"
        super().__init__(f"a host buffer ({dtype}, shape {list(shape)}) that {op} queued to "
                         f"{access} was changed by the host before the stream ran it")


class HostSync(KVTierError):
    """The CPU stand-in device's recorder met an op whose result the host needs (a scalar, a
    shape only the data tells): internal to kvtier.testing.standinwork, which then runs the
    op at once, as a GPU's host would wait for it."""


# -- the operator tools ----------------------------------------------------------------------
class WarmupError(KVTierError):
    """`kvtier warm`: the server cannot be used (unreachable, not an OpenAI-compatible vLLM,
    no model)."""


class ServerError(KVTierError):
    """A vLLM server the tools started exited or did not become healthy in time (the message
    has its log)."""


class ClientFailed(KVTierError):
    """`kvtier bench clients`: a vendored benchmark client exited with an error or ran past
    its time (the message has its command and the end of its output)."""


class ShimUnavailable(KVTierError):
    """A benchmark's emulated filesystem latency cannot run here (no C compiler, not Linux, or
    its shim did not build): `kvtier.tools.bench.emulators.fslatency`."""


class GcStopped(KVTierError):
    """`kvtier gc` stopped partway through a tier's deletions (a command the storage refused,
    a connection dropped): what it had removed by then is in `outcomes` (the tiers' before it
    too; kvtier.tools.admin.gc.GcOutcome), counted by listing the tier again (`counted`: False
    where that listing failed too), and `cause` is what stopped it."""

    def __init__(self, tier: str, cause: BaseException, outcomes: list[Any],
                 counted: bool) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.tier, self.cause, self.outcomes, self.counted = tier, cause, outcomes, counted
