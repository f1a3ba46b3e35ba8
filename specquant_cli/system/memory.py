"""This process's resident memory: now, and its peak since the last reset (Linux keeps the peak as VmHWM in
/proc/self/status, and writing 5 to /proc/self/clear_refs starts it again), so that a measurement can say what one
stretch of work needed at most rather than what the whole process ever held."""

from __future__ import annotations

from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


_before_reset = [0]  # the highest peak any reset cleared


def reset_peak() -> bool:
    """Start the peak again from the present resident size (the peak it clears is kept for `run_peak_bytes`);
    False where the kernel does not let us (then `peak_bytes` is the process's peak so far)."""
    _before_reset[0] = max(_before_reset[0], peak_bytes())
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """The peak resident size since `reset_peak` (VmHWM), or the present one where /proc does not say."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return rss_bytes()


def run_peak_bytes() -> int:
    """The process's peak resident size over its whole life, across resets."""
    return max(_before_reset[0], peak_bytes())
