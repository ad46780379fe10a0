#!/usr/bin/env bash
# System packages the tests need beyond the Python lock file: an OpenSSH server and rsync, for
# tests/system/test_ray_up.py (`ray up` with provider: local against sshd on loopback). Idempotent: does
# nothing when both are there; installs them where it can (root with apt-get); else says what to install.
#
#   bash tests/system-deps.sh
set -euo pipefail

if [[ -x /usr/sbin/sshd ]] && command -v rsync >/dev/null; then
  exit 0
fi
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  # A failed install must not stop the other tests: the ray up test then fails (CI) or skips, saying why.
  if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server rsync; then
    exit 0
  fi
  echo "tests/system-deps.sh: apt-get could not install openssh-server and rsync" >&2
  exit 0
fi
echo "tests/system-deps.sh: install openssh-server (for /usr/sbin/sshd) and rsync to run tests/system/test_ray_up.py" >&2
exit 0
