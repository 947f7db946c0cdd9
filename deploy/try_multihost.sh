#!/usr/bin/env bash
# Try halfmoon across three hosts on this one machine (as root): the head (conductor, Redis, a
# store node), a prefill host and a decode host, each a network namespace with its own IP,
# hostname and /dev/shm, linked through a bridge shaped to RATE_GBIT (default 1 Gbit/s) and
# DELAY_MS (1 ms, where the kernel has netem). Ray starts on each host as on real machines, then
# `halfmoon serve --config deploy/configs/multinode.yaml --ray-address HEAD` runs on the head.
# It prints the conductor's address; Ctrl-C removes every process, link and namespace it made.
#
#   sudo deploy/try_multihost.sh                      # tiny-random, one worker per role
#   sudo deploy/try_multihost.sh --set model=smollm2-135m
#   .venv/bin/halfmoon generate "Hello" --address ADDRESS     # from another shell
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m deploy.hosts \
    --rate-gbit "${RATE_GBIT:-1}" --delay-ms "${DELAY_MS:-1}" \
    --set model=tiny-random --set dtype=float32 \
    --set prefill_workers=1 --set decode_workers=1 \
    --set placement.worker_num_cpus=0 --set placement.gpus_per_worker=0 \
    --set store.dram_bytes=268435456 --set store.ssd_bytes=1073741824 \
    --set prefill.num_blocks=1024 --set decode.num_blocks=1024 \
    "$@"
