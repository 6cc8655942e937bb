"""`make test` installs Prometheus and Alertmanager without starting or enabling their services.

Debian's `prometheus` and `prometheus-alertmanager` packages enable their services when installed
(`update-rc.d defaults`, `deb-systemd-helper enable`) and start them (`invoke-rc.d start`,
`deb-systemd-invoke start`); on a normal host they would listen on :9090 and :9093 and start at every
boot. tests/support/ensure_system_packages.sh installs them so that nothing is started or enabled.

Proved with a real package run through apt-get and dpkg: a probe package whose maintainer scripts are
the very debhelper sections of the installed `prometheus` package (renamed), with an init script and a
systemd unit that leave a mark when started. Installed plainly it enables and starts itself (so the
probe is a fair one; it starts itself too where invoke-rc.d or systemd can start anything);
installed by the script it does neither, and the machine is left as it was
(policy-rc.d, rc links, systemd links). The probe is purged afterwards.

Which packages it asks for follows from the commands on PATH (with Chromium's, `CHROMIUM` in its
place); that is checked with stand-in commands on a PATH without apt-get, where it only says what to
install.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "support" / "ensure_system_packages.sh"
POLICY = Path("/usr/sbin/policy-rc.d")
DPKG_INFO = Path("/var/lib/dpkg/info")


def as_root() -> list[str] | None:
    """How to run a command as root here: directly, through sudo without a password, or not at all."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True,
                                               check=False).returncode == 0:
        return ["sudo", "-n"]
    return None


def debhelper_sections(script: str, package: str, name: str) -> str:
    """The "Automatically added" sections of an installed package's maintainer script, renamed."""
    text = (DPKG_INFO / f"{package}.{script}").read_text()
    sections = re.findall(r"# Automatically added by dh_.*?# End automatically added section\n", text, re.S)
    assert sections, f"no debhelper sections in {package}.{script}"
    return "#!/bin/sh\nset -e\n" + "".join(s.replace(package, name) for s in sections) + "exit 0\n"


def build_probe(tmp_path: Path, name: str, marker: Path) -> Path:
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: tracejudge tests <t@example.invalid>\n"
        "Description: probe for tests/test_system_packages.py\n")
    for script in ("postinst", "prerm", "postrm"):
        path = root / "DEBIAN" / script
        path.write_text(debhelper_sections(script, "prometheus", name))
        path.chmod(0o755)
    init = root / "etc" / "init.d" / name
    init.parent.mkdir(parents=True)
    init.write_text(
        "#!/bin/sh\n### BEGIN INIT INFO\n"
        f"# Provides:          {name}\n# Required-Start:    $remote_fs\n# Required-Stop:     $remote_fs\n"
        "# Default-Start:     2 3 4 5\n# Default-Stop:      0 1 6\n# Short-Description: probe\n"
        "### END INIT INFO\n"
        f'case "$1" in start) echo init >> {marker} ;; esac\nexit 0\n')
    init.chmod(0o755)
    unit = root / "lib" / "systemd" / "system" / f"{name}.service"
    unit.parent.mkdir(parents=True)
    unit.write_text(f"[Unit]\nDescription=probe\n[Service]\nType=oneshot\n"
                    f"ExecStart=/bin/sh -c 'echo unit >> {marker}'\n[Install]\nWantedBy=multi-user.target\n")
    deb = tmp_path / f"{name}.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True,
                   capture_output=True, timeout=60)
    return deb


def enabled(name: str) -> list[str]:
    """Where the service is enabled: systemd wants-links, SysV start links."""
    links = [str(p) for p in Path("/etc/systemd/system").glob(f"*.wants/{name}.service")]
    links += [str(p) for p in Path("/etc").glob(f"rc[2-5].d/S*{name}")]
    return sorted(links)


def machine_state() -> tuple[bytes | None, list[str]]:
    return (POLICY.read_bytes() if POLICY.exists() else None,
            sorted(str(p) for p in Path("/etc/systemd/system").rglob("*")) + sorted(os.listdir("/etc/rc2.d")))


