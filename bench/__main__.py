"""``python -m bench``: stargrpc against bare grpc.aio, measured in the same run.

Starts the bare baseline (``bench/baseline_server.py``), the floor (the same server with
``--floor``: plus only the I/O stargrpc's layers must do per call) and stargrpc (``stargrpc
serve --tools-dir bench/tools``, every layer that has landed switched on) as separate
processes, drives all three with the same client (``bench/client.py``, its own process per
measurement), and prints one table of absolute numbers and ratios. Then it measures the
server CPU per call with each layer (auth, audit, critic, run log) switched off in turn, in
stargrpc and, beside it, in the floor (whose layers are only their I/O).

    python -m bench             # full run, a few minutes
    python -m bench --quick     # reduced pass, under a minute
    python -m bench --profile   # also py-spy profiles of the hot paths

Each run is saved in ``bench/runs/`` (git-ignored; JSON with every figure, and the table as
Markdown) with a description of the machine; ``--keep`` saves it in ``bench/results/``, the
run the repository keeps. Only 127.0.0.1 is ever used; every loop is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import profiling

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
RUNS = BENCH / "runs"
REDIS_URL = "redis://127.0.0.1:6379/0"
#: Server start-up (imports, tool loading) may take this long on a busy machine.
START_TIMEOUT = 90.0


class BenchFailure(RuntimeError):
    """A server or a measurement did not do what the benchmark needs."""


@dataclass(frozen=True)
class Sizes:
    """How much of each measurement a mode runs."""

    latency_calls: int
    latency_warmup: int
    stream_n: int
    stream_runs: int
    slow_n: int
    slow_every: int
    slow_ms: float
    coalesce: int
    concurrency: int
    concurrency_rounds: int
    held: int
    held_seconds: float
    held_open_timeout: float
    held_fresh_server: bool
    cpu_calls: int
    cpu_warmup: int
    cpu_repeats: int
    cpu_block: int
    layers: bool


MODES = {
    "full": Sizes(latency_calls=1000, latency_warmup=100, stream_n=20_000, stream_runs=3,
                  slow_n=10_000, slow_every=10, slow_ms=1.0, coalesce=10, concurrency=200,
                  concurrency_rounds=5, held=5000, held_seconds=120.0, held_open_timeout=100.0,
                  held_fresh_server=True, cpu_calls=1000, cpu_warmup=60, cpu_repeats=3,
                  cpu_block=25, layers=True),
    "quick": Sizes(latency_calls=200, latency_warmup=30, stream_n=5000, stream_runs=1,
                   slow_n=2000, slow_every=10, slow_ms=1.0, coalesce=10, concurrency=200,
                   concurrency_rounds=2, held=500, held_seconds=60.0, held_open_timeout=40.0,
                   held_fresh_server=False, cpu_calls=200, cpu_warmup=30, cpu_repeats=1,
                   cpu_block=20, layers=True),
    # The tiniest pass, for the smoke test: every code path, no meaningful numbers.
    "smoke": Sizes(latency_calls=5, latency_warmup=2, stream_n=200, stream_runs=1, slow_n=100,
                   slow_every=10, slow_ms=1.0, coalesce=10, concurrency=5, concurrency_rounds=1,
                   held=5, held_seconds=10.0, held_open_timeout=10.0, held_fresh_server=False,
                   cpu_calls=10, cpu_warmup=2, cpu_repeats=1, cpu_block=2, layers=True),
}


# -- processes -----------------------------------------------------------------------------

@dataclass
class Server:
    """A server process started for the benchmark."""

    name: str
    pid: int
    address: str
    log: Path


def _port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server."""

    name: str
    argv: list[str]
    env: dict[str, str]


