"""The client a frontend imports: ``AsyncEngine`` (the async-first core: it starts and
stops the scheduler, and its event loop sends requests, reads outputs and rpc replies,
and keeps each request's state) and ``Engine`` (its blocking adapter, running it on a
private event-loop thread), with the request ``handles``. Imports ``launch`` to start a
mode; never ``cli``."""
