"""``python -m bench.ab``: stargrpc source trees side by side, against bare grpc.aio and the
floor, on the trivial call (START, END, Result).

Each ``--tree NAME=PATH`` is a checkout of stargrpc (e.g. the commit before a change,
unpacked with ``git archive``); its server runs with ``PYTHONPATH=PATH`` so it imports that
tree's code, every layer on as a user runs it: API-key auth, the SQLite audit, the critic,
and the in-memory run log (``--redis``: the Redis run log; the floor then writes to Redis
too). Every server has a state directory of its own (the same API key copied into each), so
no two audit trails share a SQLite file. The servers take turns under one client
(``bench/client.py``): CPU per call in blocks of calls, then latency call by call; over
``--repeats`` the least CPU and the least p50 of each are kept (noise only adds).

    python -m bench.ab --tree before=/tmp/base --tree after=. --repeats 3

Prints one table: CPU per call, p50 and p99, each as a ratio to bare, and the framework's
own CPU (the server's CPU less the floor's).

``--concurrent N`` adds rounds of N simultaneous 10 ms runs (``--concurrent-rounds``, the
servers taking turns round by round): calls/s (median and best round) and the server's CPU
per call over those rounds. The CPU per call is the steadier figure on a shared machine:
calls/s also moves with what else runs on the cores, the CPU a call costs much less.

``--without NAME=LAYER[,LAYER]`` starts tree ``NAME``'s server with those layers of the
interceptor chain left out (``python -m bench.launch``): give the same tree twice, once
whole and once without a layer, and the rounds show what the layer costs the server.

    python -m bench.ab --tree all=. --tree noaudit=. --without noaudit=audit --concurrent 1000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import profiling
from bench.__main__ import (
    REDIS_URL,
    ServerSpec,
    baseline_argv,
    floor_spec,
    run_plan,
    servers,
    stargrpc_argv,
    stargrpc_stack,
)


def _tree_specs(trees: list[tuple[str, Path]], env: dict[str, str], workdir: Path,
                without: dict[str, list[str]] | None = None) -> list[ServerSpec]:
    specs = []
    without = without or {}
    state = Path(env["STARGRPC_STATE_DIR"])
    for name, path in trees:
        own = workdir / f"{name}-state"
        shutil.copytree(state, own)
        tree_env = {**env, "STARGRPC_STATE_DIR": str(own),
                    "PYTHONPATH": str(path.resolve())}
        # The tree's own launcher when layers are left out, else its `stargrpc serve`.
        argv = stargrpc_argv(without.get(name))
        argv.insert(1, "-P")  # the tree on PYTHONPATH first, not this checkout (the cwd)
        specs.append(ServerSpec(name, argv, tree_env))
    return specs


def _more(running: list[Any], token: str) -> dict[str, tuple[float, float, float]]:
    pids = [s.pid for s in running]
    figures = run_plan(running, [
        {"measure": "stream", "n": 5000, "runs": 3, "server_pids": pids},
        {"measure": "concurrency", "concurrent": 200, "rounds": 3},
        {"measure": "held", "streams": 500, "seconds": 60.0, "server_pids": pids,
         "open_timeout": 40.0},
    ], token)
    return {server.name: (stream["median_events_per_s"], concurrency["calls_per_s"],
                          held["kb_per_open_run"] or 0.0)
            for server, stream, concurrency, held in zip(
                running, figures["stream"], figures["concurrency"], figures["held"],
                strict=True)}


def _concurrent(running: list[Any], token: str, concurrent: int, rounds: int
                ) -> dict[str, dict[str, float]]:
    """Rounds of ``concurrent`` simultaneous 10 ms runs: calls/s (median and best round),
    the server's CPU per call over the rounds (warm-up excluded) and the calls that failed."""
    figures = run_plan(running, [
        {"measure": "concurrency", "concurrent": concurrent, "rounds": rounds,
         "count_errors": True, "process_pids": [[s.pid] for s in running]},
    ], token)["concurrency"]
    calls = concurrent * rounds
    return {server.name: {
        "calls_per_s": f["calls_per_s"], "best_calls_per_s": f["best_calls_per_s"],
        "cpu_us_per_call": sum(f["process_cpu_s"]) / calls * 1e6,
        "client_cpu_us_per_call": f["client_cpu_s"] / calls * 1e6,
        # Of the machine's cores, how many the server and the client kept busy together.
        "cores_busy": (sum(f["process_cpu_s"]) + f["client_cpu_s"]) / sum(f["walls_s"]),
        "errors": f["errors"]}
        for server, f in zip(running, figures, strict=True)}


