#!/usr/bin/env bash
# Set up the environment (first run only) and run the main job on the built-in corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
exec .venv/bin/python tools/main_job.py "$@"
