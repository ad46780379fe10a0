#!/usr/bin/env bash
# System packages the tests need beyond the Python lock file: an OpenSSH server and rsync, for
# tests/system/test_ray_up.py (`ray up` with provider: local against sshd on loopback), a C++
# compiler, for tests/unit/test_compile.py (torch.compile's inductor builds its CPU kernels with g++),
# tmux, for tests/system/test_progress.py (the live progress display in a real terminal), and Slurm with
# munge, for tests/system/test_slurm.py (slurm.sbatch against a real slurmctld and two slurmd).
# Idempotent: does nothing when all are there; installs what is missing where it can (root with
# apt-get); else says what to install.
#
#   bash tests/system-deps.sh
set -euo pipefail

missing=()
[[ -x /usr/sbin/sshd ]] || missing+=(openssh-server)
command -v rsync >/dev/null || missing+=(rsync)
command -v g++ >/dev/null || missing+=(g++)
command -v tmux >/dev/null || missing+=(tmux)
[[ -x /usr/sbin/slurmctld ]] || missing+=(slurmctld)
[[ -x /usr/sbin/slurmd ]] || missing+=(slurmd)
command -v sbatch >/dev/null || missing+=(slurm-client)
[[ -x /usr/sbin/munged ]] || missing+=(munge)
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  # A failed install must not stop the other tests: the tests that need the package then fail (CI) or
  # skip, saying why.
  if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; then
    exit 0
  fi
  echo "tests/system-deps.sh: apt-get could not install ${missing[*]}" >&2
  exit 0
fi
echo "tests/system-deps.sh: install ${missing[*]} (openssh-server and rsync for tests/system/test_ray_up.py, g++ for tests/unit/test_compile.py, tmux for tests/system/test_progress.py, slurmctld slurmd slurm-client munge for tests/system/test_slurm.py)" >&2
exit 0
