#!/usr/bin/env bash
# Set up (.venv, install, demo family), then the main job on the demo family.
source "$(dirname "$0")/_setup.sh"
FAMILY=models/smollm2-135m
echo "== specquant doctor --family $FAMILY" >&2
specquant doctor --family "$FAMILY"