@contextlib.contextmanager
def servers(specs: list[ServerSpec], workdir: Path) -> Iterator[list[Server]]:
    """Starts the servers all at once, waits until each logs ``serving``, and stops them
    (SIGTERM, then SIGKILL after 20 s) on exit."""
    processes: list[tuple[ServerSpec, subprocess.Popen[bytes], Path]] = []
    try:
        for spec in specs:
            log = workdir / f"{spec.name}.log"
            with log.open("wb") as out:
                processes.append((spec, subprocess.Popen(
                    spec.argv, stdout=out, stderr=subprocess.STDOUT, env=spec.env, cwd=ROOT,
                    start_new_session=True), log))
        yield [Server(spec.name, process.pid, _wait_serving(process, log), log)
               for spec, process, log in processes]
    finally:
        for _, process, _ in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for _, process, _ in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_serving(process: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") == "serving":
                    return str(record["address"])
        if process.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise BenchFailure(f"server exited with {process.returncode} before serving:\n"
                               f"{tail}")
        time.sleep(0.05)  # polling a log file: there is no event to wait on
    raise BenchFailure(f"server did not start within {START_TIMEOUT:.0f} s (see {log})")


def run_plan(targets: list[Server], plan: list[dict[str, Any]], token: str = "",
             timeout: float = 900.0) -> dict[str, list[dict[str, Any]]]:
    """Runs a plan of measurements in one client process, the servers taking turns.

    Returns:
        The figures by measurement name, one entry per server in the order given.
    """
    env = dict(os.environ)
    env["BENCH_TOKEN"] = token  # in the environment, not on a command line others can read
    argv = [sys.executable, "-m", "bench.client", "--plan", json.dumps(plan)]
    for server in targets:
        argv += ["--target", server.address]
    names = ", ".join(s.name for s in targets)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT, check=False)
    except subprocess.TimeoutExpired as exc:
        raise BenchFailure(f"the client got no answer from {names} in {timeout:.0f} s") from exc
    lines = done.stdout.strip().splitlines()
    figures = json.loads(lines[-1]) if lines else {}
    if done.returncode != 0 or "error" in figures:
        raise BenchFailure(f"measuring {names} failed: "
                           f"{figures.get('error') or done.stderr[-1500:]}")
    return dict(figures)


# -- the servers ---------------------------------------------------------------------------

@dataclass
class Stack:
    """How stargrpc is started "with everything on", as far as the layers have landed."""

    env: dict[str, str]
    token: str
    layers: dict[str, str] = field(default_factory=dict)  # layer -> "on …" / "not present …"


def _settings_fields() -> set[str]:
    from stargrpc.settings import Settings

    return set(Settings.model_fields)


