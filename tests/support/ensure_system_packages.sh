#!/bin/sh
# The system (non-pip) packages `make test` needs, installed when missing; run by the Makefile before
# anything else, so a machine that cannot get them stops at once with the command to run.
#
#   sh tests/support/ensure_system_packages.sh [PYTHON]
#
# Always: Prometheus and Alertmanager, from the Debian packages `prometheus` (prometheus, promtool) and
# `prometheus-alertmanager` (prometheus-alertmanager, amtool): promtool/amtool check the deploy files and
# the end-to-end alerting test starts both servers. And Chromium, the Debian package `chromium` (command
# chromium): tests/test_docs_site.py opens the documentation site in it, headless (a Chrome or Chromium
# named by CHROMIUM=/path/to/binary is used instead, and then the package is not needed). With PYTHON
# (passed when .venv has to be made): that Python's venv module with pip, which Debian ships apart
# (python3.X-venv). On Debian/Ubuntu they are installed with apt-get, as root or through sudo when it
# needs no password; `apt-get update` runs only when a package is not in the package lists or the
# install fails (stale lists). Anywhere else this prints the command to run and exits 1.
#
# The tests run their own Prometheus and Alertmanager on free loopback ports, so the packages' system
# services are neither started nor enabled: a temporary /usr/sbin/policy-rc.d (exit 101: "action
# forbidden") keeps invoke-rc.d and deb-systemd-invoke from starting anything during the install (an
# existing policy-rc.d is left as it is), and afterwards every service of a package this run installed
# (dependencies included) is disabled (deb-systemd-helper, update-rc.d) and, if it runs anyway, stopped,
# so nothing listens on :9090/:9093 or starts at boot. Services of packages that were already there are
# left alone.
#
#   sh tests/support/ensure_system_packages.sh --install-quietly PACKAGE_OR_DEB...
#
# runs just that install (as root), for tests/test_system_packages.py.
set -eu

policy=/usr/sbin/policy-rc.d
installed_packages() {  # every package dpkg has installed, one a line
    dpkg-query -W -f '${db:Status-Status} ${Package}\n' 2>/dev/null | sed -n 's/^installed //p' | sort
}

services_of() {  # services_of PACKAGE...: the systemd units and init scripts those packages ship
    for package in "$@"; do
        dpkg-query -L "$package" 2>/dev/null
    done | sed -n -e 's#^/\(usr/\)\{0,1\}lib/systemd/system/\([^/]*\.\(service\|socket\|timer\)\)$#unit \2#p' \
                  -e 's#^/etc/init\.d/\([^/]*\)$#init \1#p' | sort -u
}

quiet_install() {  # quiet_install APT-GET-INSTALL-ARGUMENTS...: install, leaving new services off
    before=$(mktemp); after=$(mktemp)
    made_policy=""
    if [ ! -e "$policy" ] && [ ! -L "$policy" ]; then
        $as_root sh -c "printf '#!/bin/sh\n# tracejudge make test: no service starts while it installs.\nexit 101\n' > $policy && chmod 755 $policy"
        made_policy=yes
    fi
    trap 'rm -f "$before" "$after"; [ -z "$made_policy" ] || $as_root rm -f "$policy"' EXIT
    installed_packages > "$before"
    status=0
    apt install "$@" || status=$?
    installed_packages > "$after"
    # shellcheck disable=SC2046  # one package name a word
    services_of $(comm -13 "$before" "$after") | while read -r kind name; do
        if [ "$kind" = unit ]; then
            if command -v deb-systemd-helper >/dev/null 2>&1; then
                $as_root deb-systemd-helper disable "$name" >/dev/null 2>&1 || true
            fi
            if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
                $as_root systemctl disable --now "$name" >/dev/null 2>&1 || true
            fi
            echo "  left $name disabled and stopped (the tests run their own)"
        elif command -v update-rc.d >/dev/null 2>&1; then
            $as_root update-rc.d "$name" disable >/dev/null 2>&1 || true
            if [ ! -d /run/systemd/system ] && [ -z "$made_policy" ]; then  # a policy may have let it start
                $as_root invoke-rc.d "$name" stop >/dev/null 2>&1 || true
            fi
        fi
    done
    rm -f "$before" "$after"
    [ -z "$made_policy" ] || $as_root rm -f "$policy"
    trap - EXIT
    return $status
}

apt() { $as_root env DEBIAN_FRONTEND=noninteractive apt-get -q -o DPkg::Lock::Timeout=120 "$@"; }

if [ "${1:-}" = --install-quietly ]; then
    shift
    as_root=""
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1 \
            || { echo "--install-quietly needs root (or sudo without a password)" >&2; exit 1; }
        as_root="sudo -n"
    fi
    quiet_install -y --no-install-recommends "$@"
    exit
fi

python=${1:-}
packages=""
commands=""

