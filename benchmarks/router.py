"""Router: ns per routed output (cached) vs a plain dict and an isinstance if/elif chain.

Run: ``python -m benchmarks.router``. The last line is one JSON object.
Every contestant delivers to the same no-op sink, so the figures compare
dispatch alone. Two mixes, 2/8/32 types each:

* ``router_ns_N`` / ``dict_ns_N`` / ``chain_ns_N``: a round-robin mix of
  every registered type. ``dict`` is ``table[type(o)](o, origin)``, the
  floor of exact-type dispatch (no MRO walk, no totality check, no
  counters); the chain is a literal ``if isinstance(...) elif ...``.
* ``hot_router_ns_N`` / ``hot_dict_ns_N`` / ``hot_chain_first_ns_N``: what a
  scheduler routes, one hot type (token outputs) and a rare other one in
  256; the chain tests the hot type first, as a hand-tuned chain would.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from benchmarks._timing import per_call_us, print_checked
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


def _dict(types: list[type[Output]], sink: _Null) -> Callable[[Output], None]:
    """Exact-type lookup in a plain dict: the floor a table of types can reach."""
    table = {t: sink.send for t in types}

    def route(o: Output) -> None:
        table[type(o)](o, ORIGIN)

    return route


def bench(n: int, hot: bool) -> tuple[float, float, float]:
    """ns per output of (router, dict, chain) over one mix."""
    types = _types(n)
    sink = _Null()
    router: Router[Output] = Router(Output, types=types)
    for t in types:
        router.register(t, sink)
    if hot:  # types[0] is the hot one, tested first by the chain; one rare other
        outputs = [types[0]() for _ in range(255)] + [types[-1]()]
    else:
        outputs = [t() for t in types] * (256 // n)
    route, table, chain = router.route, _dict(types, sink), _chain(types, sink)

    def ours() -> None:
        for o in outputs:
            route(o, ORIGIN)

    def plain() -> None:
        for o in outputs:
            table(o)

    def theirs() -> None:
        for o in outputs:
            chain(o)

    k = len(outputs)
    return (per_call_us(ours) * 1000 / k, per_call_us(plain) * 1000 / k,
            per_call_us(theirs) * 1000 / k)


#: How many output types each contest routes.
TYPE_COUNTS = (2, 8, 32)
#: Every key of the JSON object ``main`` prints (checked once printed).
KEYS = frozenset(f"{prefix}_ns_{n}" for n in TYPE_COUNTS
                 for prefix in ("router", "dict", "chain", "hot_router", "hot_dict",
                                "hot_chain_first"))


def main() -> None:
    out: dict[str, float] = {}
    for n in TYPE_COUNTS:
        ours, plain, chain = bench(n, hot=False)
        out[f"router_ns_{n}"] = round(ours, 1)
        out[f"dict_ns_{n}"] = round(plain, 1)
        out[f"chain_ns_{n}"] = round(chain, 1)
        print(f"{n:3d} types, round robin: router {ours:6.1f} ns  dict {plain:6.1f} ns  "
              f"isinstance chain {chain:6.1f} ns", file=sys.stderr)
    for n in TYPE_COUNTS:
        ours, plain, chain = bench(n, hot=True)
        out[f"hot_router_ns_{n}"] = round(ours, 1)
        out[f"hot_dict_ns_{n}"] = round(plain, 1)
        out[f"hot_chain_first_ns_{n}"] = round(chain, 1)
        print(f"{n:3d} types, one hot: router {ours:6.1f} ns  dict {plain:6.1f} ns  "
              f"chain, hot type first {chain:6.1f} ns", file=sys.stderr)
    print_checked(out, KEYS, "benchmarks.router")


if __name__ == "__main__":
    main()