def chain_layers(env: dict[str, str]) -> list[str]:
    """The interceptor layers ``build_chain`` gives with the settings in ``env``."""
    done = subprocess.run([sys.executable, "-m", "bench.launch", "--list-layers"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                          check=False)
    if done.returncode != 0:
        raise BenchFailure(f"cannot build the interceptor chain:\n{done.stderr[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1])["layers"])


def _create_key(env: dict[str, str]) -> str:
    """An API key made with the stargrpc CLI; empty when the CLI has no key command."""
    argv = [sys.executable, "-m", "stargrpc.cli", "keys", "create", "--name", "bench",
            "--role", "admin"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                          check=False)
    lines = done.stdout.strip().splitlines()
    return lines[-1].strip() if done.returncode == 0 and lines else ""


def stargrpc_stack(workdir: Path) -> Stack:
    """The environment that switches every landed layer on, and a key for the client."""
    fields = _settings_fields()
    env = dict(os.environ)
    env.update({
        "STARGRPC_HOST": "127.0.0.1",
        "STARGRPC_PORT": "0",
        "STARGRPC_STATE_DIR": str(workdir / "state"),
        "STARGRPC_LOG_FORMAT": "json",
        "STARGRPC_SHUTDOWN_GRACE_SECONDS": "1",
    })
    env.pop("STARGRPC_CONFIG", None)
    layers: dict[str, str] = {}
    token = ""
    # The held-streams measurement opens thousands of runs from one caller: lift the
    # admission limits (a deployment expecting that many open runs would too).
    for limit in ("max_concurrent_runs", "max_concurrent_runs_per_principal"):
        if limit in fields:
            env[f"STARGRPC_{limit.upper()}"] = "0"
    if "redis_url" in fields and _port_open("127.0.0.1", 6379):
        env["STARGRPC_REDIS_URL"] = REDIS_URL
        layers["run log"] = "on: Redis (off: the in-memory log)"
    elif "redis_url" in fields:
        layers["run log"] = "not measured: Redis is not running on 127.0.0.1:6379"
    else:
        layers["run log"] = "not present: only the in-memory log exists"
    if "insecure_no_auth" in fields:
        env["STARGRPC_INSECURE_NO_AUTH"] = "false"
        token = _create_key(env)
        if token:
            layers["auth"] = "on: API key (off: --insecure-no-auth)"
        else:
            env["STARGRPC_INSECURE_NO_AUTH"] = "true"
            layers["auth"] = "not measured: no `stargrpc keys create` to make a key"
    chain = chain_layers(env)
    for layer in ("auth", "audit", "critic"):
        if layer in chain:
            layers.setdefault(layer, "on (off: left out of the interceptor chain)")
        else:
            layers.setdefault(layer, "not present: no such interceptor in the chain")
    return Stack(env, token, layers)


def stargrpc_argv(without: list[str] | None = None) -> list[str]:
    """``stargrpc serve`` with the bench tools, or the launcher when layers are left out."""
    if without is None:
        return [sys.executable, "-m", "stargrpc.cli", "serve", "--tools-dir", "bench/tools"]
    argv = [sys.executable, "-m", "bench.launch", "--tools-dir", "bench/tools"]
    for layer in without:
        argv += ["--without", layer]
    return argv


def baseline_argv() -> list[str]:
    return [sys.executable, "-m", "bench.baseline_server", "--host", "127.0.0.1", "--port", "0"]


#: stargrpc's layers that the floor has too, with their ``--floor-without`` names (the
#: critic is a timer: it has no I/O, so no floor).
FLOOR_LAYERS = {"audit": "audit", "run log": "run-log", "auth": "auth"}


def floor_spec(stack: Stack, workdir: Path, suffix: str = "", without: Iterable[str] = ()
               ) -> ServerSpec:
    """The floor: the baseline plus the I/O of the layers stargrpc runs with in ``stack`` —
    its API key (in the environment, never on a command line), its Redis if the run log is
    there, and an audit database of its own — less the layers in ``without`` (their
    ``--floor-without`` names)."""
    argv = [*baseline_argv(), "--floor", "--state-dir", str(workdir / f"floor{suffix}-state")]
    if stack.env.get("STARGRPC_REDIS_URL"):
        argv += ["--redis-url", stack.env["STARGRPC_REDIS_URL"]]
    for layer in without:
        argv += ["--floor-without", layer]
    return ServerSpec(f"floor{suffix}", argv, {**os.environ, "BENCH_FLOOR_TOKEN": stack.token})


# -- the measurements ----------------------------------------------------------------------

def server_plan(sizes: Sizes, targets: list[Server]) -> list[dict[str, Any]]:
    """Latency, throughput (fast and slow reader) and concurrency."""
    return [
        {"measure": "latency", "calls": sizes.latency_calls, "warmup": sizes.latency_warmup},
        {"measure": "stream", "n": sizes.stream_n, "runs": sizes.stream_runs,
         "server_pids": [s.pid for s in targets]},
        {"measure": "stream", "name": "stream_slow", "n": sizes.slow_n, "runs": 1,
         "slow_every": sizes.slow_every, "slow_ms": sizes.slow_ms, "coalesce_deltas": True},
        {"measure": "concurrency", "concurrent": sizes.concurrency,
         "rounds": sizes.concurrency_rounds},
    ]


def cpu_step(sizes: Sizes, targets: list[Server]) -> dict[str, Any]:
    return {"measure": "cpu", "calls": sizes.cpu_calls, "warmup": sizes.cpu_warmup,
            "server_pids": [s.pid for s in targets], "block": sizes.cpu_block}


def held_step(sizes: Sizes, targets: list[Server]) -> dict[str, Any]:
    return {"measure": "held", "streams": sizes.held, "seconds": sizes.held_seconds,
            "server_pids": [s.pid for s in targets], "open_timeout": sizes.held_open_timeout}


#: The servers of the headline measurements, in the order the client is given them.
HEADLINE = ("baseline", "floor", "stargrpc")


def pair_specs(stack: Stack, workdir: Path, suffix: str = "", floor: bool = True
               ) -> list[ServerSpec]:
    """The bare baseline, the floor (unless ``floor`` is false) and stargrpc with
    everything on, in that order."""
    return [ServerSpec(f"baseline{suffix}", baseline_argv(), dict(os.environ)),
            *([floor_spec(stack, workdir, suffix)] if floor else []),
            ServerSpec(f"stargrpc{suffix}", stargrpc_argv(), stack.env)]


def run_pair(sizes: Sizes, stack: Stack, workdir: Path, say: Any) -> dict[str, Any]:
    """The headline measurements: the baseline, the floor and stargrpc running side by side,
    taking turns under the same client. The baseline ignores the credentials it is sent; the
    floor and stargrpc check them."""
    say("starting the baseline, the floor and stargrpc")
    with servers(pair_specs(stack, workdir), workdir) as pair:
        plan = [*server_plan(sizes, pair), cpu_step(sizes, pair)]
        if not sizes.held_fresh_server:
            plan.append(held_step(sizes, pair))
        say("latency, throughput, concurrency, CPU per call"
            + ("" if sizes.held_fresh_server else f", {sizes.held} held streams"))
        figures = run_plan(pair, plan, stack.token)
        say(f"the bare baseline with {sizes.coalesce} deltas per message")
        coalesced = run_plan(pair[:1], [{
            "measure": "stream", "n": sizes.slow_n, "runs": 1, "slow_every": sizes.slow_every,
            "slow_ms": sizes.slow_ms, "coalesce": sizes.coalesce}])["stream"][0]
    if sizes.held_fresh_server:
        say(f"{sizes.held} held streams, on fresh servers")
        with servers(pair_specs(stack, workdir, "-held"), workdir) as pair:
            figures.update(run_plan(pair, [held_step(sizes, pair)], stack.token))
    results = {name: {measure: values[k] for measure, values in figures.items()}
               for k, name in enumerate(HEADLINE)}
    results["baseline"]["stream_slow_coalesced"] = coalesced
    return results


def floor_layer_specs(stack: Stack, workdir: Path, present: list[str]
                      ) -> dict[str, ServerSpec]:
    """The floor with the layers stargrpc runs with, with each of their I/O off in turn,
    and with all of it off, by configuration name ("all on", "audit off", … "all off")."""
    # A layer stargrpc runs without is off in every floor configuration, "all on" included
    # (the run log and auth already are when there is no Redis or no key).
    absent = [flag for layer, flag in FLOOR_LAYERS.items() if layer not in present]
    configs = {"all on": absent}
    configs.update({f"{layer} off": [*absent, flag] for layer, flag in FLOOR_LAYERS.items()
                    if layer in present})
    if len(configs) > 1:
        # Bare plus nothing, through the floor's own code path: all on minus all off is the
        # layers' I/O alone.
        configs["all off"] = list(FLOOR_LAYERS.values())
    return {name: floor_spec(stack, workdir, "-" + name.replace(" ", "-"), without)
            for name, without in configs.items()}


def run_layers(sizes: Sizes, stack: Stack, workdir: Path, say: Any) -> dict[str, Any]:
    """Server CPU per call with everything on, and with each present layer off in turn, in
    stargrpc and in the floor.

    All configurations, stargrpc's and the floor's, run side by side and take turns call by
    call, so the machine's noise falls on each alike; over the repeats the least CPU of each
    is kept (noise only ever adds CPU time: cache misses, frequency, other tenants).
    """
    present = [layer for layer, state in stack.layers.items() if state.startswith("on")]
    # Every configuration starts through the launcher, "all on" included, so they differ
    # only in the layer switched off.
    specs = [ServerSpec("all on", stargrpc_argv([]), stack.env)]
    for layer in present:
        env = dict(stack.env)
        without: list[str] = []
        if layer == "run log":
            env.pop("STARGRPC_REDIS_URL", None)
        elif layer == "auth" and "STARGRPC_INSECURE_NO_AUTH" in env:
            env["STARGRPC_INSECURE_NO_AUTH"] = "true"
        else:
            without = [layer]
        specs.append(ServerSpec(f"{layer} off", stargrpc_argv(without), env))
    if present:
        # Every layer off at once: what the framework itself costs, next to the baseline.
        env = dict(stack.env)
        env.pop("STARGRPC_REDIS_URL", None)
        if "STARGRPC_INSECURE_NO_AUTH" in env:
            env["STARGRPC_INSECURE_NO_AUTH"] = "true"
        chain_off = [layer for layer in present if layer in ("audit", "critic")
                     or (layer == "auth" and "STARGRPC_INSECURE_NO_AUTH" not in env)]
        specs.append(ServerSpec("all off", stargrpc_argv(chain_off), env))
    floors = floor_layer_specs(stack, workdir, present)
    # One list of servers, stargrpc's configurations then the floor's, each keyed by
    # (server, configuration) so that the figures can be split again afterwards.
    keys = [("stargrpc", spec.name) for spec in specs] + [("floor", name) for name in floors]
    samples: dict[str, dict[str, list[float]]] = {"stargrpc": {}, "floor": {}}
    p50: dict[str, dict[str, list[float]]] = {"stargrpc": {}, "floor": {}}
    say(f"starting {len(specs)} stargrpc servers ({', '.join(s.name for s in specs)}) and "
        f"{len(floors)} floor servers ({', '.join(floors)})")
    with servers([ServerSpec(s.name.replace(" ", "-"), s.argv, s.env) for s in specs]
                 + list(floors.values()), workdir) as running:
        for repeat in range(sizes.cpu_repeats):
            say(f"CPU per call, layers off in turn ({repeat + 1}/{sizes.cpu_repeats})")
            # A server with auth off ignores the credentials the others need.
            figures = run_plan(running, [cpu_step(sizes, running)], stack.token)["cpu"]
            for (server, name), figure in zip(keys, figures, strict=True):
                samples[server].setdefault(name, []).append(figure["cpu_us_per_call"])
                p50[server].setdefault(name, []).append(figure["p50_ms"])

    def least(values: dict[str, list[float]]) -> dict[str, float]:
        return {name: min(found) for name, found in values.items()}

    return {"cpu_us_per_call": least(samples["stargrpc"]), "p50_ms": least(p50["stargrpc"]),
            "samples": samples["stargrpc"],
            "floor_cpu_us_per_call": least(samples["floor"]),
            "floor_p50_ms": least(p50["floor"]), "floor_samples": samples["floor"]}


def run_profiles(sizes: Sizes, stack: Stack, workdir: Path, results_dir: Path, stamp: str,
                 say: Any) -> dict[str, Any]:
    """py-spy profiles of stargrpc and the baseline under the latency and stream loads."""
    if profiling.py_spy() is None:
        return {"skipped": "py-spy is not installed: pip install -r bench/requirements.txt"}
    found: dict[str, Any] = {}
    loads = {
        "latency": {"measure": "latency", "calls": max(500, sizes.latency_calls),
                    "warmup": 0},
        "stream": {"measure": "stream", "n": sizes.stream_n, "runs": max(2, sizes.stream_runs)},
    }
    with servers(pair_specs(stack, workdir, "-profile", floor=False), workdir) as pair:
        run_plan(pair, [{"measure": "latency", "calls": 50, "warmup": 0}], stack.token)
        for server, name in zip(pair, ("baseline", "stargrpc"), strict=True):
            for load, step in loads.items():
                say(f"profiling {name} under the {load} load")
                raw = results_dir / f"{stamp}-profile-{name}-{load}.txt"
                recorder = profiling.Recorder(server.pid, raw)
                try:
                    run_plan([server], [step], stack.token)
                finally:
                    written = recorder.stop()
                if written is None:
                    found[f"{name}/{load}"] = {"error": "py-spy wrote no profile"}
                    continue
                summary = profiling.summarize(written)
                summary_path = raw.with_name(raw.stem + "-summary.txt")
                summary_path.write_text(summary.render(40))
                packed = profiling.compress(written)
                found[f"{name}/{load}"] = {"raw": packed.name, "summary": summary_path.name,
                                           "samples": summary.samples,
                                           "self_top": summary.self_share[:15],
                                           "inclusive_top": summary.inclusive_share[:30]}
    return found


# -- the report ----------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    import google.protobuf
    import grpc

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "stargrpc"],
                           capture_output=True, text=True, cwd=ROOT, check=False).stdout.strip()
    return {
        "cpu": model, "cores": os.cpu_count(), "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "kernel": platform.release(), "python": platform.python_version(),
        "grpcio": grpc.__version__, "protobuf": google.protobuf.__version__,
        "commit": commit + (" + uncommitted changes in stargrpc/" if dirty else ""),
        "load_average": os.getloadavg(),
    }


