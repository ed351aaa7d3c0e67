"""`tiered profile`: measure this machine and save its HardwareProfile, or list the presets.

The core (`run_profile`, `format_profile`, `format_presets`) has no CLI dependency; `profile_command`
is the body the typer command calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tiered.hardware.presets import PRESETS, get_preset
from tiered.hardware.profile import HardwareProfile, default_profile_path


def run_profile(quick: bool = True, out: Path | None = None, threads: int | None = None,
                disk_dir: Path | None = None, progress: Callable[[str], None] | None = None
                ) -> tuple[HardwareProfile, Path]:
    """Profile this machine and save the JSON to `out` (default: default_profile_path()). A profile
    measured while other processes took more than contention.CONTENDED_SHARE of the cores is measured
    again, contention.RETRIES times at most (the last is kept), as the engine would on loading it."""
    from tiered.hardware import contention
    from tiered.hardware.profiler import profile_machine

    profile = None
    while profile is None or not contention.keep(profile.meta):
        if profile is not None and progress is not None:
            progress(f"other processes took {profile.meta['others_share']:.0%} of the cores while profiling: "
                     "measuring again")
        profile = profile_machine(quick=quick, disk_dir=disk_dir, threads=threads, progress=progress,
                                  previous=profile)
    path = Path(out) if out is not None else default_profile_path()
    profile.save(path)
    return profile, path


def _rate(key: str, beta: float) -> str:
    """1 / beta in the unit natural for the key."""
    if beta <= 0 or key.startswith(("runtime/", "launch/")):  # seconds per layer or per call: no rate
        return ""
    if key.startswith(("gemm/", "attn/", "expert_rows/", "decode_rows/")):  # n = multiply-adds
        return f"{2 / beta / 1e9:.1f} GFLOP/s"
    return f"{1 / beta / 1e9:.2f} GB/s"


def format_profile(profile: HardwareProfile) -> str:
    """A fixed-width table of the profile's models: key, alpha, beta, rate, R^2."""
    lines = [f"{profile.name}: {profile.source}",
             f"{'key':28} {'alpha [s]':>10} {'beta [s/unit]':>13} {'rate':>16} {'R^2':>7}"]
    for key in sorted(profile.models):
        m = profile.models[key]
        r2 = "" if m.r2 is None else f"{m.r2:.3f}"
        lines.append(f"{key:28} {m.alpha:10.3g} {m.beta:13.3g} {_rate(key, m.beta):>16} {r2:>7}")
    caps = [f"{t} {v / 2**30:.1f} GiB" for t, v in (("gpu", profile.gpu_memory), ("cpu", profile.cpu_memory),
                                                     ("disk", profile.meta.get("disk_memory"))) if v]
    if caps:
        lines.append("capacity: " + ", ".join(caps))
    share = profile.meta.get("host_share")
    if share:  # CUDA: CPU experts and H2D copies at once (hardware/host_share)
        lines.append(f"host share: CPU experts {share['cpu_GBps'][0]:.1f} -> {share['cpu_GBps'][1]:.1f} GB/s (x{share['cpu']:.2f}), "
                     f"H2D {share['h2d_GBps'][0]:.1f} -> {share['h2d_GBps'][1]:.1f} GB/s (x{share['h2d']:.2f}) when both run")
    for note in profile.meta.get("notes", []):
        lines.append(f"note: {note}")
    for key, why in profile.meta.get("skipped", {}).items():
        lines.append(f"skipped {key}: {why}")
    return "\n".join(lines)


def format_presets() -> str:
    """One line per preset: name and machine."""
    return "\n".join(f"{name:15} {desc}" for name, desc in PRESETS.items())


def profile_command(quick: bool, out: Path | None, preset_list: bool, threads: int | None = None,
                    disk_dir: Path | None = None) -> Path:
    """Body of `tiered profile`. Prints progress and the fitted table; returns the JSON's path.

    With `preset_list`, prints the presets and returns `out` (or the default path) without profiling.
    """
    import typer

    path = Path(out) if out is not None else default_profile_path()
    if preset_list:
        typer.echo(format_presets())
        return path
    typer.echo(f"profiling this machine ({'quick' if quick else 'full'} run)...")
    profile, path = run_profile(quick, path, threads, disk_dir, progress=lambda msg: typer.echo("  " + msg))
    typer.echo(format_profile(profile))
    typer.echo(f"wrote {path}")
    return path


def preset_table(name: str) -> str:
    """format_profile of the preset `name` (raises ConfigError for an unknown name)."""
    return format_profile(get_preset(name))
