"""Codec: ours vs pickle vs the copy-into-extension codec vs raw bytes, side by side.

Run: ``python -m benchmarks.codec``. The last line is one JSON object.
Every figure is encode+decode time per message (median of repeated runs);
ratios are speeds (> 1: ours is faster). Like for like:

* The pickle twin carries the same fields in the same representation as
  ours: token ids as packed ``bytes`` (``_bytes_ids``), not a numpy array.
  ``numpy_field`` is our own codec with the ids as an ``np.ndarray`` field
  (the enc/dec hooks path) instead of the packed ``memoryview``.
* A batch's columns: the pickle twin carries ``output_ids`` and
  ``output_lens`` as the same packed ``bytes`` ours carries (not numpy
  arrays, which would measure the array, not the codec). Ours makes no
  ``str`` per rid until one is read, pickle builds all 64, so every batch
  ratio reads every rid after decoding
  (``ratio_batch64_read_rids_ours_vs_pickle``); ``pickle_lists`` is the
  batch as an engine without columns keeps it (a list of lists).
* Tensors go through a real transport (a zmq PAIR over ``ipc://`` in this
  process: the kernel copies every byte in and out, on every side), since
  in process ours moves no bytes at all (``*_inproc``). ``lean_copy_ext`` is
  the leanest copy-into-extension codec: the tensor's bytes copied once into
  a reused msgpack buffer (``encode_into``: no allocation per message; an
  ``Ext`` over a view, dtype and shape beside it) and decoded as a view of
  the received buffer. ``socket`` is the bytes alone
  through the same socket (the transport's floor); ``raw`` the bytes out and
  back in process (one copy each way); ``wrap`` the zero-copy floor (a view
  of the same memory, no message at all).
"""

from __future__ import annotations

import dataclasses
import pickle  # the contestant we compare against, never in the packages
import sys
import tempfile
import warnings
from collections.abc import Callable

import msgspec
import numpy as np
import numpy.typing as npt
import torch
import zmq

from benchmarks._timing import interleaved, per_call_us, print_checked
from messages import (
    BatchEmbeddingOut,
    BatchTokenIDOut,
    Codec,
    Message,
    Request,
    SamplingParams,
    TokenizedGenerateReqInput,
    token_ids,
)

CODEC = Codec(Message)

#: The tensors timed (name -> bytes) and each one's contestants, as printed
#: (``tensor<name>_<contestant>_us``).
TENSOR_SIZES = {"64k": 1 << 16, "4m": 1 << 22, "64m": 1 << 26, "4m_bf16": 1 << 22}
TENSOR_CONTESTANTS = ("ours_inproc", "lean_copy_ext_inproc", "wrap", "raw",
                      "ours", "lean_copy_ext", "pickle", "socket")

#: Every key of the JSON object ``main`` prints (checked before printing), so a
#: figure quoted elsewhere can be traced to this benchmark without running it.
KEYS = frozenset({
    *(f"tensor{name}_{k}_us" for name in TENSOR_SIZES for k in TENSOR_CONTESTANTS),
    "small_ours_us", "small_pickle_bytes_ids_us", "small_numpy_field_us", "small_listint_us",
    "ratio_small_ours_vs_pickle_bytes_ids", "ratio_small_ours_vs_numpy_field",
    "ratio_small_ours_vs_listint", "batch64_encdec_read_rids_us", "batch64_pickle_us",
    "ratio_batch64_read_rids_ours_vs_pickle", "ratio_batch64_read_rids_ours_vs_pickle_lists",
    "ratio_tensor4m_ours_inproc_vs_raw", "ratio_tensor4m_ours_inproc_vs_wrap",
    "ratio_tensor4m_ours_vs_lean_copy_ext", "ratio_tensor64m_ours_vs_lean_copy_ext",
    "ratio_tensor64m_ours_vs_pickle", "ratio_tensor64m_ours_vs_socket", "inline_threshold",
})


# -- the SGLang-style contestants ---------------------------------------------

class ListSampling(msgspec.Struct, array_like=True, omit_defaults=True):
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False