@dataclass
class Row:
    measure: str
    stargrpc: float | None
    baseline: float | None
    unit: str
    ratio: float | None = None
    target: str = ""
    met: bool | None = None
    floor: float | None = None
    floor_ratio: float | None = None
    #: The floor against the target; False means no stargrpc with these layers can meet it.
    floor_met: bool | None = None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def build_rows(pair: dict[str, Any], sizes: Sizes) -> list[Row]:
    """The table: one row per figure, with its ratios (stargrpc and the floor against the
    bare baseline) and its target."""
    rows: list[Row] = []

    def add(measure: str, get: Callable[[dict[str, Any]], float | None], unit: str,
            target: str = "", check: Callable[[float], bool] | None = None,
            ratio: bool = True, only: str = "") -> None:
        # get picks the figure out of one server's results; only: the one server the row
        # is about. check judges the ratio to bare, or with ratio=False the figure itself.
        sg, fl, bl = (get(pair[name]) if only in ("", name) else None
                      for name in ("stargrpc", "floor", "baseline"))
        r, fr = _ratio(sg, bl), _ratio(fl, bl)
        subject, floor_subject = (r, fr) if ratio else (sg, fl)
        met = check(subject) if check is not None and subject is not None else None
        floor_met = (check(floor_subject) if check is not None and floor_subject is not None
                     else None)
        rows.append(Row(measure, sg, bl, unit, r, target, met, fl, fr, floor_met))

    add("Call latency p50 (START, END, Result)", lambda s: s["latency"]["p50_ms"], "ms",
        "≤ 1.25x", lambda r: r <= 1.25)
    add("Call latency p99", lambda s: s["latency"]["p99_ms"], "ms", "≤ 1.5x",
        lambda r: r <= 1.5)
    add(f"Stream throughput, {sizes.stream_n} deltas",
        lambda s: s["stream"]["median_events_per_s"], "events/s", "≥ 0.8x", lambda r: r >= 0.8)
    add("  the tool's own emission rate", lambda s: s["stream"]["best"]["tool_events_per_s"],
        "events/s", only="stargrpc")
    add("  server CPU per event", lambda s: s["stream"]["server_cpu_us_per_event"], "µs")
    add(f"Slow reader ({sizes.slow_ms:g} ms pause per {sizes.slow_every} messages, opting in "
        "to coalescing): events", lambda s: s["stream_slow"]["median_events_per_s"],
        "events/s", "> 1x (coalescing)", lambda r: r > 1.0)
    add("  messages carrying them", lambda s: s["stream_slow"]["median_messages_per_s"],
        "msgs/s")
    add(f"  bare grpc.aio packing {sizes.coalesce} deltas per message (what coalescing "
        "reaches)", lambda s: s["stream_slow_coalesced"]["median_events_per_s"], "events/s",
        only="baseline")
    add(f"Concurrency, {sizes.concurrency} runs of a 10 ms tool",
        lambda s: s["concurrency"]["calls_per_s"], "calls/s", "≥ 0.85x", lambda r: r >= 0.85)
    add("  wall time per round", lambda s: s["concurrency"]["median_wall_s"], "s")
    add(f"Held streams ({pair['stargrpc']['held']['opened']} open): server memory per open "
        "run", lambda s: s["held"]["kb_per_open_run"], "KiB", "≤ 50 KiB", lambda v: v <= 50,
        ratio=False)
    add("  a normal call meanwhile, slowest of probes", lambda s: s["held"]["probe_max_ms"],
        "ms", "≪ 1 s (≤ 250 ms)", lambda v: v <= 250, ratio=False)
    add("Server CPU per trivial call", lambda s: s["cpu"]["cpu_us_per_call"], "µs")
    return rows