def test_the_packages_are_installed_with_their_services_neither_started_nor_enabled(tmp_path):
    root = as_root()
    if root is None:
        # Not root and no sudo: the install is out of reach and the script says so, installing nothing.
        proc = subprocess.run(["sh", str(SCRIPT), "--install-quietly", "prometheus"], capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 1 and "needs root" in proc.stderr, proc.stderr
        return
    name = f"tracejudge-probe-{os.getpid()}"
    marker = tmp_path / "started"
    deb = build_probe(tmp_path, name, marker)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

    def apt_get(*args: str) -> None:
        proc = subprocess.run([*root, "apt-get", "-q", "-o", "DPkg::Lock::Timeout=300", *args], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    saved = POLICY.read_bytes() if POLICY.exists() else None
    before = machine_state()
    try:
        # Without a policy-rc.d (as on a normal host), installed plainly: enabled and started.
        subprocess.run([*root, "rm", "-f", str(POLICY)], check=True)
        apt_get("install", "-y", str(deb))
        assert enabled(name), "the probe package did not enable itself: not a fair probe"
        # It also starts itself where invoke-rc.d knows the runlevel or systemd runs (a normal host);
        # a container without either starts nothing whoever installs it.
        apt_get("purge", "-y", name)
        assert not enabled(name)
        marker.unlink(missing_ok=True)

        # The same, through the script: neither started nor enabled, and its temporary policy is gone.
        proc = subprocess.run([*root, "sh", str(SCRIPT), "--install-quietly", str(deb)], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert subprocess.run(["dpkg-query", "-W", name], capture_output=True, check=False).returncode == 0
        assert enabled(name) == []
        assert not marker.exists(), marker.read_text()
        assert not POLICY.exists()
        apt_get("purge", "-y", name)

        # With a policy-rc.d of the machine's own: used and left exactly as it was.
        own = b"#!/bin/sh\n# the machine's own policy\nexit 101\n"
        subprocess.run([*root, "sh", "-c", f"cat > {POLICY} && chmod 755 {POLICY}"], input=own, check=True)
        proc = subprocess.run([*root, "sh", str(SCRIPT), "--install-quietly", str(deb)], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert enabled(name) == [] and not marker.exists()
        assert POLICY.read_bytes() == own
    finally:
        subprocess.run([*root, "apt-get", "-q", "-o", "DPkg::Lock::Timeout=300", "purge", "-y", name],
                       env=env, capture_output=True, timeout=600, check=False)
        if saved is None:
            subprocess.run([*root, "rm", "-f", str(POLICY)], check=True)
        else:
            subprocess.run([*root, "sh", "-c", f"cat > {POLICY} && chmod 755 {POLICY}"], input=saved,
                           check=True)
    assert machine_state() == before



def run_with_commands(tmp_path: Path, commands: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """The script, with only `commands` (stand-ins) on PATH: no apt-get, so it installs nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for command in commands:
        (bin_dir / command).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / command).chmod(0o755)
    return subprocess.run(["/bin/sh", str(SCRIPT)], env={"PATH": str(bin_dir), **env}, capture_output=True,
                          text=True, timeout=60, check=False)


PROMETHEUS = ["prometheus", "promtool", "prometheus-alertmanager", "amtool"]


def test_chromium_is_asked_for_when_missing_unless_chromium_names_a_browser(tmp_path):
    assert run_with_commands(tmp_path, [*PROMETHEUS, "chromium"]).returncode == 0

    missing = run_with_commands(tmp_path / "no-chromium", PROMETHEUS)
    assert missing.returncode == 1
    assert "not found on PATH: chromium." in missing.stderr, missing.stderr
    assert "apt-get install -y --no-install-recommends chromium" in missing.stderr
    assert "CHROMIUM" in missing.stderr  # the way out where there is no Debian package

    browser = tmp_path / "my-chrome"
    browser.write_text("#!/bin/sh\nexit 0\n")
    browser.chmod(0o755)
    assert run_with_commands(tmp_path / "named", PROMETHEUS, CHROMIUM=str(browser)).returncode == 0

    wrong = run_with_commands(tmp_path / "wrong", PROMETHEUS, CHROMIUM=str(tmp_path / "no-such-browser"))
    assert wrong.returncode == 1 and "not an executable file" in wrong.stderr, wrong.stderr

    both = run_with_commands(tmp_path / "both", ["prometheus", "promtool"])
    assert "not found on PATH: prometheus-alertmanager amtool chromium." in both.stderr, both.stderr
    assert "--no-install-recommends prometheus-alertmanager chromium" in both.stderr


def test_on_ubuntu_a_missing_chromium_is_named_with_the_way_to_get_one(tmp_path):
    """Ubuntu has no chromium .deb (chromium-browser installs a snap): the script says what to do
    instead of failing inside apt-get."""
    ubuntu = tmp_path / "os-release"
    ubuntu.write_text('NAME="Ubuntu"\nID=ubuntu\nVERSION_ID="24.04"\n')
    told = run_with_commands(tmp_path / "ubuntu", PROMETHEUS, TRACEJUDGE_OS_RELEASE=str(ubuntu))
    assert told.returncode == 1
    assert "snap install chromium" in told.stderr and "CHROMIUM=" in told.stderr, told.stderr
    assert "apt-get install" not in told.stderr
    debian = tmp_path / "debian-release"
    debian.write_text('NAME="Debian GNU/Linux"\nID=debian\n')
    asked = run_with_commands(tmp_path / "debian", PROMETHEUS, TRACEJUDGE_OS_RELEASE=str(debian))
    assert "--no-install-recommends chromium" in asked.stderr, asked.stderr
