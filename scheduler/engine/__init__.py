"""The client a frontend imports: ``AsyncEngine`` (the async-first core: one event
loop sends requests, reads outputs and rpc replies, and keeps each request's state)
and ``Engine`` (its blocking adapter, running it on a private event-loop thread),
over ``core`` (wiring a mode, rids, validation, liveness), with the request
``handles``. Imports ``launch`` to start a mode; never ``cli``."""