class ListGenerate(msgspec.Struct, tag=True, kw_only=True, array_like=True):
    """Our request with ids as list[int]: the tagged-struct style SGLang uses."""

    rid: str
    input_ids: list[int]
    sampling: ListSampling
    stream: bool = False
    return_logprob: bool = False


@dataclasses.dataclass
class PickledSampling:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: np.ndarray | None = None
    seed: int | None = None
    ignore_eos: bool = False


@dataclasses.dataclass
class PickledGenerate:
    """The same request as pickle would carry it (ids as packed uint32 bytes).

    Our messages refuse pickle (a memoryview cannot be pickled), so the
    pickle contestant carries the same fields in a plain dataclass, in the
    same representation: the ids packed, as ours (a numpy array costs pickle
    twice as much, and would measure the array, not the codec).
    """

    rid: str
    input_ids: bytes
    sampling: PickledSampling
    stream: bool = False
    return_logprob: bool = False
    input_embeds: torch.Tensor | None = None


def pickled_twin(req: TokenizedGenerateReqInput) -> PickledGenerate:
    s = req.sampling
    return PickledGenerate(req.rid, bytes(req.input_ids),
                           PickledSampling(s.max_new_tokens, s.temperature, s.top_p, s.top_k,
                                           None, s.seed, s.ignore_eos))


@dataclasses.dataclass
class PickledColumns:
    """Our batch's columns, as pickle would carry them: the ids and lengths packed, as ours."""

    rids: list[str]
    output_ids: bytes
    output_lens: bytes
    finished_reasons: list[str | None]


@dataclasses.dataclass
class PickledBatch:
    """A batch output as an engine without a columnar codec keeps it."""

    rids: list[str]
    output_ids: list[list[int]]
    finished_reasons: list[str | None]


class ExtEmbeddings(msgspec.Struct, array_like=True):
    """A batch of embeddings for the copy-into-extension codec."""

    rids: list[str]
    embeddings: torch.Tensor


def _lean_copy_ext_codec() -> tuple[Callable[[ExtEmbeddings], bytearray],
                                    msgspec.msgpack.Decoder[ExtEmbeddings]]:
    """Tensor bytes copied into a msgpack extension, and nothing more.

    The leanest form of the SGLang 0.5 approach: one copy, the encoder's
    own (an ``Ext`` over a view of the tensor, dtype and shape beside it),
    into one buffer reused by every encode (``encode_into``: no allocation
    per message; safe here because each message is received before the next
    is encoded); decoded as a view of the received buffer, no copy out.
    """

    def enc(obj: object) -> object:
        assert isinstance(obj, torch.Tensor)
        t = obj.contiguous()
        return [str(t.dtype)[6:], list(t.shape),
                msgspec.msgpack.Ext(1, t.view(torch.uint8).numpy().data)]

    def ext(code: int, data: memoryview) -> object:
        return data

    def dec(tp: type, obj: object) -> object:
        assert isinstance(obj, list)
        dtype, shape, data = obj
        return torch.frombuffer(data, dtype=getattr(torch, dtype)).reshape(shape)

    encoder = msgspec.msgpack.Encoder(enc_hook=enc)
    buf = bytearray()

    def encode(msg: ExtEmbeddings) -> bytearray:
        encoder.encode_into(msg, buf)  # same size each time: no resize, no allocation
        return buf

    return encode, msgspec.msgpack.Decoder(ExtEmbeddings, ext_hook=ext, dec_hook=dec)


