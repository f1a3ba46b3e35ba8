#!/usr/bin/env bash
# Set up (.venv, install, demo family), then the main job on the demo family:
# the doctor's placement report, a routed answer to a piped prompt, and a short bench.
source "$(dirname "$0")/_setup.sh"
FAMILY=models/smollm2-135m
echo "== specquant doctor --family $FAMILY" >&2
specquant doctor --family "$FAMILY"
echo "== echo '…' | specquant chat --stats" >&2
echo "Explain in two sentences why the sky is blue." | specquant chat --family "$FAMILY" --max-tokens 96 --stats
echo "== specquant bench (short: 2 prompts, 2 policies)" >&2
specquant bench --family "$FAMILY" --categories qa,code --limit 1 --policies parent,auto --max-tokens 32
