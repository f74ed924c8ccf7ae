"""The scheduler process: its loop and the parts the loop is made of.

``loop`` (the :class:`~scheduler.core.loop.Scheduler`), ``batch`` (running
requests and chunked prefill), ``admission`` (queue limits), ``backpressure``
(pausing an inbox whose consumer stops reading), ``outputs`` (building a
step's outputs), ``control`` and ``rpc_methods`` (the rpc surface),
``checkpoint`` (state on disk) and ``metrics`` (Prometheus families).
Imports ``models``; never ``engine``, ``launch`` or ``cli``.
"""
