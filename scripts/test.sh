#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh machine, then runs the whole suite.
# Usage: bash scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

apt_updated=0
apt_install() {
  if [ $apt_updated = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Redis and PostgreSQL: the fleet-mode tests talk to real servers on loopback.
command -v redis-server >/dev/null || apt_install redis-server
if ! command -v pg_ctlcluster >/dev/null; then
  apt_install postgresql
  # A fresh install asks for passwords on TCP; the tests connect as postgres over
  # 127.0.0.1 to a database named test, as on the development machines (trust auth).
  for hba in /etc/postgresql/*/main/pg_hba.conf; do
    as_root sed -i -E 's/^(host[[:space:]]+all[[:space:]]+all[[:space:]]+(127\.0\.0\.1\/32|::1\/128)[[:space:]]+)[a-z0-9-]+/\1trust/' "$hba"
  done
  fresh_postgres=1
fi
# The sandbox: bubblewrap is its strongest isolation (util-linux gives prlimit and setpriv).
command -v bwrap >/dev/null || apt_install bubblewrap
port_open 6379 || redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
port_open 5432 || as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
for _ in $(seq 100); do port_open 6379 && port_open 5432 && break; sleep 0.2; done
port_open 6379 || { echo "redis did not start" >&2; exit 1; }
port_open 5432 || { echo "postgresql did not start" >&2; exit 1; }
if [ "${fresh_postgres:-0}" = 1 ]; then
  as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main reload
  psql -h 127.0.0.1 -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -c "CREATE DATABASE test" >/dev/null
fi

# A real headless browser for the progress-page tests (Debian's chromium, driven by
# Playwright; Playwright's own browser download is never used).
command -v chromium >/dev/null || apt_install chromium
# Node.js and npm for the polyglot client test (its packages come from the npm registry).
command -v npm >/dev/null || apt_install nodejs npm
# Go, offline, for the Go client and its stubs (clients/go/; GOPATH mode over Debian's
# libraries). golang-github-golang-protobuf-1-5-dev is named: apt may otherwise pick the
# 1-3 package, which builds but panics at run time ("protobuf tag not enough fields").
go_packages=(golang-go golang-google-grpc-dev golang-google-protobuf-dev
  golang-github-golang-protobuf-1-5-dev protoc-gen-go protoc-gen-go-grpc protobuf-compiler)
for package in "${go_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" \
    || { apt_install "${go_packages[@]}"; break; }
done

# The Python environment.
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -e '.[dev]'

# One worker per core (pytest-xdist); worksteal evens out the long modules (the browser,
# the agent stacks, the Redis Cluster). `bash scripts/test.sh -n 0 tests/x.py` runs in one
# process.
exec .venv/bin/python -m pytest -n auto --dist worksteal --durations=20 "$@"
