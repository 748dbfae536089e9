#!/usr/bin/env bash
# Installs the system packages the test suite needs (idempotent). Tests start and stop the services
# themselves, by pid; this script only makes the programs available.
set -uo pipefail
need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup_services: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null 2>&1 || true
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
      || echo "setup_services: could not install ${need[*]}; the tests that need them will skip and say why"
  else
    echo "setup_services: missing ${need[*]} and not root with apt-get; those tests will skip"
  fi
fi
# Optional: a real Prometheus for tests/test_metrics_export.py (which skips, saying why, without it). Debian's
# package; it must never fail this script. Without systemd running (containers) the package's service does not
# start; where systemd runs, it starts Debian's prometheus on :9090, which the tests do not use.
if ! command -v prometheus >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if apt-cache show prometheus >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1; apt-cache show prometheus >/dev/null 2>&1; }; then
    echo "setup_services: installing prometheus"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
      || echo "setup_services: could not install prometheus; the Prometheus test will skip"
  else
    echo "setup_services: no prometheus package in apt; the Prometheus test will skip"
  fi
fi
# sshd refuses to start without its privilege-separation directory.
[ "$(id -u)" = 0 ] && mkdir -p /run/sshd
exit 0
