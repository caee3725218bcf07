#!/usr/bin/env bash
# Letta 0.11.7's own local-sandbox tests through kernelexec's AsyncToolSandboxKernel, at the
# adapter's defaults (see README.md). Usage: conformance/letta/run.sh [pytest args]
# KX_LETTA_ISOLATION=none runs the adapter with configure(isolation="none") instead.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
work=${LETTA_SUITE_DIR:-$repo/.cache/letta-suite}
version=0.11.7
venv=$work/venv

if [ ! -e "$venv/.complete" ]; then
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/pip" install -q uv
  # Letta 0.11.7 (the last release that runs on sqlite) and kernelexec from this checkout, with
  # what was current when Letta 0.11.7 came out (today's pydantic breaks its mcp import)
  # (kernelexec needs a newer filelock than that).
  "$venv/bin/uv" pip install -q --python "$venv/bin/python" --exclude-newer 2025-09-05 \
    --exclude-newer-package "filelock=$(date -u +%Y-%m-%d)" \
    "letta[postgres,server,sqlite,desktop,cloud-tool-sandbox]==$version" pytest pytest-asyncio \
    -e "$repo"
  touch "$venv/.complete"
fi

suite=$work/letta-$version
if [ ! -e "$suite/.complete" ]; then
  rm -rf "$suite" "$work/sdist"
  "$venv/bin/pip" download -q --no-deps --no-binary :all: -d "$work/sdist" "letta==$version"
  mkdir -p "$suite"
  tar -xzf "$work/sdist/letta-$version.tar.gz" -C "$suite" --strip-components=1 \
    "letta-$version/tests"
  touch "$suite/.complete"
fi
cp "$here/conftest.py" "$here/pytest.ini" "$here/fake_openai.py" "$suite/"

# Letta's ~/.letta (its sqlite database, tool_execution_dir) in a home of its own, 0700 as
# /root is; OpenAI's model list from 127.0.0.1, so Letta can create its test agents.
run=$(mktemp -d "$work/run-XXXXXX")
fake=
cleanup() {
  if [ -n "$fake" ]; then kill "$fake" 2>/dev/null || true; wait "$fake" 2>/dev/null || true; fi
  rm -rf "$run"
}
trap cleanup EXIT
mkdir -m 700 "$run/home"
"$venv/bin/python" "$suite/fake_openai.py" "$run/port" &
fake=$!
while [ ! -s "$run/port" ]; do sleep 0.1; done
unset LETTA_PG_URI LETTA_SERVER_URL E2B_API_KEY
cd "$suite"
HOME=$run/home KERNELEXEC_CACHE_DIR=$run/home/.cache/kernelexec \
OPENAI_API_KEY=sk-local OPENAI_BASE_URL="http://127.0.0.1:$(cat "$run/port")/v1" \
  "$venv/bin/python" -m pytest -c pytest.ini --rootdir=. -p no:cacheprovider -q -rfE \
  -k "not test_e2b and not test_async_function_detection and not test_async_template_selection" \
  "$@" tests/integration_test_async_tool_sandbox.py
