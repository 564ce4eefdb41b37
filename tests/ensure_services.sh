#!/usr/bin/env bash
# Make sure the test suite can start (or reach) PostgreSQL and Redis, and drive Chromium.
#
# The tests start throwaway servers themselves (tests/conftest.py); this only checks that the
# server binaries exist, unless TEST_DATABASE_URL / TEST_REDIS_URL point at servers to use.
# The dashboard's browser tests (tests/dashboard) drive Debian's chromium through Playwright
# (never `playwright install`, whose downloads need the internet). tests/bench runs the
# gateway benchmark with wrk, its load generator.
# As root on Debian it installs what is missing; otherwise it says what to install and fails.
set -euo pipefail

missing=()

have_postgres() {
    command -v initdb >/dev/null 2>&1 && return 0
    compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null
}

if [[ -z "${TEST_DATABASE_URL:-}" ]] && ! have_postgres; then
    missing+=(postgresql)
fi
if [[ -z "${TEST_REDIS_URL:-}" ]] && ! command -v redis-server >/dev/null 2>&1; then
    missing+=(redis-server)
fi
if [[ ! -x "${TOKENMILL_CHROMIUM:-/usr/bin/chromium}" ]]; then
    missing+=(chromium)
fi
if ! command -v wrk >/dev/null 2>&1; then
    missing+=(wrk)
fi
# tests/infra/test_grafana.py checks the alert rules with promtool, which Debian ships in prometheus.
if ! command -v promtool >/dev/null 2>&1; then
    missing+=(prometheus)
fi
# The invoice PDF's tests read its text back with poppler's pdftotext.
if ! command -v pdftotext >/dev/null 2>&1; then
    missing+=(poppler-utils)
fi

if ((${#missing[@]} == 0)); then
    exit 0
fi

if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure_services: installing ${missing[*]} for the tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    # A machine whose earlier apt run was cut off refuses every install until
    # the half-configured packages are finished; finishing them is harmless.
    dpkg --configure -a
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
    exit 0
fi

echo "ensure_services: the tests need ${missing[*]} (Debian: sudo apt-get install ${missing[*]})," >&2
echo "or TEST_DATABASE_URL / TEST_REDIS_URL pointing at servers they may use." >&2
exit 1
