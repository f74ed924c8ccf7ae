"""Tensor-parallel ranks over ``torch.distributed``: rank 0 owns the bus.

Every step, rank 0 polls its :class:`~bus.Receiver` and broadcasts what it got
to every rank as codec frames packed in ``uint8`` tensors (never pickle); the
other ranks decode and handle the same requests in the same order, so every
rank runs the same batch. A step that received nothing, or a few requests,
costs one 8 KiB broadcast. Outputs leave from rank 0 only; an rpc runs on every rank
and rank 0 answers once, with every rank's outcome (:func:`rpc_reducer`).

When every rank runs on rank 0's node (the default ``transport="auto"``
finds out once, at construction, by gathering a node id), the poll travels
through a shared-memory ring instead (:class:`~bus.ShmWriter`, one reader
per other rank, parked on an fd: no spin): one memcpy in, one out, no
collective per step. A poll too large for the ring, and every step on
ranks spread over several nodes, use the broadcast. Either way a poll is
its outline (origins, rejections) and its messages encoded as bursts: one
msgspec call per ``MAX_BURST`` messages on each side, not one per message. The model's own
collectives are untouched.
"""

from __future__ import annotations

import errno
import hashlib
import socket
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from operator import attrgetter
from typing import Literal, cast

import msgspec
import torch
import torch.distributed as dist

from bus import Envelope, Origin, Receiver, Rejected, ShmReader, ShmWriter
from bus.shm.segment import ShmSpaceError, shm_space
from messages import (
    MAX_BURST,
    Codec,
    DecodeError,
    Frame,
    Message,
    Output,
    Request,
    RpcReqOutput,
    RpcResult,
)
from router import CallbackSink, Router

__all__ = ["BroadcastReceiver", "TPConfig", "check_tp_room", "init_ranks", "null_router",
           "rpc_reducer"]


@dataclass(frozen=True, slots=True)
class TPConfig:
    """How the ranks meet: ``world_size`` processes rendezvous through ``init_file``."""

    world_size: int
    init_file: str
    timeout_s: float = 60.0


def check_tp_room() -> None:
    """Refuse a tensor-parallel start at once when ``/dev/shm`` cannot hold its ring.

    Docker's default ``/dev/shm`` is 64 MiB, less than the ring: rank 0 would
    fail (it reserves the ring's space when it makes it) after every rank
    started. This check, before anything starts, says so in one line; rank 0
    still checks for real (another process may take the room meanwhile).

    Raises:
        ShmSpaceError: less free room than the ring needs (names the size).
    """
    space = shm_space()
    if space is None:  # a TSB_SHM_DIR that does not exist: say so now, not in a rank
        raise ShmSpaceError(errno.ENOENT, _SHM_RING_BYTES, None, None,
                            "the tensor-parallel ring", "the directory cannot be read")
    if space[0] < _SHM_RING_BYTES:
        raise ShmSpaceError(errno.ENOSPC, _SHM_RING_BYTES, space[0], space[1],
                            "the tensor-parallel ring", "not enough free space")


