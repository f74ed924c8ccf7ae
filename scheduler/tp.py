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
ranks spread over several nodes, use the broadcast. The model's own
collectives are untouched.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import msgspec
import torch
import torch.distributed as dist

from bus import Envelope, Origin, Receiver, Rejected, ShmReader, ShmWriter
from messages import (
    Codec,
    DecodeError,
    Message,
    Output,
    Request,
    RpcReqOutput,
    RpcResult,
)
from router import CallbackSink, Router

__all__ = ["BroadcastReceiver", "TPConfig", "init_ranks", "null_router", "rpc_reducer"]



@dataclass(frozen=True, slots=True)
class TPConfig:
    """How the ranks meet: ``world_size`` processes rendezvous through ``init_file``."""

    world_size: int
    init_file: str
    timeout_s: float = 60.0


def init_ranks(rank: int, tp: TPConfig) -> None:
    """Join the process group (gloo on CPU, nccl when CUDA is present)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tp.init_file}", rank=rank,
                            world_size=tp.world_size, timeout=timedelta(seconds=tp.timeout_s))


class _Item(msgspec.Struct, array_like=True):
    """One envelope of a broadcast poll: its origin and frame sizes (or its rejection)."""

    inbox: str
    identity: bytes | None
    sizes: list[int]
    reason: str | None = None
    rid: str | None = None
    message_type: str | None = None


_HEAD = msgspec.msgpack.Encoder()
_FIRST = 8192  # bytes of the first broadcast of every step: length + a small poll
_ITEMS = msgspec.msgpack.Decoder(list[_Item])
_INTERNAL = Origin("internal")  # requests rank 0 decided on, not received
_SHM_RING_BYTES = 64 << 20  # a poll of up to 32 MiB goes through shared memory
_SHM_SEND_TIMEOUT = 60.0  # rank 0 waits this long for a follower that stopped reading
_VIA_SHM, _VIA_COLLECTIVE = b"S", b"G"
_NAME_BYTES = 256


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
        """Rank 0 makes the ring and broadcasts its name; the others attach (a collective)."""
        name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            self._writer = ShmWriter(dist.get_world_size() - 1, _SHM_RING_BYTES, name="tp")
            raw = self._writer.handle.encode()
            name[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(name, src=0)
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
            envelopes = self.inner.poll()
            if self._injected:
                envelopes = [*self._injected, *envelopes]
                self._injected = []
            if not envelopes:
                dist.broadcast(self._idle, src=0)
                return envelopes
            wire = torch.frombuffer(self._pack(envelopes), dtype=torch.uint8)
            dist.broadcast(wire[:_FIRST], src=0)
            if len(wire) > _FIRST:
                dist.broadcast(wire[_FIRST:], src=0)
            return envelopes
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

    def _poll_shm(self) -> Sequence[Envelope[Request] | Rejected]:
        """The poll through the ring: ``S`` + the packed poll, or ``G`` ("see the broadcast")."""
        if self._writer is not None:
            assert self.inner is not None
            envelopes = self.inner.poll()
            if self._injected:
                envelopes = [*self._injected, *envelopes]
                self._injected = []
            if not envelopes:
                self._writer.send([_VIA_SHM], timeout=_SHM_SEND_TIMEOUT)
                return envelopes
            packed = self._pack(envelopes, pad=False)
            if len(packed) + 64 < _SHM_RING_BYTES // 2:
                self._writer.send([_VIA_SHM, packed], timeout=_SHM_SEND_TIMEOUT)
                return envelopes
            self._writer.send([_VIA_COLLECTIVE], timeout=_SHM_SEND_TIMEOUT)
            wire = torch.frombuffer(self._pack(envelopes), dtype=torch.uint8)
            dist.broadcast(wire[:_FIRST], src=0)
            if len(wire) > _FIRST:
                dist.broadcast(wire[_FIRST:], src=0)
            return envelopes
        assert self._reader is not None
        frames = self._reader.recv(None)
        if frames[0] == _VIA_SHM:
            if len(frames) == 1:
                return []
            data = frames[1]
            return self._unpack(data[8 : 8 + int.from_bytes(data[:8], "little")])
        head = torch.empty(_FIRST, dtype=torch.uint8)
        dist.broadcast(head, src=0)
        n = int.from_bytes(head[:8].numpy().tobytes(), "little")
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
        """One buffer: payload length, item index, frames; padded to the first broadcast."""
        items: list[_Item] = []
        frames: list[bytes | bytearray | memoryview] = []
        for env in envelopes:
            if isinstance(env, Envelope):
                fs = self.codec.encode(env.message)
                items.append(_Item(env.origin.inbox, env.origin.identity,
                                   [memoryview(f).nbytes for f in fs]))
                frames.extend(fs)
            else:
                err = env.error
                items.append(_Item(env.origin.inbox, env.origin.identity, [], err.reason,
                                   err.rid, err.message_type))
        head = _HEAD.encode(items)
        buf = bytearray(8)
        buf += len(head).to_bytes(8, "little")
        buf += head
        for f in frames:
            buf += f
        buf[:8] = (len(buf) - 8).to_bytes(8, "little")
        if pad and len(buf) < _FIRST:
            buf += bytes(_FIRST - len(buf))
        return buf

    def _unpack(self, data: memoryview) -> list[Envelope[Request] | Rejected]:
        n = int.from_bytes(data[:8], "little")
        items = _ITEMS.decode(data[8 : 8 + n])
        pos = 8 + n
        out: list[Envelope[Request] | Rejected] = []
        for it in items:
            origin = Origin(it.inbox, it.identity)
            if it.reason is not None:
                out.append(Rejected(DecodeError(it.reason, rid=it.rid,
                                                message_type=it.message_type), origin))
                continue
            frames = []
            for size in it.sizes:
                frames.append(data[pos : pos + size])
                pos += size
            out.append(Envelope(self.codec.decode(frames), origin))
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



