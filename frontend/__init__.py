"""An OpenAI-compatible HTTP server over the bus: ``python -m frontend``.

The top floor: it imports ``scheduler`` (the :class:`~scheduler.AsyncEngine`)
and below; nothing imports it. One job a module: ``schemas`` (the bodies,
validated at the door), ``tokenizer`` (byte-level built in, or a Hugging
Face ``tokenizer.json``), ``detokenizer`` (incremental, UTF-8 safe, stop
strings), ``chat`` (the template), ``generate`` (the request path of
completions and chat: handler, engine, answer), ``sampling`` (a request as
its token budget and sampling parameters), ``request_state`` (one answer
being made), ``responses`` (an answer's bodies and events, as OpenAI spells
them), ``fanout`` (prompt lists, ``n``, ``best_of``: several answers as one),
``app`` (the ASGI app), ``asgi`` (its plumbing), ``running`` (how
``python -m frontend`` starts the engine, serves, and closes it whatever
signals come), ``rpc_door`` (the
scheduler's rpc endpoint for operators), ``metrics``, ``errors``.
"""

from frontend.app import Frontend, Settings
from frontend.chat import ChatTemplate
from frontend.detokenizer import Detokenizer
from frontend.errors import ApiError, FrontendError, TokenizerError
from frontend.rpc_door import RpcDoor
from frontend.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ApiError",
    "ByteTokenizer",
    "ChatTemplate",
    "Detokenizer",
    "Frontend",
    "FrontendError",
    "HFTokenizer",
    "RpcDoor",
    "Settings",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]