def init_ranks(rank: int, tp: TPConfig) -> None:
    """Join the process group (gloo on CPU, nccl when CUDA is present)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tp.init_file}", rank=rank,
                            world_size=tp.world_size, timeout=timedelta(seconds=tp.timeout_s))


class _Refusal(msgspec.Struct, array_like=True, gc=False):
    """An envelope of the poll that rank 0 could not decode: its place and its error."""

    position: int
    reason: str
    rid: str | None
    message_type: str | None


class _Outline(msgspec.Struct, array_like=True, gc=False):
    """One poll, less its messages' bytes: every envelope's origin, the rejections, the bursts.

    The accepted messages travel as bursts (``Codec.encode_many``, up to
    ``MAX_BURST`` each: one msgspec call per burst either way), in order;
    ``bursts`` holds each burst's frame sizes. ``where`` is one uint32 per
    envelope (rejections included): its index in ``origins``.
    """

    origins: list[tuple[str, bytes | None]]
    where: bytes
    refused: list[_Refusal]
    bursts: list[list[int]]


_HEAD = msgspec.msgpack.Encoder()
_FIRST = 8192  # bytes of the first broadcast of every step: length + a small poll
_OUTLINE = msgspec.msgpack.Decoder(_Outline)
_INTERNAL = Origin("internal")  # requests rank 0 decided on, not received
_SHM_RING_BYTES = 64 << 20  # a poll of up to 32 MiB goes through shared memory
_SHM_SEND_TIMEOUT = 60.0  # rank 0 waits this long for a follower that stopped reading
_VIA_SHM, _VIA_COLLECTIVE = b"S", b"G"
_NAME_BYTES = 256
_ORIGIN_OF = attrgetter("origin")  # Envelope and Rejected alike
_MESSAGE_OF = attrgetter("message")


def _node_id() -> int:
    """This machine, as an int64: hostname and boot id (containers may share a hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:  # pragma: no cover
        boot = b""
    digest = hashlib.blake2b(socket.gethostname().encode() + b"/" + boot, digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


def _all_local() -> bool:
    """Whether every rank of the group runs on this node (a collective: all ranks call it)."""
    mine = torch.tensor([_node_id()], dtype=torch.int64)
    ids = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(ids, mine)
    return all(int(t[0]) == int(mine[0]) for t in ids)


class BroadcastReceiver:
    """A receiver shared by all ranks: rank 0 polls and broadcasts, the others listen.

    Args:
        rank: this process's rank.
        inner: the real receiver (rank 0 only; ``None`` elsewhere).
        codec: encodes and decodes the requests.
        transport: ``"auto"`` (shared memory when every rank is on this
            node, else the process group's broadcast), ``"shm"`` (required:
            :class:`ValueError` if a rank is elsewhere) or ``"collective"``
            (always the broadcast). Every rank must pass the same value.
            Where a process group is up with more than one rank, all ranks
            construct their receiver together (it is a collective).

    Raises:
        ValueError: ``transport="shm"`` with a rank on another node.
    """

    def __init__(self, rank: int, inner: Receiver[Request] | None, codec: Codec[Request], *,
                 transport: Literal["auto", "shm", "collective"] = "auto") -> None:
        if (rank == 0) != (inner is not None):
            raise ValueError("rank 0, and only rank 0, owns the inner receiver")
        self.rank = rank
        self.inner = inner
        self.codec = codec
        self.broadcasts = 0
        self._idle = torch.zeros(_FIRST, dtype=torch.uint8)  # length 0: nothing arrived
        self._injected: list[Envelope[Request] | Rejected] = []
        self._writer: ShmWriter | None = None
        self._reader: ShmReader | None = None
        if transport != "collective" and dist.is_initialized() and dist.get_world_size() > 1:
            local = _all_local()
            if transport == "shm" and not local:
                raise ValueError("transport='shm' needs every rank on one node")
            if local:
                self._open_shm()
        #: How each poll reaches the other ranks: ``"shm"`` or ``"collective"``.
        self.transport = "shm" if (self._writer or self._reader) else "collective"

    def _open_shm(self) -> None:
        """Rank 0 makes the ring and broadcasts its name; the others attach (a collective).

        Raises:
            ShmSpaceError: rank 0 could not reserve the ring in ``/dev/shm``
                (every rank raises: an empty name tells the others).
        """
        name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        failed: ShmSpaceError | None = None
        if self.rank == 0:
            try:
                self._writer = ShmWriter(dist.get_world_size() - 1, _SHM_RING_BYTES, name="tp")
            except ShmSpaceError as exc:
                failed = exc  # the others must not wait for a name: send an empty one
            else:
                raw = self._writer.handle.encode()
                name[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(name, src=0)
        if failed is not None:
            raise failed
        if not int(name[0]):
            raise ShmSpaceError(errno.ENOSPC, _SHM_RING_BYTES, None, None,
                                "the tensor-parallel ring", "rank 0 could not make it")
        if self.rank != 0:
            handle = bytes(name.numpy().tobytes()).rstrip(b"\0").decode()
            self._reader = ShmReader.attach(handle, self.rank - 1, name="tp")

    def close(self) -> None:
        """Release the shared-memory ring (rank 0 unlinks it). Idempotent."""
        if self._writer is not None:
            self._writer.close()
        if self._reader is not None:
            self._reader.close()

    def inject(self, req: Request) -> None:
        """Rank 0: have every rank handle ``req`` at the next poll.

        For decisions rank 0 takes alone (aborting the requests whose
        outputs are stuck behind a consumer that is not reading): the other
        ranks must drop them too, or their batches drift apart.
        """
        self._injected.append(Envelope(req, _INTERNAL))

    def poll(self) -> Sequence[Envelope[Request] | Rejected]:
        """Rank 0: poll, then broadcast. Others: block until rank 0's broadcast.

        One fixed-size broadcast carries the length and, when it fits, the
        whole poll (an idle step or a few requests: one round); a bigger
        poll sends the rest in a second broadcast.
        """
        self.broadcasts += 1
        if self._writer is not None or self._reader is not None:
            return self._poll_shm()
        if self.inner is not None:
            envelopes = self._take()
            if not envelopes:
                dist.broadcast(self._idle, src=0)
                return envelopes
            self._broadcast(envelopes)
            return envelopes
        return self._receive()

    def _poll_shm(self) -> Sequence[Envelope[Request] | Rejected]:
        """The poll through the ring: ``S`` + the packed poll, or ``G`` ("see the broadcast")."""
        if self._writer is not None:
            envelopes = self._take()
            if not envelopes:
                self._writer.send([_VIA_SHM], timeout=_SHM_SEND_TIMEOUT)
                return envelopes
            parts = _pack_poll(self.codec, envelopes)
            if (sum(memoryview(f).nbytes for f in parts) + 8 * len(parts) + 64
                    < _SHM_RING_BYTES // 2):
                self._writer.send([_VIA_SHM, *parts], timeout=_SHM_SEND_TIMEOUT)
                return envelopes
            self._writer.send([_VIA_COLLECTIVE], timeout=_SHM_SEND_TIMEOUT)
            self._broadcast(envelopes)
            return envelopes
        assert self._reader is not None
        frames = self._reader.recv(None)
        if frames[0] == _VIA_SHM:
            if len(frames) == 1:
                return []
            return _unpack_poll(self.codec, frames[1], frames[2:])
        return self._receive()

    def _take(self) -> Sequence[Envelope[Request] | Rejected]:
        """Rank 0: this poll's envelopes, the injected ones first."""
        assert self.inner is not None
        envelopes: Sequence[Envelope[Request] | Rejected] = self.inner.poll()
        if self._injected:
            envelopes = [*self._injected, *envelopes]
            self._injected = []
        return envelopes

    def _broadcast(self, envelopes: Sequence[Envelope[Request] | Rejected]) -> None:
        """Rank 0: the packed poll over the collective, in one or two broadcasts."""
        wire = torch.frombuffer(self._pack(envelopes), dtype=torch.uint8)
        dist.broadcast(wire[:_FIRST], src=0)
        if len(wire) > _FIRST:
            dist.broadcast(wire[_FIRST:], src=0)

    def _receive(self) -> Sequence[Envelope[Request] | Rejected]:
        """The other ranks: rank 0's packed poll from the collective."""
        head = torch.empty(_FIRST, dtype=torch.uint8)
        dist.broadcast(head, src=0)
        n = int.from_bytes(head[:8].numpy().tobytes(), "little")
        if n == 0:
            return []
        if 8 + n > _FIRST:
            whole = torch.empty(8 + n, dtype=torch.uint8)
            whole[:_FIRST] = head
            dist.broadcast(whole[_FIRST:], src=0)
            head = whole
        return self._unpack(head.numpy().data[8 : 8 + n])

    def pause(self, name: str) -> None:
        """Rank 0: stop draining inbox ``name`` (the others follow its broadcasts)."""
        if self.inner is not None:
            self.inner.pause(name)

    def resume(self, name: str) -> None:
        """Rank 0: drain inbox ``name`` again."""
        if self.inner is not None:
            self.inner.resume(name)

    def wait(self, timeout: float | None) -> bool:
        """Rank 0 parks on its inboxes; the other ranks park inside :meth:`poll`."""
        if self.inner is not None:
            return self.inner.wait(timeout)
        return True

    def _pack(self, envelopes: Sequence[Envelope[Request] | Rejected], *,
              pad: bool = True) -> bytearray:
        """One buffer: payload length, outline length, outline, burst frames; padded."""
        parts = _pack_poll(self.codec, envelopes)
        buf = bytearray(8)
        buf += memoryview(parts[0]).nbytes.to_bytes(8, "little")
        for f in parts:
            buf += f
        buf[:8] = (len(buf) - 8).to_bytes(8, "little")
        if pad and len(buf) < _FIRST:
            buf += bytes(_FIRST - len(buf))
        return buf

    def _unpack(self, data: memoryview) -> list[Envelope[Request] | Rejected]:
        n = int.from_bytes(data[:8], "little")
        outline = data[8 : 8 + n]
        return _unpack_poll(self.codec, outline, _slices(data, 8 + n, outline))


def _pack_poll(codec: Codec[Request],
               envelopes: Sequence[Envelope[Request] | Rejected]) -> list[Frame]:
    """The frames of one poll: its :class:`_Outline`, then every burst's frames, in order.

    The accepted messages are encoded as bursts (one msgspec call per
    ``MAX_BURST``), not one by one: per-message Python work is what a
    256-request poll costs.
    """
    # Origins by identity (the common case: every envelope of an inbox shares one
    # object); map and comprehensions keep the per-envelope work in C.
    origins = list(map(_ORIGIN_OF, envelopes))
    table: dict[int, int] = {}
    uniq: list[Origin] = []
    for o in origins:
        if id(o) not in table:
            table[id(o)] = len(uniq)
            uniq.append(o)
    where = array("I", map(table.__getitem__, map(id, origins)))
    refused = [_Refusal(pos, env.error.reason, env.error.rid, env.error.message_type)
               for pos, env in enumerate(envelopes) if type(env) is Rejected]
    msgs: list[Request] = ([env.message for env in envelopes if isinstance(env, Envelope)]
                           if refused else list(map(_MESSAGE_OF, envelopes)))
    frames: list[Frame] = []
    bursts: list[list[int]] = []
    for at in range(0, len(msgs), MAX_BURST):
        fs = codec.encode_many(msgs[at : at + MAX_BURST])
        bursts.append([memoryview(f).nbytes for f in fs])
        frames.extend(fs)
    outline = _Outline([(o.inbox, o.identity) for o in uniq], where.tobytes(), refused, bursts)
    return [_HEAD.encode(outline), *frames]


def _slices(data: memoryview, pos: int, outline: Frame) -> list[memoryview]:
    """The burst frames that follow an outline in one buffer (their sizes are in it)."""
    frames = []
    for size in (n for sizes in _OUTLINE.decode(outline).bursts for n in sizes):
        frames.append(data[pos : pos + size])
        pos += size
    return frames


def _unpack_poll(codec: Codec[Request], outline: Frame,
                 frames: Sequence[Frame]) -> list[Envelope[Request] | Rejected]:
    """Rebuild a poll from :func:`_pack_poll`'s outline and burst frames.

    A burst that fails to decode here (it decoded on rank 0, so only a bug
    or a corrupted transfer can do that) becomes rejections, member by
    member where the codec can tell them apart, so every rank still sees
    the same number of envelopes in the same order.
    """
    plan = _OUTLINE.decode(outline)
    origins = [Origin(inbox, identity) for inbox, identity in plan.origins]
    where = array("I")
    where.frombytes(plan.where)
    msgs: list[Request | DecodeError] = []
    failed = False
    at = 0
    for sizes in plan.bursts:
        fs = frames[at : at + len(sizes)]
        at += len(sizes)
        expect = min(MAX_BURST, len(where) - len(plan.refused) - len(msgs))
        try:
            got = codec.decode_any(fs)
        except DecodeError as exc:
            members = codec.decode_members(fs) if expect > 1 else [exc]
            if len(members) != expect:  # not even the outline read: the burst's error, each
                members = [exc] * expect
            msgs.extend(members)
            failed = True
            continue
        if isinstance(got, list):
            msgs.extend(got)
        else:
            msgs.append(got)
    if not plan.refused and not failed and len(msgs) == len(where):
        ok = cast(list[Request], msgs)  # no DecodeError among them: checked just above
        return list(map(Envelope, ok, map(origins.__getitem__, where)))
    refused = {r.position: r for r in plan.refused}
    out: list[Envelope[Request] | Rejected] = []
    it = iter(msgs)
    for pos, k in enumerate(where):
        r = refused.get(pos)
        if r is not None:
            out.append(Rejected(DecodeError(r.reason, rid=r.rid, message_type=r.message_type),
                                origins[k]))
            continue
        m = next(it)
        out.append(Rejected(m, origins[k]) if isinstance(m, DecodeError)
                   else Envelope(m, origins[k]))
    return out


def rpc_reducer(rank: int, world_size: int) -> Callable[[RpcReqOutput], RpcReqOutput | None]:
    """Gather every rank's rpc reply on rank 0 and merge them into one answer.

    The merged reply succeeds only if every rank did; its message names the
    ranks that failed. A scalar result ``key`` becomes the list of the ranks'
    values (rank order); a list result becomes ``key.rank<r>`` per rank.
    Other ranks get ``None`` (they answer nobody).
    """
    codec: Codec[Message] = Codec(Message, types=[RpcReqOutput])

    def reduce(reply: RpcReqOutput) -> RpcReqOutput | None:
        raw = bytes(memoryview(codec.encode(reply)[0]))
        size = torch.tensor([len(raw)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(sizes, size)
        longest = max(int(s[0]) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world_size)]
        dist.all_gather(bufs, mine)
        if rank != 0:
            return None
        replies = []
        for s, b in zip(sizes, bufs, strict=True):
            r = codec.decode([b.numpy()[: int(s[0])].tobytes()])
            assert isinstance(r, RpcReqOutput)
            replies.append(r)
        failed = [i for i, r in enumerate(replies) if not r.success]
        merged: RpcResult = {}
        for i, r in enumerate(replies):
            for k, v in (r.result or {}).items():
                if isinstance(v, list):
                    merged[f"{k}.rank{i}"] = v
                else:
                    per_rank = merged.setdefault(k, [])
                    assert isinstance(per_rank, list)
                    per_rank.append(v)
        message = "ok" if not failed else "; ".join(
            f"rank {i} failed: {replies[i].message}" for i in failed)
        return RpcReqOutput(rid=reply.rid, success=not failed, message=message,
                            result=merged or None)

    return reduce


def null_router() -> Router[Output]:
    """The router of ranks other than 0: outputs leave from rank 0 only."""
    router: Router[Output] = Router(Output)
    router.register(Output, CallbackSink(lambda output, origin: None))
    router.freeze()
    return router



