"""Router: ns per routed output (cached) vs an isinstance if/elif chain, 2/8/32 types.

Run: ``python -m benchmarks.router``. The last line is one JSON object.
Both sides deliver to the same no-op sink and route the same round-robin
mix of every registered type, so the figures compare dispatch alone.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from benchmarks._timing import per_call_us
from bus import Origin
from messages import Output
from router import Router

ORIGIN = Origin("work")


class _Null:
    def send(self, output: Output, origin: Origin, /) -> None:
        pass


def _types(n: int) -> list[type[Output]]:
    return [type(f"Out{n}_{i}", (Output,), {}, tag=f"bench.{n}.{i}") for i in range(n)]


def _chain(types: list[type[Output]], sink: _Null) -> Callable[[Output], None]:
    """Build a literal if/elif isinstance chain, as hand-written routing code looks."""
    lines = ["def route(o):"]
    for i in range(len(types)):
        kw = "if" if i == 0 else "elif"
        lines.append(f"    {kw} isinstance(o, T{i}): send(o, ORIGIN)")
    lines.append("    else: raise TypeError(o)")
    env: dict[str, object] = {f"T{i}": t for i, t in enumerate(types)}
    env.update(send=sink.send, ORIGIN=ORIGIN)
    exec("\n".join(lines), env)
    fn: Callable[[Output], None] = env["route"]  # type: ignore[assignment]
    return fn


def bench(n: int) -> tuple[float, float]:
    types = _types(n)
    sink = _Null()
    router: Router[Output] = Router(Output, types=types)
    for t in types:
        router.register(t, sink)
    outputs = [t() for t in types] * (256 // n)
    route, chain = router.route, _chain(types, sink)

    def ours() -> None:
        for o in outputs:
            route(o, ORIGIN)

    def theirs() -> None:
        for o in outputs:
            chain(o)

    k = len(outputs)
    return per_call_us(ours) * 1000 / k, per_call_us(theirs) * 1000 / k


def main() -> None:
    out: dict[str, float] = {}
    for n in (2, 8, 32):
        ours, chain = bench(n)
        out[f"router_ns_{n}"] = round(ours, 1)
        out[f"chain_ns_{n}"] = round(chain, 1)
        print(f"{n:3d} types: router {ours:7.1f} ns  isinstance chain {chain:7.1f} ns",
              file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