def _fmt(value: float | None) -> str:
    if value is None:
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def render(rows: list[Row], layers: dict[str, Any] | None, stack: Stack, info: dict[str, Any],
           mode: str) -> str:
    """The Markdown report: the table, the layer costs, the machine."""
    lines = [f"### {info['date']} — `python -m bench{'' if mode == 'full' else ' --' + mode}`",
             "",
             "| measure | stargrpc | bare grpc.aio | floor | floor ratio | unit | ratio "
             "| target | met |",
             "|---|---:|---:|---:|---:|---|---:|---|---|"]
    for row in rows:
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "—"
        floor_ratio = f"{row.floor_ratio:.2f}x" if row.floor_ratio is not None else "—"
        if row.floor_met is False:
            floor_ratio = f"**{floor_ratio}**"
        met = {True: "yes", False: "**no**", None: ""}[row.met]
        lines.append(f"| {row.measure} | {_fmt(row.stargrpc)} | {_fmt(row.baseline)} | "
                     f"{_fmt(row.floor)} | {floor_ratio} | {row.unit} | {ratio} | "
                     f"{row.target} | {met} |")
    run_log = ("the run's events to Redis in one background script call"
               if stack.env.get("STARGRPC_REDIS_URL") else "no run log I/O (stargrpc's is in "
               "memory in this run)")
    lines += ["", "The **floor** is the bare server plus only the I/O stargrpc's layers must do "
              f"per call, done as leanly as Python allows (the API key hashed and compared, "
              f"{run_log}, one audit row committed to SQLite on the event loop before the "
              "Result): its ratio is the best any stargrpc with these layers can reach on "
              "grpc.aio, in bold where even that misses the target.",
              "", "Layers of stargrpc in this run: " + "; ".join(
        f"**{k}** {v}" for k, v in stack.layers.items()), ""]
    if layers:
        lines += _layer_table(layers, stack)
    m = info["machine"]
    lines += [f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux "
              f"{m['kernel']}, Python {m['python']}, grpcio {m['grpcio']}, protobuf "
              f"{m['protobuf']}; commit {m['commit']}; load average at start "
              f"{', '.join(f'{x:.2f}' for x in m['load_average'])} (a shared machine: the "
              f"ratios are what count).", ""]
    return "\n".join(lines)


