"""Starting and joining schedulers: ``wiring`` (what a mode is: which inboxes
and sinks), ``processes`` (spawned scheduler, tp and dp processes) and ``tp``
(tensor-parallel ranks). Imports ``core``, ``models`` and ``dp``."""