need() {  # need PACKAGE COMMAND...: PACKAGE is missing when one of its COMMANDs is not on PATH
    package=$1; shift
    for command in "$@"; do
        if ! command -v "$command" >/dev/null 2>&1; then
            commands="$commands $command"
            case " $packages " in *" $package "*) ;; *) packages="$packages $package" ;; esac
        fi
    done
}

is_ubuntu() {  # is_ubuntu OS_RELEASE_FILE (another file only in tests/test_system_packages.py)
    [ -r "$1" ] || return 1
    while IFS= read -r line; do
        case "$line" in ID=ubuntu|ID=\"ubuntu\") return 0 ;; esac
    done < "$1"
    return 1
}

need prometheus prometheus promtool
need prometheus-alertmanager prometheus-alertmanager amtool
if [ -n "${CHROMIUM:-}" ]; then  # the browser tests/support/chromium.py runs instead of Debian's
    [ -x "$CHROMIUM" ] || { echo "CHROMIUM=$CHROMIUM is not an executable file" >&2; exit 1; }
elif is_ubuntu "${TRACEJUDGE_OS_RELEASE:-/etc/os-release}" && ! command -v chromium >/dev/null 2>&1; then
    # Ubuntu has no chromium .deb (its chromium-browser installs a snap, which containers cannot run).
    echo "make test needs a Chrome or Chromium for the documentation site's test. Ubuntu ships Chromium only" >&2
    echo "as a snap; install one and name it, e.g.:" >&2
    echo "  sudo snap install chromium && make test CHROMIUM=/snap/bin/chromium" >&2
    echo "  (or Google Chrome's .deb: make test CHROMIUM=/usr/bin/google-chrome)" >&2
    exit 1
else
    need chromium chromium
fi

venv_package=""
if [ -n "$python" ] && ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    # Debian's Python keeps ensurepip (which puts pip into a new venv) in python3.X-venv.
    venv_package=$("$python" -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])')
    interpreter=$("$python" -c 'import sys; print(sys.executable)')
    if command -v dpkg >/dev/null 2>&1 && dpkg -S "$interpreter" >/dev/null 2>&1; then
        packages="$packages $venv_package"
    else  # not the distribution's Python: no package of ours can help
        echo "$python ($interpreter) cannot make a virtual environment with pip (no ensurepip);" \
             "use a Python that can: make test PYTHON=/path/to/python3.11" >&2
        exit 1
    fi
fi

[ -z "$packages" ] && exit 0
packages=${packages# }
install="apt-get install -y --no-install-recommends $packages"

if ! command -v apt-get >/dev/null 2>&1; then
    {
        echo "make test needs these commands, not found on PATH:${commands:- (none)}${venv_package:+ (and Python's venv with pip)}."
        echo "There is no apt-get here (not Debian/Ubuntu), so install them yourself under these names, then run"
        echo "make test again. On macOS with Homebrew, Prometheus and Alertmanager:"
        echo '  brew install prometheus alertmanager && ln -s "$(brew --prefix)/bin/alertmanager" "$(brew --prefix)/bin/prometheus-alertmanager"'
        echo "and for chromium, Google Chrome or Chromium named by CHROMIUM (or a chromium on PATH), e.g.:"
        echo '  make test CHROMIUM="/Applications/Google Chrome.app/Contents/MacOS/Google Chrome"'
        echo "(On Debian/Ubuntu make test does it itself: apt-get install -y --no-install-recommends $packages)"
    } >&2
    exit 1
fi

if [ "$(id -u)" = 0 ]; then
    as_root=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
    as_root="sudo -n"
else
    why="not root and sudo is not installed"
    command -v sudo >/dev/null 2>&1 && why="not root and sudo asks for a password"
    {
        echo "make test needs the Debian packages: $packages (${commands:+missing:$commands}${venv_package:+${commands:+; }Python's venv with pip})."
        echo "Cannot install them ($why). Run this, then make test again:"
        echo "  sudo $install"
        echo "(or, as root: $install)"
    } >&2
    exit 1
fi

echo "Installing the Debian packages the tests need (their services neither started nor enabled): $packages"

listed=yes
for package in $packages; do
    # "Candidate: (none)" or no output: the package lists are empty or do not have it yet.
    apt-cache policy "$package" 2>/dev/null | grep -q 'Candidate: [^(]' || listed=no
done
if [ "$listed" = no ]; then
    echo "Updating the package lists (they do not list $packages yet)"
    apt update -qq
    # shellcheck disable=SC2086  # $packages is a list of words
    quiet_install -y --no-install-recommends $packages
else
    # shellcheck disable=SC2086
    quiet_install -y --no-install-recommends $packages \
        || { echo "apt-get install failed; updating the package lists and trying again" >&2
             apt update -qq && quiet_install -y --no-install-recommends $packages; }
fi

for command in $commands; do  # the packages must have brought what was missing
    command -v "$command" >/dev/null 2>&1 || { echo "$command is still not on PATH after installing $packages" >&2; exit 1; }
done