def _floor_cost(floor: dict[str, float], key: str) -> tuple[float, float] | None:
    """The floor's cost of a configuration (all on minus that one) and its share of all on."""
    if "all on" not in floor or key not in floor:
        return None
    cost = floor["all on"] - floor[key]
    return cost, (cost / floor["all on"] if floor["all on"] else 0.0)


def _layer_table(layers: dict[str, Any], stack: Stack) -> list[str]:
    """The per-layer table (stargrpc's cost of each layer beside the floor's) and the
    sentence on what the floor share means for the < 10% targets."""
    cpu = layers["cpu_us_per_call"]
    base = cpu["all on"]
    p50 = layers["p50_ms"]
    floor: dict[str, float] = layers.get("floor_cpu_us_per_call", {})

    def floor_cells(key: str) -> str:
        found = _floor_cost(floor, key)
        return "— | —" if found is None else f"{_fmt(found[0])} µs | {found[1]:.0%}"

    lines = ["| layer | server CPU per call, all on | with the layer off | cost | share "
             "| floor cost | floor share | target | met | latency p50 all on / off |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for layer, state in stack.layers.items():
        key = f"{layer} off"
        target = "< 10%" if layer != "auth" else ""
        if key not in cpu:
            lines.append(f"| {layer} | {_fmt(base)} µs | — | — | — | — | — | {target} "
                         f"| {state} | |")
            continue
        cost = base - cpu[key]
        share = cost / base if base else 0.0
        met = "" if layer == "auth" else ("yes" if share < 0.10 else "**no**")
        lines.append(f"| {layer} | {_fmt(base)} µs | {_fmt(cpu[key])} µs | {_fmt(cost)} µs "
                     f"| {share:.0%} | {floor_cells(key)} | {target} | {met} "
                     f"| {_fmt(p50['all on'])} / {_fmt(p50[key])} ms |")
    if "all off" in cpu:
        lines.append(f"| *every layer off: the framework alone* | {_fmt(base)} µs | "
                     f"{_fmt(cpu['all off'])} µs | {_fmt(base - cpu['all off'])} µs | "
                     f"{(base - cpu['all off']) / base:.0%} | {floor_cells('all off')} | | | "
                     f"{_fmt(p50['all on'])} / {_fmt(p50['all off'])} ms |")
    if floor:
        lines += ["", _floor_verdict(floor)]
    return [*lines, ""]


def _floor_verdict(floor: dict[str, float]) -> str:
    """One sentence: what the floor share means, and which < 10% targets it rules out."""
    out_of_reach: list[str] = []
    reachable: list[str] = []
    for layer in FLOOR_LAYERS:
        found = _floor_cost(floor, f"{layer} off")
        if layer == "auth" or found is None:  # auth has no target; an absent layer no figure
            continue
        (out_of_reach if found[1] >= 0.10 else reachable).append(f"{layer} ({found[1]:.0%})")
    parts = [f"out of reach for {' and '.join(out_of_reach)}"] if out_of_reach else []
    parts += [f"within reach for {' and '.join(reachable)}"] if reachable else []
    verdict = ("in this run it is " + " and ".join(parts) if parts
               else "no layer with a target has floor I/O in this stack")
    return (f"**Floor cost**: the floor with every layer on ({_fmt(floor['all on'])} µs per "
            "call) minus the floor with that layer's I/O off; **floor share**: that cost over "
            "the floor all on — the least share that layer can have on grpc.aio (short of making "
            "the rest of the call slower), so where it is ≥ 10% the < 10% target cannot be "
            f"met by any implementation ({verdict}; the critic has no I/O, only a timer).")


def render_profiles(profiles: dict[str, Any], top: int = 12) -> str:
    """The busiest functions of each profile, for the report."""
    if "skipped" in profiles:
        return f"Profiles: skipped ({profiles['skipped']}).\n"
    lines = ["Profiles (py-spy, share of busy samples; full summaries beside the results):", ""]
    for name, found in profiles.items():
        if "error" in found:
            lines.append(f"- {name}: {found['error']}")
            continue
        lines.append(f"- **{name}** ({found['samples']} samples, {found['summary']}); "
                     "self: " + ", ".join(f"{share:.0%} {func}"
                                          for func, share in found["self_top"][:3])
                     + "; inclusive: " + ", ".join(
                         f"{share:.0%} {func}" for func, share in found["inclusive_top"][:top]))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="A reduced pass, under a minute.")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true",
                        help="Also record py-spy profiles of the hot paths.")
    parser.add_argument("--no-layers", action="store_true",
                        help="Skip the per-layer CPU measurements.")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="Where to save the run [default: bench/runs, git-ignored].")
    parser.add_argument("--keep", action="store_true",
                        help="Save the run in bench/results, the run the repository keeps.")
    parser.add_argument("--no-save", action="store_true", help="Print only.")
    args = parser.parse_args(argv)
    if args.results_dir is None:
        args.results_dir = RESULTS if args.keep else RUNS
    elif args.keep:
        parser.error("--keep saves in bench/results: give it or --results-dir, not both")
    # Killed (timeout, CI): unwind normally, so that every server started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = MODES[mode]
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    info: dict[str, Any] = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                            "mode": mode, "sizes": asdict(sizes), "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="stargrpc-bench-") as tmp:
        workdir = Path(tmp)
        try:
            stack = stargrpc_stack(workdir)
            info["layers"] = stack.layers
            pair = run_pair(sizes, stack, workdir, say)
            layers = (run_layers(sizes, stack, workdir, say)
                      if sizes.layers and not args.no_layers else None)
            if args.profile or not args.no_save:
                args.results_dir.mkdir(parents=True, exist_ok=True)
            profiles = (run_profiles(sizes, stack, workdir, args.results_dir, stamp, say)
                        if args.profile else None)
        except BenchFailure as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 1
    rows = build_rows(pair, sizes)
    info["machine"]["load_average_end"] = os.getloadavg()
    info["seconds"] = round(time.monotonic() - started, 1)
    report = render(rows, layers, stack, info, mode)
    if profiles:
        report += render_profiles(profiles)
    print(report)
    if not args.no_save:
        base = args.results_dir / f"{stamp}-{mode}"
        base.with_suffix(".md").write_text(report)
        base.with_suffix(".json").write_text(json.dumps(
            {**info, "rows": [asdict(r) for r in rows], "raw": pair, "layers_cpu": layers,
             "profiles": profiles}, indent=1, default=str))
        say(f"saved {base}.md and .json")
    say(f"done in {info['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
