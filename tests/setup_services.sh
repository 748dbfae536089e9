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
# sshd refuses to start without its privilege-separation directory.
[ "$(id -u)" = 0 ] && mkdir -p /run/sshd
exit 0
