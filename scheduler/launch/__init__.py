"""Starting and joining schedulers: ``wiring`` (what a mode is: which inboxes
and sinks), ``processes`` (scheduler, tp and dp processes, forked from a fork
server), ``started`` (an engine's scheduler: thread or processes, liveness,
stop) and ``tp`` (tensor-parallel ranks). Imports ``core``, ``models`` and
``dp``."""