class _Pair:
    """A zmq PAIR over ``ipc://`` in this process: what a real transport copies."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        ep = f"ipc://{tempfile.mkdtemp()}/pair"
        self.rx = self.ctx.socket(zmq.PAIR)
        self.rx.bind(ep)
        self.tx = self.ctx.socket(zmq.PAIR)
        self.tx.connect(ep)

    def send_recv(self, frames: list[object]) -> list[memoryview]:
        self.tx.send_multipart(frames, copy=False)  # type: ignore[arg-type]
        return [f.buffer for f in self.rx.recv_multipart(copy=False)]

    def close(self) -> None:
        self.tx.close(0)
        self.rx.close(0)
        self.ctx.term()


def bench_small() -> dict[str, float]:
    # Made here, not at import: a Request subclass defined in a process joins every
    # scheduler's and dispatcher's totality check there (the catalogue is every
    # concrete Request), and a module imported for its KEYS must not add one.
    class NumpyIdsGenerate(Request):
        """Our request with the ids as an ``np.ndarray`` field (the codec's hooks path)."""

        input_ids: npt.NDArray[np.uint32]
        sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
        stream: bool = False
        return_logprob: bool = False

    ids = list(range(256))
    ours = TokenizedGenerateReqInput(rid="req-0001", input_ids=token_ids(ids),
                                     sampling=SamplingParams(max_new_tokens=64))
    listy = ListGenerate(rid="req-0001", input_ids=ids, sampling=ListSampling(max_new_tokens=64))
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ListGenerate)
    raw = np.asarray(ids, np.uint32)
    twin = pickled_twin(ours)
    npy = NumpyIdsGenerate(rid="req-0001", input_ids=np.asarray(ids, np.uint32),
                           sampling=SamplingParams(max_new_tokens=64))
    npy_codec: Codec[NumpyIdsGenerate] = Codec(NumpyIdsGenerate)
    return interleaved({
        "ours": lambda: CODEC.decode(CODEC.encode(ours)),
        "pickle_bytes_ids": lambda: pickle.loads(pickle.dumps(twin, protocol=5)),
        "numpy_field": lambda: npy_codec.decode(npy_codec.encode(npy)),
        "listint": lambda: dec.decode(enc.encode(listy)),
        "raw": lambda: np.frombuffer(raw.tobytes(), np.uint32),
    })


def bench_batch64() -> dict[str, float]:
    rids = [f"req-{i:04d}" for i in range(64)]
    new = [[1000 + i] for i in range(64)]
    fin: list[str | None] = [None] * 64
    ours = BatchTokenIDOut.from_lists(rids, new, [None] * 64)
    columns = PickledColumns(rids, bytes(ours.output_ids), bytes(ours.output_lens), fin)
    plain = PickledBatch(rids, new, fin)
    def ours_read_rids() -> object:  # the rids are a column: str objects made on first read
        return list(CODEC.decode(CODEC.encode(ours)).rids)  # type: ignore[attr-defined]

    return interleaved({
        "ours_read_rids": ours_read_rids,
        "pickle": lambda: pickle.loads(pickle.dumps(columns, protocol=5)),
        "pickle_lists": lambda: pickle.loads(pickle.dumps(plain, protocol=5)),
    })


def bench_tensor(t: torch.Tensor, pair: _Pair) -> dict[str, float]:
    msg = BatchEmbeddingOut(rids=["r"], embeddings=t.reshape(1, -1))
    ext_msg = ExtEmbeddings(rids=["r"], embeddings=t.reshape(1, -1))
    lean_encode, dec = _lean_copy_ext_codec()
    big = t.numel() * t.element_size() > 1 << 24
    reps = 5 if big else 7

    def ours_inproc() -> object:
        return CODEC.decode(CODEC.encode(msg))

    def lean_inproc() -> object:
        return dec.decode(lean_encode(ext_msg))

    def ours() -> object:
        return CODEC.decode(pair.send_recv(CODEC.encode(msg)))  # type: ignore[arg-type]

    def lean() -> object:
        return dec.decode(pair.send_recv([lean_encode(ext_msg)])[0])

    def pickled() -> object:
        return pickle.loads(pair.send_recv([pickle.dumps(t, protocol=5)])[0])

    def socket() -> object:  # the bytes alone through the same socket, viewed on arrival
        view = t.view(torch.uint8).numpy().data
        got = pair.send_recv([view])[0]
        return torch.frombuffer(got, dtype=torch.uint8).view(t.dtype)

    def wrap() -> object:  # the zero-copy floor: wrap the same memory, no header, no checks
        view = t.view(torch.uint8).numpy().data
        return torch.frombuffer(view, dtype=torch.uint8).view(t.dtype)

    def raw() -> object:  # the bytes alone: out as bytes, back into a tensor
        data = t.view(torch.uint8).numpy().tobytes()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(t.dtype)

    row = {"ours_inproc": per_call_us(ours_inproc),
           "lean_copy_ext_inproc": per_call_us(lean_inproc, repeats=reps),
           "wrap": per_call_us(wrap),
           "raw": per_call_us(raw, repeats=reps)}
    # Over the socket, in turns (a noisy neighbour hurts each alike).
    over: dict[str, Callable[[], object]] = {"ours": ours, "lean_copy_ext": lean,
                                             "pickle": pickled, "socket": socket}
    row.update(interleaved(over, repeats=reps))
    return row


