#!/usr/bin/env bash
# Set up (.venv, install, the test family), then the main job on a family where speculation pays:
# qwen2.5-coder-1.5b (pulled once: download, dequantize, quantize, a few minutes; verified on later runs),
# the doctor's report, a routed answer to a piped prompt, and a short parent-vs-auto bench on two prompts
# (code, summarization). The first run also measures this machine's costs for auto (once per family and machine).
source "$(dirname "$0")/_setup.sh"
FAMILY=qwen2.5-coder-1.5b  # by name: pull makes it in ./models here, and --family NAME finds it from any folder
echo "== specquant pull qwen2.5-coder-1.5b" >&2
specquant pull qwen2.5-coder-1.5b
echo "== specquant doctor --family $FAMILY" >&2
specquant doctor --family "$FAMILY"
echo "== echo '…' | specquant chat --stats" >&2
echo "Write a Python function that returns the n-th Fibonacci number." \
  | specquant chat --family "$FAMILY" --max-tokens 96 --stats
echo "== specquant bench prompts (short: 2 prompts, parent vs auto)" >&2
specquant bench prompts --family "$FAMILY" --categories code,summarization --limit 1 --policies parent,auto --max-tokens 96
