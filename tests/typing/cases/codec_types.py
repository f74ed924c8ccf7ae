# Checked by tests/typing/test_typing.py.
from bus import Ring
from messages import BatchTokenIDOut, Codec, Request, TokenizedGenerateReqInput

codec: Codec[Request] = Codec(Request)
reveal_type(codec.decode([b""]))  # R: messages.base.Request
ring: Ring[TokenizedGenerateReqInput] = Ring(4)
reveal_type(ring.get_nowait())  # R: messages.catalogue.TokenizedGenerateReqInput
ring.put(BatchTokenIDOut.from_lists([], [], []))  # E: an output on a request ring
codec.encode(BatchTokenIDOut.from_lists([], [], []))  # E: not a Request