def _profile(running: list[Any], name: str, token: str, concurrent: int = 0) -> None:
    server = next(s for s in running if s.name == name)
    raw = Path(tempfile.mkstemp(prefix=f"ab-{name}-", suffix=".txt")[1])
    recorder = profiling.Recorder(server.pid, raw, rate=500)
    load: dict[str, Any] = (
        {"measure": "concurrency", "concurrent": concurrent, "rounds": 10} if concurrent
        else {"measure": "latency", "calls": 2000, "warmup": 0})
    try:
        run_plan([server], [load], token)
    finally:
        recorded = recorder.stop()
    if recorded is not None:
        print(profiling.summarize(recorded).render(top=60), file=sys.stderr)
        print(f"raw profile: {recorded}", file=sys.stderr)


def _with_ratio(value: float, bare: float, spec: str = ",.0f") -> str:
    """Two cells of a table: ``value``, and its ratio to bare's ("—" when bare's is 0: a
    figure read in clock ticks over a short pass can be)."""
    return f"{value:{spec}} | {_ratio(value, bare)}"


def _ratio(value: float, bare: float) -> str:
    return f"{value / bare:.2f}x" if bare else "—"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True,
                        help="NAME=PATH of a stargrpc checkout (repeatable)")
    parser.add_argument("--without", action="append", default=[], metavar="NAME=LAYER[,LAYER]",
                        help="start tree NAME without these layers of the interceptor chain "
                             "(audit, auth, critic; repeatable)")
    parser.add_argument("--redis", action="store_true",
                        help="the Redis run log instead of the in-memory one")
    parser.add_argument("--calls", type=int, default=600, help="CPU calls per repeat")
    parser.add_argument("--latency-calls", type=int, default=400)
    parser.add_argument("--block", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument("--more", action="store_true",
                        help="then, once: stream throughput (5,000 deltas), 200 concurrent "
                             "10 ms runs and memory per held stream (500 open)")
    parser.add_argument("--concurrent", type=int, default=0, metavar="N",
                        help="then rounds of N concurrent 10 ms runs: calls/s and server CPU "
                             "per call")
    parser.add_argument("--concurrent-rounds", type=int, default=10)
    parser.add_argument("--profile", metavar="NAME",
                        help="then py-spy this server under 2,000 sequential calls and print "
                             "its summary (the raw profile is kept in /tmp)")
    parser.add_argument("--profile-concurrent", type=int, default=0, metavar="N",
                        help="with --profile: profile ten rounds of N concurrent 10 ms runs "
                             "instead of sequential calls (the concurrent path)")
    args = parser.parse_args(argv)
    trees = []
    for entry in args.tree:
        name, _, path = entry.partition("=")
        trees.append((name, Path(path or ".")))
    without: dict[str, list[str]] = {}
    for entry in args.without:
        name, _, layers = entry.partition("=")
        named = [layer for layer in layers.split(",") if layer]
        if name not in {tree for tree, _ in trees} or not named:
            parser.error(f"--without {entry}: give NAME=LAYER[,LAYER] for a --tree NAME")
        without.setdefault(name, []).extend(named)
    with tempfile.TemporaryDirectory(prefix="stargrpc-ab-") as tmp:
        workdir = Path(tmp)
        stack = stargrpc_stack(workdir)
        env = dict(stack.env)
        if args.redis:
            env["STARGRPC_REDIS_URL"] = REDIS_URL
        else:
            env.pop("STARGRPC_REDIS_URL", None)
        stack.env = env
        specs = [ServerSpec("bare", baseline_argv(), dict(os.environ))]
        if not args.no_floor:
            floor = floor_spec(stack, workdir)
            specs.append(ServerSpec("floor", floor.argv, floor.env))
        specs += _tree_specs(trees, env, workdir, without)
        cpu: dict[str, list[float]] = {s.name: [] for s in specs}
        p50: dict[str, list[float]] = {s.name: [] for s in specs}
        p99: dict[str, list[float]] = {s.name: [] for s in specs}
        with servers(specs, workdir) as running:
            for repeat in range(args.repeats):
                plan: list[dict[str, Any]] = [
                    {"measure": "cpu", "calls": args.calls, "warmup": 30 if repeat else 100,
                     "server_pids": [s.pid for s in running], "block": args.block},
                    {"measure": "latency", "calls": args.latency_calls, "warmup": 10},
                ]
                figures = run_plan(running, plan, stack.token)
                for server, c, lat in zip(running, figures["cpu"], figures["latency"],
                                          strict=True):
                    cpu[server.name].append(c["cpu_us_per_call"])
                    p50[server.name].append(lat["p50_ms"])
                    p99[server.name].append(lat["p99_ms"])
                print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
                    f"{s.name} {c['cpu_us_per_call']:.0f} µs"
                    for s, c in zip(running, figures["cpu"], strict=True)),
                    file=sys.stderr, flush=True)
            if args.more:
                more = _more(running, stack.token)
            if args.concurrent:
                concurrent = _concurrent(running, stack.token, args.concurrent,
                                         args.concurrent_rounds)
            if args.profile:
                _profile(running, args.profile, stack.token, args.profile_concurrent)
    bare_cpu, bare_p50, bare_p99 = min(cpu["bare"]), min(p50["bare"]), min(p99["bare"])
    floor_cpu = min(cpu["floor"]) if "floor" in cpu else None
    print(f"run log: {'Redis' if args.redis else 'in memory'}; {args.repeats} repeats of "
          f"{args.calls} CPU calls (blocks of {args.block}) and {args.latency_calls} "
          "latency calls; least of the repeats")
    print("| server | CPU µs/call | ratio | over floor µs | p50 ms | ratio | p99 ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    result = {}
    for name in cpu:
        c, l50, l99 = min(cpu[name]), min(p50[name]), min(p99[name])
        over = f"{c - floor_cpu:.0f}" if floor_cpu is not None else "—"
        print(f"| {name} | {c:.0f} | {_ratio(c, bare_cpu)} | {over} | {l50:.3f} | "
              f"{_ratio(l50, bare_p50)} | {l99:.3f} | {_ratio(l99, bare_p99)} |")
        result[name] = {"cpu_us_per_call": c, "p50_ms": l50, "p99_ms": l99,
                        "samples": {"cpu": cpu[name], "p50": p50[name], "p99": p99[name]}}
    if args.more:
        print("| server | stream events/s | ratio | 200 concurrent 10 ms calls/s | ratio | "
              "KiB per held stream | ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        bare = more["bare"]
        for name, figures in more.items():
            print(f"| {name} | {_with_ratio(figures[0], bare[0])} | "
                  f"{_with_ratio(figures[1], bare[1])} | "
                  f"{_with_ratio(figures[2], bare[2], '.1f')} |")
            result[name]["more"] = figures
    if args.concurrent:
        print(f"| server | {args.concurrent} concurrent 10 ms runs, calls/s (median of "
              f"{args.concurrent_rounds} rounds) | ratio | best round | ratio | server CPU "
              "µs/call | ratio | client CPU µs/call | cores busy | failed |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        bare_c = concurrent["bare"]
        for name, c in concurrent.items():
            cells = " | ".join(_with_ratio(c[figure], bare_c[figure]) for figure in
                               ("calls_per_s", "best_calls_per_s", "cpu_us_per_call"))
            print(f"| {name} | {cells} | {c['client_cpu_us_per_call']:.0f} | "
                  f"{c['cores_busy']:.2f} | {c['errors']:.0f} |")
            result[name]["concurrent"] = c
    print(json.dumps(result))


if __name__ == "__main__":
    main()