def main() -> None:
    results: dict[str, object] = {}
    small = bench_small()
    batch = bench_batch64()
    pair = _Pair()
    with warnings.catch_warnings():  # a view of a received (read-only) buffer: on purpose
        warnings.simplefilter("ignore", UserWarning)
        tensors = {
            "64k": bench_tensor(torch.randn(16 * 1024), pair),
            "4m": bench_tensor(torch.randn(1024 * 1024), pair),
            "64m": bench_tensor(torch.randn(16 * 1024 * 1024), pair),
            "4m_bf16": bench_tensor(torch.randn(2 * 1024 * 1024).to(torch.bfloat16), pair),
        }
    pair.close()
    print("small generate request (256 ids), encode+decode us:", file=sys.stderr)
    for k, v in small.items():
        print(f"  {k:14s} {v:9.2f}", file=sys.stderr)
    print("BatchTokenIDOut, 64 requests x 1 token, encode+decode us:", file=sys.stderr)
    for k, v in batch.items():
        print(f"  {k:14s} {v:9.2f}", file=sys.stderr)
    for name, row in tensors.items():
        print(f"tensor {name}: encode+decode us (MB/s)", file=sys.stderr)
        for k, v in row.items():
            print(f"  {k:14s} {v:11.2f} ({TENSOR_SIZES[name] / v:,.0f} MB/s)", file=sys.stderr)
        for k, v in row.items():
            results[f"tensor{name}_{k}_us"] = round(v, 2)
    results.update({
        "small_ours_us": round(small["ours"], 2),
        "small_pickle_bytes_ids_us": round(small["pickle_bytes_ids"], 2),
        "small_numpy_field_us": round(small["numpy_field"], 2),
        "small_listint_us": round(small["listint"], 2),
        "ratio_small_ours_vs_pickle_bytes_ids": round(
            small["pickle_bytes_ids"] / small["ours"], 2),
        "ratio_small_ours_vs_numpy_field": round(small["numpy_field"] / small["ours"], 2),
        "ratio_small_ours_vs_listint": round(small["listint"] / small["ours"], 2),
        # Every rid read after decoding (pickle built them all already).
        "batch64_encdec_read_rids_us": round(batch["ours_read_rids"], 2),
        "batch64_pickle_us": round(batch["pickle"], 2),
        "ratio_batch64_read_rids_ours_vs_pickle": round(
            batch["pickle"] / batch["ours_read_rids"], 2),
        "ratio_batch64_read_rids_ours_vs_pickle_lists": round(
            batch["pickle_lists"] / batch["ours_read_rids"], 2),
        # In process (no transport): ours moves no bytes, raw copies out and back.
        "ratio_tensor4m_ours_inproc_vs_raw": round(
            tensors["4m"]["raw"] / tensors["4m"]["ours_inproc"], 2),
        "ratio_tensor4m_ours_inproc_vs_wrap": round(
            tensors["4m"]["wrap"] / tensors["4m"]["ours_inproc"], 2),
        # Over the same ipc:// socket, every copy counted on both sides.
        "ratio_tensor4m_ours_vs_lean_copy_ext": round(
            tensors["4m"]["lean_copy_ext"] / tensors["4m"]["ours"], 2),
        "ratio_tensor64m_ours_vs_lean_copy_ext": round(
            tensors["64m"]["lean_copy_ext"] / tensors["64m"]["ours"], 2),
        "ratio_tensor64m_ours_vs_pickle": round(
            tensors["64m"]["pickle"] / tensors["64m"]["ours"], 2),
        "ratio_tensor64m_ours_vs_socket": round(
            tensors["64m"]["socket"] / tensors["64m"]["ours"], 2),
        "inline_threshold": CODEC.inline_threshold,
    })
    print_checked(results, KEYS, "benchmarks.codec")


if __name__ == "__main__":
    main()
