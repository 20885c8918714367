#!/usr/bin/env bash
# The system packages megabam's launchers use, apart from Python's: OpenMPI (launch/mpirun.sh, and
# mpi4py, which builds against it) and Slurm with munge (the launcher tests' real one-node cluster).
# Installed only when asked, with --with-test-cluster (as root, through apt-get; .ci/run passes it
# through tools/install.sh). Without them everything but those launchers works, and their tests are
# skipped, saying why.
#
# Usage: bash tools/system_packages.sh [--with-test-cluster]
set -euo pipefail
WITH_TEST_CLUSTER=0
for arg in "$@"; do
  case $arg in
    --with-test-cluster) WITH_TEST_CLUSTER=1 ;;
    *) echo "system_packages.sh: unknown option $arg (known: --with-test-cluster)" >&2; exit 2 ;;
  esac
done

if [[ $WITH_TEST_CLUSTER == 1 ]]; then
  packages=()
  command -v mpicc >/dev/null || packages+=(libopenmpi-dev openmpi-bin)
  [[ -x /usr/sbin/slurmctld ]] || command -v slurmctld >/dev/null || packages+=(slurm-wlm munge)
  if ((${#packages[@]})); then
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
      echo "install.sh: --with-test-cluster installs ${packages[*]} with apt-get, as root; install them yourself" >&2
      exit 1
    fi
    echo "install.sh: --with-test-cluster: apt-get install ${packages[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
  fi
elif ! command -v mpicc >/dev/null; then
  echo "install.sh: no MPI here: mpi4py not installed, so launch/mpirun.sh cannot run (install OpenMPI, or" \
    "run with --with-test-cluster as root); every other launcher works" >&2
fi
