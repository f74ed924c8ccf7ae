"""The client a frontend imports: ``AsyncEngine`` (the async-first core: one event
loop reads outputs and rpc replies) and ``Engine`` (its blocking adapter, running it
on a private event-loop thread), over ``core`` (wiring, rid allocation, the
``pending`` table, error mapping), with their request ``handles``.
Imports ``launch`` to start a mode; never ``cli``."""
