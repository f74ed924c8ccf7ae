"""The client faces a frontend imports: ``Engine`` (threads) and
``AsyncEngine`` (asyncio) over one ``core`` (wiring, rid allocation, the
``pending`` table, error mapping), with their request ``handles``.
Imports ``launch`` to start a mode; never ``cli``."""
