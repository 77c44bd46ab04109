"""Settings, in one place: flags override ``STARGRPC_*`` environment variables, which
override an optional TOML file (``--config`` / ``STARGRPC_CONFIG``), which overrides the
defaults below. :meth:`Settings.masked` is what start-up logs, with secrets hidden.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from stargrpc.file_trust import others_may_write
from stargrpc.http_guard import HostRule, normal_origin

MiB = 1024 * 1024


class ToolAccess(BaseModel):
    """Who may run one tool (an entry of ``Settings.tool_permissions``)."""

    model_config = ConfigDict(extra="forbid")

    roles: list[str] = Field(default_factory=list, description="Allowed roles; '*' = any.")
    principals: list[str] = Field(default_factory=list, description="Allowed principal "
                                  "ids; '*' = any authenticated caller.")
    privileged: bool = Field(False, description="Also require the privileged role.")


class ApprovalPolicy(BaseModel):
    """Which runs wait for a person's approval (``Settings.approval_policy``), besides those
    of tools declared ``@tool(approval=True)``."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(default_factory=list, description="Tools whose runs need "
                             "approval ('*' for every tool).")
    roles: list[str] = Field(default_factory=list, description="Callers holding any of "
                             "these roles need approval for every run.")
    destructive: bool = Field(False, description="Runs of tools annotated destructive need "
                              "approval.")
    exempt_roles: list[str] = Field(default_factory=list, description="Callers holding any "
                                    "of these roles never need approval (not even for a "
                                    "tool declared approval=True).")
#: Lane names: what a request's ``lane`` field, a tool's ``@tool(lane=…)``, metrics labels and
#: Redis keys carry.
LANE_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


class LaneConfig(BaseModel):
    """One lane of ``Settings.lanes``: how many of its runs go at once and how many wait."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent: int = Field(0, ge=0, description="Runs of the lane running at once "
                                "(the fleet's, with redis_url); 0 = unlimited: runs never "
                                "queue.")
    max_queued: int = Field(1000, ge=0, description="Runs waiting in the lane's queue at "
                            "most; past it calls are refused RESOURCE_EXHAUSTED LANE_FULL.")
    default_priority: int = Field(0, ge=0, le=1000, description="Priority of a run whose "
                                  "request and tool give none.")


class McpServerEntry(BaseModel):
    """One MCP server whose tools join the catalog (an entry of ``Settings.mcp_servers``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,32}$", description="Short name, in logs, "
                      "reasons and the default prefix.")
    url: str | None = Field(None, description="A streamable-HTTP MCP endpoint (http or https).")
    command: str | None = Field(None, description="A stdio MCP server, started in the sandbox "
                                "(looked up on the sandbox PATH unless absolute).")
    args: list[str] = Field(default_factory=list, description="Arguments of command.")
    env: dict[str, SecretStr] = Field(default_factory=dict, description="Environment "
                                      "variables of command (besides the sandbox's).")
    headers: dict[str, SecretStr] = Field(default_factory=dict, description="HTTP headers "
                                          "sent to url, e.g. Authorization.")
    read_only_paths: list[Path] = Field(default_factory=list, description="Host folders "
                                        "shown read-only inside bubblewrap at the same path "
                                        "(the server's code, a virtualenv).")
    prefix: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{0,32}$", description="Put "
                               "before each tool name; default '<name>.'.")
    roles: list[str] = Field(default_factory=lambda: ["*"], description="Roles allowed to "
                             "run its tools ('*' = any authenticated caller).")
    principals: list[str] = Field(default_factory=list, description="Principal ids allowed "
                                  "to run its tools.")
    privileged: bool = Field(False, description="Its tools also need the privileged role.")
    connect_timeout_seconds: float = Field(10.0, gt=0, le=300, description="Connecting and "
                                           "listing the tools, before the server is marked "
                                           "unavailable.")
    call_timeout_seconds: float | None = Field(None, gt=0, description="Longest wait for "
                                               "one call's answer; default: the critic alone "
                                               "supervises.")
    soft_timeout_seconds: float | None = Field(None, gt=0, description="Critic soft timeout "
                                               "of its tools, when not the server's.")

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerEntry:
        if (self.url is None) == (self.command is None):
            raise ValueError(f"mcp_servers entry {self.name!r}: give url or command (one)")
        return self

    @property
    def tool_prefix(self) -> str:
        """What goes before each upstream tool name."""
        return f"{self.name}." if self.prefix is None else self.prefix


class Settings(BaseSettings):
    """Every setting of the server. Environment: ``STARGRPC_<NAME>``; TOML: ``name = …``."""

    # hide_input_in_errors: a refused setting's error is printed and logged, and a check
    # of the whole model would quote every input given — secrets included.
    model_config = SettingsConfigDict(env_prefix="STARGRPC_", extra="forbid",
                                      validate_default=True, hide_input_in_errors=True)

    # -- listening -------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")

    # -- state -----------------------------------------------------------------------------
    state_dir: Path = Field(
        default_factory=lambda: Path(os.environ.get("XDG_STATE_HOME")
                                     or Path.home() / ".local" / "state") / "stargrpc",
        description="Where the server keeps its files (keys file, audit database, "
        "pending deliveries, indexes).")

    # -- tools -----------------------------------------------------------------------------
    tools_dir: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Extra tools directories, besides the bundled tools "
        "(environment: separated by the path separator).")
    bundled_tools: bool = Field(True, description="Load the bundled tools.")
    entry_point_tools: bool = Field(True, description="Load tools from the stargrpc.tools "
                                    "entry-point group.")

    # -- limits ----------------------------------------------------------------------------
    max_receive_message_bytes: int = Field(8 * MiB, ge=1024, description="Largest request "
                                           "message accepted by the transport.")
    max_send_message_bytes: int = Field(64 * MiB, ge=1024, description="Largest message sent.")
    max_event_bytes: int = Field(
        4 * MiB, ge=1024, description="Largest run event (a Result included) sent, within "
        "max_send_message_bytes: 4 MiB is the default receive limit of gRPC clients in every "
        "language, so a default client reads every event; more output comes as a sent file.")
    max_argument_bytes: int = Field(1 * MiB, ge=2, description="Largest arguments payload.")
    max_argument_depth: int = Field(64, ge=1, le=512, description="Deepest argument nesting.")

    # -- runs ------------------------------------------------------------------------------
    run_retention_seconds: float = Field(600.0, ge=0, description="How long a finished run "
                                         "stays watchable.")
    max_finished_runs: int = Field(10_000, ge=0, description="Finished runs kept at most.")
    max_finished_run_bytes: int = Field(
        256 * MiB, ge=0, description="Bytes of events (serialised) the finished runs kept in "
        "memory may hold together; the oldest expire first when over it; 0 = no bound.")

    # -- run state (runs/state.py, stores/) -------------------------------------------------
    state_max_value_bytes: int = Field(64 * 1024, ge=1, description="Largest value (its "
                                       "JSON, in bytes) a tool may keep in run state.")
    state_max_bytes_per_scope: int = Field(
        1 * MiB, ge=0, description="Bytes of keys and values one state scope (a run, a "
        "tree, a principal, global) may hold; 0 = no bound.")
    state_retention_seconds: float = Field(
        86400.0, gt=0, description="How long run and tree state stays after the run (the "
        "root run) ends.")
    state_global_writers: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Tools (comma-separated names) that may write the "
        "global state scope; every tool may read it.")
    state_persist: bool = Field(
        False, description="Keep run state across restarts in <state_dir>/state.db (SQLite) "
        "when embedded; otherwise it lives in memory and a restart loses it. With redis_url "
        "state is in Redis and this is ignored.")
    sandbox_state_scopes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["run", "tree"], description="State scopes sandboxed "
        "commands (python, shell) reach through their run's state socket (comma-separated "
        "of run, tree, principal, global); empty gives them no socket.")
    sandbox_state_requests_per_second: float = Field(
        200.0, gt=0, description="State requests a sandboxed run may make per second "
        "(bursts up to as many at once); more are refused STATE_RATE_LIMITED.")

    # -- runs, retries and replicas (stores/, runs/idempotency.py, runs/concurrency.py) -------
    redis_url: str = Field("", description="The run store shared by replicas: "
                           "redis://host:port/db (one Redis), redis+cluster://host:port[,…] "
                           "(Redis Cluster) or redis+sentinel://host:port[,…]/service_name "
                           "(the primary Sentinel names); empty keeps runs in this process.")
    redis_key_prefix: str = Field("stargrpc:", description="Prefix of every Redis key.")
    redis_timeout_seconds: float = Field(2.0, gt=0, description="Connect/command timeout "
                                         "for Redis; calls fail UNAVAILABLE after it.")
    redis_wait_replicas: int = Field(0, ge=0, description="Replicas that must acknowledge "
                                     "(Redis WAIT) each claim and batch of events before it "
                                     "counts as written; 0 = Redis's asynchronous "
                                     "replication (a failover may lose the last writes).")
    redis_wait_timeout_ms: int = Field(500, ge=1, description="How long a write waits for "
                                       "redis_wait_replicas acknowledgements before it counts "
                                       "as failed (and is retried, or the call fails "
                                       "UNAVAILABLE).")
    run_lease_seconds: float = Field(10.0, ge=1, description="A replica's claim on its "
                                     "runs; runs of a replica dead this long are lost.")
    run_sweep_interval_seconds: float = Field(1.0, gt=0, description="How often each replica "
                                              "looks for runs of dead replicas to end "
                                              "RUN_LOST (jittered; at most a quarter of "
                                              "run_lease_seconds).")
    redis_ping_interval_seconds: float = Field(1.0, gt=0, description="How often each replica "
                                               "PINGs Redis (each bounded by "
                                               "redis_timeout_seconds): health is NOT_SERVING "
                                               "while a PING or a write of its gets no answer.")
    run_max_events: int = Field(100_000, ge=100, description="Events kept per run in Redis "
                                "(older ones are trimmed).")
    max_watch_lag_events: int = Field(10_000, ge=0, description="A live watcher further "
                                      "behind than this is ended (ABORTED, resume from its "
                                      "seq); 0 never.")
    run_watch_roles: list[str] = Field(["watch"], description="Roles that may watch "
                                       "anyone's runs (admin_role may also cancel them).")
    max_concurrent_runs: int = Field(1024, ge=0, description="Runs in flight per replica; "
                                     "0 = unlimited.")
    max_concurrent_runs_per_principal: int = Field(256, ge=0, description="Runs in flight "
                                                   "per principal per replica; 0 = unlimited.")
    max_concurrent_runs_per_tool: int = Field(0, ge=0, description="Runs in flight per tool "
                                              "per replica; 0 = unlimited.")
    max_run_depth: int = Field(8, ge=1, le=64, description="How deep a call tree may go: "
                               "a run started by a tool (ctx.call) or under a parent_run_id is "
                               "refused RUN_DEPTH_EXCEEDED when it would be more than this "
                               "many levels below its root.")
    max_runs_per_tree: int = Field(1000, ge=1, description="Runs one call tree may start "
                                   "below its root; one more is refused RUN_TREE_FULL.")
    max_tree_seconds: float = Field(3600.0, gt=0, description="Wall time a call tree may "
                                    "take from its root's start: later children are refused "
                                    "RUN_TREE_EXPIRED, and children still running then end "
                                    "TIMEOUT.")
    limit_retry_after_seconds: float = Field(1.0, gt=0, description="RetryInfo delay "
                                             "suggested when a limit refuses a call.")

    # -- lanes (stargrpc/runs/lanes.py, docs/operate/lanes.md) ------------------------------
    lanes: dict[str, LaneConfig] = Field(
        default_factory=dict, description="Named lanes (TOML table [lanes.NAME], or JSON in "
        "the environment): max_concurrent, max_queued, default_priority. A lane 'default' "
        "always exists (unlimited unless configured).")
    tool_lanes: dict[str, str] = Field(
        default_factory=dict, description="Per tool: the lane its runs go to, overriding "
        "the tool's own @tool(lane=...).")
    lane_override_role: str = Field("admin", description="Holders may name a lane in the "
                                    "request (ExecuteRequest.lane).")
    priority_max_per_principal: int = Field(5, ge=0, le=1000, description="Highest "
                                            "priority a caller may ask for; the admin role "
                                            "may exceed it.")
    inline_file_bytes: int = Field(1 * MiB, ge=0, description="Sent files up to this size "
                                   "travel inside the Result; larger ones as FileChunks.")
    file_chunk_bytes: int = Field(256 * 1024, ge=1024, le=4 * MiB, description="Size of "
                                  "one FileChunk event.")

    # -- supervision (critic/, interceptors/critic.py) ---------------------------------------
    critic_soft_timeout: float = Field(
        90.0, gt=0, description="Seconds a run may go without progress before the critic "
        "stops it (a tool's own soft_timeout takes precedence); restarted by progress.")
    critic_hard_timeout: float = Field(
        900.0, gt=0, description="Seconds a run may take at most, progress or not.")
    critic: str = Field("", description="The server's critic: module:factory, or the name "
                        "of an entry point of the stargrpc.critics group; empty: the rules.")
    critic_url: str = Field("", description="host:port of a remote CriticService that judges "
                            "every run (the rules take over a run when it fails); empty: "
                            "none.")
    critic_verdict_timeout_seconds: float = Field(
        2.0, gt=0, le=60, description="How long a remote critic asked at a run's soft "
        "deadline may take to answer before the rules take over the run.")

    # -- lifecycle -------------------------------------------------------------------------
    shutdown_grace_seconds: float = Field(30.0, ge=0, description="How long in-flight runs "
                                          "may take to finish after SIGTERM.")
    workers: int = Field(
        1, ge=1, le=256, description="Server processes sharing the gRPC (and HTTP) ports, "
        "supervised by the first ('auto' = the cores this process may use); more than one "
        "needs redis_url.")
    keepalive_time_seconds: float = Field(30.0, gt=0, description="HTTP/2 keepalive ping "
                                          "interval.")
    keepalive_timeout_seconds: float = Field(10.0, gt=0, description="Time to wait for a "
                                             "keepalive ack.")

    # -- logging ---------------------------------------------------------------------------
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Minimum level of log lines written.")
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: console on a terminal, JSON otherwise.")

    # -- HTTP gateway, metrics and traces (stargrpc/gateway, http_server.py, tracing.py) ---
    http_port: int | None = Field(None, ge=0, le=65535, description="Serve the HTTP gateway "
                                  "and the progress page on this port (0 picks a free one); "
                                  "off when unset.")
    http_host: str | None = Field(None, description="Address of the HTTP gateway; defaults "
                                  "to host.")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Serve Prometheus "
                                     "metrics at /metrics on this port; off when unset.")
    metrics_host: str | None = Field(None, description="Address of the metrics endpoint; "
                                     "defaults to host.")
    tracing: bool = Field(False, description="Record OpenTelemetry traces: a span per call, "
                          "a span per run, a span per step.")
    tracing_exporter: Literal["otlp", "console", "none"] = Field(
        "otlp", description="Where traces go: OTLP/gRPC (configured by the standard "
        "OTEL_EXPORTER_OTLP_* variables), the console, or nowhere here (a program that "
        "embeds the server installs its own tracer provider).")
    tracing_service_name: str = Field("stargrpc", description="service.name of the traces.")
    http_grpc_ca_file: Path | None = Field(
        None, description="With TLS on: the CA trusted for the server's certificate by a "
        "replica forwarding a session's call, unless session_forward_ca_file is set (the "
        "gateway and the MCP endpoint call their own server in-process, without TLS); "
        "default tls_cert_file (right for a self-signed certificate).")
    http_grpc_server_name: str | None = Field(
        None, description="With TLS on: the name expected in the server certificate had the "
        "gateway a channel to its server (it calls it in-process); default its first DNS "
        "name (or common name).")
    http_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Host names the HTTP gateway and the MCP endpoint "
        "answer to besides IP addresses and localhost (comma-separated: name, name:port, "
        "*.domain, or * for any when a proxy checks Host); other Host headers are refused "
        "421 (DNS rebinding).")
    http_allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Web origins (https://name[:port]) that may call "
        "the HTTP gateway and the MCP endpoint besides the server's own (comma-separated); "
        "requests from other origins are refused 403.")
    http_max_connections: int = Field(
        1000, ge=1, description="Connections each HTTP port (the gateway, the MCP endpoint, "
        "the metrics) serves at once; a request arriving while that many are open (or that "
        "many requests are in progress) is answered 503 at once. Each open connection "
        "holds a descriptor and memory: keep it below the process's open-file limit.")
    http_trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Addresses or networks (comma-separated) of "
        "proxies in front of the HTTP gateway and the MCP endpoint whose X-Forwarded-For "
        "and X-Forwarded-Proto are believed: the audit then records the client they name; "
        "empty believes none (the audit records the connecting address).")

    @model_validator(mode="after")
    def _check_gateway(self) -> Settings:
        # Behind client-certificate auth every HTTP request would reach the service as the
        # gateway's own certificate: refuse rather than let anonymous callers in as it.
        if self.http_port is not None and self.tls_client_ca_file is not None:
            raise ValueError("the HTTP gateway (http_port) cannot be used with client "
                             "certificates (tls_client_ca_file): HTTP callers would all "
                             "reach the service as the gateway")
        return self

    # -- authentication and permissions (stargrpc/auth, interceptors/auth.py) -------------
    insecure_no_auth: bool = Field(
        False, description="Turn authentication OFF (local experiments only): every caller "
        "is the local principal, which holds every role.")
    keys_file: Path | None = Field(None, description="The API keys file (hashes only); "
                                   "default <state_dir>/keys.json.")
    auth_bootstrap_key: bool = Field(
        True, description="`stargrpc serve` with no API keys (and no JWT or client "
        "certificates configured) creates one admin key on first start and prints it once.")
    auth_open_health: bool = Field(True, description="Health checks need no credentials.")
    auth_open_reflection: bool = Field(True, description="Server reflection needs no "
                                       "credentials.")
    admin_role: str = Field("admin", description="Holders may run every tool (privileged "
                            "ones still need the privileged role).")
    privileged_role: str = Field("privileged", description="The role privileged tools "
                                 "need, held explicitly (no wildcard grants it).")
    delegation_role: str = Field("delegate", description="Holders may name an end user "
                                 "(channel, session) in ExecuteRequest.context.")
    permission_default: Literal["allow", "deny"] = Field(
        "allow", description="Tools without a tool_permissions entry: allow = the roles the "
        "tool declares (default every authenticated caller); deny = admins only.")
    tool_permissions: dict[str, ToolAccess] = Field(
        default_factory=dict, description="Per tool: allowed roles and principals ('*' for "
        "any authenticated caller); overrides what the tool declares.")
    list_tools_show_uncallable: bool = Field(
        False, description="ListTools also lists tools the caller may not run, marked "
        "permissions.callable = false (default: they are left out).")
    jwt_secret: SecretStr | None = Field(None, description="HS256 shared secret for JWTs "
                                         "(prefer jwt_secret_file).")
    jwt_secret_file: Path | None = Field(None, description="A file holding the HS256 shared "
                                         "secret for JWTs, read once at start-up (a final "
                                         "newline is ignored); instead of jwt_secret.")
    jwt_public_key_file: Path | None = Field(None, description="PEM public key for RS256/"
                                             "ES256 JWTs.")
    jwt_jwks_file: Path | None = Field(None, description="A JWKS file of RS256/ES256 keys "
                                       "(picked by kid; re-read when it changes).")
    jwt_issuer: str = Field("", description="Required iss of JWTs (required with JWT).")
    jwt_audience: str = Field("", description="Required aud of JWTs (required with JWT).")
    jwt_principal_claim: str = Field("sub", description="Claim naming the principal.")
    jwt_roles_claim: str = Field("roles", description="Claim holding roles/scopes: a list or "
                                 "a space-separated string; dots reach nested claims.")
    jwt_leeway_seconds: float = Field(30.0, ge=0, le=600, description="Clock skew allowed "
                                      "on exp/nbf/iat.")
    tls_cert_file: Path | None = Field(None, description="PEM certificate chain: serve TLS.")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_client_ca_file: Path | None = Field(
        None, description="PEM CA bundle: require and verify client certificates (mTLS); "
        "the subject's common name becomes the principal.")
    mtls_roles: dict[str, list[str]] = Field(
        default_factory=dict, description="Roles per client-certificate principal; '*' "
        "applies to every certificate.")

    # -- audit (stargrpc/audit, interceptors/audit.py, cli/audit.py) -----------------------
    audit_store: str = Field("", description="Where audit records go: sqlite:///PATH or "
                             "postgresql://…; default sqlite:///<state_dir>/audit.db.")
    audit_hmac_key_file: Path | None = Field(
        None, description="The audit key file (32+ bytes of secret) the audit hash chain is "
        "keyed with; made 0600 on first start when missing. Default "
        "<state_dir>/audit-hmac.key: keep it outside the state folder (a read-only secret) "
        "to protect the trail from whoever can write that folder; one file for every "
        "replica of a fleet.")
    audit_log_lines: Literal["all", "notable", "off"] = Field(
        "notable", description="Which calls also get an 'audit' log line (the trail in the "
        "audit store has every call, whatever this says): all; notable (default: privileged "
        "tools and every call not ok — refused, denied, failed, timed out, cancelled — each "
        "a warning); off.")
    audit_max_batch: int = Field(500, ge=1, le=10_000, description="Most audit records "
                                 "written in one transaction.")
    audit_group_commit_ms: float = Field(
        2.0, ge=0, le=100, description="On a busy server (8 or more other Execute calls "
        "open, and the record before came within twice this), how long (ms) an audit "
        "record may wait for the records of the calls ending next to share its "
        "transaction: one commit for several calls instead of one each, at up to this much "
        "later a Result (0: no wait, the next loop turn).")
    audit_sqlite_append_on_loop: bool = Field(
        True, description="A SQLite trail tries each append right on the event loop (no "
        "thread hop: the cheapest commit). A disk that stalls (a frozen file system, a hung "
        "network mount) then stalls every call of the server with it; off, every append "
        "is made on the store's thread and only Results wait (audit_commit_timeout_seconds).")
    audit_commit_timeout_seconds: float = Field(
        10.0, ge=0, description="How long an Execute's Result waits for its audit record to "
        "be committed before it is sent anyway (the record stays queued).")
    audit_close_timeout_seconds: float = Field(30.0, ge=0, description="How long shutdown "
                                               "keeps trying to write queued audit records.")
    audit_max_value_chars: int = Field(1000, ge=16, description="Longest argument value kept "
                                       "whole in an audit record; longer ones are cut.")
    audit_max_arguments_chars: int = Field(8000, ge=64, description="Longest arguments JSON "
                                           "kept in an audit record.")
    audit_max_result_chars: int = Field(2000, ge=0, description="Longest result text kept in "
                                        "an audit record.")

    @model_validator(mode="after")
    def _lanes_named(self) -> Settings:
        for name in self.lanes:
            if not re.match(LANE_NAME_PATTERN, name):
                raise ValueError(f"lanes: {name!r} is not a lane name (letters, digits, "
                                 "'_', '.', '-'; at most 64)")
        for tool_name, lane in self.tool_lanes.items():
            if lane != "default" and lane not in self.lanes:
                raise ValueError(f"tool_lanes: tool {tool_name!r} names lane {lane!r}, "
                                 "which lanes does not configure")
        return self

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        if value:
            from stargrpc.stores.connect import parse_redis_url  # redis-py only when used

            parse_redis_url(value)
        return value

    @field_validator("audit_store")
    @classmethod
    def _check_audit_store(cls, value: str) -> str:
        scheme = value.split("://", 1)[0].lower() if "://" in value else ""
        if value and scheme not in ("sqlite", "postgresql", "postgres"):
            raise ValueError("use sqlite:///PATH or postgresql://user@host/db")
        return value

    # -- sandbox and bundled tools (stargrpc/sandbox, egress.py, kb/, tools/) --------------
    sandbox_isolation: Literal["auto", "bwrap", "unshare", "rlimits"] = Field(
        "auto", description="How sandboxed commands are isolated: auto picks the strongest "
        "that works here (bwrap, then unshare, then rlimits only) and refuses to run them "
        "when that cannot keep them away from the server's secrets.")
    sandbox_isolation_min: Literal["bwrap", "unshare", "rlimits"] = Field(
        "rlimits", description="The weakest isolation sandboxed tools may run with; below "
        "it they fail with SANDBOX_UNAVAILABLE.")
    sandbox_allow_weak_isolation: bool = Field(
        False, description="Run sandboxed tools even when the isolation auto picks cannot "
        "keep them away from the server's secrets (logged at warning on every start).")
    sandbox_root: Path | None = Field(None, description="Where run working directories are "
                                      "made; default <tmp>/stargrpc-sandbox.")
    sandbox_keep_workdir: bool = Field(False, description="Keep each run's working directory "
                                       "(for debugging) instead of removing it.")
    sandbox_user: str = Field("nobody", description="When the server runs as root and "
                              "sandbox_uid_range is empty, sandboxed commands run as this "
                              "user (all runs share it); the isolation probe at start-up "
                              "runs as it.")
    sandbox_uid_range: str = Field(
        "2000000000-2000065535", pattern=r"^(\d+-\d+)?$", description="When the server "
        "runs as root, each run takes a user and group id of its own from this range "
        "(FIRST-LAST, no passwd entry needed), so runs cannot read each other's files or "
        "processes and the process limit is per run; empty: every run is sandbox_user.")
    sandbox_disk_mb: int = Field(256, ge=1, description="Disk space a run's working "
                                 "directory may hold (polled while it runs, checked at the "
                                 "end); in bubblewrap also the size of its private /tmp and "
                                 "/dev/shm.")

    sandbox_cpu_seconds: int = Field(10, ge=1, le=3600, description="CPU time limit per run.")
    sandbox_memory_mb: int = Field(512, ge=16, description="Address-space limit per process.")
    sandbox_file_size_mb: int = Field(64, ge=1, description="Largest file a run may write.")
    sandbox_max_processes: int = Field(64, ge=1, description="Processes (threads) the "
                                       "run's user may have at once.")
    sandbox_max_open_files: int = Field(256, ge=16, description="Open files per process.")
    sandbox_wall_clock_seconds: float = Field(60.0, gt=0, description="Wall-clock limit of "
                                              "a run.")
    sandbox_output_bytes: int = Field(1 * MiB, ge=1024, description="stdout+stderr streamed "
                                      "per run; the rest is cut with a marker.")
    sandbox_sent_file_bytes: int = Field(8 * MiB, ge=0, description="Total size of the "
                                         "output-folder files returned as sent files.")
    sandbox_env_allowlist: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["LANG", "LC_ALL", "TZ"], description="Server environment "
        "variables passed to sandboxed commands (comma-separated); nothing else is.")
    sandbox_warm_pool: int | None = Field(
        None, ge=0, le=256, description="Sandboxes started ahead of need, per warm kind "
        "(python for the python tool, exec for the shell tool) and per process (each "
        "worker of serve --workers keeps its own); each serves exactly one run. Unset: "
        "2 per CPU core; 0 turns the warm pool off.")
    sandbox_python: str = Field("python3", description="Interpreter of the python tool, "
                                "looked up on the sandbox PATH.")
    session_max_per_principal: int = Field(4, ge=0, description="Sessions (CreateSession) "
                                           "one principal may hold open at once on a "
                                           "replica; 0 turns sessions off.")
    session_max_total: int = Field(32, ge=0, description="Sessions open at once on a "
                                   "replica, all principals together.")
    session_ttl_seconds: float = Field(3600.0, gt=0, description="Longest life of a "
                                       "session (and the TTL of one that asks for none).")
    session_idle_seconds: float = Field(600.0, gt=0, description="A session without a call "
                                        "for this long is closed (also the most one may "
                                        "ask for).")
    session_memory_mb: int = Field(1024, ge=16, description="Address-space limit of each "
                                   "process of a session (the most a session may ask for).")
    session_cpu_seconds: int = Field(300, ge=1, le=86400, description="CPU time each "
                                     "process of a session may use over the session's "
                                     "life: its interpreter's budget (the most a session "
                                     "may ask for).")
    session_disk_mb: int = Field(512, ge=1, description="Disk space a session's folder may "
                                 "hold (polled); past it the session is closed.")
    session_advertise_address: str = Field(
        "", description="With a fleet (redis_url): this replica's gRPC address as the other "
        "replicas reach it (host:port). Set, the replica records the sessions it holds in "
        "Redis and forwards a call for a session another replica holds to it; empty, a "
        "session is known to its own replica only. A port of 0 means the port bound.")
    fleet_secret: SecretStr | None = Field(
        None, description="A secret every replica of the fleet shares (32 characters or "
        "more; prefer fleet_secret_file). A replica forwarding a call for a session another "
        "replica holds vouches for the caller with it (a signed assertion bound to that one "
        "request; the caller's credentials never leave the replica they were presented "
        "to), and a replica accepts forwarded calls only with it. Unset, a call for a "
        "session another replica holds is refused SESSION_FORWARDING_UNCONFIGURED.")
    fleet_secret_file: Path | None = Field(
        None, description="A file holding fleet_secret, read once at start-up (a final "
        "newline is ignored); instead of fleet_secret.")
    session_forward_ca_file: Path | None = Field(
        None, description="With TLS on: the CA bundle a replica trusts for the certificate "
        "of the replica it forwards a session's call to; default http_grpc_ca_file, else "
        "tls_cert_file (right when every replica serves the same self-signed certificate).")
    session_forward_cert_file: Path | None = Field(
        None, description="With TLS on: a client certificate (PEM) a replica presents when it "
        "forwards a session's call; needed when the replicas require client certificates "
        "(tls_client_ca_file). It opens the connection only: the call's principal is the "
        "one the signed assertion names.")
    session_forward_key_file: Path | None = Field(
        None, description="The private key of session_forward_cert_file.")
    http_fetch_allowlist: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Hosts http_fetch may reach (comma-separated; "
        "'*.example.com' for subdomains); empty refuses every host.")
    http_fetch_allowed_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="CIDRs http_fetch may reach although they are "
        "private, loopback or link-local (an escape hatch for tests and intranets).")
    http_fetch_max_bytes: int = Field(5 * MiB, ge=1, description="Largest response body.")
    http_fetch_timeout_seconds: float = Field(30.0, gt=0, description="Total time per fetch.")
    http_fetch_max_redirects: int = Field(5, ge=0, le=20, description="Redirects followed.")
    kb_dir: Path | None = Field(None, description="Folder of Markdown/text documents that "
                                "knowledge_search searches.")
    kb_index_path: Path | None = Field(None, description="The SQLite FTS5 index; default "
                                       "<state_dir>/kb/index.sqlite3.")

    # -- MCP (stargrpc/mcp) -----------------------------------------------------------------
    mcp_port: int | None = Field(None, ge=0, le=65535, description="Serve the tools as a "
                                 "streamable-HTTP MCP endpoint at /mcp on this port (0 picks a "
                                 "free one); off when unset. Needs the mcp extra (pip install "
                                 "'stargrpc[mcp]').")
    mcp_host: str | None = Field(None, description="Address of the MCP endpoint; defaults to "
                                 "host.")
    mcp_max_sessions_per_principal: int = Field(
        32, ge=1, le=10_000, description="Handshake-era MCP sessions one principal may hold "
        "open at the MCP endpoint; one more is refused (HTTP 429) until one ends (DELETE) or "
        "expires (mcp_session_idle_seconds). Per worker process.")
    mcp_max_sessions: int = Field(
        1000, ge=1, le=100_000, description="MCP sessions the endpoint holds open, all "
        "principals together; one more is refused (HTTP 503). Per worker process.")
    mcp_session_idle_seconds: float = Field(
        1800.0, gt=0, le=7 * 24 * 3600, description="An MCP session with no request in "
        "flight (no call answered, no open GET stream) for this long ends; its client must "
        "initialize again.")
    mcp_task_after_seconds: float = Field(
        2.0, ge=0, le=3600, description="A tools/call of a 2026-07-28 MCP client that "
        "declares the tasks extension (io.modelcontextprotocol/tasks) is answered with its "
        "result when its run ends within this, else with a task the client polls (tasks/get); "
        "0 makes every such call a task.")
    mcp_progress_after_seconds: float = Field(
        0.5, ge=0, le=3600, description="A tools/call's run events reach its MCP client "
        "(progress notifications, or log messages when it asked for no progress) once the "
        "call has run this long: then the latest at once, the rest as they come. A call that "
        "ends sooner is answered with its result alone (2026-07-28: one JSON body, no SSE "
        "stream); 0 shows every event from the start.")
    mcp_servers: list[McpServerEntry] = Field(
        default_factory=list, description="MCP servers whose tools join the catalog (TOML "
        "[[mcp_servers]] tables, or JSON in the environment); see docs/use/mcp.md. Needs the "
        "mcp extra (pip install 'stargrpc[mcp]').")
    mcp_servers_allowed_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="CIDRs an HTTP MCP server (mcp_servers url) may be "
        "reached at although private, loopback or link-local (comma-separated); the other "
        "rules of http_fetch apply as they are.")
    mcp_servers_restart_max_seconds: float = Field(
        30.0, ge=0.1, le=3600, description="Longest wait between two attempts to (re)start "
        "or reconnect an MCP server; the wait doubles from 0.1 s up to this.")

    # -- human approval (runs/approval.py, ApproveRun) -----------------------------------
    approval_policy: ApprovalPolicy = Field(
        default_factory=ApprovalPolicy, description="Which runs wait for a person's "
        "approval before they start: per tool, per role, destructive tools; exempt roles.")
    approver_role: str = Field("approver", description="The role that may approve or deny "
                               "a waiting run (ApproveRun), held explicitly (admin_role "
                               "does not grant it).")
    approval_allow_self: bool = Field(False, description="An approver may decide on a run "
                                      "it started itself.")
    approval_timeout_seconds: float = Field(600.0, gt=0, le=7 * 24 * 3600, description=(
        "A run nobody approves or denies within this ends DENIED, code APPROVAL_TIMEOUT."))

    # -- delivery and steering (delivery/, runs/run.py steer, server/service.py) -----
    steer_max_bytes: int = Field(4096, ge=1, le=1024 * 1024, description="Longest SteerRun "
                                 "message (UTF-8 bytes); longer ones are refused "
                                 "INVALID_ARGUMENT.")
    steer_max_pending: int = Field(16, ge=1, le=10_000, description="Steering messages a "
                                   "run holds unread; more are refused RESOURCE_EXHAUSTED.")
    run_steer_roles: list[str] = Field(["critic"], description="Roles that may steer anyone's "
                                       "run (besides its owner, admin_role and "
                                       "delegation_role); watchers may not steer.")
    delivery_allowlist: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Hosts a webhook delivery may post to "
        "(*.example.com for subdomains); any other is refused when the run is requested.")
    delivery_allowed_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Non-public networks (CIDR) webhooks may reach "
        "anyway; by default the SSRF rules of http_fetch refuse them.")
    delivery_webhook_secret_file: Path | None = Field(
        None, description="File holding the HMAC-SHA256 key that signs webhook deliveries "
        "(stargrpc-signature header); webhooks are refused while it is unset.")
    delivery_ca_file: Path | None = Field(None, description="PEM CA bundle webhook "
                                          "receivers' certificates are checked against; "
                                          "default: the system's.")
    delivery_timeout_seconds: float = Field(10.0, gt=0, description="Time per delivery "
                                            "attempt.")
    delivery_retry_initial_seconds: float = Field(1.0, gt=0, description="Wait before the "
                                                  "first retry; doubled after each failure.")
    delivery_retry_max_interval_seconds: float = Field(60.0, gt=0, description="Longest wait "
                                                       "between two attempts.")
    delivery_retry_seconds: float = Field(600.0, ge=0, description="How long a delivery is "
                                          "retried before it is given up (an audit record "
                                          "and the delivery_failed log line say so).")
    delivery_redis_stream_maxlen: int = Field(
        10_000, ge=0, description="Entries a redis_stream delivery's stream keeps: each "
        "XADD trims it to the newest this many (any caller may name a stream, and Redis "
        "holds every entry in memory); 0 keeps them all.")

    @model_validator(mode="after")
    def _check_critic(self) -> Settings:
        if self.critic and self.critic_url:
            raise ValueError("set critic or critic_url, not both: the remote critic at "
                             "critic_url is the server's critic")
        return self

    @model_validator(mode="after")
    def _check_mcp(self) -> Settings:
        # As for the HTTP gateway: MCP callers would all reach the service as the endpoint.
        if self.mcp_port is not None and self.tls_client_ca_file is not None:
            raise ValueError("the MCP endpoint (mcp_port) cannot be used with client "
                             "certificates (tls_client_ca_file): MCP callers would all "
                             "reach the service as the endpoint")
        names = [entry.name for entry in self.mcp_servers]
        if len(set(names)) != len(names):
            raise ValueError(f"mcp_servers: each entry needs a name of its own: {names}")
        return self

    @field_validator("workers", mode="before")
    @classmethod
    def _auto_workers(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return len(os.sched_getaffinity(0)) or 1
        return value

    @model_validator(mode="after")
    def _check_workers(self) -> Settings:
        # Runs, WatchRun, CancelRun and idempotency keys must be seen by every process.
        if self.workers > 1 and not self.redis_url:
            raise ValueError(f"workers = {self.workers} needs a run store the processes "
                             "share: set redis_url (--redis-url); without it each process "
                             "would keep its own runs and idempotency keys")
        return self

    @field_validator("sandbox_env_allowlist", "http_fetch_allowlist",
                     "http_fetch_allowed_networks", "delivery_allowlist",
                     "delivery_allowed_networks", "mcp_servers_allowed_networks",
                     "http_allowed_hosts", "http_allowed_origins", "http_trusted_proxies",
                     "state_global_writers", "sandbox_state_scopes",
                     mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("sandbox_state_scopes")
    @classmethod
    def _check_sandbox_state_scopes(cls, value: list[str]) -> list[str]:
        for scope in value:
            if scope not in ("run", "tree", "principal", "global"):
                raise ValueError(f"sandbox_state_scopes: no state scope {scope!r} (run, "
                                 "tree, principal, global)")
        return list(dict.fromkeys(value))

    @field_validator("http_allowed_hosts")
    @classmethod
    def _check_allowed_hosts(cls, value: list[str]) -> list[str]:
        for entry in value:
            HostRule(entry)  # ValueError names the entry
        return value

    @field_validator("http_trusted_proxies")
    @classmethod
    def _check_trusted_proxies(cls, value: list[str]) -> list[str]:
        for entry in value:
            ipaddress.ip_network(entry, strict=False)  # ValueError names the entry
        return value

    @field_validator("http_allowed_origins")
    @classmethod
    def _check_allowed_origins(cls, value: list[str]) -> list[str]:
        return [normal_origin(entry) for entry in value]

    @field_validator("sandbox_user")
    @classmethod
    def _check_sandbox_user(cls, value: str) -> str:
        try:
            entry = pwd.getpwnam(value)
        except KeyError:
            return value  # an unknown user runs as nobody (65534)
        if entry.pw_uid == 0 or entry.pw_gid == 0:
            raise ValueError(f"sandbox_user {value!r} is root (uid or gid 0): sandboxed "
                             "commands would run with the server's full rights; name an "
                             "unprivileged user (default nobody)")
        return value

    @model_validator(mode="after")
    def _check_isolation_min(self) -> Settings:
        order = ("bwrap", "unshare", "rlimits")
        if self.sandbox_isolation != "auto" and (
                order.index(self.sandbox_isolation) > order.index(self.sandbox_isolation_min)):
            raise ValueError(f"sandbox_isolation {self.sandbox_isolation!r} is weaker than "
                             f"sandbox_isolation_min {self.sandbox_isolation_min!r}")
        return self

    @field_validator("sandbox_uid_range")
    @classmethod
    def _check_uid_range(cls, value: str) -> str:
        if value:
            first, last = (int(part) for part in value.split("-"))
            # 0 is root; 2**32-1 is the kernel's "no id" (and 65534 is nobody's in practice).
            if not 0 < first <= last < 2**32 - 1:
                raise ValueError("give FIRST-LAST with 0 < FIRST <= LAST < 4294967295")
        return value

    @property
    def sandbox_warm_pool_size(self) -> int:
        """``sandbox_warm_pool``, or 2 per CPU core when it is unset."""
        if self.sandbox_warm_pool is not None:
            return self.sandbox_warm_pool
        return 2 * (os.cpu_count() or 1)

    @property
    def sandbox_uids(self) -> tuple[int, int] | None:
        """``sandbox_uid_range`` as (first, last), or None when it is empty."""
        if not self.sandbox_uid_range:
            return None
        first, last = (int(part) for part in self.sandbox_uid_range.split("-"))
        return first, last

    @model_validator(mode="after")
    def _check_auth(self) -> Settings:
        self.jwt_secret = _secret_or_file(self.jwt_secret, self.jwt_secret_file, "jwt_secret")
        jwt_keys = [self.jwt_secret, self.jwt_public_key_file, self.jwt_jwks_file]
        if sum(k is not None for k in jwt_keys) > 1:
            raise ValueError("give one of jwt_secret, jwt_public_key_file, jwt_jwks_file")
        if any(k is not None for k in jwt_keys) and not (self.jwt_issuer and self.jwt_audience):
            raise ValueError("JWT needs jwt_issuer and jwt_audience (both are checked)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        return self

    @model_validator(mode="after")
    def _check_fleet_secret(self) -> Settings:
        self.fleet_secret = _secret_or_file(self.fleet_secret, self.fleet_secret_file,
                                            "fleet_secret")
        if self.fleet_secret is not None and len(self.fleet_secret.get_secret_value()) < 32:
            # A short shared secret can be guessed offline from one assertion seen.
            raise ValueError("fleet_secret must be 32 characters or more (e.g. "
                             "`openssl rand -hex 32`)")
        if ((self.session_forward_cert_file is None)
                != (self.session_forward_key_file is None)):
            raise ValueError("give session_forward_cert_file and session_forward_key_file "
                             "together")
        return self

    @field_validator("tools_dir", mode="before")
    @classmethod
    def _split_paths(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [Path(p) for p in value.split(os.pathsep) if p]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get("STARGRPC_CONFIG")
        if config_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(config_file)))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Settings:
        """Settings from overrides (flags), the environment and an optional TOML file.

        Args:
            config_file: A TOML file; defaults to ``STARGRPC_CONFIG`` when set.
            overrides: Values given on the command line; None values are ignored.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        if config_file is None:
            return cls(**given)
        previous = os.environ.get("STARGRPC_CONFIG")
        os.environ["STARGRPC_CONFIG"] = str(config_file)
        try:
            return cls(**given)
        finally:
            if previous is None:
                os.environ.pop("STARGRPC_CONFIG", None)
            else:
                os.environ["STARGRPC_CONFIG"] = previous

    def masked(self) -> dict[str, Any]:
        """All settings as JSON-ready values, with secrets and URL passwords hidden."""
        shown: dict[str, Any] = {}
        for name, value in self:
            if isinstance(value, SecretStr):
                shown[name] = "***" if value.get_secret_value() else ""
            elif isinstance(value, str) and "://" in value:
                shown[name] = mask_url(value)
            elif isinstance(value, Path):
                shown[name] = str(value)
            elif isinstance(value, list):  # mcp_servers: entries with their secrets masked
                shown[name] = [v.model_dump(mode="json") if isinstance(v, BaseModel)
                               else str(v) for v in value]
            elif isinstance(value, dict):  # e.g. tool_permissions: entries as plain dicts
                shown[name] = {k: v.model_dump() if isinstance(v, BaseModel) else v
                               for k, v in value.items()}
            elif isinstance(value, BaseModel):  # e.g. approval_policy
                shown[name] = value.model_dump(mode="json")
            else:
                shown[name] = value
        return shown


def _secret_or_file(secret: SecretStr | None, path: Path | None, name: str
                    ) -> SecretStr | None:
    """The secret setting ``name``: given as it is, or read from its ``<name>_file``.

    Raises:
        ValueError: Both are given, or the file cannot be read or is empty.
    """
    if path is None:
        return secret
    if secret is not None:
        raise ValueError(f"give {name} or {name}_file, not both")
    return SecretStr(_read_secret_file(path))


def _read_secret_file(path: Path) -> str:
    try:
        with path.open("rb") as file:
            # Checked on the file read: one another user may write could hold a secret of
            # theirs (a JWT secret signs any token; the fleet secret vouches for any caller).
            others = others_may_write(os.fstat(file.fileno()))
            if others is not None:
                raise ValueError(f"the secret file {path} {others}, who could put a secret "
                                 "of their own in it: make it the server's user's, mode 600")
            text = file.read().decode("utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the secret file {path}: {exc}") from exc
    if not text:
        raise ValueError(f"the secret file {path} is empty")
    return text


#: A query parameter of a URL that holds a password (``?password=``, which redis-py,
#: asyncpg and libpq take as the password; libpq's ``sslpassword``).
_PASSWORD_PARAMETER = re.compile(r"([?&;])([^=&;#]*pass(?:word|wd)?|pwd)=([^&;#]*)",
                                 re.IGNORECASE)


def url_has_password(url: str) -> bool:
    """Whether ``url`` holds a password: in its user part or as a query parameter."""
    if "://" not in url:
        return False
    if _PASSWORD_PARAMETER.search(url.split("#", 1)[0]) is not None:
        return True
    try:
        return urlsplit(url).password is not None
    except ValueError:
        return False


def mask_url(url: str) -> str:
    """``redis://:secret@host`` → ``redis://:***@host``, and ``?password=secret`` →
    ``?password=***``; other URLs unchanged."""
    url = _PASSWORD_PARAMETER.sub(r"\1\2=***", url)
    if "," in url.split("://", 1)[-1].split("/", 1)[0]:  # several hosts: not urlsplit's
        return re.sub(r"^([a-z+]+://[^:@/]*):[^@/]*@", r"\1:***@", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
